"""``deadpool bench gpu``: the NCCL hot swap on one GPU that hosts the whole job.

TP2 x PP2 x DP2 on 4 nodes x 2 processes + 1 spare node (8 ranks, 2 spares), bf16, NCCL,
every process on the one GPU in the shared-GPU mode (``launch/gpus.py``: each process its
own NCCL host on the socket transport; a test layout, not a production one). For each
trainer (the reference trainer; Megatron-LM's patched ``pretrain_gpt.py`` when a tree is
given), a failure-free run and runs with node 1 SIGKILLed at iteration K: in forward/backward
(a pipeline send or receive in flight), in the optimizer step (the survivors in the
data-parallel reduce-scatter / all-gather), in the mirror job. Each kill run must end with
the failure-free run's state fingerprint (``bitwise``) and every recovery phase under
``PHASE_LIMIT_S``.

Writes ``gpu_swap.json`` and ``gpu_swap.log`` (every launcher's whole output; ``--log``
puts it elsewhere) under ``--out`` and prints a table. Cases run in :data:`CASES` order
until ``--budget-s`` is spent, each under its own cap; a case that does not fit, or that the
budget cuts, is recorded as skipped, not failed. The JSON has ``bitwise`` (the kill runs
that finished) and ``deterministic`` (the two failure-free runs agree). ``--dry-run`` prints the commands
and writes the JSON's plan without running anything (no GPU needed).
"""

from __future__ import annotations

import json
import os
import platform
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from ..adapters import lm_rules
from ..base.vocabulary import PHASE_ORDER
from ..launch import gpus

KILL_ITER, ITERS, PHASE_LIMIT_S = 6, 12, 30.0
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LAYOUT = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
          "--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "8",
          "--seq-length", "128", "--max-position-embeddings", "128", "--micro-batch-size", "2",
          "--global-batch-size", "16", "--train-iters", str(ITERS), "--lr", "1e-3",
          "--lr-warmup-iters", "2", "--lr-decay-style", "cosine", "--mock-data",
          "--use-distributed-optimizer", "--bf16"]
TRAINER_FLAGS = {
    "reference": LAYOUT + ["--vocab-size", "512"],
    # Megatron-LM without TE/apex (the device has neither): the CPU mode's flags but gloo;
    # --deterministic-mode: Megatron's own switch (torch deterministic algorithms,
    # CUBLAS_WORKSPACE_CONFIG, NCCL_ALGO=Ring)
    "pretrain_gpt": LAYOUT + ["--tokenizer-type", "NullTokenizer", "--vocab-size", "512",
                              "--log-interval", "1", "--deterministic-mode"]
    + [f for names, add in lm_rules.CPU_FLAGS if names != ("--distributed-backend",)
       for f in add],
}
# What every run's processes get besides the shared-GPU mode's NCCL settings
ENV = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8", "NCCL_DEBUG": "WARN", "OMP_NUM_THREADS": "1",
       "TORCHDYNAMO_DISABLE": "1", "CUDA_DEVICE_MAX_CONNECTIONS": "1"}


@dataclass(frozen=True)
class Case:
    name: str
    trainer: str                 # a key of TRAINER_FLAGS
    phase: Optional[str] = None  # None: failure-free; else node 1 killed in this phase
    what: str = "failure-free"
    flags: Tuple[str, ...] = ()  # more trainer flags

    def inject(self) -> List[str]:
        return [] if self.phase is None else [f"kill:node=1@iter={KILL_ITER},phase={self.phase}"]


_FWD = "a pipeline send/receive in flight"
_OPT = "the survivors in the data-parallel reduce-scatter / all-gather"
# The order they run in; the budget cuts from the end. The failure-free runs first (the
# second one is the determinism control: without it a kill run that does not match cannot
# tell a bad swap from a nondeterministic trainer), then the kill cases, Megatron-LM's
# among the first.
CASES = (
    Case("ref-free", "reference"),
    Case("ref-free-again", "reference", what="failure-free again: is the trainer deterministic"),
    Case("mlm-free", "pretrain_gpt"),
    Case("ref-kill-fwdbwd", "reference", "forward_backward", _FWD),
    Case("mlm-kill-fwdbwd", "pretrain_gpt", "forward_backward", _FWD),
    # On NCCL an aborted collective leaves its output unwritten, and kernels queued behind it
    # still run: a survivor can hit a device-side assert (a sticky CUDA error). A local
    # restart replaces such a process from its mirror.
    Case("mlm-kill-fwdbwd-restart", "pretrain_gpt", "forward_backward",
         _FWD + ", a local restart allowed", ("--deadpool-max-local-restarts", "2")),
    Case("ref-kill-optimizer", "reference", "optimizer", _OPT),
    Case("mlm-kill-optimizer", "pretrain_gpt", "optimizer", _OPT),
    Case("ref-kill-mirror", "reference", "mirror", "the mirror job in flight"),
)
MIN_CASE_S = 45.0  # a case is not started with less budget left (nor less than the
#                    longest finished case of its trainer took)
CASE_CAP_S = 240.0  # one case's own limit: past it the case failed (a hang), not cut
REHEARSAL_CUT = 0.4  # --rehearse-cut: the last case gets this share of a finished case's time


def command(case: Case, out: str, tree: Optional[str], device: str = "cuda") -> List[str]:
    """A case's launch. ``device="cpu"``: the same job in CPU mode with gloo and fp32 (a
    rehearsal of the script on a machine without a GPU)."""
    d = os.path.join(out, case.name)
    argv = [sys.executable, "-m", "megatron_deadpool.apps.cli", "launch", "--nodes", "4",
            "--procs-per-node", "2", "--spare-nodes", "1", "--device", device,
            *(["--share-gpu"] if device == "cuda" else []),
            "--summary-json", d + ".json", "--results-dir", d]
    flags = list(TRAINER_FLAGS[case.trainer])
    if device == "cpu":  # a rehearsal runs fp32: bf16 matmuls on a CPU without bf16
        flags.remove("--bf16")  # instructions take about 100x fp32's (AMD EPYC, AVX2)
    if case.trainer == "pretrain_gpt":
        argv += ["--script", os.path.join(tree, "pretrain_gpt.py")]
    else:
        flags += ["--device", device, "--backend", "nccl" if device == "cuda" else "gloo"]
    for spec in case.inject():
        argv += ["--inject", spec]
    return argv + ["--", *flags, *case.flags, "--deadpool", "--deadpool-events",
                   d + ".events.jsonl"]


def environment(commit: Optional[str]) -> dict:
    info = {"commit": commit or _git_commit(), "python": platform.python_version(),
            "host": platform.node(), "share_gpu": gpus.describe(True), "env": dict(ENV),
            "date": time.strftime("%Y-%m-%d")}
    try:
        import torch

        info["torch"] = torch.__version__
        info["cuda_available"] = torch.cuda.is_available()
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
            info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
            info["cuda"] = torch.version.cuda
    except Exception as exc:  # noqa: BLE001 -- recorded: the JSON says what was missing
        info["torch_error"] = repr(exc)
    info["driver"] = _driver()
    return info


def _driver() -> Optional[str]:
    """The NVIDIA driver's version (nvidia-smi), None where there is none."""
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=30)
        return r.stdout.strip().splitlines()[0] if r.returncode == 0 and r.stdout.strip() \
            else None
    except (OSError, subprocess.SubprocessError):
        return None


def _git_commit() -> Optional[str]:
    try:
        return subprocess.run(["git", "-C", REPO, "rev-parse", "HEAD"], capture_output=True,
                              text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def run_case(case: Case, argv: List[str], out: str, timeout_s: float, log) -> dict:
    """One launch; its output goes to ``log``. A launch over ``timeout_s`` is stopped
    (SIGTERM, then SIGKILL) and anything left of its processes is killed."""
    env = dict(os.environ, **ENV)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH")) if p)
    log.write(f"\n===== {case.name}: {case.what}\n$ {' '.join(argv)}\n")
    log.flush()
    t0 = time.monotonic()
    p = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=out,
                         start_new_session=True)
    timed_out = False
    try:
        p.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        timed_out = True
        _stop(p)
    _sweep(os.path.join(out, case.name))
    return summarize(case, os.path.join(out, case.name + ".json"), p.returncode,
                     time.monotonic() - t0, timed_out)


def _stop(p: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
        try:
            os.killpg(p.pid, sig)
            p.wait(timeout=wait)
            return
        except (ProcessLookupError, subprocess.TimeoutExpired):
            continue


def _sweep(results_dir: str) -> List[int]:
    """Kill every process whose DEADPOOL_RESULTS_DIR is ``results_dir`` (a worker that
    outlived its launcher, e.g. stuck in a CUDA call); returns their pids."""
    killed, want = [], f"DEADPOOL_RESULTS_DIR={results_dir}".encode()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if want in f.read().split(b"\0"):
                    os.kill(int(pid), signal.SIGKILL)
                    killed.append(int(pid))
        except OSError:
            continue
    return killed


def summarize(case: Case, path: str, code: Optional[int], wall_s: float,
              timed_out: bool) -> dict:
    s = json.load(open(path)) if os.path.exists(path) else {}
    recs = [{"phases_s": r["phases_s"], "total_s": r["total_s"], "wall_s": r.get("wall_s"),
             "failed_ranks": r["failed_ranks"], "restored_iter": r["restored_iter"],
             "recomputed_iters": r["recomputed_iters"]} for r in s.get("recoveries", [])]
    worst = max((v for r in recs for v in r["phases_s"].values() if v is not None),
                default=None)
    return {"case": case.name, "trainer": case.trainer, "kill_phase": case.phase,
            "what": case.what, "inject": case.inject(), "exit_code": code,
            "timed_out": timed_out, "wall_s": round(wall_s, 1), "ok": bool(s.get("ok")),
            "error": s.get("error") if s else "no summary written",
            "completed_iters": s.get("completed_iters"),
            "final_state_sha256": s.get("final_state_sha256"), "recoveries": recs,
            "max_phase_s": worst, "local_restarts": len(s.get("local_restarts") or []),
            "losses": s.get("losses")}


def verdict(results: List[dict]) -> Dict[str, object]:
    """Per trainer: every kill run that finished has the failure-free run's fingerprint
    (None: nothing to compare), its recoveries happened, and no phase passed the limit."""
    out: Dict[str, object] = {}
    for trainer in TRAINER_FLAGS:
        mine = [r for r in results if r["trainer"] == trainer]
        ref = _free(mine)
        kills = [r for r in mine if r["kill_phase"] is not None]
        if ref is None or not kills:
            out[trainer] = None
            continue
        for r in kills:
            r["bitwise"] = bool(r["ok"] and r["final_state_sha256"] == ref["final_state_sha256"])
            r["phases_bounded"] = bool(r["recoveries"]) and (r["max_phase_s"] or 0) <= PHASE_LIMIT_S
        out[trainer] = all(r["bitwise"] and r["phases_bounded"] for r in kills)
    return out


def _free(mine: List[dict]) -> Optional[dict]:
    return next((r for r in mine if r["kill_phase"] is None and r["ok"]), None)


def determinism(results: List[dict]) -> Dict[str, Optional[bool]]:
    """Per trainer: its two failure-free runs ended with the same fingerprint (None: fewer
    than two finished)."""
    out: Dict[str, Optional[bool]] = {}
    for trainer in TRAINER_FLAGS:
        free = [r for r in results if r["trainer"] == trainer and r["kill_phase"] is None]
        out[trainer] = None if len(free) < 2 else all(
            r["ok"] and r["final_state_sha256"] == free[0]["final_state_sha256"] for r in free)
    return out


def table(results: List[dict]) -> str:
    head = ["case", "ok", "bitwise", "recoveries", "max phase s", "wall s"]
    rows = [head] + [[r["case"], str(r["ok"]), str(r.get("bitwise", "-")),
                      str(len(r["recoveries"])), str(r["max_phase_s"] or "-"),
                      str(r["wall_s"])] for r in results]
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in rows]
    for r in results:
        for i, rec in enumerate(r["recoveries"]):
            phases = " ".join(f"{ph} {rec['phases_s'][ph]}" for ph in PHASE_ORDER
                              if rec["phases_s"].get(ph) is not None)
            lines.append(f"{r['case']} recovery {i + 1}: {phases}")
    return "\n".join(lines)


def run(out: str, tree: Optional[str], budget_s: float, dry_run: bool,
        commit: Optional[str] = None, cases: Optional[List[str]] = None,
        device: str = "cuda", case_cap_s: float = CASE_CAP_S, log_path: Optional[str] = None,
        rehearse_cut: bool = False) -> dict:
    """Run the cases in :data:`CASES` order. A case starts only if the budget left is at
    least :data:`MIN_CASE_S` and the longest finished case of its trainer; it runs under the
    smaller of ``case_cap_s`` and the budget left. A case stopped by its own cap failed; one
    stopped because the budget ran out is *cut*: listed under ``skipped``, not judged.
    ``rehearse_cut``: the last case gets :data:`REHEARSAL_CUT` of a finished case's time, so
    a rehearsal shows the cut path whatever the machine's speed."""
    os.makedirs(out, exist_ok=True)
    chosen = [c for c in CASES if (cases is None or c.name in cases)
              and (tree is not None or c.trainer != "pretrain_gpt")]
    result = {"bench": "gpu_swap", "environment": environment(commit), "kill_iter": KILL_ITER,
              "train_iters": ITERS, "phase_limit_s": PHASE_LIMIT_S, "budget_s": budget_s,
              "case_cap_s": case_cap_s, "megatron_lm_tree": tree, "dry_run": dry_run,
              "device": device,
              "plan": [{"case": c.name, "what": c.what, "argv": command(c, out, tree, device)}
                       for c in chosen], "results": [], "skipped": [], "case_seconds": {}}
    if tree is None:
        result["skipped"].append({"trainer": "pretrain_gpt", "why": "no --megatron-lm tree"})
    if dry_run:
        for c in result["plan"]:
            print(f"[bench gpu] would run {c['case']} ({c['what']}):\n  {' '.join(c['argv'])}")
        return _write(out, result)
    with open(log_path or os.path.join(out, "gpu_swap.log"), "a") as log:
        _run_cases(chosen, result, out, budget_s, case_cap_s, log, rehearse_cut)
    return _write(out, _conclude(result))


def _run_cases(chosen: List[Case], result: dict, out: str, budget_s: float,
               case_cap_s: float, log, rehearse_cut: bool) -> None:
    """The cases in order under the budget (``run``'s rules); each result, skip or cut goes
    into ``result``, written after each case."""
    deadline = time.monotonic() + budget_s
    for i, (c, planned) in enumerate(zip(chosen, result["plan"])):
        done = [r["wall_s"] for r in result["results"] if r["trainer"] == c.trainer]
        if rehearse_cut and i == len(chosen) - 1 and result["results"]:
            walls = [r["wall_s"] for r in result["results"]]
            deadline = time.monotonic() + REHEARSAL_CUT * sum(walls) / len(walls)
            need = 0.0
        else:
            need = max([MIN_CASE_S] + done)
        left = deadline - time.monotonic()
        if left < need:
            result["skipped"].append({"case": c.name, "why": f"budget: {left:.0f} s left, "
                                      f"the case needs about {need:.0f} s"})
            print(f"[bench gpu] {c.name}: skipped ({left:.0f} s of budget left)", flush=True)
            continue
        cap = min(case_cap_s, left)
        print(f"[bench gpu] {c.name}: {c.what} ({left:.0f} s of budget left, "
              f"cap {cap:.0f} s)", flush=True)
        r = run_case(c, planned["argv"], out, cap, log)
        result["case_seconds"][c.name] = r["wall_s"]
        if r["timed_out"] and cap < case_cap_s:
            result["skipped"].append({"case": c.name, "cut": True, "wall_s": r["wall_s"],
                                      "why": f"cut by the budget after {r['wall_s']} s",
                                      "completed_iters": r["completed_iters"]})
            print(f"[bench gpu] {c.name}: cut by the budget after {r['wall_s']} s "
                  "(skipped, not judged)", flush=True)
        else:
            result["results"].append(r)
            print(f"[bench gpu] {c.name}: ok {r['ok']} in {r['wall_s']} s "
                  f"(timed out {r['timed_out']})", flush=True)
        _write(out, result)  # what ran so far survives a cut-off


def _conclude(result: dict) -> dict:
    """The verdicts: ``bitwise`` (every finished kill case of a trainer), ``deterministic``
    (the failure-free runs agree) and ``kills``; printed with the table."""
    v = verdict(result["results"])
    result["bitwise_by_trainer"] = v
    result["bitwise"] = bool(v) and all(x is True for x in v.values() if x is not None) \
        and any(x is True for x in v.values())
    d = determinism(result["results"])
    result["deterministic_by_trainer"] = d
    result["deterministic"] = (all(x is not False for x in d.values())
                               and any(x is True for x in d.values())) \
        if any(x is not None for x in d.values()) else None
    result["kills"] = {r["case"]: r.get("bitwise") for r in result["results"]
                       if r["kill_phase"] is not None}
    print(table(result["results"]), flush=True)
    print(f"[bench gpu] bitwise {result['bitwise']} {v}; deterministic "
          f"{result['deterministic']} {d}; skipped "
          f"{[s.get('case', s.get('trainer')) for s in result['skipped']]}", flush=True)
    return result


def _write(out: str, result: dict) -> dict:
    with open(os.path.join(out, "gpu_swap.json"), "w") as f:
        json.dump(result, f, indent=1)
    return result
