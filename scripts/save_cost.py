#!/usr/bin/env python
"""The cost of Megatron-LM's checkpoint saves per iteration, synchronous against
``--async-save``: two failure-free runs of the patched ``pretrain_gpt.py`` under
``deadpool launch --device cpu`` (TP2.PP2.DP2, 4 nodes x 2, a save every
``--save-interval`` iterations), each read from Megatron's own timer lines.

    python scripts/save_cost.py TREE [--iters 12] [--save-interval 4] [--out DIR]

Per run: the blocking time of each save (``save-checkpoint``, max over ranks, ms), and
that time spread over the run's iterations (total save ms / iterations).
TREE: a patched Megatron-LM tree (scripts/apply_patches.sh). Prints JSON."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

FLAGS = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
         "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "2",
         "--global-batch-size", "8", "--lr", "1e-3", "--lr-decay-style", "cosine",
         "--lr-warmup-iters", "2", "--mock-data", "--tokenizer-type", "NullTokenizer",
         "--vocab-size", "128", "--use-distributed-optimizer", "--deadpool"]
ASYNC = ["--async-save", "--use-persistent-ckpt-worker"]
SAVE_TIMER = re.compile(r"save-checkpoint \.*: \(([\d.]+), ([\d.]+)\)")


def run(tree: str, out: str, name: str, extra: list, iters: int, interval: int) -> dict:
    d = os.path.join(out, name)
    os.makedirs(d, exist_ok=True)
    flags = FLAGS + ["--train-iters", str(iters), "--save-interval", str(interval),
                     "--save", os.path.join(d, "ck")] + extra
    cmd = [sys.executable, "-m", "megatron_deadpool.apps.cli", "launch", "--nodes", "4",
           "--procs-per-node", "2", "--device", "cpu", "--summary-json",
           os.path.join(d, "s.json"), "--results-dir", os.path.join(d, "r"), "--script",
           os.path.join(tree, "pretrain_gpt.py"), "--", *flags]
    p = subprocess.run(cmd, capture_output=True, text=True,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    if p.returncode:
        raise SystemExit(f"{name}: exit {p.returncode}\n{p.stdout[-3000:]}{p.stderr[-2000:]}")
    saves = [float(mx) for _, mx in SAVE_TIMER.findall(p.stdout + p.stderr)]
    return {"saves_ms_max_over_ranks": saves, "iterations": iters,
            "save_ms_per_iteration": round(sum(saves) / iters, 1)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("tree")
    ap.add_argument("--iters", type=int, default=12)
    ap.add_argument("--save-interval", type=int, default=4)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    out = a.out or tempfile.mkdtemp(prefix="save-cost-")
    newest = os.path.isfile(os.path.join(a.tree, "megatron", "core", "dist_checkpointing",
                                         "strategies", "nvrx.py"))
    extra = ASYNC + (["--async-strategy", "mcore"] if newest else [])
    res = {"sync": run(a.tree, out, "sync", [], a.iters, a.save_interval),
           "async": run(a.tree, out, "async", extra, a.iters, a.save_interval)}
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
