"""Planned swaps (drains): a node's ranks move to spare processes while every process is
still alive, on the machinery of a failure (the same plan, rebuild and restore path),
started by a request instead of a death. Zero iterations are redone.

    request: `deadpool drain --node N`, a Slurm DRAIN seen by the node's agent, a straggler
             (--deadpool-straggler-swap), or `--inject drain:node=N@iter=K`
      ─► decider (this module, pure): refused (unknown node, no rank there, no spare left)
         ─► a `drain_refused` event, the job goes on untouched;
         else plan g+1 = next_plan(g, the node's processes) with ``drain`` set
      ─► every rank agrees on a boundary D (control/runtime.py, recovery/boundary.py): it
         posts the iteration it will stop at (the main thread at a step boundary: its
         completed iteration; its watcher during a step: one more); D = the maximum
      ─► at D every rank waits for snapshot D (copied, sent to the buddies, verified);
         the drained node's processes leave (exit 0; ``to_standby``: replaced by standby
         spares on the same node), the others abort, rendezvous on g+1, rebuild and
         restore D: the promoted spares from the buddies' copies, the rest from their own.

One drain at a time; a request that arrives while a recovery or another drain is under way
waits for it. A node that dies during a drain is a failure of the drain's plan: the next
plan is made from it, so the moves of both end in one plan.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Dict, Hashable, List, Mapping, Optional, Sequence, Tuple

from ..base.errors import NoSpareError
from ..base.plan import Drain, Plan
from ..base.vocabulary import Event
from . import plan as plans

REASONS = ("request", "slurm", "straggler")


@dataclass(frozen=True)
class DrainRequest:
    node: int
    reason: str = "request"          # one of REASONS
    to_standby: bool = False         # the drained processes are replaced by standby spares
    text: str = ""                   # the operator's --reason
    t: float = 0.0                   # when it was requested (wall clock)
    nonce: str = ""                  # `deadpool drain` waits for the answer under it


def drain_plan(prev: Plan, req: DrainRequest, pool: Sequence[Tuple[int, Hashable]],
               node_of_lid: Mapping[int, Hashable], t: float
               ) -> Tuple[Optional[Plan], str]:
    """The plan that moves node ``req.node``'s ranks to idle spares of ``pool`` (none on that
    node), or (None, why not)."""
    leaving = sorted(lid for lid in prev.rank_of if node_of_lid.get(lid) == req.node)
    if req.node not in set(node_of_lid.values()):
        return None, f"node {req.node} is not part of this job"
    if not leaving:
        return None, f"node {req.node} holds no rank (a spare node, or drained already)"
    pool = [(lid, n) for lid, n in pool if n != req.node]
    try:
        nxt = plans.next_plan(prev, leaving, pool, node_of_lid, t=t, t_failure=req.t)
    except NoSpareError as exc:
        return None, f"no spare left for its {len(leaving)} rank(s) ({exc})"
    drain = Drain(node=req.node, reason=req.reason, to_standby=req.to_standby,
                  text=req.text, leaving=tuple(leaving))
    return dataclasses.replace(nxt, drain=drain), ""


class DrainQueue:
    """The decider's drains: waiting requests, the one under way, and the processes that
    leave (their exit is not a failure)."""

    def __init__(self, answer: Callable[[str, dict], None] = lambda nonce, body: None):
        self.answer = answer  # to the `deadpool drain` that asked (store.answer_drain)
        self.waiting: List[DrainRequest] = []
        self.active: Optional[Plan] = None  # published, not yet applied
        self.leaving: Dict[int, Plan] = {}  # lid -> the drain plan it leaves in
        self.refused: List[dict] = []

    def add_event(self, ev: dict) -> None:
        """A signed ``drain_request`` event (node, reason, to_standby, text)."""
        self.add(DrainRequest(node=int(ev["node"]), reason=ev.get("reason", "request"),
                              to_standby=bool(ev.get("to_standby")),
                              text=str(ev.get("text", ""))[:200], t=ev["t"],
                              nonce=str(ev.get("nonce", ""))))

    def add(self, req: DrainRequest) -> None:
        if any(w.node == req.node for w in self.waiting) or (
                self.active is not None and self.active.drain.node == req.node):
            if req.nonce:  # the same node twice: one drain
                self.answer(req.nonce, {"ok": False, "why": f"node {req.node} is being "
                                        "drained already", "t_request": req.t})
            return
        self.waiting.append(req)

    def plan(self, req: DrainRequest, prev: Plan, pool, node_of_lid, t: float,
             emit: Callable[..., None], log: Callable[[str], None]) -> Optional[Plan]:
        """The drain's plan, to publish (its leaving processes recorded), or None: refused,
        with an event and a log line; the job goes on untouched."""
        plan, why = drain_plan(prev, req, pool, node_of_lid, t)
        if req.nonce:
            self.answer(req.nonce, {"ok": False, "why": why, "t_request": req.t} if plan is None
                        else {"ok": True, "generation": plan.gen, "t_request": req.t,
                              "world_size": plan.world_size})
        if plan is None:
            self.refused.append({"node": req.node, "reason": req.reason, "why": why})
            emit(Event.DRAIN_REFUSED, node=req.node, reason=req.reason, why=why)
            log(f"drain of node {req.node} refused: {why}; the job goes on untouched")
            return None
        self.active = plan
        self.leaving.update({lid: plan for lid in plan.drain.leaving})
        emit(Event.DRAIN, generation=plan.gen, node=req.node, reason=req.reason,
             ranks=list(plan.failed_ranks))
        log(f"generation {plan.gen}: draining node {req.node} ({req.reason}): ranks "
            f"{list(plan.failed_ranks)} -> spares "
            f"{[plan.spare_of_rank[r] for r in plan.failed_ranks]} at the next boundary")
        return plan

    def take(self) -> Optional[DrainRequest]:
        return self.waiting.pop(0) if self.waiting and self.active is None else None

    def settle(self, generation_done: Callable[[Plan], bool]) -> None:
        """The drain under way is applied once every rank of its generation has restored and
        stepped, the moment its drained processes start to leave. From then on a failure is
        planned from the drain's plan, and the new plan's ranks complete the job, however
        late the drained processes' exits are seen (an exit can take seconds)."""
        if self.active is not None and generation_done(self.active):
            self.active = None

    def left(self, lid: int) -> Optional[Plan]:
        """A leaving process exited cleanly (its drain applied, or applies now)."""
        plan = self.leaving.pop(lid, None)
        if plan is not None and self.active is plan:
            self.active = None
        return plan

    def cancel(self, plans_so_far: Sequence[Plan], procs: Mapping[int, object]) -> Plan:
        """A failure before the drain applied: the drained node's processes are alive (they
        stay until the swap is done) and hold copies the failure's restore may need, so
        the drain is undone and asked again, and the failure is planned from the plan
        before it. Returns that plan."""
        plan, self.active = self.active, None
        before = plans_so_far[-2]
        for lid in plan.drain.leaving:
            self.leaving.pop(lid, None)
            procs[lid].rank = before.rank_of[lid]
        for lid in plan.spare_of_rank.values():
            procs[lid].rank = None  # its spares go back to the pool (if they still can)
        d = plan.drain
        self.waiting.insert(0, DrainRequest(node=d.node, reason=d.reason,
                                            to_standby=d.to_standby, text=d.text,
                                            t=plan.t_failure or plan.t))
        return before

    def finishing(self, procs: Mapping[int, object], plans_so_far: Sequence[Plan]
                  ) -> list:
        """The processes whose end completes the job: the ranked ones, or while a drain is
        under way the previous plan's (a job that ends before the boundary never applies
        the drain; its promoted spares are released when the job stops)."""
        if self.active is None or len(plans_so_far) < 2:
            return [p for p in procs.values() if p.rank is not None]
        members = plans_so_far[-2].rank_of
        return [p for p in procs.values() if p.lid in members]
