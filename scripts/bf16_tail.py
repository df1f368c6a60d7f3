"""The tail check of issue 38: a bf16 ``pretrain_gpt.py`` pair, node 1 killed at iteration
6 (4 nodes x 2 processes + 1 spare node, TP2 x PP2 x DP2, CPU/gloo), repeated: one
failure-free run, then ``--runs`` killed runs, each compared with it. Per killed run:
``total_s`` (the recovery's phases, the slowest rank's each: launch/summary.py), its
slowest phase, iterations redone and whether the final fingerprint equals the failure-free
run's. Prints a line per run and a JSON summary; exit 1 if a run failed or was not bitwise.

    python scripts/bf16_tail.py [--archive ...core_v0.16.1.tar.gz] [--runs 5] [--work DIR]

The Python must have the tag's megatron-core (``.venv`` for core_v0.16.1, ``.venv312`` for
core_v0.19.0).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from megatron_deadpool.apps.bench_peers import unpack_tree  # noqa: E402
from test_megatron_lm_train import FLAGS as MLM_FLAGS  # noqa: E402

FLAGS = MLM_FLAGS + ["--bf16", "--deadpool"]  # the CI tests' pretrain_gpt.py job, in bf16
KILL = "kill:node=1@iter=6"


def launch(tree: str, work: Path, name: str, kill: bool) -> dict:
    summary = work / f"{name}.json"
    cmd = [sys.executable, "-m", "megatron_deadpool.apps.cli", "launch", "--device", "cpu",
           "--script", os.path.join(tree, "pretrain_gpt.py"), "--nodes", "4",
           "--procs-per-node", "2", "--spare-nodes", "1" if kill else "0",
           "--summary-json", str(summary), "--results-dir", str(work / name)]
    cmd += ["--inject", KILL] if kill else []
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    with open(work / f"{name}.log", "w") as log:
        rc = subprocess.run(cmd + ["--"] + FLAGS, cwd=work, env=env, stdout=log,
                            stderr=subprocess.STDOUT, timeout=900).returncode
    s = json.loads(summary.read_text()) if summary.exists() else {}
    return {"rc": rc, **s}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--archive", default=str(REPO.parent / "shared" / "megatron-lm" /
                                             "Megatron-LM-core_v0.16.1.tar.gz"))
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--work", default="out/bf16_tail")
    a = ap.parse_args()
    if not os.path.isfile(a.archive):
        ap.error(f"no Megatron-LM archive at {a.archive}")
    if a.runs < 1:
        ap.error("--runs must be at least 1")
    work = Path(a.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    tree = unpack_tree(a.archive, str(work))
    t0 = time.monotonic()
    ref = launch(tree, work, "reference", kill=False)
    print(f"reference: rc {ref['rc']}, sha {str(ref.get('final_state_sha256'))[:12]}",
          flush=True)
    runs = []
    for i in range(1, a.runs + 1):
        k = launch(tree, work, f"kill{i}", kill=True)
        recs = k.get("recoveries", [])
        rec = recs[0] if len(recs) == 1 else {}
        phases = rec.get("phases_s", {})
        row = {"run": i, "rc": k["rc"], "recoveries": len(recs), "total_s": rec.get("total_s"),
               "slowest_phase": max(phases, key=phases.get) if phases else None,
               "recomputed_iters": rec.get("recomputed_iters"),
               "bitwise": bool(ref.get("final_state_sha256")) and
               k.get("final_state_sha256") == ref.get("final_state_sha256") and
               k.get("losses") == ref.get("losses")}
        runs.append(row)
        print(json.dumps(row), flush=True)
    totals = [r["total_s"] for r in runs if r["total_s"] is not None]
    ok = ref["rc"] == 0 and all(r["rc"] == 0 and r["bitwise"] and r["recoveries"] == 1
                                for r in runs)
    print(json.dumps({"archive": os.path.basename(a.archive), "runs": len(runs),
                      "bitwise": sum(r["bitwise"] for r in runs),
                      "total_s": totals, "max_total_s": max(totals, default=None),
                      "within_3s": sum(t <= 3.0 for t in totals), "ok": ok,
                      "wall_s": round(time.monotonic() - t0, 1)}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
