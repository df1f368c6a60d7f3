"""The launch summary (``--summary-json``): layout, losses, fingerprint, faults and one
entry per recovery with its phase breakdown, from the ranks' result files and reports."""

from __future__ import annotations

import json
import os
from typing import Dict, List

from ..membership.procs import ProcState
from ..mirror import persist, placement
from ..base import counts
from ..base.plan import Plan
from ..base.state import Role
from ..base.vocabulary import PHASE_ORDER
from . import gpus
from .options import LaunchOptions


def _layout(opts: LaunchOptions) -> dict:
    tp = pp = 1
    a = opts.trainer_argv
    for i, x in enumerate(a):
        if x == "--tensor-model-parallel-size":
            tp = int(a[i + 1])
        if x == "--pipeline-model-parallel-size":
            pp = int(a[i + 1])
    return {"tp": tp, "pp": pp, "dp": opts.world_size // (tp * pp),
            "world_size": opts.world_size, "nodes": opts.nodes,
            "procs_per_node": opts.procs_per_node, "spare_nodes": opts.spare_nodes}


def read_losses(results_dir: str) -> List[float]:
    path = os.path.join(results_dir, "losses.jsonl")
    by_iter: Dict[int, float] = {}
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                rec = json.loads(line)
                by_iter[rec["iteration"]] = rec["loss"]
    return [by_iter[i] for i in sorted(by_iter)]


def read_rank_results(results_dir: str, world_size: int) -> List[dict]:
    """The ``rank{r}.json`` files the ranks wrote at the end (``Deadpool.finish``), in rank
    order; missing ones (a job that did not finish) are left out."""
    out = []
    for r in range(world_size):
        path = os.path.join(results_dir, f"rank{r}.json")
        if os.path.exists(path):
            with open(path) as f:
                out.append(json.load(f))
    return out


def build_summary(opts, cfg, results_dir, decider, codes, failed, wall_s,
                  fault_records=()) -> dict:
    ranks = read_rank_results(results_dir, opts.world_size)
    shas = {x["final_state_sha256"] for x in ranks}
    complete = len(ranks) == opts.world_size and len(shas) == 1 and not failed
    losses = read_losses(results_dir)
    summary = {
        "layout": _layout(opts),
        "device": opts.device,
        "share_gpu": gpus.describe(opts.share_gpu),
        "completed_iters": len(losses),
        "losses": losses,
        "final_state_sha256": shas.pop() if complete else None,
        "ok": complete,
        "error": failed,
        "wall_s": round(wall_s, 3),
        "results_dir": results_dir,
        "exit_codes": {str(k): v for k, v in sorted(codes.items())},
    }
    if ranks:
        summary["mirror"] = {
            "waits": sum(x.get("mirror_waits", 0) for x in ranks),
            "host_bytes_per_rank": max(x.get("host_bytes", 0) for x in ranks),
            "mirror_bytes_per_rank": max(x.get("mirror_bytes", 0) for x in ranks),
            **mirror_failures(ranks),
        }
    if decider is not None:
        summary["faults"] = [{k: v for k, v in f.items() if k != "t"} | {"t": round(f["t"], 3)}
                             for f in fault_records]
        later = [(plan, _recovery(plan, decider.coord, opts.world_size)) for plan in decider.plans[1:]]
        summary["recoveries"] = [r for plan, r in later if plan.drain is None]
        summary["drains"] = [_drain(plan, r) for plan, r in later if plan.drain is not None]
        summary["drains_refused"] = list(decider.drains.refused)
        summary["local_restarts"] = _local_restarts(decider, summary["recoveries"])
        summary["waited_for_spare_s"] = round(decider.waited_for_spare_s, 3)
        summary["forged_events_ignored"] = decider.forged  # store.py, queue.py
        if decider.startup_error is not None:  # "ExcType: message (first raised by rank R)"
            summary["startup_error"] = decider.startup_error
        if cfg.enabled and cfg.fallback_save_dir:
            summary["fallback_save"] = fallback_save(cfg.fallback_save_dir, opts.world_size)
        if cfg.enabled:  # which buddy placement ran (mirror/placement.py)
            summary["placement"] = placement.describe(cfg.failure_domains)
        restarted = {x["lid"] for x in decider.local.records}
        summary["standby_spares_at_end"] = sum(
            1 for p in decider.procs.values() if p.role is Role.SPARE and p.rank is None
            and p.state != ProcState.DEAD and p.lid not in restarted and not p.standby)
        summary["warm_standbys_at_end"] = sum(
            1 for p in decider.procs.values() if p.standby and p.rank is None
            and p.state != ProcState.DEAD)
    return summary


def mirror_failures(ranks: List[dict]) -> dict:
    """What the ranks' result files say about copies that did not protect anything:
    ``rejected_copies`` (copies a holder received and refused, summed over holders),
    ``failed_commits`` (iterations that did not commit: the most any rank saw),
    ``unprotected_ranks`` (ranks that reported UNPROTECTED at some step)."""
    return {"rejected_copies": sum(x.get("rejected_copies", 0) for x in ranks),
            "failed_commits": max(x.get("failed_commits", 0) for x in ranks),
            "unprotected_ranks": [x["rank"] for x in ranks if x.get("unprotected_steps")],
            # connections the mirror listeners refused in the handshake (socket_transport.py)
            "refused_peers": sum(x.get("mirror_refused_peers", 0) for x in ranks)}


def fallback_save(root: str, world: int) -> dict:
    """``{dir, iteration, run, bytes}``: the newest iteration saved for every rank (None:
    none), and the run that saved it (persist.py)."""
    saved = persist.scan(root)
    done = saved.complete(world)
    if not done:
        return {"dir": root, "iteration": None, "run": None, "bytes": 0}
    return {"dir": root, "iteration": done[0][0], "run": done[0][1],
            "bytes": saved.nbytes[done[0]]}


def _local_restarts(decider, recoveries: List[dict]) -> List[dict]:
    """``[{rank, node, exit_code, restored_iter, total_s}]``: the recoveries that restarted
    a crashed process in its slot instead of spending a spare."""
    by_gen = {r["generation"]: r for r in recoveries}
    out = []
    for rec in decider.local.records:
        r = by_gen.get(rec["generation"], {})
        out.append({"rank": rec["rank"], "node": rec["node"], "exit_code": rec["exit_code"],
                    "restored_iter": r.get("restored_iter"), "total_s": r.get("total_s"),
                    "generation": rec["generation"],
                    # taken by the node's warm standby (else a process started cold)
                    "warm": rec.get("warm", False)})
    return out


def _drain(plan: Plan, rec: dict) -> dict:
    """A planned swap (membership/drain.py): the node, why, the ranks moved, what was
    redone (0: every rank stopped at the boundary it agreed on), the phases, and
    ``wall_s``: from the request to the slowest rank's first resumed step."""
    d = plan.drain
    return {"generation": plan.gen, "node": d.node, "reason": d.reason,
            "text": d.text, "to_standby": d.to_standby,
            "ranks_moved": list(plan.failed_ranks), "spare_of_rank": rec["spare_of_rank"],
            "restored_iter": rec["restored_iter"], "iterations_redone": rec["recomputed_iters"],
            "request_to_plan_s": rec["phases_s"].get("detect"),
            "phases_s": {k: v for k, v in rec["phases_s"].items() if k != "detect"},
            "wall_s": rec["wall_s"], "ranks_reported": rec["ranks_reported"],
            "state_from": rec["state_from"],  # per moved rank: "direct" or "buddy"
            # not applied: the job ended before the boundary, or a failure's plan took over
            "applied": not rec["superseded"]}


def _recovery(plan: Plan, coord, world_size: int) -> dict:
    reports = [x for x in (coord.rank_record("report", plan.gen, r) for r in range(world_size))
               if x is not None]
    phases = {"detect": round(plan.detect_s, 4)}
    for ph in PHASE_ORDER[1:]:
        vals = [x["phases_s"].get(ph) for x in reports if ph in x.get("phases_s", {})]
        if vals:
            phases[ph] = round(max(vals), 4)
    restored = reports[0]["restored_iter"] if reports else None
    at_fail = [x["iteration_at_failure"] for x in reports if x["iteration_at_failure"] is not None]
    return {
        "generation": plan.gen,
        "failed_ranks": list(plan.failed_ranks),
        "spare_of_rank": {str(r): lid for r, lid in plan.spare_of_rank.items()},
        "restored_iter": restored,
        "recomputed_iters": (max(at_fail) - restored) if at_fail and restored is not None
        else None,
        "phases_s": phases,
        # the sum of each phase's slowest rank: an upper bound (different ranks can be the
        # slowest in different phases, and survivors' phases overlap the detection)
        "total_s": round(sum(phases.values()), 4),
        # end to end: the failure until the slowest rank finished its first step (wall
        # clocks of the decider's and the workers' hosts: exact on one host)
        "wall_s": round(max(x["t_done"] for x in reports) - plan.t_failure, 4)
        if reports and plan.t_failure is not None and all("t_done" in x for x in reports)
        else None,
        "ranks_reported": len(reports),
        # where each promoted spare's state came from: "buddy", or a drain's "direct"
        "state_from": {str(x["rank"]): x["state_from"] for x in reports if x.get("state_from")},
        # per phase, the most work one survivor and one promoted spare did (base/counts.py)
        "counts": counts.per_phase_max([x.get("counts") or {} for x in reports
                                        if x["rank"] not in plan.spare_of_rank], PHASE_ORDER),
        # the busiest survivor's rebuild, and what it and the others did outside the dead
        # ranks' own groups (issue 57: that part must not grow with the world)
        "counts_busiest": counts.busiest([x for x in reports
                                          if x["rank"] not in plan.spare_of_rank]),
        "counts_spare": counts.per_phase_max([x.get("counts") or {} for x in reports
                                              if x["rank"] in plan.spare_of_rank], PHASE_ORDER),
        # superseded: a further failure during this recovery moved on to a newer generation
        "superseded": not reports,
    }
