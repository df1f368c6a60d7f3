"""``deadpool soak``: one long CPU job with a seeded random schedule of recoverable faults.

Every process that dies is replaced by a fresh standby spare on its node (the node
returns), so the pool stays topped up. The job then runs again without faults and the two
state fingerprints are compared bit for bit. Both runs trace every rank's state after each
step and restore (adapters/digest_trace.py): a soak that ends not bitwise names the first
iteration, rank and part that differ (``first_divergence``).

    deadpool soak --failures 25 --seed 7 [--gap 10] [--summary-json F]
"""

from __future__ import annotations

import json
import os
import random
import tempfile
from typing import List

from .demo import DEMO_FLAGS
from ..adapters import digest_trace
from ..launch.launcher import LaunchOptions, run
from ..launch.progress import Console

# (kind, phase): the recoverable single-process faults the schedule draws from.
KINDS = (("kill", "forward_backward"), ("kill", "optimizer"), ("kill", "mirror"),
         ("segv", "forward_backward"), ("term", "forward_backward"),
         ("stop", "forward_backward"))
NODES, PROCS_PER_NODE, SPARE_NODES = 4, 2, 2


def schedule(failures: int, seed: int, gap: int, world_size: int) -> List[str]:
    """Pure: ``failures`` fault specs, one every ``gap`` iterations (+-2), seeded."""
    rng = random.Random(seed)
    specs, it = [], 2
    for _ in range(failures):
        it += gap + rng.randint(-2, 2)
        kind, phase = rng.choice(KINDS)
        rank = rng.randrange(world_size)
        suffix = "" if phase == "forward_backward" else f",phase={phase}"
        specs.append(f"{kind}:rank={rank}@iter={it}{suffix}")
    return specs


def percentile(xs, q: float) -> float:
    """The q-quantile (0..1) of ``xs``, linear between the closest ranks."""
    xs = sorted(xs)
    i = (len(xs) - 1) * q
    lo, hi = int(i), min(int(i) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (i - lo)


def recovery_percentiles(xs) -> dict:
    """{n, p50, p95, max} of recovery times (docs/reliability.md's tail table)."""
    xs = [x for x in xs if x is not None]
    if not xs:
        return {"n": 0}
    return {"n": len(xs), "p50": round(percentile(xs, 0.5), 3),
            "p95": round(percentile(xs, 0.95), 3), "max": round(max(xs), 3)}


def soak_flags(iters: int) -> List[str]:
    """The job's trainer flags (the demo's, longer, with local restarts)."""
    return DEMO_FLAGS + ["--train-iters", str(iters), "--lr-decay-style", "cosine",
                        "--lr-warmup-iters", "3", "--deadpool",
                        "--deadpool-heartbeat-timeout", "3",
                        # a rank's first crash is restarted in its slot; later ones and
                        # hangs (fenced) take a spare node: both paths are soaked. Two
                        # warm standbys per node: a used one's refill starts cold (about
                        # 10 s on 2 cores), and a node's next crash may come sooner
                        "--deadpool-max-local-restarts", "1",
                        "--deadpool-local-standby", "2"]


def run_soak(failures: int, seed: int, gap: int, summary_json=None, quiet=True) -> dict:
    """``quiet``: the terminal shows iterations, faults and recoveries, not every line."""
    world = NODES * PROCS_PER_NODE
    specs = schedule(failures, seed, gap, world)
    iters = int(specs[-1].split("@iter=")[1].split(",")[0]) + gap if specs else gap
    flags = soak_flags(iters)
    work = tempfile.mkdtemp(prefix="deadpool-soak-")
    log = os.path.join(work, "workers.log")
    print(f"[soak] {failures} failures, seed {seed}, {iters} iterations; full worker output: "
          f"{log}", flush=True)
    traced = os.environ.get(digest_trace.ENV)
    os.environ[digest_trace.ENV] = "1"  # the workers inherit it
    try:
        faulted, reference = _runs(specs, flags, iters, work, log, quiet)
    finally:
        if traced is None:
            os.environ.pop(digest_trace.ENV, None)
        else:
            os.environ[digest_trace.ENV] = traced
    return _summary(failures, seed, specs, faulted, reference, work, summary_json, log)


def _runs(specs, flags, iters: int, work: str, log: str, quiet: bool):
    """The faulted run, then the same job without faults: (summary of each)."""
    with Console(log, total=iters, verbose=not quiet) as con:
        faulted = run(LaunchOptions(nodes=NODES, procs_per_node=PROCS_PER_NODE,
                                    spare_nodes=SPARE_NODES, inject=specs,
                                    results_dir=os.path.join(work, "soak"),
                                    trainer_argv=flags, respawn_spares=True), out=con)
    print(f"[soak] faulted run: ok={faulted['ok']} error={faulted['error']}; replaying "
          "without faults (every 10th iteration shown)", flush=True)
    with Console(log, total=iters, every=10, label="reference ", verbose=not quiet) as con:
        reference = run(LaunchOptions(nodes=NODES, procs_per_node=PROCS_PER_NODE,
                                      spare_nodes=0, results_dir=os.path.join(work, "reference"),
                                      trainer_argv=flags), out=con)
    return faulted, reference


def _summary(failures, seed, specs, faulted, reference, work, summary_json, log) -> dict:
    recs = [r for r in faulted.get("recoveries", []) if not r.get("superseded")]
    table = []
    local_gens = {x["generation"]: "warm" if x.get("warm") else "cold"
                  for x in faulted.get("local_restarts", [])}
    for f, r in zip(faulted.get("faults", []), recs):
        table.append({"kind": f["kind"], "rank": f["rank"], "phase": f["phase"],
                      "iteration": f["at_iter"], "recovery_s": r["total_s"],
                      "restored_iter": r["restored_iter"],
                      "local": local_gens.get(r["generation"])})
    bitwise = bool(faulted["ok"] and reference["ok"] and
                   faulted["final_state_sha256"] == reference["final_state_sha256"])
    out = {
        "seed": seed, "failures_requested": failures, "schedule": specs,
        "failures_injected": len(faulted.get("faults", [])),
        "recoveries": recs, "table": table, "recovery_s": recovery_percentiles(
            r["recovery_s"] for r in table),
        "local_restarts": faulted.get("local_restarts", []),
        "waited_for_spare_s": faulted.get("waited_for_spare_s", 0.0),
        "final_state_sha256": faulted["final_state_sha256"],
        "reference_state_sha256": reference["final_state_sha256"],
        "bitwise_equal": bitwise,
        "first_divergence": None if bitwise else _divergence(work),
        "error": faulted["error"], "work_dir": work,
    }
    print(f"{'#':>3} {'kind':<5} {'rank':>4} {'phase':<17} {'iter':>5} {'recovery s':>10} "
          "replaced by")
    for i, row in enumerate(table, 1):
        print(f"{i:>3} {row['kind']:<5} {row['rank']:>4} {row['phase']:<17} "
              f"{row['iteration']:>5} {row['recovery_s']:>10.3f} "
              f"{'local restart, ' + row['local'] if row['local'] else 'spare'}")
    print(json.dumps({k: out[k] for k in ("failures_injected", "bitwise_equal", "recovery_s")}))
    if out["first_divergence"] is not None:
        print(f"[soak] first divergence from the failure-free run: "
              f"{json.dumps(out['first_divergence'])}", flush=True)
    print(f"[soak] recoveries {len(recs)}; bitwise_equal {out['bitwise_equal']}; full worker "
          f"output: {log}", flush=True)
    if summary_json:
        with open(summary_json, "w") as f:
            json.dump(out, f, indent=2)
    return out


def _divergence(work: str):
    """The traces' first difference (digest_trace.first_divergence), or why there is none."""
    try:
        found = digest_trace.first_divergence(os.path.join(work, "soak"),
                                              os.path.join(work, "reference"))
    except (OSError, ValueError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    return found if found is not None else {"iteration": None, "ranks": [],
                                            "note": "every traced event matches"}
