"""Snapshot slots: layout, seal/verify, and refusal of corrupt or mismatched copies."""

import pytest
import torch

from megatron_deadpool.base.errors import MirrorCorruptError
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


# ---------------------------------------------------------------- metadata without pickle
EXECUTED = []


def _observe(what):
    EXECUTED.append(what)
    return {"iteration": 7}


class _Payload:
    """What a crafted copy would carry under pickle: reading it calls ``_observe``."""

    def __reduce__(self):
        return (_observe, ("code ran while reading a mirror copy",))


def _forge(layout, slot, blob: bytes) -> None:
    """Put ``blob`` where the metadata goes and make the header consistent with it, as
    anyone who has seen one copy can (the checksum is not keyed)."""
    import numpy as np

    slot.numpy()[layout.tensor_end:layout.tensor_end + len(blob)] = np.frombuffer(
        blob, dtype=np.uint8)
    h = snapshot._header(slot)
    h[4] = len(blob)
    h[5] = snapshot._crc(slot, layout.tensor_end, len(blob))


def test_forged_copy_with_a_pickle_payload_is_refused_and_runs_nothing():
    import pickle

    named, layout, slot = _sealed()
    _forge(layout, slot, pickle.dumps(_Payload(), protocol=2))
    EXECUTED.clear()
    with pytest.raises(MirrorCorruptError, match="metadata"):
        snapshot.verify(slot, 3, 7, layout)
    assert EXECUTED == [], "reading a copy ran code"


def test_metadata_round_trips_every_type_the_meta_carries_bitwise():
    """RNG states (bytes, numpy's tuple with its uint32 array, Python's packed words),
    counters, floats, a grad scaler's tensor, numpy scalars and int keys come back equal
    and of the same type: set_state calls take them as they are."""
    import random

    import numpy as np

    from megatron_deadpool.adapters import train_state as ts
    from megatron_deadpool.mirror import metadata

    py = random.Random(3).getstate()
    rng = {"python": py, "numpy": np.random.RandomState(5).get_state(),
           "torch": torch.get_rng_state().numpy().tobytes()}
    meta = {"iteration": 7, "rng": ts.compact_rng(rng),
            "flops": 1.0000000000000002e13, "nan": float("inf"), "none": None, "flag": True,
            "scale": torch.tensor([65536.0, -0.0]), "np": np.float32(0.1), "i64": np.int64(-3),
            "by_int": {0: "a", 1: (2, 3)}, "dunder": {"__bytes": [0, 1]},
            "groups": [[{"step": {"tensor": 7.0}, "lr": 0.1 + 0.2}]]}
    back = metadata.decode(metadata.encode(meta))
    assert ts.canonical_bytes(back) == ts.canonical_bytes(meta)
    state = back["rng"]["numpy"]
    assert type(state) is tuple and state[1].dtype == np.uint32
    assert np.array_equal(state[1], meta["rng"]["numpy"][1])
    assert ts._python_state(back["rng"]["python"]) == py
    assert back["rng"]["torch"] == meta["rng"]["torch"] and type(back["rng"]["torch"]) is bytes
    assert torch.equal(back["scale"], meta["scale"]) and back["scale"].dtype == torch.float32
    assert torch.signbit(back["scale"][1])
    assert type(back["np"]) is np.float32 and back["np"] == meta["np"]
    assert type(back["i64"]) is np.int64 and back["by_int"] == {0: "a", 1: (2, 3)}
    assert back["dunder"] == {"__bytes": [0, 1]} and back["groups"] == meta["groups"]
    assert back["nan"] == float("inf")


@pytest.mark.parametrize("doc", [
    '{"__ndarray": ["|O", [1], 0, 8]}',          # an object array
    '{"__tensor": ["__class__", [1], 0, 4]}',    # not a dtype
    '{"__bytes": [0, 99]}',                      # outside the raw section
    '{"__tuple": 5}', '[1, 2', '{"__dict": [[[1], 2]]}'])
def test_malformed_metadata_is_refused(doc):
    import struct

    from megatron_deadpool.mirror import metadata

    data = doc.encode()
    with pytest.raises(MirrorCorruptError, match="metadata"):
        metadata.decode(struct.pack("<I", len(data)) + data + b"\0" * 8)


def test_format_2_slot_with_pickled_metadata_is_refused_by_name():
    named, layout, slot = _sealed()
    snapshot._header(slot)[0] = snapshot.MAGIC_V2
    with pytest.raises(MirrorCorruptError, match="format 2"):
        snapshot.verify(slot, 3, 7, layout)
