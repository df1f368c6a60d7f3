"""The mirror's host side, in one process: which slots are pinned, how the snapshot copies
are planned and issued, the local-only mode (--deadpool-replicas 0)."""

import threading

import pytest
import torch

from megatron_deadpool.mirror import d2h, snapshot
from megatron_deadpool.mirror.exchange import Exchange
from megatron_deadpool.mirror.meter import Meter
from megatron_deadpool.mirror.mirror import Mirror


class _Transport:
    """Two ranks; records every call. The buddy's slot has the same size as ours."""

    def __init__(self):
        self.calls = []

    def gather_from(self, v, ranks, timeout_s=None):
        self.calls.append("gather_from")
        return {r: v for r in ranks}

    def exchange(self, sends, recvs, timeout_s=None):
        self.calls.append("exchange")
        self.sent = [src.numel() for _, src in sends]
        for (_, src), (_, dst) in zip(sends, recvs):
            dst[:src.numel()].copy_(src)  # the buddy's copy: ours, as if it had sent it

    def all_ok(self, ok, timeout_s=None):
        self.calls.append("all_ok")
        return ok


def _connect(m, transport, peers):
    """``m`` exchanges over ``transport`` with ``peers`` as its buddies and its owners."""
    m.exchange = Exchange(m.holdings, transport, peers, peers, m.replicas)
    return m.exchange


def _named():
    flat = torch.arange(64, dtype=torch.float32)  # 3 views, 64-byte multiples, adjacent
    return [("a", flat[:16]), ("b", flat[16:48]), ("c", flat[48:]),
            ("d", torch.ones(5, dtype=torch.bfloat16)), ("e", torch.arange(6.0).t()),
            ("step", torch.tensor(3.0))]


def test_only_the_own_slots_are_pinned(monkeypatch):
    """The own double buffer receives D2H copies (pinned); buddy receive buffers never
    touch a device (not pinned): 2 pinned slots per rank, not 2(K+1)."""
    pins = []
    real = snapshot.alloc_slot

    def alloc(nbytes, pin):
        pins.append(pin)
        return real(nbytes, False)  # this machine may have no pinned allocator

    monkeypatch.setattr(snapshot, "alloc_slot", alloc)
    m = Mirror(0, replicas=1, meta_capacity=1 << 12, sources=_named)
    try:
        m.pin = True  # as with CUDA present
        exchange = _connect(m, _Transport(), [1])
        m.holdings.ensure_layout()
        assert pins == [True, True]
        exchange._alloc_recv()
        assert pins == [True, True, False, False]
    finally:
        m.close()


def test_adjacent_tensors_are_one_copy_and_the_slot_is_exact():
    named = _named()
    layout = snapshot.Layout(named, 1 << 12)
    runs = d2h.plan(layout, [t for _, t in named])
    # a, b, c share one storage back to back (and the slot): one copy; d, e, step: one each
    assert [r.nbytes for r in runs] == [256, 10, 24, 4]
    slot = snapshot.alloc_slot(layout.total_bytes, False)
    d2h.Copier().copy(slot, runs)
    ref = snapshot.alloc_slot(layout.total_bytes, False)
    snapshot.copy_tensors_in(ref, layout, [t for _, t in named])
    assert torch.equal(slot, ref)


def test_views_that_are_not_adjacent_in_the_slot_stay_separate():
    flat = torch.arange(10, dtype=torch.float32)  # 16 + 24 bytes
    named = [("b", flat[4:]), ("a", flat[:4])]  # adjacent in storage, swapped in the slot
    runs = d2h.plan(snapshot.Layout(named, 64), [t for _, t in named])
    assert [r.nbytes for r in runs] == [24, 16]
    # the slot packs entries back to back (no padding between them): in order, one copy
    named = [("a", flat[:4]), ("b", flat[4:])]
    runs = d2h.plan(snapshot.Layout(named, 64), [t for _, t in named])
    assert [r.nbytes for r in runs] == [40]


def test_a_new_plan_copies_its_own_sources_even_at_a_freed_plans_address():
    """The copier caches each slot's views per plan. A plan is replaced at every relayout
    (the optimizer state created after the placeholders, a restore), and CPython reuses a
    freed list's address: a cache keyed by ``id(runs)`` served a new plan the views of an
    old one, here the placeholders (zeros) of the first layout. Snapshots then carried the
    live params with the placeholders' moments and step, and a restore from them gave a
    trajectory that was not bitwise (the short soak in CI, 2026-11-29)."""
    def sources(value):  # separate allocations: one run each, as torch Adam's state
        return [torch.full((4,), value), torch.full((4,), value + 1)]

    first = sources(0.0)  # the placeholders
    layout = snapshot.Layout([("m", first[0]), ("v", first[1])], 1 << 12)
    slots = [snapshot.alloc_slot(layout.total_bytes, False) for _ in range(2)]
    c = d2h.Copier()
    old = d2h.plan(layout, first)
    c.copy(slots[0], old)
    live = sources(5.0)
    later = d2h.plan(layout, live)
    for slot in slots:
        c.copy(slot, later)
    freed = id(old)
    del old
    new = d2h.plan(layout, live)  # CPython's list free list hands the freed address out
    assert id(new) == freed  # the case this test is about
    c.copy(slots[0], new)
    got = [slots[0][e.offset:e.offset + e.nbytes].view(torch.float32) for e in layout.entries]
    assert [x.tolist() for x in got] == [[5.0] * 4, [6.0] * 4]


def test_snapshot_copies_run_on_the_mirror_thread(monkeypatch):
    threads = []
    real = d2h.Copier.copy

    def spy(self, slot, runs, step_done=None):
        threads.append(threading.current_thread().name)
        return real(self, slot, runs, step_done)

    monkeypatch.setattr(d2h.Copier, "copy", spy)
    meter = Meter()
    m = Mirror(0, replicas=0, meta_capacity=1 << 12, meter=meter, sources=_named)
    try:
        m.set_topology(_Transport(), ["node0"])
        m.begin(1, {"iteration": 1})
        m.wait()
        assert threads == ["deadpool-mirror"]
        assert m.copier.runs == 4 and m.copier.copies == 4
        # the job's CPU, per part: every part clocked, none more than the whole job
        assert set(meter.phase_cpu) == {"copy", "seal", "exchange", "verify"}
        assert all(v >= 0 for v in meter.phase_cpu.values())
        assert meter.phase_cpu["copy"] > 0 and meter.phase_cpu["seal"] > 0
        assert sum(meter.phase_cpu.values()) <= meter.job_cpu_s
        assert meter.jobs == 1 and len(meter.copy_times) == 1
    finally:
        m.close()


def test_replicas_zero_keeps_the_local_double_buffer_only():
    """No buddy, no exchange, no collective: each snapshot commits locally and restores."""
    t = _Transport()
    named = _named()
    m = Mirror(0, replicas=0, meta_capacity=1 << 12, sources=lambda: named)
    try:
        m.set_topology(t, ["node0"])  # one node: fine without replicas
        for it in (1, 2, 3):
            m.begin(it, {"iteration": it})
            m.wait()
            assert m.commits.committed == it
        ex = m.exchange
        assert t.calls == [] and ex.buddies == [] and ex.holds == [] and m.held.slots == {}
        assert m.memory()["host_bytes"] == 2 * m.layout.total_bytes
        assert ex.inventory() == {"own": [2, 3], "committed": 3, "copies": {}}
        before = [x.clone() for _, x in named]
        for _, x in named:
            x.mul_(0)
        meta = m.verify_local(3)
        m.load_local(3)
        assert meta == {"iteration": 3}
        assert all(torch.equal(x, b) for (_, x), b in zip(named, before))
    finally:
        m.close()


def test_replicas_zero_config_and_spares_refused():
    from megatron_deadpool.base.config import DeadpoolConfig
    from megatron_deadpool.base.errors import ConfigError
    from megatron_deadpool.launch.options import LaunchOptions, validate

    assert DeadpoolConfig(replicas=0).replicas == 0
    with pytest.raises(ConfigError, match="replicas"):
        DeadpoolConfig(replicas=-1)
    argv = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
            "--seq-length", "16", "--micro-batch-size", "1", "--global-batch-size", "2",
            "--train-iters", "3", "--mock-data", "--deadpool", "--deadpool-replicas", "0"]
    validate(LaunchOptions(nodes=1, procs_per_node=1, trainer_argv=argv))
    with pytest.raises(ConfigError, match="--deadpool-replicas 0.*--spare-nodes"):
        validate(LaunchOptions(nodes=2, procs_per_node=1, spare_nodes=1, trainer_argv=argv))


def test_a_buddy_gets_the_sealed_bytes_only():
    """The unused metadata capacity of the slot does not travel (``snapshot.sealed``)."""
    t = _Transport()
    m = Mirror(0, replicas=1, meta_capacity=1 << 12, sources=_named)
    try:
        _connect(m, t, [1])
        m.begin(1, {"iteration": 1})
        m.wait()
        h = snapshot.read_header(m.own.slot(1))
        assert t.sent == [h["tensor_end"] + h["meta_len"]]
        assert t.sent[0] < m.layout.total_bytes
        # what arrived is our own slot's used part: byte for byte, the rest untouched
        got = m.held.slots[1][1]
        assert torch.equal(got[:t.sent[0]], m.own.slot(1)[:t.sent[0]])
        assert not got[t.sent[0]:].any()
    finally:
        m.close()


class _Pair:
    """Two in-process mirrors, each the other's buddy: an exchange deposits what it sends
    and waits for the other side's."""

    def __init__(self):
        self.box, self.barrier = {}, threading.Barrier(2, timeout=10)

    def end(self, rank):
        pair = self

        class End:
            world_size = 2

            def gather_from(self, v, ranks, timeout_s=None):
                return {r: v for r in ranks}

            def exchange(self, sends, recvs, timeout_s=None):
                pair.box[rank] = [src.clone() for _, src in sends]
                pair.barrier.wait()
                for (src_rank, dst), got in zip(recvs, pair.box[1 - rank]):
                    dst[:got.numel()].copy_(got)
                pair.barrier.wait()

            def all_ok(self, ok, timeout_s=None):
                return ok

        return End()


def test_a_held_copy_is_checksummed_when_needed_and_a_damaged_one_left_out():
    """Receipt checks the header only; the inventory (the restore decision) checks each
    held copy's checksum once, and leaves out one damaged after it arrived."""
    pair = _Pair()
    ms = [Mirror(r, replicas=1, meta_capacity=1 << 12, sources=_named) for r in (0, 1)]
    try:
        for r, m in enumerate(ms):
            _connect(m, pair.end(r), [1 - r])
        for it in (1, 2):
            for m in ms:
                m.begin(it, {"iteration": it})
            for m in ms:
                m.wait()
        assert ms[0].held.crc_checked == set()  # nothing checksummed on the per-step path
        assert ms[0].exchange.inventory()["copies"] == {"1": [1, 2]}
        assert ms[0].held.crc_checked == {(1, 0), (1, 1)}
        slot = ms[1].held.slots[0][0]  # rank 1's copy of rank 0's iteration 2
        slot[ms[1].layout.entries[1].offset + 3] ^= 0x10  # damaged in memory after arrival
        assert ms[1].exchange.inventory()["copies"] == {"0": [1]}
        assert ms[1].held.holds(0, 1) and not ms[1].held.holds(0, 2)
        ms[0].begin(3, {"iteration": 3})  # a new arrival is checked again
        ms[1].begin(3, {"iteration": 3})
        for m in ms:
            m.wait()
        assert (1, 1) not in ms[0].held.crc_checked
        assert ms[1].exchange.inventory()["copies"] == {"0": [3]}  # 2 stays dropped
    finally:
        for m in ms:
            m.close()
