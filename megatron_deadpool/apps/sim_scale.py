"""``deadpool sim``'s default law at scale (issue 57): what the busiest survivor does in a
recovery at W GPUs, from the code's own plan where one exists, times what one unit of it
costs, each unit either measured here or assumed from a named public source (``UNITS``, the
one list; the table and docs/simulator.md are derived from it).

    detect, abort, first_step    the count law (sim_counts.py: gloo unit costs fitted to the
                                 measured phases) with the busiest survivor's counts as
                                 measured (BOUNDED: the most at any W of the fit);
                                 abort + one NCCL abort of the survivor's communicators
    rendezvous                   the count law + the store server serving every survivor's
                                 operations of the phase, one after another, and the plan to
                                 every member (a survivor: the delta from the plan it holds;
                                 a promoted spare: the whole plan, O(W) bytes)
    (steady state)               not a phase: the store operations the control plane costs
                                 while training (``steady_utilization``): at 1 or more the
                                 job's one store cannot serve them
    rebuild_groups               its constant + one NCCL communicator built per group the
                                 busiest survivor rebuilds: megatron-core's groups that held a
                                 rank of the lost node (apps/group_plan.py, computed for the
                                 layout at W, never extrapolated), one after another + the
                                 store server serving their members' operations + the keep
                                 votes: one signed round of every rank (recovery/repair.py:
                                 MAX_OPS_PER_ROUND operations each) and its records' bytes
                                 (an upper bound: every kept membership's counters at every
                                 level of the rounds' tree, up and down)
    restore_state                the count law + the store server serving every rank's round
                                 operations (the busiest survivor's count for every rank: an
                                 upper bound) + the shard's bytes over the link (sim.py); the
                                 rounds' tree adds 2 log_4 W store hops a round in a row
                                 (about 10 ms at 100,000 GPUs: left out)

BOUNDED: outside megatron-core's groups (the plan), the code bounds what a survivor does in a
recovery by a constant: one store operation at the rendezvous, at most MAX_OPS_PER_ROUND store
operations a round in the mirror's rounds (mirror/rounds.py), the in-flight transfers to its
buddies at the abort. So the counts are the most measured at any W of the fit, not a fitted
law extrapolated (a fit through 0, 0, 2 in-flight messages at W = 8, 16, 32 grows as W).

The store server term is what the count law alone misses: it times a store operation as one
rank sees it on an idle server, but at W ranks one server does every rank's operations.
Pure but for reading the plans and the store rate (and computing a missing plan).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from ..base.errors import DeadpoolError
from ..base.vocabulary import PHASE_ORDER
from ..mirror.rounds import FANOUT, MAX_OPS_PER_ROUND
from . import group_plan, sim_counts

DATA = Path(__file__).resolve().parents[2] / "docs" / "data"
PLANS_FILE = DATA / "megatron_group_plans.json"
STORE_RATE_FILE = DATA / "store_rate.json"
# the runs with the round records on the node record stores: which store each operation hit
SPLIT_FILE = DATA / "bench_recovery_counts_plan_addresses.json"
FIT_MAX_W = 32   # the count law is fitted and validated on the runs up to this W
# deadpool sim's measured runs by default (bench recovery --counts at W = 8 to 64)
MEASURED_FILE = DATA / "bench_recovery_counts_253495f.json"


@dataclass(frozen=True)
class Unit:
    name: str
    value: float
    unit: str
    status: str    # "measured here" or "assumed"
    source: str


# (GPUs, seconds): NeMo-RL's NCCL communicator shrink, as issue 57 cites it.
NCCL_INIT_POINTS = ((32, 1.4), (1024, 2.0))


def _log_law(points=NCCL_INIT_POINTS):
    (n0, t0), (n1, t1) = points
    b = (t1 - t0) / (math.log2(n1) - math.log2(n0))
    return t0 - b * math.log2(n0), b


def _nccl_units(a: float, b: float) -> List[Unit]:
    """The NCCL unit costs at scale (assumed, each with its source)."""
    return [
        Unit("nccl_comm_init_a_s", a, "s", "assumed",
             f"one NCCL communicator of n ranks takes a + b log2(n) s, through "
             f"{NCCL_INIT_POINTS[0][1]} s at {NCCL_INIT_POINTS[0][0]} GPUs and "
             f"{NCCL_INIT_POINTS[1][1]} s at {NCCL_INIT_POINTS[1][0]} GPUs (NeMo-RL's NCCL "
             "communicator shrink, as cited in issue 57). Not measured here beyond 1 GPU. "
             "Caveat: NVIDIA/nccl pull request 1789 (Meta) reports O(n^2) loops in NCCL's "
             "init costing dozens of seconds at 100K ranks before its fix"),
        Unit("nccl_comm_init_b_s", b, "s per doubling of n", "assumed",
             "the same two points as nccl_comm_init_a_s"),
        Unit("nccl_abort_s", 1.0, "s", "assumed",
             "ncclCommAbort of every communicator a survivor holds, from a thread pool "
             "(NVRx inprocess' design): no public figure found; the H200 check (issue 56) "
             "aborted communicators but did not time the abort"),
        Unit("store_ops_per_group_member", 1.0, "operations", "assumed",
             "torch's NCCL communicator creation (ProcessGroupNCCL.cpp initNCCLComm, recent "
             "upstream read 2026-11-29): each root sets its unique id and every member reads "
             "it (one get, or one multiGet of every root's); no store barrier "
             "(TORCH_DIST_INIT_BARRIER defaults to 0, distributed_c10d.py, torch 2.14.1). "
             "Before 2026-11-29 this was assumed to be 2, with a barrier"),
        Unit("nccl_ranks_per_root", float(NCCL_RANKS_PER_ROOT), "ranks", "assumed",
             "TORCH_NCCL_RANKS_PER_ROOT's default (ProcessGroupNCCL.hpp): a group of more "
             "ranks is made with ncclCommInitRankScalable from ceil(n / 128) roots' unique "
             "ids, and every member reads all of them from the store in one multiGet "
             "(initNCCLComm, allgatherUniqueNCCLIDs): n ceil(n / 128) ids in all"),
        Unit("nccl_unique_id_bytes", float(NCCL_UNIQUE_ID_BYTES), "bytes", "assumed",
             "sizeof(ncclUniqueId) (nccl.h, NCCL_UNIQUE_ID_BYTES)"),
    ]


@dataclass(frozen=True)
class Behaviour:
    """What the projection assumes the code does at scale, and whether it does today."""

    name: str
    status: str    # "implemented", "measured here" or "assumed, not implemented"
    text: str


def _kept_on_nccl() -> Behaviour:
    from ..recovery.world import KEEPS_GROUPS

    if "nccl" in KEEPS_GROUPS:
        return Behaviour("groups_kept_on_nccl", "implemented", "a survivor keeps every "
                         "communicator that held no lost rank (recovery/repair.py)")
    return Behaviour(
        "groups_kept_on_nccl", "assumed, not implemented",
        "a survivor keeps every communicator that held no lost rank, so only the groups of "
        "the plan above are made again. The code keeps unbroken groups on "
        f"{', '.join(KEEPS_GROUPS)} only (recovery/world.py KEEPS_GROUPS); on NCCL it aborts "
        "every communicator and makes every group again: there a recovery still grows with "
        "the job. Keeping on NCCL needs each communicator's in-flight work known (gloo_waits "
        "tallies only gloo) and the abort limited to the broken ones")


BEHAVIOUR = (
    _kept_on_nccl(),
    Behaviour("groups_caught_in_flight", "implemented (gloo)",
              "a group no member of which died, caught with a collective in flight (a "
              "data-parallel reduce-scatter the dead ranks' pipeline partners never "
              "joined), is completed and kept: the members that never issued it issue the "
              "same one (recovery/repair.py _complete: its description in the votes' round, and one more round, only then). "
              "One that cannot be completed (point-to-point traffic, an undescribed "
              "collective) is made again, W / (TP x PP) - 1 connections for each member: "
              "left out, as its members are not the busiest survivor"),
)


def units(store_rate: Optional[Mapping] = None, split: Optional[Mapping] = None
          ) -> List[Unit]:
    """The unit costs at scale, each with its status and source: the one list."""
    a, b = _log_law()
    rate = store_rate or load_store_rate()
    split = split or load_split()
    where = (f"the most one survivor did at W = {split['world_sizes']} with the round "
             f"records on the node record stores ({split['commit']}, {split['date']})")
    return [
        *_nccl_units(a, b),
        Unit("store_ops_per_keep_round", float(MAX_OPS_PER_ROUND), "operations",
             "counted in the code", "recovery/repair.py's keep votes: one signed round of "
             "the mirror's tree (mirror/rounds.py) for every group at once, at most "
             "MAX_OPS_PER_ROUND store operations per rank (before issue 58: 4 or 5 per "
             "member of every unbroken group)"),
        Unit("keep_rounds", 2.0, "rounds", "counted in the code", "the signed rounds of a "
             "recovery's keep votes: one (it carries the descriptions of collectives caught "
             "in flight), and one more when a group was caught so (recovery/repair.py settle, "
             "_complete: the votes again), taken always (the upper end)"),
        Unit("restore_job_store_ops", split["restore_state"]["store_ops"], "operations",
             "measured here", "the restore's operations on the job's one store per rank (the "
             f"round records are on the node stores): {where}"),
        Unit("restore_record_store_ops", split["restore_state"]["record_store_ops"],
             "operations", "measured here", "the restore's operations per rank on the node "
             f"record stores (its own node's, its parent's): {where}"),
        Unit("rendezvous_record_store_ops", split["rendezvous"]["record_store_ops"],
             "operations", "measured here", "the rendezvous barrier's operations per rank on "
             "the node record stores (one round of the store tree, recovery/world.py meet; "
             f"on the job's store before 2026-11-29): {where}"),
        *[Unit(f"control_store_ops_{ph}", split[ph]["control_store_ops"], "operations",
               "measured here", f"{ph}: the membership's operations per rank on the job's "
               "one store (plan reads, the rendezvous and ready barriers, the waits for a "
               f"declared failure, the reports): {where}") for ph in PHASE_ORDER
          if split[ph]["control_store_ops"]],  # a phase without any: no unit, no term
        Unit("keep_round_bytes_per_group", float(keep_counter_bytes()), "bytes",
             "counted in the code", "one kept group's two counters (arrivals, hash sum) in "
             "a round record, as JSON (repair.topic, a 60-bit hash times a group of 100,000)"),
        Unit("steady_store_ops_per_rank_s", steady_ops_per_rank_s(), "operations/s",
             "counted in the code", "while training: each rank's watcher and heartbeat and "
             "the decider's heartbeat scan (sim_scale.steady_ops_per_rank_s)"),
        Unit("store_server_bytes_s", rate["bytes_per_s"], "bytes/s", "measured here",
             f"the same server with 1 MB and 4 MB values ({rate['bytes_note']})"),
        Unit("store_server_op_s", rate["op_s"], "s", "measured here",
             f"one TCPStore server (torch {rate.get('torch')}, {rate.get('backend')} "
             f"backend) served {rate['ops_per_s']:.0f} operations/s, the best of "
             f"{rate.get('runs', 1)} runs of `python -m megatron_deadpool.apps.store_rate` on "
             f"a {rate.get('cpu_cores')}-core machine ({rate.get('date', 'date not recorded')})"
             "; a datacenter host serves more"),
    ]


def top_share(w: int, gpn: int) -> float:
    """The ranks in the subtrees whose round records the root's node keeps (its ranks'
    children's: up and down records of each carry its subtree's counters), as a share of
    W: an upper bound of that node's bytes with every rank's counters unmerged."""
    from ..mirror.rounds import children_of

    total = 0
    for r in range(min(gpn, w)):
        todo = list(children_of(r, w))
        while todo:
            total += len(todo)
            todo = [c for x in todo for c in children_of(x, w)]
    return total / w


def keep_counter_bytes() -> int:
    """One kept group's counters in a keep round's record (recovery/repair.py), as JSON."""
    from ..recovery import repair

    t = repair.topic(((0, 1), "gloo", 0))
    return len(json.dumps({f"{t}/n": 100000, f"{t}/s": (2 ** 60 - 1) * 100000},
                          separators=(",", ":"))) - 1


def load_split(path: Path = SPLIT_FILE) -> Dict:
    """Per phase, the most store operations one survivor did on the job's store and on the
    node record stores, in the runs with the node stores (``SPLIT_FILE``)."""
    try:
        data = json.loads(Path(path).read_text())
        runs = data["runs"]
        out = {ph: {k: float(max(r["counts"].get(ph, {}).get(k, 0) for r in runs))
                    for k in ("store_ops", "record_store_ops", "control_store_ops")}
               for ph in PHASE_ORDER}
    except (OSError, ValueError, KeyError) as exc:
        raise DeadpoolError(f"{path}: no store split ({exc!r}); measure one with `deadpool "
                            "bench recovery --counts --json F`") from None
    return {**out, "world_sizes": ", ".join(str(r["world_size"]) for r in runs),
            "commit": data.get("commit", "commit not recorded"),
            "date": data.get("date", "date not recorded")}


def load_store_rate(path: Path = STORE_RATE_FILE) -> Dict:
    try:
        data = json.loads(Path(path).read_text())
        best = max(data["runs"], key=lambda r: r["ops_per_s"])
        big = max(data["byte_runs"], key=lambda r: r["value_bytes_per_s"])
    except (OSError, ValueError, KeyError) as exc:
        raise DeadpoolError(f"{path}: no store rate ({exc!r}); measure one with `python -m "
                            f"megatron_deadpool.apps.store_rate --json F` (and "
                            "--value-bytes 1000000)") from None
    return {**best, "op_s": 1.0 / best["ops_per_s"], "runs": len(data["runs"]),
            "date": data.get("date"), "bytes_per_s": big["value_bytes_per_s"],
            "bytes_note": data.get("byte_runs_note", "")}


def steady_ops_per_rank_s() -> float:
    """Store operations per second one rank costs the job's store while it trains, from the
    code's own constants: its watcher reads the generation pointer (1 operation) and the
    shutdown record (2: a missing key's get_now is a compare_set and a check) every
    WATCH_POLL_S, and writes a heartbeat every heartbeat interval; the decider reads each
    rank's heartbeat every quarter interval (membership/member.py, decider.py)."""
    from ..base.config import DeadpoolConfig
    from ..membership.member import WATCH_POLL_S

    hb = DeadpoolConfig().heartbeat_interval_s
    return 3 / WATCH_POLL_S + 1 / hb + 4 / hb


def plan_read_bytes(world: int, gpus_per_node: int) -> int:
    """The bytes the store serves when every member of the generation after node 0's loss
    reads its plan: a survivor the signed delta from the plan it holds, each promoted spare
    the whole signed plan (O(W) bytes; store.Coordinator.get_plan)."""
    from ..base.plan import Plan, delta
    from ..membership import auth

    nodes = tuple(r // gpus_per_node for r in range(world))
    lost = tuple(range(gpus_per_node))
    prev = Plan(gen=0, world_size=world, rank_of={r: r for r in range(world)},
                node_of_rank=nodes, prev_node_of_rank=nodes, t=1.7e9)
    plan = Plan(gen=1, world_size=world, rank_of={world + r if r in lost else r: r
                                                 for r in range(world)},
                node_of_rank=tuple(world // gpus_per_node if r in lost else n
                                   for r, n in enumerate(nodes)),
                prev_node_of_rank=nodes, failed_ranks=lost,
                spare_of_rank={r: world + r for r in lost}, t=1.7e9, t_failure=1.7e9)
    full = len(auth.seal("s" * 32, plan.to_json()))
    small = len(auth.seal("s" * 32, delta(prev, plan)))
    return (world - len(lost)) * small + len(lost) * full


# ---------------------------------------------------------------------- the plans
def _cache_file() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "megatron-deadpool" / "group_plans.json"


def _read_plans(path: Path) -> Dict[str, Dict]:
    """The plans in ``path``; one computed before --deadpool-grad-stats existed (no
    ``grad_stats`` field, under a key that did not name it) is left out, to be computed
    again."""
    try:
        plans = json.loads(path.read_text()).get("plans", {})
    except (OSError, ValueError):
        return {}
    return {k: v for k, v in plans.items() if "grad_stats" in v}


def plans_for(gpus: Sequence[int], tp: int, pp: int, gpus_per_node: int,
              files: Sequence[Path] = (PLANS_FILE,), log=print, grad_stats: str = "world"
              ) -> Dict[int, Dict]:
    """The plan of each GPU count, for a job with ``--deadpool-grad-stats grad_stats``: from
    the committed plans or this user's cache, else computed (a process of its own, about
    12 s at 100,000 GPUs) and cached."""
    known: Dict[str, Dict] = {}
    cache = _cache_file()
    for f in list(files) + [cache]:
        known.update(_read_plans(Path(f)))
    out = {}
    for g in gpus:
        k = group_plan.key(g, tp, pp, gpus_per_node, grad_stats)
        if k not in known:
            log(f"[deadpool sim] megatron-core's group plan for {k}: computing it "
                f"(initialize_model_parallel on the fake backend) ...")
            t0 = time.monotonic()
            proc = subprocess.run(
                [sys.executable, "-m", "megatron_deadpool.apps.group_plan", "--world", str(g),
                 "--tp", str(tp), "--pp", str(pp), "--gpus-per-node", str(gpus_per_node),
                 "--grad-stats", grad_stats],
                capture_output=True, text=True)
            if proc.returncode != 0:
                raise DeadpoolError(f"the group plan for {k} failed (is megatron-core "
                                    f"installed? `--law counts` needs none): "
                                    f"{proc.stderr.strip().splitlines()[-1:]}")
            known[k] = json.loads(proc.stdout.strip().splitlines()[-1])
            log(f"[deadpool sim] {k}: done in {time.monotonic() - t0:.1f} s, cached in {cache}")
            _write_cache(cache, k, known[k])
        out[g] = known[k]
    return out


def _write_cache(cache: Path, k: str, plan: Dict) -> None:
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        data = {"plans": _read_plans(cache)}
        data["plans"][k] = plan
        tmp = cache.with_suffix(".tmp")
        tmp.write_text(json.dumps(data))
        tmp.replace(cache)
    except OSError:
        pass  # no cache: the next run computes it again


# ---------------------------------------------------------------------- the law
NCCL_RANKS_PER_ROOT = 128  # torch's TORCH_NCCL_RANKS_PER_ROOT default
NCCL_UNIQUE_ID_BYTES = 128  # NCCL_UNIQUE_ID_BYTES


def unique_id_bytes(sizes: Sequence[int], u: Mapping[str, float]) -> float:
    """The bytes the store serves when groups of ``sizes`` make their NCCL communicators
    (torch's initNCCLComm): every member of a group of n reads ceil(n / ranks per root)
    unique ids (one, at or below ranks per root)."""
    r, b = u["nccl_ranks_per_root"], u["nccl_unique_id_bytes"]
    return sum(n * (math.ceil(n / r) if n > r else 1) * b for n in sizes)


def nccl_init_s(n: int, u: Mapping[str, float]) -> float:
    return u["nccl_comm_init_a_s"] + u["nccl_comm_init_b_s"] * math.log2(max(n, 2))


@dataclass(frozen=True)
class ScaleLaw:
    """One phase's law at scale: ``__call__(W)`` like scaling.Law; ``terms(W)`` its parts."""

    phase: str
    count: sim_counts.CountLaw
    plans: Mapping[int, Mapping]
    unit: Mapping[str, float]
    bounded: Tuple[Tuple[str, float], ...] = ()

    form = "plan x unit costs at scale"

    def counted(self) -> Dict[str, float]:
        """The busiest survivor's counts of this phase: the most measured at any W of the
        fit, which the code bounds (BOUNDED), never extrapolated."""
        return dict(self.bounded)

    def terms(self, w: int) -> Dict[str, float]:
        u, c = self.unit, self.count
        counted = self.counted()
        server = u["store_server_op_s"] * w
        # the ranks whose operations one node's record store serves: the node's own (their
        # children's records) and their children (their own records)
        per_node = self.plans[w]["gpus_per_node"] * (1 + FANOUT)
        if self.phase == "rebuild_groups":
            plan = self.plans[w]
            groups = plan["busiest_survivor"]["groups"]
            kept = plan["members_total"] - plan["rebuilt_members_total"]
            return {"constant": c.units.constants_s[self.phase],
                    **{f"nccl_init {g['megatron']} ({g['size']})": nccl_init_s(g["size"], u)
                       for g in groups},
                    "store_server (members of the rebuilt groups)": u["store_server_op_s"]
                    * plan["rebuilt_members_total"] * u["store_ops_per_group_member"],
                    "store_server (NCCL unique ids: every member of the busiest survivor's "
                    "rebuilt groups reads every root's)": unique_id_bytes(
                        [g["size"] for g in groups], u) / u["store_server_bytes_s"],
                    "record stores (keep votes: the busiest node's)": per_node
                    * u["keep_rounds"] * u["store_ops_per_keep_round"]
                    * u["store_server_op_s"],
                    "record stores (keep votes: the round's bytes at the root's node)": 2
                    * kept * top_share(w, self.plans[w]["gpus_per_node"])
                    * u["keep_round_bytes_per_group"] / u["store_server_bytes_s"],
                    **self.control_term(w)}
        out = {"count_law": c.units.phase_s(self.phase, counted)}
        if self.phase == "abort":
            out["nccl_abort"] = u["nccl_abort_s"]
        if self.phase == "rendezvous":
            out["store_server (every rank's operations)"] = server * counted.get("store_ops", 0)
        if self.phase == "restore_state":
            out["store_server (every rank's operations)"] = server * u["restore_job_store_ops"]
            out["record stores (the busiest node's)"] = per_node * \
                u["restore_record_store_ops"] * u["store_server_op_s"]
        if self.phase == "rendezvous":
            out["record stores (the busiest node's)"] = per_node * \
                u.get("rendezvous_record_store_ops", 0.0) * u["store_server_op_s"]
            gpn = self.plans[w]["gpus_per_node"]
            out["store_server (every rank reads the plan)"] = \
                plan_read_bytes(w, gpn) / u["store_server_bytes_s"]
        out.update(self.control_term(w))
        return out

    def __call__(self, w: float) -> float:
        return sum(self.terms(int(w)).values())

    def control_term(self, w: int) -> Dict[str, float]:
        """The job's one store serving every rank's membership operations of this phase
        (counted apart from the groups' creation: ``control_store_ops``)."""
        ops = self.unit.get(f"control_store_ops_{self.phase}", 0.0)
        return {"store_server (every rank's membership operations)":
                self.unit["store_server_op_s"] * w * ops} if ops else {}

    def to_json(self) -> Dict:
        top = max(self.plans)
        return {"form": self.form, "count_law": self.count.to_json(),
                "terms_at": {str(w): {k: round(v, 4) for k, v in self.terms(w).items()}
                             for w in sorted(self.plans)}, "largest_w": top}


def fit_runs(runs: Sequence[Mapping], fit_max_w: int = FIT_MAX_W) -> List[Mapping]:
    fit = [r for r in runs if r["world_size"] <= fit_max_w]
    if len({r["world_size"] for r in fit}) < 2:
        raise DeadpoolError(f"the law at scale fits the runs up to W = {fit_max_w}: need "
                            f">= 2 world sizes there, got {sorted({r['world_size'] for r in runs})}")
    return fit


def phase_laws(runs: Sequence[Mapping], plans: Mapping[int, Mapping],
               unit_list: Sequence[Unit], fit_max_w: int = FIT_MAX_W) -> Dict[str, ScaleLaw]:
    fit = fit_runs(runs, fit_max_w)
    counts = sim_counts.phase_laws(fit)  # gloo units fitted
    u = {x.name: x.value for x in unit_list}
    return {ph: ScaleLaw(ph, counts[ph], plans, u, tuple(sorted(
        (k, max(float(r["counts"].get(ph, {}).get(k, 0)) for r in fit))
        for k in {k for r in fit for k in r["counts"].get(ph, {})}))) for ph in PHASE_ORDER}


def outside_fit(runs: Sequence[Mapping], fit_max_w: int = FIT_MAX_W,
                within: float = 0.25) -> List[Dict]:
    """The measured runs above the fit window, each predicted from the fit (what the law
    says of them, not part of its validation)."""
    units_fit = sim_counts.fit_units(fit_runs(runs, fit_max_w))
    out = []
    for w in sorted({r["world_size"] for r in runs if r["world_size"] > fit_max_w}):
        mine = [r for r in runs if r["world_size"] == w]
        out.append({"world_size": w, "oversubscription": round(mine[0].get("oversub", 1.0), 3),
                    **sim_counts.predicted(mine, units_fit, within)})
    return out


def steady_utilization(w: int, unit: Mapping[str, float]) -> float:
    """The fraction of the store server's time the control plane takes while ``w`` ranks
    train (1 or more: it cannot keep up)."""
    return w * unit["steady_store_ops_per_rank_s"] * unit["store_server_op_s"]
