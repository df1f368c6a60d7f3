"""Benchmarks. Ratios are measured within one invocation; nothing here is asserted by a
timed unit test.

* ``overhead``: the same config with the mirror off and on, interleaved (off, on, off, on,
  ...), median step time of each and the ratio.
* ``recovery``: in ``apps/bench_recovery.py``.
"""

from __future__ import annotations

import os
import statistics
import tempfile
from typing import List, Optional

from ..base.worker_env import WorkerEnv
from .demo import DEMO_FLAGS
from ..launch.launcher import LaunchOptions, run
from ..launch.progress import Console
from ..launch.summary import read_rank_results

WARMUP_ITERS = 3
IN_RUN_ITERS = 150  # 37 blocks of 4: ~55 kept steps per mode
IN_RUN_BLOCK = 4


def _step_times(results_dir: str, world_size: int) -> List[float]:
    """Per iteration, the slowest rank's step time (what the job waits for)."""
    per_rank = [x["step_s"] for x in read_rank_results(results_dir, world_size)]
    return [max(xs) for xs in zip(*per_rank)][WARMUP_ITERS:]


def _with_iters(argv: List[str], n: int) -> List[str]:
    out = list(argv)
    if "--train-iters" in out:
        out[out.index("--train-iters") + 1] = str(n)
    else:
        out += ["--train-iters", str(n)]
    return out


def overhead(trainer_argv: Optional[List[str]], rounds: int = 3, nodes: int = 4,
             procs_per_node: int = 2, in_run_iters: int = IN_RUN_ITERS) -> dict:
    argv = list(trainer_argv) if trainer_argv else DEMO_FLAGS + ["--train-iters", "30"]
    argv = [a for a in argv if a != "--deadpool"]
    work = tempfile.mkdtemp(prefix="deadpool-bench-")
    log = os.path.join(work, "workers.log")
    print(f"full worker output: {log}", flush=True)
    samples = {"off": [], "on": [], "waits": []}
    per_round, costs = [], []
    mirror = {}
    for i in range(rounds):
        for mode in ("off", "on"):
            rd = os.path.join(work, f"{mode}{i}")
            s = run(LaunchOptions(nodes=nodes, procs_per_node=procs_per_node, results_dir=rd,
                                  trainer_argv=argv + (["--deadpool"] if mode == "on" else []),
                                  quiet=True),
                    out=Console(log, every=10, label=f"round {i + 1} mirror {mode}: "))
            if not s["ok"]:
                raise RuntimeError(f"benchmark run {mode}{i} failed: {s['error']}")
            times = _step_times(rd, nodes * procs_per_node)
            samples[mode].extend(times)
            per_round.append({"round": i + 1, "mirror": mode,
                              "median_step_s": statistics.median(times)})
            print(f"round {i + 1}/{rounds} mirror {mode:>3}: median step "
                  f"{statistics.median(times) * 1000:.1f} ms", flush=True)
            if mode == "on":
                mirror = dict(s.get("mirror", {}), **host_memory(rd, nodes * procs_per_node,
                                                               argv))
                samples["waits"].append(s["mirror"]["waits"])
                costs.append(mirror_cost(rd, nodes * procs_per_node))
                per_round[-1]["mirror_cpu_fraction"] = costs[-1]["mirror_cpu_fraction"]
    off, on = statistics.median(samples["off"]), statistics.median(samples["on"])
    result = {
        "step_s_off": off, "step_s_on": on, "ratio_on_over_off": on / off,
        "mirror_bytes_per_rank": mirror.get("mirror_bytes_per_rank"),
        "host_bytes_per_rank": mirror.get("host_bytes_per_rank"),
        "waits": sum(samples["waits"]),
        **{k: mirror.get(k) for k in ("shard_bytes_per_rank", "pinned_bytes_per_rank",
                                      "replicas", "host_bytes_over_shard",
                                      "host_bytes_over_shard_all",
                                      "host_bytes_bound_over_shard")},
        **combine_costs(costs),
        "rounds": rounds, "steps_per_mode": len(samples["off"]), "per_round": per_round,
        "trainer_argv": argv, "nodes": nodes, "procs_per_node": procs_per_node,
    }
    if in_run_iters:
        result["in_run"] = in_run(_with_iters(argv, in_run_iters), nodes, procs_per_node)
    _print_overhead(result)
    print(f"full worker output: {log}", flush=True)
    return result


def _print_overhead(r: dict) -> None:
    if "in_run" in r:
        ir = r["in_run"]
        print(f"in one job (alternating blocks of {ir['block']} iterations, {ir['blocks']} "
              f"blocks): step_s_off {ir['step_s_off'] * 1000:.2f} ms | step_s_on "
              f"{ir['step_s_on'] * 1000:.2f} ms | ratio {ir['ratio_on_over_off']:.4f} "
              f"(block pairs: p25 {_fmt(ir['pair_ratio_p25'], 4)}, p75 "
              f"{_fmt(ir['pair_ratio_p75'], 4)})",
              flush=True)
    print(f"host memory per rank: {r['host_bytes_per_rank']} bytes, at most "
          f"{r['host_bytes_over_shard']:.3f} x the rank's shard (max shard "
          f"{r['shard_bytes_per_rank']} bytes); 2(K+1) = "
          f"{r['host_bytes_bound_over_shard']} for K = {r['replicas']}; pinned "
          f"{r['pinned_bytes_per_rank']}", flush=True)
    f = r.get("mirror_cpu_fraction")
    print(f"mirror_cpu_fraction {f if f is None else round(f, 5)} (max over ranks) | "
          f"snapshot_gbps {_fmt(r.get('snapshot_gbps'))} | copy_gbps "
          f"{_fmt(r.get('copy_gbps'))} (cold caches: {_fmt(r.get('copy_cold_gbps'))}) | "
          f"checksum_gbps {_fmt(r.get('checksum_gbps'))} | commit "
          f"{'/'.join(r.get('mirror_commit') or ['?'])} | transport "
          f"{'/'.join(r.get('mirror_transport') or ['?'])}",
          flush=True)
    worst = [c for c in r.get("mirror_cpu") or [] if c]
    if worst:  # the last run's worst rank: where a snapshot job's CPU goes
        w, us = worst[-1], lambda x: f"{x * 1e6:.0f}"
        ph = " ".join(f"{k} {us(v)}" for k, v in
                      (w.get("mirror_thread_phase_cpu_per_job_s") or {}).items())
        print(f"CPU us per snapshot job (worst rank, last run): main thread "
              f"{us(w['main_mirror_cpu_per_job_s'])} | mirror thread "
              f"{us(w.get('mirror_thread_cpu_per_job_s', 0.0))} ({ph}) | gloo "
              f"{us(w.get('gloo_cpu_per_job_s', 0.0))} | main thread's step "
              f"{us(w['main_train_cpu_per_step_s'])}", flush=True)
    print(f"step_s_off {r['step_s_off'] * 1000:.2f} ms | step_s_on {r['step_s_on'] * 1000:.2f}"
          f" ms | ratio_on_over_off {r['ratio_on_over_off']:.4f} | mirror_bytes_per_rank "
          f"{r['mirror_bytes_per_rank']} | host_bytes_per_rank "
          f"{r['host_bytes_per_rank']} | waits {r['waits']}", flush=True)


def _fmt(x, digits: int = 2) -> str:
    return "n/a" if x is None else f"{x:.{digits}f}"


def mirror_cost(results_dir: str, world_size: int) -> dict:
    """One job's mirror cost from the ranks' results (``mirror/meter.py``): the CPU fraction
    per rank and its max, and the snapshot's copy bandwidth against a plain copy."""
    ranks = read_rank_results(results_dir, world_size)
    fr = [(x.get("mirror_cpu") or {}).get("mirror_cpu_fraction") for x in ranks]
    worst = max(range(len(fr)), key=lambda i: fr[i] if fr[i] is not None else -1.0,
                default=None)
    snaps = [x.get("snapshot") or {} for x in ranks]
    return {"mirror_cpu_fraction": fr[worst] if worst is not None else None,
            "mirror_cpu_fraction_per_rank": fr,
            "mirror_commit": sorted({x.get("mirror_commit") or "?" for x in ranks}),
            "mirror_transport": sorted({x.get("mirror_transport") or "?" for x in ranks}),
            "mirror_cpu_worst_rank": ranks[worst].get("mirror_cpu") if worst is not None
            else None,
            "snapshot_per_rank": snaps}


def combine_costs(costs: List[dict]) -> dict:
    """Over the mirror-on runs: the median of each run's max-over-ranks CPU fraction, and
    medians over every rank of every run of the snapshot / plain-copy bandwidths."""
    fr = [c["mirror_cpu_fraction"] for c in costs if c["mirror_cpu_fraction"] is not None]
    snaps = [s for c in costs for s in c["snapshot_per_rank"]]

    def med(key):
        vals = [s[key] for s in snaps if s.get(key) is not None]
        return statistics.median(vals) if vals else None

    ratios = [s["snapshot_gbps"] / s["copy_gbps"] for s in snaps
              if s.get("snapshot_gbps") and s.get("copy_gbps")]
    cold = [s["snapshot_gbps"] / s["copy_cold_gbps"] for s in snaps
            if s.get("snapshot_gbps") and s.get("copy_cold_gbps")]
    return {"mirror_cpu_fraction": statistics.median(fr) if fr else None,
            "mirror_cpu_fraction_runs": fr,
            "mirror_cpu": [c["mirror_cpu_worst_rank"] for c in costs],
            "mirror_commit": sorted({m for c in costs for m in c.get("mirror_commit", [])}),
            "mirror_transport": sorted({m for c in costs for m in c.get("mirror_transport", [])}),
            "snapshot_gbps": med("snapshot_gbps"), "copy_gbps": med("copy_gbps"),
            "checksum_gbps": med("checksum_gbps"), "snapshot_bytes": med("snapshot_bytes"),
            "snapshot_over_copy_min": min(ratios) if ratios else None,
            "snapshot_over_copy_median": statistics.median(ratios) if ratios else None,
            "copy_cold_gbps": med("copy_cold_gbps"),
            "snapshot_over_cold_copy_median": statistics.median(cold) if cold else None}


def host_memory(results_dir: str, world_size: int, argv: List[str]) -> dict:
    """Host bytes per rank against the shard (every tensor a snapshot holds): own double
    buffer + K buddy double buffers = 2(K+1) slots, a slot being the shard plus a header and
    a fixed metadata area (so a little over 2(K+1) x shard; 4 x shard for K = 1)."""
    ranks = read_rank_results(results_dir, world_size)
    k = 1
    if "--deadpool-replicas" in argv:
        k = int(argv[argv.index("--deadpool-replicas") + 1])
    ratios = [x["host_bytes"] / x["mirror_tensor_bytes"] for x in ranks
              if x.get("mirror_tensor_bytes")]
    return {"shard_bytes_per_rank": max(x.get("mirror_tensor_bytes", 0) for x in ranks),
            "replicas": k,
            "pinned_bytes_per_rank": max(x.get("pinned_bytes", 0) for x in ranks),
            # max over ranks of the rank's host bytes / its own shard (a buddy's shard can
            # be larger: pipeline stages differ)
            "host_bytes_over_shard": max(ratios) if ratios else None,
            "host_bytes_over_shard_all": ratios,
            "host_bytes_bound_over_shard": 2 * (k + 1)}


def in_run(argv: List[str], nodes: int, procs_per_node: int, block: int = IN_RUN_BLOCK
           ) -> dict:
    """Mirror on and off in alternating blocks of ``block`` iterations inside ONE job, so
    both modes see the same processes and machine load. The first step of each block is
    dropped (it still carries the previous block's mode: snapshot k is paid for in step k+1).
    Measures the snapshot and exchange only; the runtime's threads run in both modes.
    ``pair_ratio_*``: quartiles of the ratio of each on block's median to the next off
    block's (how much the headline could move from block to block)."""
    work = tempfile.mkdtemp(prefix="deadpool-bench-inrun-")
    log = os.path.join(work, "workers.log")
    print(f"in one job, mirror on and off in blocks of {block}; full worker output: {log}",
          flush=True)
    s = run(LaunchOptions(nodes=nodes, procs_per_node=procs_per_node, results_dir=work,
                          trainer_argv=argv + ["--deadpool"], quiet=True, bench_block=block),
            out=Console(log, every=25, label="in one job: "))
    if not s["ok"]:
        raise RuntimeError(f"in-run benchmark failed: {s['error']} (see {log})")
    per_rank = read_rank_results(work, nodes * procs_per_node)
    steps = [max(xs) for xs in zip(*(x["step_s"] for x in per_rank))]
    modes = ["on" if WorkerEnv(bench_block=block).mirror_on(i + 1) else "off"
             for i in range(len(steps))]
    by = {"on": [], "off": []}
    blocks: List[tuple] = []
    for i, (t, m) in enumerate(zip(steps, modes)):
        if i >= WARMUP_ITERS and i % block != 0:
            by[m].append(t)
            if not blocks or blocks[-1][0] != i // block:
                blocks.append((i // block, m, []))
            blocks[-1][2].append(t)
    pairs = [statistics.median(a[2]) / statistics.median(b[2])
             for a, b in zip(blocks, blocks[1:]) if a[1] == "on" and b[1] == "off"]
    q = statistics.quantiles(pairs, n=4) if len(pairs) >= 2 else [None, None, None]
    on, off = statistics.median(by["on"]), statistics.median(by["off"])
    return {"step_s_off": off, "step_s_on": on, "ratio_on_over_off": on / off,
            "block": block, "blocks": len(blocks), "steps_on": len(by["on"]),
            "steps_off": len(by["off"]), "pair_ratio_p25": q[0], "pair_ratio_median": q[1],
            "pair_ratio_p75": q[2], **mirror_cost(work, nodes * procs_per_node)}
