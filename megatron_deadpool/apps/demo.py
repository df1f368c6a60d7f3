"""``deadpool demo``: the CPU hot-swap demo.

TP2 x PP2 x DP2 on 4 simulated nodes x 2 processes plus 1 spare node. Node 1 is killed
(SIGKILL) at iteration 12; a spare takes its ranks and training finishes. The same run is
then replayed without failure and the state fingerprints are compared bit for bit.
"""

from __future__ import annotations

import json
import os
import tempfile
import time

from ..launch.launcher import LaunchOptions, run
from ..launch.progress import Console
from ..base.vocabulary import PHASE_ORDER

DEMO_FLAGS = [
    "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
    "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "2",
    "--global-batch-size", "8", "--lr", "1e-3", "--mock-data", "--use-distributed-optimizer",
    "--vocab-size", "128", "--device", "cpu",
]


def timeline_table(recoveries) -> str:
    lines = []
    for i, r in enumerate(recoveries):
        lines.append(f"recovery {i + 1}: ranks {r['failed_ranks']} -> spare processes "
                     f"{r['spare_of_rank']}; restored iteration {r['restored_iter']}, "
                     f"{r['recomputed_iters']} iteration(s) redone")
        lines.append(f"  {'phase':<16}{'seconds':>10}")
        for ph in PHASE_ORDER:
            v = r["phases_s"].get(ph)
            lines.append(f"  {ph:<16}{'-' if v is None else f'{v:.3f}':>10}")
        lines.append(f"  {'total':<16}{r['total_s']:>10.3f}")
    return "\n".join(lines)


def run_demo(args) -> int:
    workdir = tempfile.mkdtemp(prefix="deadpool-demo-")
    log = os.path.join(workdir, "workers.log")
    out = Console(log, total=args.train_iters, verbose=args.verbose)
    flags = DEMO_FLAGS + ["--train-iters", str(args.train_iters)]
    print(f"== deadpool demo: TP2 x PP2 x DP2, 4 nodes x 2 procs + 1 spare node, "
          f"{args.train_iters} iterations, kill node {args.kill_node} at iteration "
          f"{args.kill_iter}\n   (full worker output: {log})", flush=True)
    t0 = time.time()
    swap = run(LaunchOptions(
        nodes=4, procs_per_node=2, spare_nodes=1,
        inject=[f"kill:node={args.kill_node}@iter={args.kill_iter}"],
        results_dir=os.path.join(workdir, "hotswap"),
        trainer_argv=flags + ["--deadpool", "--deadpool-events",
                              os.path.join(workdir, "events.jsonl")]), out=out)
    out.close()
    t_swap = time.time() - t0
    if not swap["ok"]:
        print(f"== the hot-swap run failed: {swap['error']}", flush=True)
    summary = dict(swap)
    summary["events_jsonl"] = os.path.join(workdir, "events.jsonl")
    ref = None
    if not args.no_replay:
        print("== replaying the same run without failure (reference, every 10th "
              "iteration shown)", flush=True)
        t1 = time.time()
        ref_out = Console(log, total=args.train_iters, every=10, label="reference ",
                          verbose=args.verbose)
        ref = run(LaunchOptions(nodes=4, procs_per_node=2,
                                results_dir=os.path.join(workdir, "reference"),
                                trainer_argv=flags), out=ref_out)
        ref_out.close()
        summary["reference_wall_s"] = round(time.time() - t1, 3)
    summary["reference_state_sha256"] = ref["final_state_sha256"] if ref else None
    summary["reference_losses"] = ref["losses"] if ref else None
    summary["bitwise_equal"] = bool(
        ref and swap["ok"] and ref["ok"]
        and swap["final_state_sha256"] == ref["final_state_sha256"]
        and swap["losses"] == ref["losses"])
    summary["hotswap_wall_s"] = round(t_swap, 3)
    print("\n== recovery timeline")
    print(timeline_table(summary.get("recoveries", [])) or "  (no recovery happened)")
    print(f"\nfinal_state_sha256     {summary['final_state_sha256']}")
    print(f"reference_state_sha256 {summary['reference_state_sha256']}")
    print(f"bitwise_equal          {summary['bitwise_equal']}")
    print(f"full worker output: {log}")
    if args.summary_json:
        os.makedirs(os.path.dirname(os.path.abspath(args.summary_json)), exist_ok=True)
        with open(args.summary_json, "w") as f:
            json.dump(summary, f, indent=2)
        print(f"summary written to {args.summary_json}")
    return 0 if summary["bitwise_equal"] else 1
