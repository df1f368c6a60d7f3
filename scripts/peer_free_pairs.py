#!/usr/bin/env python3
"""The fault-free cost against one peer, in adjacent pairs (issue 36, docs/peers.md).

``deadpool bench peers`` runs each system's failure-free run minutes apart from the others',
and on this 2-core machine the CPU's speed drifts over minutes: the same code's start-up
and steps take 20-40 % more CPU in some runs than in others, for every system alike. This
script runs only failure-free runs, DeadPool's and one peer's, back to back in pairs whose
order flips each pair (ABBA), so that both runs of a pair see the same machine. Per pair it
records each run's plain step (the median time between iterations no save follows), its
CPU seconds per iteration (the whole job's, saves and mirror included) and its whole span
per iteration (iteration 1's end to the last one's, saves included), and the ratios
DeadPool / peer. Medians and ranges of the ratios are the result.

    .venv-peers/bin/python scripts/peer_free_pairs.py \\
        --archive ../shared/megatron-lm/Megatron-LM-core_v0.19.0.tar.gz \\
        --work out/pairs --pairs 8 --peer nvrx-local --json out/pairs/pairs.json

Run it from a frozen copy of the repository, from that copy's folder (docs/peers.md).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_deadpool.apps import bench_peers, peer_log  # noqa: E402
from megatron_deadpool.apps.peer_systems import SYSTEMS, PeerJob  # noqa: E402

METRICS = ("iteration_s", "cpu_s", "span_per_iteration_s")


def free_run(system: str, job: PeerJob, work: str) -> dict:
    info = bench_peers.one_run(system, job, work, None)
    log = peer_log.parse(Path(info["log"]).read_text())
    costs = peer_log.free_run_costs(log, job.train_iters)
    span = costs["free_span_s"]
    return {"system": system, "outcome": info["outcome"],
            "iteration_s": costs["iteration_s"], "cpu_s": costs["cpu_s"],
            "span_per_iteration_s": None if span is None else span / (job.train_iters - 1),
            "save_s": costs["save_s"], "fingerprint": info["fingerprint"]}


def summarize(pairs) -> dict:
    out = {}
    for m in METRICS:
        ratios = [p["deadpool"][m] / p["peer"][m] for p in pairs
                  if p["deadpool"][m] and p["peer"][m]]
        out[m] = {"deadpool": peer_log.summarize([p["deadpool"][m] for p in pairs]),
                  "peer": peer_log.summarize([p["peer"][m] for p in pairs]),
                  "ratio": peer_log.summarize(ratios),
                  "pairs_deadpool_faster": sum(r < 1 for r in ratios)}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tree", default=None)
    p.add_argument("--archive", default=None)
    p.add_argument("--work", default="out/pairs")
    p.add_argument("--peer", default="nvrx-local", choices=[s for s in SYSTEMS
                                                             if s != "deadpool"])
    p.add_argument("--pairs", type=int, default=8)
    p.add_argument("--train-iters", type=int, default=20)
    p.add_argument("--save-interval", type=int, default=5)
    p.add_argument("--timeout", type=float, default=1200.0)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    if a.pairs < 1:
        p.error("--pairs must be >= 1")
    if not (a.tree or a.archive):
        p.error("give --tree or --archive")
    work = os.path.abspath(a.work)
    os.makedirs(work, exist_ok=True)
    tree = a.tree or bench_peers.unpack_tree(a.archive, work)
    job = PeerJob(tree=os.path.abspath(tree), python=sys.executable,
                  flags=bench_peers.MODEL_FLAGS + ["--train-iters", str(a.train_iters)],
                  train_iters=a.train_iters, save_interval=a.save_interval, nodes=4,
                  timeout_s=a.timeout)
    pairs = []
    for i in range(a.pairs):
        order = ["deadpool", a.peer] if i % 2 == 0 else [a.peer, "deadpool"]
        runs = {s: free_run(s, job, os.path.join(work, f"pair{i + 1}", s)) for s in order}
        pairs.append({"pair": i + 1, "order": order, "deadpool": runs["deadpool"],
                      "peer": runs[a.peer]})
        d, q = runs["deadpool"], runs[a.peer]
        print(f"pair {i + 1}/{a.pairs} ({' then '.join(order)}): step {d['iteration_s']:.3f}"
              f" / {q['iteration_s']:.3f} s, CPU per iteration {d['cpu_s']:.3f} / "
              f"{q['cpu_s']:.3f} s (deadpool / {a.peer})", flush=True)
    result = {"peer": a.peer, "pairs": pairs, "summary": summarize(pairs),
              "versions": bench_peers.versions(sys.executable),
              "config": {"train_iters": a.train_iters, "save_interval": a.save_interval,
                         "flags": job.flags}}
    Path(a.json or os.path.join(work, "pairs.json")).write_text(json.dumps(result, indent=1))
    for m, s in result["summary"].items():
        r = s["ratio"]
        print(f"{m}: deadpool / {a.peer} median {r['median']:.3f} ({r['min']:.3f}-"
              f"{r['max']:.3f}) over {r['n']} pairs; deadpool lower in "
              f"{s['pairs_deadpool_faster']}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
