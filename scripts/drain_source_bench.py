#!/usr/bin/env python3
"""Where a drained node's ranks take their state from: straight from the draining process
(``--deadpool-drain-source direct``) or from the buddy's copy (``buddy``), measured in
alternation on the same machine: the reference trainer (TP2.PP2.DP2, 4 nodes x 2 + 1
spare node), node 2 drained at iteration 6 (``--inject drain:node=2@iter=6``).

Per run it reads the summary's drain: ``restore_state`` (its slowest rank: the promoted
spares' receive and load), ``wall_s`` (the request until the slowest rank's first resumed
step), ``state_from`` (which path each moved rank took; a "direct" run whose handoff fell
back reads "buddy" and is counted as a failed direct run) and the fingerprint, which must
equal in every run. Prints one line per run and the medians.

    python scripts/drain_source_bench.py --repeats 5 [--hidden-size 64] [--out r.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def flags(hidden: int) -> list:
    return ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
            "--micro-batch-size", "2", "--num-layers", "4", "--hidden-size", str(hidden),
            "--num-attention-heads", "4", "--seq-length", "32", "--max-position-embeddings",
            "32", "--global-batch-size", "8", "--lr", "1e-3", "--mock-data",
            "--use-distributed-optimizer", "--vocab-size", "128", "--device", "cpu",
            "--train-iters", "10", "--seed", "1234", "--deadpool"]


def one(source: str, hidden: int, work: Path) -> dict:
    summary = work / f"{source}.json"
    cmd = [sys.executable, "-m", "megatron_deadpool.apps.cli", "launch", "--nodes", "4",
           "--procs-per-node", "2", "--spare-nodes", "1", "--summary-json", str(summary),
           "--inject", "drain:node=2@iter=6", "--", *flags(hidden),
           "--deadpool-drain-source", source]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    p = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=900)
    if p.returncode != 0:
        raise SystemExit(f"{source} run failed (exit {p.returncode}):\n{p.stdout[-3000:]}"
                         f"\n{p.stderr[-2000:]}")
    s = json.loads(summary.read_text())
    (d,) = s["drains"]
    return {"source": source, "state_from": sorted(set(d["state_from"].values())),
            "restore_state_s": d["phases_s"]["restore_state"], "wall_s": d["wall_s"],
            "iterations_redone": d["iterations_redone"], "sha": s["final_state_sha256"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5, help="runs per source (alternating)")
    ap.add_argument("--hidden-size", type=int, default=64)
    ap.add_argument("--out", default=None, help="write the runs and medians as JSON")
    a = ap.parse_args(argv)
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(a.repeats):
            for source in (("direct", "buddy") if i % 2 == 0 else ("buddy", "direct")):
                r = one(source, a.hidden_size, Path(tmp))
                runs.append(r)
                print(json.dumps(r), flush=True)
    shas = {r["sha"] for r in runs}
    if len(shas) != 1 or any(r["iterations_redone"] != 0 for r in runs):
        raise SystemExit(f"runs differ: fingerprints {shas}")
    med = {}
    for source in ("direct", "buddy"):
        ok = [r for r in runs if r["source"] == source and r["state_from"] == [source]]
        med[source] = {"runs": len(ok), "of": a.repeats,
                       "restore_state_s": statistics.median(r["restore_state_s"] for r in ok),
                       "wall_s": statistics.median(r["wall_s"] for r in ok)} if ok else None
    print("medians:", json.dumps(med))
    if a.out:
        Path(a.out).write_text(json.dumps({"runs": runs, "medians": med}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
