"""``deadpool bench peers``: DeadPool against NVRx (in-job restart with hot spares, local
checkpoints with replication) and a whole-job relaunch, on the same Megatron-LM
``pretrain_gpt.py`` job with one injector (docs/peers.md).

Per round, for each system in turn (the order rotates every round): a failure-free run and a
run whose node is SIGKILLed when iteration K starts. Each run's log gives the recovery time
(kill to the end of the first iteration after it), the iterations redone, the wall time lost
against the same round's failure-free run of that system, the step time and the save cost.
The fingerprint, the same for every system: SHA-256 over every tensor (parameters and the
distributed optimizer's state) of the checkpoint each run writes with ``--save`` at the last
iteration, its optimizer step counts and that iteration (bitwise: equal to its free run's).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Dict, List, Optional

from . import peer_log
from .peer_inject import CpuProbe, Injector
from .peer_systems import SYSTEMS, PeerJob, node_tag, run_system, slurm_check

REPO = Path(__file__).resolve().parents[2]
# the job of tests/test_megatron_lm_train.py: TP2 x PP2 x DP2 on 4 nodes x 2
MODEL_FLAGS = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
               "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
               "--seq-length", "32", "--max-position-embeddings", "32",
               "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "1e-3",
               "--lr-decay-style", "cosine", "--lr-warmup-iters", "2", "--mock-data",
               "--tokenizer-type", "NullTokenizer", "--vocab-size", "128",
               "--use-distributed-optimizer"]
CPU_FROM_ITER = 2  # peer_log.step_times leaves the first two steps out too
PACKAGES = ["torch", "megatron-core", "megatron-deadpool", "nvidia-resiliency-ext"]


def unpack_tree(archive: str, dest: str) -> str:
    """A patched Megatron-LM tree from a ``git archive`` tarball (scripts/apply_patches.sh)."""
    root = os.path.join(dest, "Megatron-LM")
    if not os.path.isdir(root):
        with tarfile.open(archive) as t:
            t.extractall(dest, filter="data")
        subprocess.run(["bash", str(REPO / "scripts" / "apply_patches.sh"), root],
                       check=True, capture_output=True, text=True)
    return root


def fingerprint(ck: str, iteration: int) -> Optional[str]:
    """SHA-256 of the checkpoint of ``iteration`` under ``ck``: every tensor by name, dtype,
    shape and bytes, the optimizer's step counts (``param_groups[*].step``: Adam's bias
    correction; stored as objects, not tensors) and the iteration; None if that checkpoint
    does not exist."""
    import torch

    from ..adapters.checkpoints import load_tensors

    d = os.path.join(ck, f"iter_{iteration:07d}")
    if not os.path.isfile(os.path.join(d, ".metadata")):  # torch.distributed.checkpoint
        return None
    h = hashlib.sha256(f"iteration {iteration}\n".encode())
    for key, t in sorted(load_tensors(d).items()):
        t = t.detach().contiguous().cpu()
        h.update(f"{key} {t.dtype} {tuple(t.shape)}\n".encode())
        h.update(t.view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    h.update(repr(optimizer_steps(d)).encode())
    return h.hexdigest()


def optimizer_steps(checkpoint_dir: str) -> List[tuple]:
    """(object key, param group, step) of every optimizer object a ``torch_dist``
    checkpoint holds."""
    import io

    import torch
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    sd: dict = {}
    _load_state_dict(sd, storage_reader=FileSystemReader(checkpoint_dir),
                     planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    out = []
    for key in sorted(k for k in sd if ".optimizer/" in k or k.endswith(".optimizer")):
        obj = sd[key]
        if isinstance(obj, io.BytesIO):
            obj.seek(0)
            obj = torch.load(obj, weights_only=True)
        for part in obj if isinstance(obj, list) else [obj]:
            groups = part.get("param_groups", []) if isinstance(part, dict) else []
            out += [(key, i, g.get("step")) for i, g in enumerate(groups)]
    return out


def versions(python: str) -> Dict[str, Optional[str]]:
    code = ("import json\nfrom importlib.metadata import version\nout = {}\n"
            f"for n in {PACKAGES!r}:\n"
            "    try: out[n] = version(n)\n    except Exception: out[n] = None\n"
            "print(json.dumps(out))")
    r = subprocess.run([python, "-c", code], capture_output=True, text=True)
    return json.loads(r.stdout) if r.returncode == 0 else {}


def one_run(system: str, job: PeerJob, work: str, kill: Optional[dict], echo=None,
            reparse: bool = False) -> dict:
    """Run one job (``reparse``: read the run already in ``work`` again instead)."""
    if reparse:
        return _reread(work, job.train_iters)
    injector, probe = None, None
    if kill is not None:
        injector = Injector(kill["iter"], node_tag(system), rank=kill["rank"])
    else:  # the failure-free run's CPU, from after the warm-up to before the last save
        probe = CpuProbe((CPU_FROM_ITER, job.train_iters - 1))
    info = run_system(system, job, work, injector, echo=echo, probe=probe)
    info["fingerprint"] = fingerprint(info["checkpoints"], job.train_iters)
    fired = (injector.fired if injector else None) or {}
    info["killed_pids"], info["kill_node"] = fired.get("pids"), fired.get("node")
    return info


def _reread(work: str, train_iters: int) -> dict:
    path = os.path.join(work, "run.log")
    log = peer_log.parse(Path(path).read_text())
    end, kill = log.first("exit"), log.first("kill")
    ck = os.path.join(work, "ck")
    return {"outcome": end[1].get("outcome") if end else "unknown", "log": path,
            "checkpoints": ck, "fingerprint": fingerprint(ck, train_iters),
            "killed_pids": kill[1].get("pids") if kill else None,
            "kill_node": kill[1].get("node") if kill else None}


def measure(system: str, free: dict, failed: dict, train_iters: int) -> dict:
    free_log = peer_log.parse(Path(free["log"]).read_text())
    fail_log = peer_log.parse(Path(failed["log"]).read_text())
    out = {"system": system, **peer_log.free_run_costs(free_log, train_iters),
           **peer_log.failure_run(fail_log, free_log, train_iters)}
    out.update(free_outcome=free["outcome"], outcome=failed["outcome"],
               free_fingerprint=free["fingerprint"], fingerprint=failed["fingerprint"],
               kill_node=failed["kill_node"], killed_pids=failed["killed_pids"],
               bitwise=bool(failed["fingerprint"]) and
               failed["fingerprint"] == free["fingerprint"])
    return out


def run_rounds(job: PeerJob, systems: List[str], runs: int, kill: dict, work: str,
               say=print, reparse: bool = False) -> List[dict]:
    records = []
    for r in range(runs):
        order = systems[r % len(systems):] + systems[:r % len(systems)]  # alternate
        for system in order:
            base = os.path.join(work, f"round{r + 1}", system)
            free = one_run(system, job, os.path.join(base, "free"), None, reparse=reparse)
            failed = one_run(system, job, os.path.join(base, "kill"), kill, reparse=reparse)
            rec = dict(measure(system, free, failed, job.train_iters), round=r + 1)
            records.append(rec)
            say(f"round {r + 1}/{runs} {system}: recovery {_s(rec['recovery_s'])} s, "
                f"redone {rec['redone']}, lost {_s(rec['lost_s'])} s, "
                f"bitwise {rec['bitwise']} ({rec['outcome']})")
    return records


def _s(x) -> str:
    return "-" if x is None else f"{x:.2f}"


def summarize(records: List[dict], systems: List[str], mtbf_s: Optional[float]
              ) -> Dict[str, dict]:
    """Per system: medians and ranges, the lost-time ratio to DeadPool and Young's interval
    (``mtbf_s`` None: one failure per failure-free run, the rate this benchmark imposes)."""
    out = {}
    for system in systems:
        rs = [r for r in records if r["system"] == system]
        s = {k: peer_log.summarize([r.get(k) for r in rs])
             for k in ("recovery_s", "redone", "lost_s", "iteration_s", "save_s",
                       "free_span_s", "cpu_s")}
        s["bitwise"] = f"{sum(r['bitwise'] for r in rs)}/{len(rs)}"
        s["cpu_by_role"] = {k: peer_log.summarize([(r.get("cpu_by_role") or {}).get(k)
                                                   for r in rs])["median"]
                            for k in (*CpuProbe.ROLES, "total")}
        s["pieces"] = {k: peer_log.summarize([(r.get("pieces") or {}).get(k) for r in rs])
                       ["median"] for k in peer_log.PIECES}
        save, step = s["save_s"]["median"], s["iteration_s"]["median"]
        mtbf = mtbf_s if mtbf_s is not None else s["free_span_s"]["median"]
        if save is not None and save > 0 and step and mtbf:
            young = peer_log.young_interval_s(save, mtbf)
            iters = max(1, round(young / step))
            s["young_interval"] = {"s": young, "iterations": iters, "mtbf_s": mtbf,
                                   "lost_s_modeled": _lost_at(s, iters, step)}
        out[system] = s
    ref = ratio_reference(out.get("deadpool"))
    for system, s in out.items():
        lost = s["lost_s"]["median"]
        s["lost_ratio_to_deadpool"] = (lost / ref if ref and lost is not None and ref > 0
                                       and lost > 0 else None)
    if ref is not None:
        out["deadpool"]["ratio_reference_s"] = ref
    return out


def ratio_reference(s: Optional[dict]) -> Optional[float]:
    """DeadPool's loss the ratios divide by: the larger of its median lost time and its
    median kill → first step after. A lost time within the noise of zero (a median below
    zero) gives no ratio; the recovery time bounds the loss from above (one whole step
    included), so the ratios it gives are the peers' smallest."""
    if not s:
        return None
    vals = [s[k]["median"] for k in ("lost_s", "recovery_s") if s[k]["median"] is not None]
    return max(vals) if vals else None


def _lost_at(s: dict, interval: int, step: float) -> Optional[float]:
    """Modeled, not run: the measured restart (lost time less the redone iterations) plus
    half an interval of redone iterations, a failure's expected redo at that interval."""
    lost, redone = s["lost_s"]["median"], s["redone"]["median"]
    if lost is None or redone is None:
        return None
    return lost - redone * step + interval / 2 * step


def _cell(s: dict, digits: int = 2) -> str:
    if s["median"] is None:
        return "-"
    f = f"{{:.{digits}f}}"
    return f"{f.format(s['median'])} ({f.format(s['min'])}–{f.format(s['max'])})"


def markdown(result: dict) -> str:
    head = ("| system | s kill → first step after | iterations redone | s lost vs own "
            "failure-free run | ratio to DeadPool | step s | save s | CPU s / iteration | "
            "bitwise |\n|---|---|---|---|---|---|---|---|---|\n")
    rows = []
    for system, s in result["summary"].items():
        ratio = s["lost_ratio_to_deadpool"]
        rows.append(f"| {system} | {_cell(s['recovery_s'])} | {_cell(s['redone'], 0)} | "
                    f"{_cell(s['lost_s'])} | {'-' if ratio is None else f'{ratio:.1f}'} | "
                    f"{_cell(s['iteration_s'], 3)} | {_cell(s['save_s'])} | "
                    f"{_cell(s['cpu_s'], 3)} | {s['bitwise']} |")
    cfg = result["config"]
    young = {k: v["young_interval"] for k, v in result["summary"].items()
             if "young_interval" in v}
    return (head + "\n".join(rows) + "\n\nMedians (min–max) over "
            f"{cfg['runs']} alternated run(s) per system; kill at iteration "
            f"{cfg['kill_iter']} of {cfg['train_iters']}, the node of rank "
            f"{cfg['kill_rank']}; save interval {cfg['save_interval']}. Ratio: a peer's "
            "median lost time over DeadPool's larger of its median lost time and its median "
            "kill → first step after. CPU s / iteration: "
            "every process of the failure-free job (workers, spares, launchers, saves), "
            f"iterations {CPU_FROM_ITER} to {cfg['train_iters'] - 1}. Young's interval "
            "sqrt(2 × save s × MTBF), MTBF " + ("one failure per failure-free run"
                                               if cfg["mtbf_s"] is None else
                                               f"{cfg['mtbf_s']:.0f} s") + ": "
            + (", ".join(f"{k} {v['s']:.1f} s ≈ {v['iterations']} iterations "
                         f"(MTBF {v['mtbf_s']:.0f} s; s lost there, modeled: "
                         f"{_s(v['lost_s_modeled'])})"
                         for k, v in young.items()) or "-") + "\n")


def run(args, extra: List[str] = ()) -> dict:
    """``extra``: trainer flags after ``--``, appended to every system's job."""
    work = os.path.abspath(args.work)
    os.makedirs(work, exist_ok=True)
    # SIGTERM unwinds like Ctrl-C, so that each run's cleanup kills what it started
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    tree = args.tree or unpack_tree(args.archive, work)
    systems = [s for s in args.systems.split(",") if s]
    bad = [s for s in systems if s not in SYSTEMS]
    if bad:
        raise SystemExit(f"unknown system(s) {bad}; known: {', '.join(SYSTEMS)}")
    if "deadpool-slurm" in systems:
        slurm_check(args.nodes)
    job = PeerJob(tree=os.path.abspath(tree), python=args.python or sys.executable,
                  flags=MODEL_FLAGS + list(extra) + ["--train-iters", str(args.train_iters)],
                  train_iters=args.train_iters, save_interval=args.save_interval,
                  nodes=args.nodes, timeout_s=args.timeout)
    kill = {"iter": args.kill_iter, "rank": args.kill_rank}
    if (args.kill_iter - 1) % args.save_interval == 0:
        print(f"warning: iteration {args.kill_iter - 1} is saved: the kill, on its log line, "
              "lands in that save, so the checkpoint systems restart from the one before",
              file=sys.stderr, flush=True)
    records = run_rounds(job, systems, args.runs, kill, work, reparse=args.reparse)
    result = {"config": {"runs": args.runs, "train_iters": args.train_iters,
                         "kill_iter": args.kill_iter, "kill_rank": args.kill_rank,
                         "save_interval": args.save_interval, "mtbf_s": args.mtbf,
                         "nodes": args.nodes, "procs_per_node": job.procs_per_node,
                         "spares": job.spares, "systems": systems, "tree": tree,
                         "flags": job.flags},
              "versions": versions(job.python), "runs": records,
              "summary": summarize(records, systems, args.mtbf)}
    Path(args.json or os.path.join(work, "peers.json")).write_text(
        json.dumps(result, indent=1))
    Path(args.markdown or os.path.join(work, "peers.md")).write_text(markdown(result))
    print(markdown(result), flush=True)
    return result


def add_arguments(p) -> None:
    p.add_argument("--tree", default=None, help="a patched Megatron-LM tree")
    p.add_argument("--archive", default=None, help="or a git archive of one (unpacked and "
                   "patched under --work)")
    p.add_argument("--work", default="out/peers", help="runs, logs, checkpoints")
    p.add_argument("--python", default=None, help="the workers' Python (default: this one; "
                   "NVRx must be importable: scripts/install_peers.sh)")
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--runs", type=int, default=5, help="rounds; each runs every system")
    p.add_argument("--train-iters", type=int, default=20)
    p.add_argument("--kill-iter", type=int, default=12, help="K: the kill fires as K starts")
    p.add_argument("--kill-rank", type=int, default=2, help="the node of this rank is killed")
    p.add_argument("--save-interval", type=int, default=5)
    p.add_argument("--nodes", type=int, default=4, help="active nodes of 2 processes")
    p.add_argument("--mtbf", type=float, default=None, help="for Young's interval, s "
                   "(default: one failure per failure-free run, the rate imposed here)")
    p.add_argument("--timeout", type=float, default=1200.0, help="per run, s")
    p.add_argument("--json", default=None, metavar="FILE")
    p.add_argument("--markdown", default=None, metavar="FILE")
    p.add_argument("--reparse", action="store_true", help="run nothing: measure the runs "
                   "already under --work again (same options)")
