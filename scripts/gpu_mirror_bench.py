#!/usr/bin/env python3
"""The mirror on one GPU: world size 1, --deadpool-replicas 0 (the local double-buffered
pinned host snapshot only), the package's own code path (``Attachment.attach``, the wrapped
``optimizer.step`` that waits for the previous snapshot, ``after_step``, ``restoring``).

Measures, in one process:
  * step time with the mirror off and on, in alternating blocks inside the run (the first
    step of each block is dropped: snapshot k is paid for in step k+1) -> ratio_on_over_off;
  * the snapshot's device-to-host bandwidth (side-stream time, CUDA events) against a plain
    torch copy of the same number of bytes from one device buffer into the same pinned slot;
  * the pinned host memory the mirror holds; the host checksum's throughput;
  * restore: snapshot at k, step k+1, restore k -> every snapshotted tensor, the per-group
    optimizer state, the RNG/counters equal the saved state bitwise; rerun k+1 and compare.

    python scripts/gpu_mirror_bench.py --out r.json -- $(grep -v '^#' configs/gpt_1b_h100.args | xargs)

The trainer flags are the reference trainer's (megatron_deadpool.trainer.args); ``--device
cpu`` runs the same path on CPU (CPU mode) for debugging.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import threading
import time
import zlib
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

RESULT: dict = {}


def save(path):
    with open(path, "w") as f:
        json.dump(RESULT, f, indent=1)


def log(msg):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def start(trainer_argv):
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_deadpool.trainer import gpt
    from megatron_deadpool.trainer.args import parse_args

    args = parse_args(trainer_argv + ["--deadpool", "--deadpool-replicas", "0"])
    if args.device == "cpu":
        from megatron_deadpool.adapters import cpu_mode

        cpu_mode.enable()
        torch.set_num_threads(1)
        device = torch.device("cpu")
    else:
        torch.cuda.set_device(0)
        device = torch.device("cuda", 0)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                            init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    ps.initialize_model_parallel(1, 1)
    t0 = time.perf_counter()
    model, optimizer, scheduler = gpt.build(args, device)
    RESULT["build_s"] = time.perf_counter() - t0
    RESULT["params"] = sum(p.numel() for c in model for p in c.parameters())
    state = SimpleNamespace(iteration=0, consumed_train_samples=0)
    return args, device, model, optimizer, scheduler, state


def sync(device):
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def train(args, device, model, optimizer, scheduler, state, p, modes):
    """One step per entry of ``modes`` ("on"/"off"); returns the step times. Each step's
    breakdown goes to RESULT["steps"]: the main thread's CPU time (time.thread_time: a
    main thread that waits, e.g. for the GIL held by the mirror's threads, uses less CPU than
    its wall time), and on a GPU the compute stream's span from the step's first to its last
    recorded event (kernels slowed by the snapshot's copies lengthen it)."""
    import torch

    from megatron_deadpool.trainer import gpt

    times = []
    for mode in modes:
        ev = ([torch.cuda.Event(enable_timing=True) for _ in range(2)]
              if device.type == "cuda" else None)
        t0, c0 = time.perf_counter(), time.thread_time()
        if ev:
            ev[0].record()
        p.before_step(state.iteration)
        loss, _ = gpt.train_step(args, state, model, optimizer, scheduler, device, None)
        state.iteration += 1
        state.consumed_train_samples += args.global_batch_size
        if ev:
            ev[1].record()
        t_launched = time.perf_counter() - t0
        p.after_step(state.iteration, mirror_on=(mode == "on"))
        sync(device)
        times.append(time.perf_counter() - t0)
        RESULT.setdefault("steps", []).append({
            "iteration": state.iteration, "mode": mode, "wall_s": times[-1],
            "main_cpu_s": time.thread_time() - c0, "launched_s": t_launched,
            "gpu_span_s": ev[0].elapsed_time(ev[1]) / 1e3 if ev else None})
        log(f"iteration {state.iteration} mirror {mode}: {times[-1] * 1000:.1f} ms "
            f"loss {loss}")
    return times


def breakdown(steps, block):
    """Medians per mode of each step measure (each block's first step left out, as for the
    ratio): where the mirror's cost goes. ``wall - main_cpu``: the main thread off the CPU
    (waiting); ``gpu_span``: the device's time for the step's work."""
    out = {}
    for mode in ("on", "off"):
        kept = [s for i, s in enumerate(steps) if s["mode"] == mode and i % block != 0]
        out[mode] = {k: statistics.median(s[k] for s in kept) if kept and kept[0][k]
                     is not None else None
                     for k in ("wall_s", "main_cpu_s", "launched_s", "gpu_span_s")}
    out["ratios_on_over_off"] = {k: out["on"][k] / out["off"][k] for k in out["on"]
                                 if out["on"][k] and out["off"][k]}
    return out


def profile(run, device, steps=("on", "on", "off", "off")):
    """torch.profiler over a few steps of each mode: the device time of the kernels
    (copies excluded) and of the device-to-host copies, per mode, and the top operators by
    self CPU time. Kernels that take longer with the mirror on point at the device (the copy
    engine and memory bandwidth); the same kernel time with a longer step points at the
    host (launches delayed on the main thread)."""
    import torch
    from torch.profiler import ProfilerActivity, profile as prof

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    out = {}
    for mode in dict.fromkeys(steps):
        with prof(activities=acts) as pr:
            run([m for m in steps if m == mode])
        ka = pr.key_averages()

        def dev(e):
            return getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0))
        copies = sum(dev(e) for e in ka if "Memcpy" in e.key or "memcpy" in e.key)
        out[mode] = {"kernel_s": (sum(dev(e) for e in ka) - copies) / 1e6,
                     "copy_s": copies / 1e6,
                     "top_cpu": [(e.key, e.self_cpu_time_total / 1e6) for e in
                                 sorted(ka, key=lambda e: -e.self_cpu_time_total)[:12]]}
    return out


def blocks(args_b, p_run):
    """Alternating blocks (on, off, on, off, ...) of ``block`` steps."""
    modes = []
    for b in range(args_b.blocks * 2):
        modes += ["on" if b % 2 == 0 else "off"] * args_b.block
    times = p_run(modes)
    by = {"on": [], "off": []}
    for i, (t, m) in enumerate(zip(times, modes)):
        if i % args_b.block != 0:
            by[m].append(t)
    on, off = statistics.median(by["on"]), statistics.median(by["off"])
    return {"block": args_b.block, "blocks_per_mode": args_b.blocks, "step_s_on": on,
            "step_s_off": off, "ratio_on_over_off": on / off, "steps_on": by["on"],
            "steps_off": by["off"], "modes": modes, "times": times}


def state_tensors(p):
    p.mirror.refresh_sources()
    p.mirror.holdings.ensure_layout()
    return list(p.mirror._tensors)


def snapshot_state(p, optimizer, state, scheduler, where):
    """A copy of everything a restore must bring back (tensors on ``where``)."""
    from megatron_deadpool.adapters import shard
    from megatron_deadpool.adapters import train_state as ts

    meta = ts.capture(state.iteration, state, scheduler, optimizer,
                      with_cuda=p._with_cuda)
    return {"tensors": [t.detach().to(where, copy=True) for t in state_tensors(p)],
            "meta": ts.canonical_bytes(meta), "groups": shard.group_state(optimizer)}


def same_state(p, optimizer, state, scheduler, saved):
    import torch

    from megatron_deadpool.adapters import shard
    from megatron_deadpool.adapters import train_state as ts

    live = state_tensors(p)
    diff = [i for i, (a, b) in enumerate(zip(live, saved["tensors"]))
            if not torch.equal(a.detach().view(-1).view(torch.uint8).to(b.device),
                               b.view(-1).view(torch.uint8))]
    meta = ts.capture(state.iteration, state, scheduler, optimizer, with_cuda=p._with_cuda)
    return {"tensors": len(live), "tensors_differing": len(diff),
            "meta_equal": ts.canonical_bytes(meta) == saved["meta"],
            "groups_equal": shard.group_state(optimizer) == saved["groups"]}


def restore_check(args, device, model, optimizer, scheduler, state, p, link):
    """Snapshot at k (committed), step k+1 unsnapshotted, restore k, compare; rerun k+1."""
    import torch

    from megatron_deadpool.recovery import restore

    run = lambda modes: train(args, device, model, optimizer, scheduler, state, p, modes)  # noqa: E731
    run(["on"])
    p.mirror.wait()
    k = state.iteration
    where = device.type if device.type == "cuda" else "cpu"
    at_k = snapshot_state(p, optimizer, state, scheduler, where)
    run(["off"])
    at_k1 = snapshot_state(p, optimizer, state, scheduler, "cpu")
    t0 = time.perf_counter()
    restored = restore.run(p.restoring(0, link))
    sync(device)
    out = {"snapshot_iteration": k, "restored_iteration": restored,
           "restore_s": time.perf_counter() - t0}
    out["restored_vs_saved"] = same_state(p, optimizer, state, scheduler, at_k)
    del at_k
    if device.type == "cuda":
        torch.cuda.empty_cache()
    run(["off"])
    out["rerun_vs_first_run"] = same_state(p, optimizer, state, scheduler, at_k1)
    r = out["restored_vs_saved"]
    out["bitwise"] = (restored == k and r["tensors_differing"] == 0 and r["meta_equal"]
                      and r["groups_equal"])
    return out


def copy_reference(p, device, reps=3):
    """A plain torch copy of the snapshot's bytes: one device buffer -> the pinned slot."""
    import torch

    n = p.mirror.layout.tensor_bytes
    slot = p.mirror.own.slot(0)
    out = {"bytes": n, "slot_pinned": bool(slot.is_pinned())}
    if device.type != "cuda":
        return out
    src = torch.empty(n, dtype=torch.uint8, device=device)
    src.fill_(7)
    s, e0, e1 = torch.cuda.Stream(), torch.cuda.Event(True), torch.cuda.Event(True)
    secs = []
    for _ in range(reps):
        with torch.cuda.stream(s):
            e0.record(s)
            slot[128:128 + n].copy_(src, non_blocking=True)
            e1.record(s)
        e1.synchronize()
        secs.append(e0.elapsed_time(e1) / 1000.0)
    del src
    torch.cuda.empty_cache()
    out.update({"seconds": secs, "gbps": n / min(secs) / 1e9})
    return out


def checksum_rate(p, nbytes=1 << 30, threads=8):
    """zlib.crc32 (the snapshot checksum) over part of a slot: one thread, and ``threads``
    threads on separate chunks (zlib releases the GIL)."""
    slot = p.mirror.own.slot(1)
    n = min(nbytes, slot.numel() - 128)
    mv = memoryview(slot.numpy())[128:128 + n]
    t0 = time.perf_counter()
    zlib.crc32(mv)
    one = time.perf_counter() - t0
    step = n // threads
    ts = [threading.Thread(target=zlib.crc32, args=(mv[i * step:(i + 1) * step],))
          for i in range(threads)]
    t0 = time.perf_counter()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    many = time.perf_counter() - t0
    return {"bytes": n, "one_thread_gbps": n / one / 1e9, "threads": threads,
            "threads_gbps": n / many / 1e9}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--block", type=int, default=3)
    ap.add_argument("--blocks", type=int, default=2, help="blocks per mode")
    ap.add_argument("--profile", action="store_true",
                    help="also profile 2 steps per mode (torch.profiler): kernel and copy "
                         "device time, top CPU operators (RESULT['profile'])")
    ap.add_argument("trainer_argv", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    argv = [x for x in a.trainer_argv if x != "--"]
    import torch

    from megatron_deadpool.control.attachment import Attachment
    from megatron_deadpool.control.link import Links, MirrorSettings
    from megatron_deadpool.mirror.meter import Meter

    RESULT.update({"argv": argv, "torch": torch.__version__})
    try:
        from importlib.metadata import version

        RESULT["megatron_core"] = version("megatron-core")
    except Exception as exc:  # noqa: BLE001
        RESULT["megatron_core"] = repr(exc)
    if torch.cuda.is_available():
        RESULT["device"] = torch.cuda.get_device_name(0)
    args, device, model, optimizer, scheduler, state = start(argv)
    log(f"built: {RESULT['params']:,} parameters in {RESULT['build_s']:.1f} s")
    save(a.out)
    meter = Meter()
    settings = MirrorSettings(replicas=0, create_timeout_s=600, op_timeout_s=600)
    link = Links(settings, meter).connect(SimpleNamespace(node_of_rank=[0], gen=0))
    p = Attachment(settings, meter)
    p.attach(model, optimizer, scheduler, state, rank=0, world_size=1,
             with_cuda=device.type == "cuda", link=link, fault_points=lambda it, phase: None)
    run = lambda modes: train(args, device, model, optimizer, scheduler, state, p, modes)  # noqa: E731
    t0 = time.perf_counter()
    run(["off"] * a.warmup)  # the first call commits the initial state (allocates slots)
    RESULT["warmup_s"] = time.perf_counter() - t0
    RESULT["in_run"] = blocks(a, run)
    log(f"in run: {json.dumps({k: RESULT['in_run'][k] for k in ('step_s_on', 'step_s_off', 'ratio_on_over_off')})}")
    kept = RESULT["steps"][a.warmup:]
    RESULT["breakdown"] = breakdown(kept, a.block)
    log(f"breakdown: {json.dumps(RESULT['breakdown'])}")
    if a.profile:
        RESULT["profile"] = profile(run, device)
        log(f"profile: {json.dumps({m: {k: v for k, v in d.items() if k != 'top_cpu'} for m, d in RESULT['profile'].items()})}")
    save(a.out)
    m = p.mirror
    m.wait()
    c = m.copier
    cs = {"copies": c.copies, "bytes": c.bytes, "gpu_copy_s": c.gpu_copy_s, "runs": c.runs}
    RESULT["mirror"] = {"slot_bytes": m.layout.total_bytes,
                        "snapshot_tensor_bytes": m.layout.tensor_bytes,
                        "tensors": len(m.layout.entries), "copies_per_snapshot": cs["runs"],
                        **m.memory(), "jobs": meter.jobs, "job_s": meter.job_s,
                        "waits": meter.waits, "wait_s": meter.wait_s, "copy_stats": cs,
                        "snapshot_gbps": cs["bytes"] / cs["gpu_copy_s"] / 1e9
                        if cs["gpu_copy_s"] else None}
    save(a.out)
    RESULT["plain_copy"] = copy_reference(p, device)
    RESULT["checksum"] = checksum_rate(p)
    log(f"mirror: {json.dumps(RESULT['mirror'])}")
    log(f"plain copy: {json.dumps(RESULT['plain_copy'])} checksum: {json.dumps(RESULT['checksum'])}")
    save(a.out)
    RESULT["restore"] = restore_check(args, device, model, optimizer, scheduler, state, p, link)
    log(f"restore: {json.dumps(RESULT['restore'])}")
    if device.type == "cuda":
        RESULT["max_memory_allocated"] = torch.cuda.max_memory_allocated()
    save(a.out)
    p.close()
    return 0 if RESULT["restore"]["bitwise"] else 1


if __name__ == "__main__":
    sys.exit(main())
