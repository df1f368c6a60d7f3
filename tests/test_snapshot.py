"""Snapshot slots: layout, seal/verify, and refusal of corrupt or mismatched copies."""

import pytest
import torch

from megatron_deadpool.errors import MirrorCorruptError
from megatron_deadpool.mirror import snapshot


def _named():
    g = torch.Generator().manual_seed(0)
    return [("a", torch.randn(10, generator=g)), ("b", torch.randn(3, 4, generator=g)),
            ("step", torch.tensor(5.0))]


def _sealed(owner=3, it=7):
    named = _named()
    layout = snapshot.Layout(named, 1 << 14)
    slot = snapshot.alloc_slot(layout.total_bytes, pin=False)
    snapshot.copy_tensors_in(slot, layout, [t for _, t in named])
    snapshot.seal(slot, layout, owner, it, {"iteration": it, "rng": torch.get_rng_state()})
    return named, layout, slot


def test_roundtrip_restores_bytes_and_meta():
    named, layout, slot = _sealed()
    meta = snapshot.verify(slot, 3, 7, layout)
    assert meta["iteration"] == 7
    dst = [torch.zeros_like(t) for _, t in named]
    snapshot.copy_tensors_out(slot, layout, dst)
    for (_, t), d in zip(named, dst):
        assert torch.equal(t, d)


@pytest.mark.parametrize("where", ["tensor", "meta", "header_crc"])
def test_flipped_byte_is_refused(where):
    named, layout, slot = _sealed()
    off = {"tensor": layout.entries[1].offset + 5, "meta": layout.tensor_end + 3,
           "header_crc": 5 * 8}[where]
    slot[off] ^= 0x10
    with pytest.raises(MirrorCorruptError):
        snapshot.verify(slot, 3, 7, layout)


def test_wrong_owner_iteration_or_layout_refused():
    named, layout, slot = _sealed()
    with pytest.raises(MirrorCorruptError, match="holds rank 3 iteration 7"):
        snapshot.verify(slot, 4, 7)
    with pytest.raises(MirrorCorruptError, match="holds rank 3 iteration 7"):
        snapshot.verify(slot, 3, 6)
    other = snapshot.Layout([("a", torch.zeros(11))], 1 << 14)
    with pytest.raises(MirrorCorruptError, match="layout"):
        snapshot.verify(slot, 3, 7, other)
    empty = snapshot.alloc_slot(layout.total_bytes, pin=False)
    with pytest.raises(MirrorCorruptError, match="magic"):
        snapshot.verify(empty, 3, 7)


def test_meta_over_capacity_is_an_error():
    named = _named()
    layout = snapshot.Layout(named, 64)
    slot = snapshot.alloc_slot(layout.total_bytes, pin=False)
    with pytest.raises(MirrorCorruptError, match="capacity"):
        snapshot.seal(slot, layout, 0, 1, {"blob": b"x" * 1000})


def test_chunked_checksum_on_threads_catches_a_flip_in_any_chunk(monkeypatch):
    """A slot of several checksum chunks: the threads' result equals one thread's, and a
    flipped byte in a late chunk is refused."""
    monkeypatch.setattr(snapshot, "CRC_CHUNK", 256)
    named = [("a", torch.arange(1000, dtype=torch.float32))]
    layout = snapshot.Layout(named, 1 << 10)
    slot = snapshot.alloc_slot(layout.total_bytes, pin=False)
    snapshot.copy_tensors_in(slot, layout, [t for _, t in named])
    snapshot.seal(slot, layout, 0, 1, {"iteration": 1})
    threaded = snapshot.read_header(slot)["crc"]
    monkeypatch.setattr(snapshot, "CRC_THREADS", 1)
    assert snapshot._crc(slot, layout.tensor_end, snapshot.read_header(slot)["meta_len"]) \
        == threaded
    monkeypatch.setattr(snapshot, "CRC_THREADS", 4)
    snapshot.verify(slot, 0, 1, layout)
    slot[layout.entries[0].offset + 3900] ^= 0x01  # chunk 15 of 16
    with pytest.raises(MirrorCorruptError, match="checksum"):
        snapshot.verify(slot, 0, 1, layout)


def test_only_the_sealed_prefix_travels_and_verifies_in_a_used_buffer():
    """What goes to a buddy ends where the metadata ends: the unused metadata capacity is not
    sent, and the copy verifies and restores in a buffer whose tail holds anything."""
    named, layout, slot = _sealed()
    used = snapshot.sealed(slot)
    h = snapshot.read_header(slot)
    assert used.numel() == h["tensor_end"] + h["meta_len"] < slot.numel()
    assert used.data_ptr() == slot.data_ptr()  # a view: nothing copied
    recv = torch.full_like(slot, 0xAB)  # e.g. an older copy's bytes
    recv[:used.numel()].copy_(used)
    assert snapshot.verify(recv, 3, 7, layout)["iteration"] == 7
    dst = [torch.zeros_like(t) for _, t in named]
    snapshot.copy_tensors_out(recv, layout, dst)
    assert all(torch.equal(t, d) for (_, t), d in zip(named, dst))
    # a slot never sealed (no header) goes whole, and its receiver refuses it
    blank = torch.zeros_like(slot)
    assert snapshot.sealed(blank).numel() == blank.numel()
    with pytest.raises(MirrorCorruptError):
        snapshot.verify(blank, 3, 7, layout)
