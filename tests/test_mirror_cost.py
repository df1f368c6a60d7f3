"""What the mirror costs and how it is measured: per-thread CPU clocks (mirror/meter.py), the
snapshot's copy bandwidth against a plain copy, the bench's aggregation, and the cheap
snapshot path (one foreach copy per slot, CRC-32C, holders skip the metadata)."""

import json
import struct
import textwrap
import threading
import time

import pytest
import torch
from crc32c import crc32c

from megatron_deadpool.apps import bench
from megatron_deadpool.base.errors import MirrorCorruptError
from megatron_deadpool.mirror import cost, d2h, meter, snapshot
from solo import solo_result


def test_window_divides_mirror_cpu_per_job_by_training_cpu_per_step():
    start = cost.Sample(main_s=10.0, main_mirror_s=1.0, steps=3, jobs=3,
                       parts={"mirror_thread": 1.5, "gloo": 0.5})
    last = cost.Sample(main_s=20.5, main_mirror_s=1.5, steps=13)
    end = cost.Sample(main_s=0.0, main_mirror_s=0.0, steps=0, jobs=14,
                     parts={"mirror_thread": 1.9, "gloo": 0.7})
    w = cost.window(start, last, end)
    assert (w["steps"], w["jobs"]) == (10, 11)
    assert w["main_train_cpu_per_step_s"] == pytest.approx(1.0)  # (10.5 - 0.5) / 10
    assert w["mirror_threads_cpu_per_job_s"] == pytest.approx(0.6 / 11)
    assert w["main_mirror_cpu_per_job_s"] == pytest.approx(0.5 / 11)
    assert w["mirror_cpu_fraction"] == pytest.approx(1.1 / 11)
    assert w["mirror_thread_cpu_per_job_s"] == pytest.approx(0.4 / 11)
    assert w["gloo_cpu_per_job_s"] == pytest.approx(0.2 / 11)
    assert cost.window(start, cost.Sample(20.0, 1.0, 3), end) is None  # no step in it


def test_thread_clock_from_proc_matches_the_threads_own_clock():
    out = {}

    def burn():
        x = 0
        while time.thread_time() < 0.05:
            x += 1
        out["tid"], out["own"] = threading.get_native_id(), time.thread_time()
        out["proc"] = meter.thread_cpu_s(out["tid"])

    t = threading.Thread(target=burn)
    t.start()
    t.join()
    assert out["proc"] == pytest.approx(out["own"], abs=0.02)
    assert meter.thread_cpu_s(0) is None  # no such thread
    assert meter.threads_cpu_s([out["tid"], threading.get_native_id()]) > 0


def _late_named_thread(name: str, delay_s: float, stop: threading.Event, tids: list):
    """A thread that, like a native one, names itself only once it runs (here: late)."""
    def body():
        tids.append(threading.get_native_id())
        time.sleep(delay_s)
        with open(f"/proc/self/task/{tids[0]}/comm", "w") as f:
            f.write(name)
        stop.wait(10)

    t = threading.Thread(target=body, daemon=True)
    t.start()
    return t


def test_a_thread_that_names_itself_late_is_still_found():
    from megatron_deadpool.mirror.meter import started_threads, thread_names

    before, stop, tids = thread_names(), threading.Event(), []
    _late_named_thread("dp-late-test", 0.2, stop, tids)
    try:
        got = started_threads(before, ("dp-late-test",), settle_s=5.0)
        assert got == set(tids) and len(tids) == 1
        # one that never names itself: given up on after settle_s, not found
        before, tids2 = thread_names(), []
        _late_named_thread("dp-never", 60.0, stop, tids2)
        assert started_threads(before, ("dp-never",), settle_s=0.1) == set()
    finally:
        stop.set()


def test_foreach_copy_fills_each_slot_exactly():
    flat = torch.arange(64, dtype=torch.float32)
    named = [("a", flat[:16]), ("b", flat[16:48]), ("x", torch.randn(7)),
             ("e", torch.arange(6.0).reshape(2, 3).t()), ("step", torch.tensor(3.0))]
    layout = snapshot.Layout(named, 1 << 12)
    runs = d2h.plan(layout, [t for _, t in named])
    c = d2h.Copier()
    slots = [snapshot.alloc_slot(layout.total_bytes, False) for _ in range(2)]
    for k, slot in enumerate(slots + slots):
        for _, t in named:
            t.add_(1)
        c.copy(slot, runs)
        ref = snapshot.alloc_slot(layout.total_bytes, False)
        snapshot.copy_tensors_in(ref, layout, [t for _, t in named])
        assert torch.equal(slot, ref), k
    assert c.copies == 4 * len(runs) and c.bytes == 4 * layout.tensor_bytes


def _sealed():
    named = [("a", torch.randn(100)), ("step", torch.tensor(2.0))]
    layout = snapshot.Layout(named, 1 << 10)
    slot = snapshot.alloc_slot(layout.total_bytes, False)
    snapshot.copy_tensors_in(slot, layout, [t for _, t in named])
    snapshot.seal(slot, layout, 1, 5, {"iteration": 5})
    return layout, slot


def test_checksum_is_crc32c_over_chunk_crcs_then_metadata():
    layout, slot = _sealed()
    h = snapshot.read_header(slot)
    raw = slot.numpy().tobytes()
    tensors = raw[snapshot.HEADER_BYTES:layout.tensor_end]
    meta = raw[layout.tensor_end:layout.tensor_end + h["meta_len"]]
    expect = crc32c(meta, crc32c(struct.pack("<I", crc32c(tensors))))
    assert h["crc"] == expect and h["magic"] == snapshot.MAGIC


def test_holder_verify_skips_the_metadata_but_not_the_checksum():
    layout, slot = _sealed()
    assert snapshot.verify(slot, 1, 5, load_meta=False) is None
    assert snapshot.verify(slot, 1, 5) == {"iteration": 5}
    slot[layout.entries[0].offset + 7] ^= 0x04
    with pytest.raises(MirrorCorruptError, match="checksum"):
        snapshot.verify(slot, 1, 5, load_meta=False)


def test_format_1_slot_is_refused_by_name():
    layout, slot = _sealed()
    snapshot._header(slot)[0] = snapshot.MAGIC_V1
    with pytest.raises(MirrorCorruptError, match="format 1"):
        snapshot.verify(slot, 1, 5)


def _rank(fraction, gbps, copy):
    return {"mirror_cpu": {"mirror_cpu_fraction": fraction},
            "snapshot": {"snapshot_gbps": gbps, "copy_gbps": copy, "copy_cold_gbps": copy / 2,
                         "snapshot_bytes": 100}}


def test_bench_takes_the_max_over_ranks_then_the_median_over_runs(tmp_path):
    costs = []
    for run_i, fr in enumerate([(0.01, 0.03), (0.02, 0.05), (0.04, 0.01)]):
        d = tmp_path / f"r{run_i}"
        d.mkdir()
        for r, f in enumerate(fr):
            (d / f"rank{r}.json").write_text(json.dumps(_rank(f, 2.0 + r, 4.0)))
        costs.append(bench.mirror_cost(str(d), 2))
    assert [c["mirror_cpu_fraction"] for c in costs] == [0.03, 0.05, 0.04]
    out = bench.combine_costs(costs)
    assert out["mirror_cpu_fraction"] == 0.04
    assert out["snapshot_gbps"] == 2.5 and out["copy_gbps"] == 4.0
    assert out["snapshot_over_copy_min"] == 0.5
    assert out["copy_cold_gbps"] == 2.0 and out["snapshot_over_cold_copy_median"] == 1.25


SOLO = textwrap.dedent("""
    import json
    import solo
    args, model, opt, sched, state = solo.start()
    p = solo.protect(model, opt, sched, state, replicas=0)
    for _ in range(9):
        p.before_step(state.iteration)
        solo.step(args, model, opt, sched, state)
        p.after_step(state.iteration)
    info = p.finish_info()
    p.close()
    print("RESULT " + json.dumps({k: info[k] for k in (
        "mirror_cpu", "snapshot", "gloo_tids", "mirror_jobs", "mirror_tensor_bytes")}))
""")


def test_a_protected_run_reports_its_mirror_cpu_and_snapshot_bandwidth():
    r = solo_result(SOLO)
    w = r["mirror_cpu"]
    # window from the 3rd step's snapshot: steps 4..9, snapshots 3..9
    assert (w["steps"], w["jobs"]) == (6, 7) and r["mirror_jobs"] == 10
    assert w["main_train_cpu_per_step_s"] > 0 and w["mirror_threads_cpu_per_job_s"] > 0
    assert w["main_mirror_cpu_per_job_s"] > 0 and w["mirror_cpu_fraction"] > 0
    phases = w["mirror_thread_phase_cpu_per_job_s"]
    assert set(phases) == {"copy", "seal", "exchange", "verify"}
    assert 0 < sum(phases.values()) <= w["mirror_thread_cpu_per_job_s"]
    assert len(r["gloo_tids"]) == 3  # the mirror group's loop thread and two workers
    s = r["snapshot"]
    assert s["snapshot_bytes"] == r["mirror_tensor_bytes"] and s["snapshots"] == 7
    assert s["snapshot_gbps"] > 0 and s["copy_gbps"] > 0 and s["checksum_gbps"] > 0
    assert s["copy_cold_gbps"] > 0


def test_compact_python_rng_state_restores_the_same_draws():
    import random

    from megatron_deadpool.adapters import train_state as ts

    random.seed(11)
    random.random()
    random.gauss(0, 1)  # leaves gauss_next set
    full = {"python": random.getstate()}
    packed = ts.compact_rng(full)["python"]
    assert isinstance(packed["words"], bytes) and full["python"][2] == packed["gauss"]
    ahead = [random.random(), random.gauss(0, 1)]
    random.setstate(ts._python_state(packed))
    assert [random.random(), random.gauss(0, 1)] == ahead
    assert ts._python_state(full["python"]) == full["python"]  # the tuple form still reads
