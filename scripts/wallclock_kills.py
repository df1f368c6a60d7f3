"""Kill a node of Megatron-LM's own pretrain_gpt.py from outside at seeded wall-clock
instants, and check every run ends bitwise with a failure-free one (issue 49 item 6).

    python scripts/wallclock_kills.py --tree MEGATRON_LM_DIR [--runs 10] [--seed 49]
        [--iters 16] [--node 1] [--layout tp2pp2dp2|slurm] [--agents] [--taskset CPUS]
        [--python PY312] [--work-dir D] [--keep-dir K] [--extra-flags '...']

``deadpool launch --device cpu --script TREE/pretrain_gpt.py``, 4 active nodes + 1 spare
node. ``--layout tp2pp2dp2`` (default): 4 x 2, TP2.PP2.DP2, ``--bf16 --overlap-grad-reduce
--overlap-param-gather --deadpool``; ``--layout slurm``: scripts/cpu-local.sbatch's job
(4 x 1, TP1.PP2.DP2, fp32). One failure-free reference run (the mirror on, the spare idle)
first; then ``--runs`` jobs that each SIGKILL every process of ``--node`` from outside (no
fault driver, no fault point) a uniform random delay after the first completed iteration
is reported, drawn from ``[0, 0.8 x the reference's time from its first to its last
reported iteration)``: kills land anywhere in a step, in the forward/backward, the
optimizer or the mirror's thread. The launcher simulates the nodes and node 1's agent
reports its workers' deaths; with ``--agents`` each node is its own ``deadpool launch
--node-rank N`` (as under srun) and the kill takes the node's agent too, found by the
heartbeat timeout (a machine that loses power, docs/local-slurm.md's node loss).

Each run's ``final_state_sha256`` and losses are compared with the reference's; a run that
differs (or fails) is copied whole (output, summary, per-rank results with
``digest_parts``, and ``state_diff.json``: the parts of each rank's state that differ) to
the keep folder. Prints a table (markdown) and exits 1 if any run is not bitwise.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from megatron_deadpool.apps.peer_inject import descendants, kill_all, node_pids  # noqa: E402
from megatron_deadpool.launch import progress  # noqa: E402
from megatron_deadpool.launch.options import free_port_pair  # noqa: E402

# tests/test_megatron_lm_train.py FLAGS (the iteration count set by --iters), plus bf16 and
# the overlapped grad-reduce and param-gather (tests/test_megatron_lm_recipe.py RECIPE)
FLAGS = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
         "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "2",
         "--global-batch-size", "8", "--lr", "1e-3",
         "--lr-decay-style", "cosine", "--lr-warmup-iters", "2", "--mock-data",
         "--tokenizer-type", "NullTokenizer", "--vocab-size", "128",
         "--use-distributed-optimizer",
         "--deadpool", "--bf16", "--overlap-grad-reduce", "--overlap-param-gather"]
WINDOW = 0.8  # the share of the reference's iterations the kill instants are drawn over


SLURM_FLAGS = ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "2",
               "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
               "--seq-length", "32", "--max-position-embeddings", "32",
               "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "1e-3",
               "--mock-data", "--use-distributed-optimizer", "--vocab-size", "128",
               "--seed", "1234", "--tokenizer-type", "NullTokenizer", "--deadpool"]
# --layout: (trainer flags, processes per node); 4 active nodes and 1 spare node in both
LAYOUTS = {"tp2pp2dp2": (FLAGS, 2),
           # scripts/cpu-local.sbatch's pretrain_gpt.py job (docs/local-slurm.md run 2)
           "slurm": (SLURM_FLAGS, 1)}
NODES, SPARE_NODES = 4, 1


class Killer:
    """Watches a job's output; ``delay`` seconds after the first reported iteration it
    SIGKILLs every process of ``node`` (a timer thread, so the instant does not wait for a
    line). Records the last reported iteration then, and when it fired. ``victims()``
    lists the processes to kill."""

    def __init__(self, victims, delay: float | None):
        self.victims, self.delay = victims, delay
        self.last_iter, self.first_t, self.last_t = None, None, None
        self.at_iter, self.killed_t, self.killed = None, None, []
        self._lock, self.timer = threading.Lock(), None

    def on_line(self, line: str) -> None:
        rec = progress.parse(line)
        if rec is None:
            return
        with self._lock:
            self.last_iter, self.last_t = rec["iteration"], time.monotonic()
            if self.first_t is None:
                self.first_t = self.last_t
                if self.delay is not None:
                    self.timer = threading.Timer(self.delay, self.fire)
                    self.timer.daemon = True
                    self.timer.start()

    def fire(self) -> None:
        pids = self.victims()
        with self._lock:
            self.killed = kill_all(pids)
            self.killed_t, self.at_iter = time.monotonic(), self.last_iter


def commands(d: Path, a) -> list:
    """The launch command lines: one simulating every node, or (``--agents``) one agent
    per node, as srun starts them (node 0 hosts the store and the decider)."""
    flags, ppn = LAYOUTS[a.layout]
    flags = flags + ["--train-iters", str(a.iters)] + a.extra_flags.split()
    pin = ["taskset", "-c", a.taskset] if a.taskset else []
    base = [*pin, a.python, "-m", "megatron_deadpool.apps.cli", "launch", "--nodes", str(NODES),
            "--procs-per-node", str(ppn), "--spare-nodes", str(SPARE_NODES),
            "--summary-json", str(d / "summary.json"), "--results-dir", str(d / "results"),
            "--device", "cpu", "--script", str(Path(a.tree) / "pretrain_gpt.py")]
    if not a.agents:
        return [base + ["--", *flags]]
    port = free_port_pair()
    return [base + ["--node-rank", str(n), "--master-addr", "127.0.0.1", "--master-port",
                    str(port), "--", *flags] for n in range(NODES + SPARE_NODES)]


def victims(procs: list, a):
    """What a node loss kills: the workers of ``--node`` (its agent stays and reports
    their exits), or with ``--agents`` that node's agent and everything under it (as when
    a machine loses power: no exit is reported, the heartbeats find it)."""
    if a.agents:
        return lambda: sorted(descendants([procs[a.node].pid]))
    return lambda: node_pids([procs[0].pid], "DEADPOOL_NODE", str(a.node))


def _pump(p, log, k: Killer) -> None:
    for line in p.stdout:
        log.write(line)
        k.on_line(line)


def run_job(d: Path, a, delay: float | None) -> dict:
    """One job in ``d`` (output.log or output-node<N>.log, summary.json, results/): returns
    the return code (node 0's), the summary (None if none) and what the killer saw."""
    d.mkdir(parents=True, exist_ok=True)
    path = os.pathsep.join(x for x in (str(REPO), os.environ.get("PYTHONPATH")) if x)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=path,
               DEADPOOL_TOKEN=secrets.token_hex(16))
    t0, procs, pumps, logs = time.monotonic(), [], [], []
    cmds = commands(d, a)
    k = Killer(victims(procs, a), delay)
    for n, cmd in enumerate(cmds):
        logs.append(open(d / ("output.log" if len(cmds) == 1 else f"output-node{n}.log"), "w"))
        procs.append(subprocess.Popen(cmd, cwd=d, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
        pumps.append(threading.Thread(target=_pump, args=(procs[-1], logs[-1], k)))
        pumps[-1].start()
    for t in pumps:
        t.join()
    rcs = [p.wait() for p in procs]
    for f in logs:
        f.close()
    if k.timer is not None:
        k.timer.cancel()  # a job that ended before its kill instant: killed stays []
    summary = d / "summary.json"
    return {"rc": rcs[0], "wall_s": time.monotonic() - t0, "killer": k,
            "summary": json.loads(summary.read_text()) if summary.exists() else None}


def state_diff(s: dict, ref: dict) -> dict:
    """{rank: the ``digest_parts`` of its final state that differ from the reference's}
    (tests/conftest.py ``state_diff``)."""
    out = {}
    for r in range(s["layout"]["world_size"]):
        parts = []
        for x in (s, ref):
            f = Path(x["results_dir"]) / f"rank{r}.json"
            parts.append(json.loads(f.read_text()).get("digest_parts", {}) if f.exists()
                         else {})
        got, want = parts
        diff = sorted(k for k in set(got) | set(want) if got.get(k) != want.get(k))
        if diff:
            out[r] = diff
    return out


def judge(job: dict, ref: dict) -> dict:
    """The table row's facts of one killed run."""
    s, k = job["summary"], job["killer"]
    recs = (s or {}).get("recoveries") or []
    bitwise = bool(s and job["rc"] == 0 and s.get("ok") and s["final_state_sha256"]
                   == ref["final_state_sha256"] and s["losses"] == ref["losses"])
    return {"delay_s": k.delay, "killed": len(k.killed), "at_iter": k.at_iter,
            "restored": [r.get("restored_iter") for r in recs],
            "recovery_s": [r.get("total_s") for r in recs], "rc": job["rc"],
            "bitwise": bitwise, "wall_s": round(job["wall_s"], 1)}


def keep(d: Path, keep_dir: Path, job: dict, ref: dict, row: dict) -> Path:
    """Copy a run that is not bitwise whole to ``keep_dir``, with its state diff and the
    first differing loss."""
    dest = keep_dir / d.name
    shutil.copytree(d, dest, dirs_exist_ok=True)
    s, facts = job["summary"], dict(row)
    if s is not None:
        facts["state_diff"] = state_diff(s, ref)
        facts["losses"], facts["reference_losses"] = s["losses"], ref["losses"]
        facts["recoveries"] = s.get("recoveries")
    (dest / "state_diff.json").write_text(json.dumps(facts, indent=1, default=str))
    return dest


def table(rows: list) -> list:
    out = ["| run | delay s | last reported iteration at the kill | restored iteration | "
           "bitwise | recovery s |", "|---|---|---|---|---|---|"]
    for i, r in enumerate(rows, 1):
        rec = ", ".join(f"{t:.2f}" for t in r["recovery_s"] if t is not None) or "-"
        rest = ", ".join(str(x) for x in r["restored"]) or "-"
        ok = "yes" if r["bitwise"] else f"**no** (rc {r['rc']}, killed {r['killed']})"
        out.append(f"| {i} | {r['delay_s']:.2f} | {r['at_iter']} | {rest} | {ok} | {rec} |")
    return out


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tree", required=True, help="a patched Megatron-LM tree")
    ap.add_argument("--python", default=str(REPO / ".venv312" / "bin" / "python"))
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--seed", type=int, default=49)
    ap.add_argument("--iters", type=int, default=16)
    ap.add_argument("--node", type=int, default=1)
    ap.add_argument("--layout", choices=sorted(LAYOUTS), default="tp2pp2dp2",
                    help="tp2pp2dp2: 4 x 2, bf16 and overlap (default); slurm: "
                    "scripts/cpu-local.sbatch's 4 x 1, TP1.PP2.DP2, fp32")
    ap.add_argument("--agents", action="store_true", help="one `deadpool launch "
                    "--node-rank N` agent per node; the node's agent dies with its workers")
    ap.add_argument("--taskset", metavar="CPUS", help="run every process of the job on "
                    "these CPUs (taskset -c), e.g. 0: a loaded machine without loading it")
    ap.add_argument("--extra-flags", default="", metavar="'FLAGS'")
    ap.add_argument("--work-dir", help="each run's folder; default: a new temporary one")
    ap.add_argument("--keep-dir", help="where runs that are not bitwise are copied; "
                    "default: WORK_DIR/failed")
    return ap.parse_args()


def main() -> int:
    a = parse_args()
    work = Path(a.work_dir or tempfile.mkdtemp(prefix="wallclock-kills-"))
    keep_dir = Path(a.keep_dir) if a.keep_dir else work / "failed"
    print(f"wallclock_kills: runs in {work}, failing runs kept in {keep_dir}", flush=True)
    ref_job = run_job(work / "reference", a, None)
    ref, rk = ref_job["summary"], ref_job["killer"]
    if ref_job["rc"] != 0 or not ref or not ref.get("final_state_sha256"):
        print(f"wallclock_kills: the reference run failed (rc {ref_job['rc']})")
        return 2
    span = WINDOW * (rk.last_t - rk.first_t)
    print(f"reference: {ref['final_state_sha256'][:16]} in {ref_job['wall_s']:.0f} s; "
          f"kills drawn from [0, {span:.2f}) s after the first iteration", flush=True)
    rng, rows = random.Random(a.seed), []
    for i in range(1, a.runs + 1):
        d = work / f"run{i}"
        job = run_job(d, a, rng.uniform(0.0, span))
        row = judge(job, ref)
        rows.append(row)
        if not row["bitwise"]:
            row["kept"] = str(keep(d, keep_dir, job, ref, row))
        print(f"run {i}: {json.dumps(row)}", flush=True)
    (work / "rows.json").write_text(json.dumps(rows, indent=1))
    print(f"\n{datetime.date.today()}, {sum(r['bitwise'] for r in rows)} of {len(rows)} "
          "bitwise\n\n" + "\n".join(table(rows)))
    return 0 if all(r["bitwise"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
