"""Flat re-homing of the mirrored tensors (mirror/flat.py) and the slot gaps that keep the
views of one buffer a single copy (snapshot.Layout, d2h.plan)."""

import torch

from megatron_deadpool.mirror import d2h, flat, snapshot


def _state():
    buf = torch.arange(200, dtype=torch.float32)  # a param buffer: views stay where they are
    params = [buf[0:30], buf[64:100]]  # padded to 64 elements, as megatron's param buffer
    moments = [torch.randn(30), torch.randn(30), torch.randn(36), torch.randn(36)]
    steps = [torch.tensor(3.0), torch.tensor(3.0)]
    return buf, params, moments, steps


def test_only_sole_owners_of_their_storage_are_movable():
    buf, params, moments, steps = _state()
    assert not flat.exclusive(buf[0:30]) and flat.exclusive(moments[0])
    alias = moments[1].view(-1)  # a second tensor object on the same storage
    assert not flat.exclusive(moments[1]) and alias.numel() == 30
    assert not flat.exclusive(torch.randn(4, 4).t())  # not contiguous


def test_consolidate_keeps_the_objects_and_values_and_makes_one_buffer():
    buf, params, moments, steps = _state()
    tensors = params + moments + steps
    before = [t.clone() for t in tensors]
    ids = [id(t) for t in tensors]
    assert flat.consolidate(tensors) == 6  # the four moments and two steps
    assert [id(t) for t in tensors] == ids
    assert all(torch.equal(a, b) for a, b in zip(tensors, before))
    ptrs = {t.untyped_storage().data_ptr() for t in moments + steps}
    assert len(ptrs) == 1
    assert params[0].untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()
    moments[2].add_(1.0)  # in-place updates land in the flat buffer
    assert torch.equal(moments[2], before[4] + 1.0)
    assert flat.consolidate(tensors) == 0  # already shared: nothing moves again


def test_a_misaligned_start_begins_a_new_buffer():
    a, b = torch.ones(3, dtype=torch.bfloat16), torch.ones(2, dtype=torch.float32)
    # b would start at byte 6, which 4 does not divide: a new run from b on (a alone: none)
    assert flat.runs([a, b, torch.ones(2)]) == [[1, 2]]
    c = torch.ones(2, dtype=torch.bfloat16)  # at byte 6: aligned for bf16; b then at 10
    assert flat.runs([a, c, b]) == [[0, 1]]


def test_the_slot_keeps_the_padding_between_views_so_they_stay_one_copy():
    buf, params, moments, steps = _state()
    flat.consolidate(moments + steps)
    named = [(f"t{i}", t) for i, t in enumerate(params + moments + steps)]
    layout = snapshot.Layout(named, 256)
    e = layout.entries
    assert e[1].offset - e[0].offset == 64 * 4  # the param buffer's gap repeated
    assert e[2].offset == e[1].offset + 36 * 4  # packed after
    tensors = [t for _, t in named]
    runs = d2h.plan(layout, tensors)
    assert len(runs) == 2  # the param buffer's views, then the flat moments and steps
    slot = snapshot.alloc_slot(layout.total_bytes, False)
    d2h.Copier().copy(slot, runs)
    ref = snapshot.alloc_slot(layout.total_bytes, False)
    snapshot.copy_tensors_in(ref, layout, tensors)
    for x in e:  # every entry's bytes are exact (the gap holds the buffer's padding)
        assert torch.equal(slot[x.offset:x.offset + x.nbytes], ref[x.offset:x.offset + x.nbytes])
    restored = [torch.zeros_like(t) for t in tensors]
    snapshot.copy_tensors_out(slot, layout, restored)
    assert all(torch.equal(a, b) for a, b in zip(restored, tensors))


def test_the_layout_does_not_depend_on_addresses():
    one = snapshot.Layout([(f"t{i}", t) for i, t in enumerate(_state()[1])], 64)
    two = snapshot.Layout([(f"t{i}", t) for i, t in enumerate(_state()[1])], 64)
    assert one.layout_id == two.layout_id
    packed = snapshot.Layout([("t0", torch.zeros(30)), ("t1", torch.zeros(36))], 64)
    assert packed.layout_id != one.layout_id  # the gap is part of the layout


def test_buffers_are_capped_so_the_transient_extra_memory_is_bounded():
    ts = [torch.randn(10) for _ in range(5)]  # 40 bytes each
    assert flat.runs(ts, cap=100) == [[0, 1], [2, 3]]  # the fifth alone: no buffer
    before = [t.clone() for t in ts]
    assert flat.consolidate(ts, cap=100) == 4
    assert ts[0].untyped_storage().data_ptr() == ts[1].untyped_storage().data_ptr()
    assert ts[1].untyped_storage().data_ptr() != ts[2].untyped_storage().data_ptr()
    assert all(torch.equal(a, b) for a, b in zip(ts, before))
