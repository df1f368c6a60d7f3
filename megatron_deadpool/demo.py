"""``deadpool demo``: the CPU hot-swap demo.

TP2 x PP2 x DP2 on 4 simulated nodes x 2 processes plus 1 spare node. Node 1 is killed
(SIGKILL) at iteration 12; a spare takes its ranks and training finishes. The same run is
then replayed without failure and the state fingerprints are compared bit for bit.
"""

from __future__ import annotations

import io
import json
import os
import sys
import tempfile
import time

from .launch.launcher import LaunchOptions, run
from .recovery.phases import PHASE_ORDER

DEMO_FLAGS = [
    "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
    "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "2",
    "--global-batch-size", "8", "--lr", "1e-3", "--mock-data", "--use-distributed-optimizer",
    "--vocab-size", "128", "--device", "cpu",
]


class _Filter(io.TextIOBase):
    """Shows launcher lines, DeadPool lines and the loss log; everything goes to a file."""

    KEEP = ("[launch]", "[deadpool", "iteration ", "error", "Error")

    def __init__(self, path: str, verbose: bool):
        self.f = open(path, "a")
        self.verbose = verbose
        self._buf = ""

    def write(self, s: str) -> int:
        self.f.write(s)
        self._buf += s
        while "\n" in self._buf:
            line, self._buf = self._buf.split("\n", 1)
            if self.verbose or any(k in line for k in self.KEEP):
                sys.stdout.write(line + "\n")
        return len(s)

    def flush(self):
        self.f.flush()
        sys.stdout.flush()


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
    out = _Filter(log, args.verbose)
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
    t_swap = time.time() - t0
    summary = dict(swap)
    summary["events_jsonl"] = os.path.join(workdir, "events.jsonl")
    ref = None
    if not args.no_replay:
        print("== replaying the same run without failure (reference)", flush=True)
        t1 = time.time()
        ref = run(LaunchOptions(nodes=4, procs_per_node=2,
                                results_dir=os.path.join(workdir, "reference"),
                                trainer_argv=flags), out=_Filter(log, False))
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
    if args.summary_json:
        os.makedirs(os.path.dirname(os.path.abspath(args.summary_json)), exist_ok=True)
        with open(args.summary_json, "w") as f:
            json.dump(summary, f, indent=2)
        print(f"summary written to {args.summary_json}")
    return 0 if summary["bitwise_equal"] else 1
