"""``deadpool bench recovery``: the hot swap's per-phase recovery time against world size.

For each world size W (processes; 2 per simulated node, TP2 x PP2 x DP W/4, one spare node)
the demo model is trained and node 1 is SIGKILLed at a fixed iteration, ``repeats`` times.
A run's phase time is the slowest rank's (``launch/summary.py``); its total is the sum of
the phases (an upper bound: ranks overlap); ``wall_s`` is the end-to-end time (failure until
the slowest rank's first step is done). Per world size the medians and min-max of each phase and of the total::

    {"runs": [{"world_size": 8, "phases_s": {"detect": {"median", "min", "max"}, ...},
               "total_s_median": ..., "total_s": {...}, "samples": [...]}, ...],
     "hang": {"heartbeat_timeout_s": ..., "detect_s": ..., "goal_s": ...}}

``hang``: one run at the middle world size where a rank is SIGSTOPped instead: its
detection latency against the configured heartbeat timeout (goal: timeout + 0.5 s).
"""

from __future__ import annotations

import os
import statistics
import tempfile
from typing import Dict, List, Optional, Sequence

from .demo import DEMO_FLAGS
from ..base.errors import DeadpoolError
from ..launch.launcher import LaunchOptions, run
from ..launch.progress import Console
from ..launch.summary import read_rank_results
from ..base.vocabulary import PHASE_ORDER

PROCS_PER_NODE = 2
KILL_ITER, TRAIN_ITERS = 8, 12
HANG_TIMEOUT_S = 2.0
CONFIG = ("demo model, TP2 x PP2 x DP W/4, W/2 nodes x 2 processes + 1 spare node, node 1 "
          f"SIGKILLed at iteration {KILL_ITER}; a phase's time is the slowest rank's")


LIGHT = {"--num-layers": "2", "--hidden-size": "8", "--num-attention-heads": "2",
         "--seq-length": "4", "--max-position-embeddings": "4", "--micro-batch-size": "1"}


def trainer_flags(world_size: int, light: bool) -> List[str]:
    """Pure: the demo model's flags, or with ``light`` a model of a few KB (2 layers of
    hidden size 8, one sample per data-parallel rank per step): the same layout, groups,
    membership, mirror and restore, so that W = 32 and 64 fit on 2 cores."""
    flags = list(DEMO_FLAGS)
    if not light:
        return flags
    for flag, value in {**LIGHT, "--global-batch-size": str(world_size // 4)}.items():
        flags[flags.index(flag) + 1] = value
    return flags


def check_world_sizes(world_sizes: Sequence[int]) -> List[int]:
    """Pure: TP2 x PP2 needs W a multiple of 4, and node 1 must exist (W >= 4)."""
    out = sorted(set(world_sizes))
    bad = [w for w in out if w < 4 or w % 4]
    if not out or bad:
        raise DeadpoolError(f"--world-sizes must be multiples of 4 (TP2 x PP2), >= 4; got "
                            f"{list(world_sizes)}")
    return out


def spread(values: Sequence[float]) -> Dict[str, float]:
    return {"median": round(statistics.median(values), 4), "min": round(min(values), 4),
            "max": round(max(values), 4)}


def aggregate(world_size: int, samples: List[dict], shard_bytes: Optional[int]) -> dict:
    """Pure: one world size's runs (each a launch summary's first recovery) -> medians."""
    phases = {ph: spread([s["phases_s"].get(ph, 0.0) for s in samples]) for ph in PHASE_ORDER}
    totals = [s["total_s"] for s in samples]
    walls = [s["wall_s"] for s in samples if s.get("wall_s") is not None]
    out = {"world_size": world_size, "nodes": world_size // PROCS_PER_NODE, "spare_nodes": 1,
            "processes": world_size + PROCS_PER_NODE,  # the spare node's included
            "repeats": len(samples), "phases_s": phases,
            "total_s_median": round(statistics.median(totals), 4), "total_s": spread(totals),
            "wall_s": spread(walls) if walls else None,
            "shard_bytes_per_rank": shard_bytes,
            "samples": [{k: s.get(k) for k in ("phases_s", "total_s", "wall_s")}
                        for s in samples]}
    if any(s.get("counts") for s in samples):  # --counts: exact, so every run must agree
        out["counts"], out["counts_spare"] = samples[0]["counts"], samples[0]["counts_spare"]
        out["counts_agree"] = all(s["counts"] == samples[0]["counts"] for s in samples)
        out["counts_busiest"] = samples[0].get("counts_busiest") or {}
        for mine, s in zip(out["samples"], samples):
            mine["counts"] = s["counts"]
    return out


def count_laws(runs: List[dict]) -> Dict[str, Dict[str, dict]]:
    """Pure: per phase and kind, the per-survivor count at each W and its fitted form
    (sim_counts.count_laws: O(1), O(log W) or O(W))."""
    from .sim_counts import count_laws as fitted

    measured = [r for r in runs if r.get("counts") is not None]
    laws = fitted(measured) if measured else {}
    return {ph: {kind: {"by_w": {str(r["world_size"]): r["counts"].get(ph, {}).get(kind, 0)
                                 for r in measured},
                        "form": law.form, "law": law.to_json()}
                 for kind, law in kinds.items()}
            for ph, kinds in laws.items() if kinds}


def counts_table(laws: Dict[str, Dict[str, dict]]) -> str:
    """Pure: one line per phase and kind, the counts at each W and the fitted form."""
    lines = []
    for ph, kinds in laws.items():
        for kind, x in kinds.items():
            at = " ".join(f"W={w}:{n}" for w, n in x["by_w"].items())
            lines.append(f"{ph:<15} {kind:<16} {at}  {x['form'] or '-'}")
    return "\n".join(lines)


def _one(work: str, tag: str, world_size: int, inject: str, extra: List[str], log: str,
         light: bool = False) -> dict:
    """One run; its first recovery (with ``counts`` and ``counts_spare``: per phase, the
    most work one survivor and one promoted spare did)."""
    rd = os.path.join(work, tag)
    argv = trainer_flags(world_size, light) + [
        "--train-iters", str(TRAIN_ITERS), "--deadpool", "--deadpool-events",
        os.path.join(work, f"{tag}.events.jsonl")] + extra
    s = run(LaunchOptions(nodes=world_size // PROCS_PER_NODE, procs_per_node=PROCS_PER_NODE,
                          spare_nodes=1, inject=[inject], results_dir=rd, trainer_argv=argv,
                          quiet=True),
            out=Console(log, total=TRAIN_ITERS, every=TRAIN_ITERS, label=f"{tag}: "))
    if not s["ok"] or not s.get("recoveries"):
        raise DeadpoolError(f"recovery benchmark run {tag} failed: {s['error']} (worker "
                            f"output: {log})")
    ranks = read_rank_results(rd, world_size)
    s["recoveries"][0]["shard_bytes"] = max(x.get("mirror_tensor_bytes", 0) for x in ranks)
    return s["recoveries"][0]


def _print_run(w: int, i: int, repeats: int, rec: dict) -> None:
    ph = " ".join(f"{p} {rec['phases_s'].get(p, 0.0):.3f}" for p in PHASE_ORDER)
    wall = rec.get("wall_s")
    print(f"W={w:<3} run {i + 1}/{repeats}: total {rec['total_s']:.3f} s (end to end "
          f"{'n/a' if wall is None else f'{wall:.3f}'} s) | {ph}", flush=True)
    if rec.get("counts_busiest"):
        print(f"W={w:<3} run {i + 1}/{repeats}: {busiest_line(rec['counts_busiest'])}",
              flush=True)


def busiest_line(b: dict) -> str:
    """Pure: the busiest survivor's rebuild against the dead ranks' own groups."""
    c, out, most = b["counts"], b["outside_dead_groups"], b["outside_dead_groups_most"]
    return (f"busiest survivor in {b['phase']}: rank {b['rank']}, connections "
            f"{c.get('connections', 0)}, store ops {c.get('store_ops', 0)}; of them in the "
            f"dead ranks' {b['dead_groups']} group(s) of {b['dead_group_members']} members: "
            f"{c.get('dead_group_connections', 0)} and {c.get('dead_group_store_ops', 0)}; "
            f"outside them {out['connections']} and {out['store_ops']} (most by any "
            f"survivor: {most['connections']} and {most['store_ops']})")


def recovery(repeats: int = 3, world_sizes: Sequence[int] = (4, 8, 16),
             hang: bool = True, counts: bool = False, light: bool = False,
             extra: Sequence[str] = ()) -> dict:
    """``counts``: each phase's work counted, and first (on the still idle machine) what
    one unit of each kind costs (bench_units.py), for ``deadpool sim``'s count law.
    ``extra``: more trainer flags for every run (e.g. ``--deadpool-replicas 2``)."""
    sizes = check_world_sizes(world_sizes)
    if repeats < 1:
        raise DeadpoolError("--repeats must be >= 1")
    unit_costs = None
    if counts:
        from .bench_units import units

        print("[bench recovery] unit costs, timed one by one (2 processes):", flush=True)
        unit_costs = units()
    work = tempfile.mkdtemp(prefix="deadpool-bench-recovery-")
    log = os.path.join(work, "workers.log")
    print(f"[bench recovery] world sizes {sizes}, {repeats} run(s) each; worker output in "
          f"{log}", flush=True)
    runs, failed = [], []
    for w in sizes:
        samples = []
        for i in range(repeats):
            try:
                samples.append(_one(work, f"w{w}-run{i}", w, f"kill:node=1@iter={KILL_ITER}",
                                    (["--deadpool-count-work"] if counts else [])
                                    + list(extra), log, light))
            except DeadpoolError as exc:  # recorded and reported; the other runs go on
                failed.append({"world_size": w, "run": i, "error": str(exc)})
                print(f"W={w:<3} run {i + 1}/{repeats}: FAILED: {exc}", flush=True)
                continue
            _print_run(w, i, repeats, samples[-1])
        if samples:
            runs.append(aggregate(w, samples, samples[-1]["shard_bytes"]))
            print(f"W={w}: median total {runs[-1]['total_s_median']:.3f} s", flush=True)
    result = {"config": CONFIG + ("; light: a model of a few KB" if light else "")
              + (f"; trainer flags {' '.join(extra)}" if extra else ""),
              "light": light, "runs": runs, "failed_runs": failed, "work_dir": work,
              "cpu_cores": os.cpu_count()}
    if counts:
        result["unit_costs"] = unit_costs
        result["count_laws"] = count_laws(runs)
        print("per survivor, per phase (the most one survivor did):\n"
              + counts_table(result["count_laws"]), flush=True)
    if hang:
        try:
            result["hang"] = _hang(work, sizes[len(sizes) // 2], log)
        except DeadpoolError as exc:
            failed.append({"world_size": sizes[len(sizes) // 2], "run": "hang",
                           "error": str(exc)})
            print(f"hang run FAILED: {exc}", flush=True)
    print(f"[bench recovery] worker output in {log}", flush=True)
    return result


def _hang(work: str, world_size: int, log: str) -> dict:
    """A SIGSTOPped rank: detected by its stale heartbeat, so detection is bounded below by
    the heartbeat timeout; the goal is the timeout + 0.5 s."""
    rec = _one(work, f"w{world_size}-hang", world_size, f"stop:rank=3@iter={KILL_ITER}",
               ["--deadpool-heartbeat-timeout", str(HANG_TIMEOUT_S)], log)
    detect = rec["phases_s"]["detect"]
    out = {"world_size": world_size, "heartbeat_timeout_s": HANG_TIMEOUT_S,
           "detect_s": detect, "goal_s": HANG_TIMEOUT_S + 0.5,
           "detect_over_timeout_s": round(detect - HANG_TIMEOUT_S, 4),
           "within_goal": detect <= HANG_TIMEOUT_S + 0.5, "phases_s": rec["phases_s"],
           "total_s": rec["total_s"]}
    print(f"hang (SIGSTOP, W={world_size}): detect {detect:.3f} s against a heartbeat timeout "
          f"of {HANG_TIMEOUT_S} s (goal <= {out['goal_s']} s); total {rec['total_s']:.3f} s",
          flush=True)
    return out
