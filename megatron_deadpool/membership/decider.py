"""The decider: the single writer of membership plans. It runs in the launcher agent of
node 0, next to the store. Detection and fencing only: it reads the event queue (joins,
child exits, completions, fatal errors), watches heartbeats, fences hung processes through
their node agent, and on failure publishes the next generation's plan (``plan.next_plan``)::

    failure seen ──► window (collect the rest of the node, or of its failure domain when
                     domains are given: procs.window_over) ──► next_plan
        ──► write dp/plan/{g+1} ──► bump dp/latest  (workers' watchers abort their groups)

Time comes from an injectable ``clock``, so tests advance it instead of sleeping.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, Hashable, List, Optional, Set

from ..base.config import DeciderConfig
from ..base.errors import NoSpareError, StopReason
from ..base.plan import Plan
from ..base.vocabulary import Event
from . import plan as plans, store as st
from .drain import DrainQueue, DrainRequest
from .local_restart import LocalRestarts
from .procs import AgentClock, Proc, ProcState, Role, scan, window_over
from .straggler import StragglerWatch
from .store import CommandOp, EventKind


@dataclass
class Decider:
    store: object
    procs: Dict[int, Proc]
    world_size: int
    token: str
    send_command: Callable[[int, dict], None]  # (node, command) -> None
    config: DeciderConfig = field(default_factory=DeciderConfig)
    log: Callable[[str], None] = print
    clock: Callable[[], float] = time.time
    # Called with every fault_request event (the launcher's fault driver delivers node
    # faults to the node's other processes and records them).
    on_fault: Callable[[dict], None] = lambda ev: None
    emit: Callable[..., None] = lambda event, **fields: None  # --deadpool-events
    # a node's failure domain (--deadpool-failure-domains); None: each node its own
    domain_of: Optional[Callable[[int], Hashable]] = None

    def __post_init__(self):
        self.cursor = 0
        self.pending_dead: Set[int] = set()
        self.pending_exits: Set[int] = set()  # those seen as process exits
        self.first_dead_t: Optional[float] = None
        self.plans: List[Plan] = []
        self.finished = False
        self.failed_reason: Optional[str] = None
        self.startup_error: Optional[str] = None  # "ExcType: message (first raised by rank R)"
        self._last_hb_poll = -1e18
        self._fault_time: Optional[float] = None
        self._failure_t = 0.0
        self.agents = AgentClock(self.config.heartbeat_timeout_s)
        self.coord = st.Coordinator(self.store, self.token)
        # forged or replayed messages, never acted on: a count and the last 100 (bounded)
        self.forged, self.rejected = 0, collections.deque(maxlen=100)
        self._waiting_logged = False
        self.next_lid = max(self.procs, default=-1) + 1
        self.local = LocalRestarts(self.config.max_local_restarts)
        self.waited_for_spare_s = 0.0
        self._plan_t = 0.0  # when the newest plan was published
        self._addresses: Dict[int, tuple] = {}  # node -> its record store (_node_stores)
        self.drains = DrainQueue(self.coord.answer_drain)  # planned swaps (drain.py)
        self.stragglers = StragglerWatch(self.config.straggler_swap)  # straggler.py

    # ------------------------------------------------------------------ setup
    @property
    def gen(self) -> int:
        return self.plans[-1].gen if self.plans else -1

    def publish_initial_plan(self) -> Plan:
        rank_of = {p.lid: p.rank for p in self.procs.values() if p.rank is not None}
        self._publish(plans.initial_plan(rank_of, self._node_of_lid(), self.world_size,
                                         self.clock()))
        return self.plans[-1]

    def _node_of_lid(self) -> Dict[int, int]:
        return {p.lid: p.node for p in self.procs.values()}

    def _publish(self, plan: Plan) -> None:
        plan = dataclasses.replace(plan, node_stores=self._node_stores(plan))
        self.coord.publish_plan(plan)
        self.plans.append(plan)
        self._plan_t = self.clock()

    def _node_stores(self, plan: Plan) -> Dict[str, tuple]:
        """The record store addresses of ``plan``'s nodes, signed with it: each read once
        from the job's store (an agent publishes its own before its workers start), so a
        recovery's plan delta carries only a new node's, and no member reads one."""
        nodes = sorted(set(plan.node_of_rank), key=str)
        for node in nodes:
            if node not in self._addresses:
                where = self.coord.node_store(node)
                if where is not None:  # none published (no agent): the members fall back
                    self._addresses[node] = tuple(where)
        return {str(n): self._addresses[n] for n in nodes if n in self._addresses}

    def note_fault(self, t: float) -> None:
        """A scheduled fault was delivered at ``t``: detection latency is measured from it."""
        self._fault_time = self._fault_time or t

    def max_iteration(self) -> int:
        return max((p.hb_iteration for p in self.procs.values() if p.rank is not None),
                   default=0)

    # ------------------------------------------------------------------ main step
    def step(self) -> None:
        if self.finished:
            return
        for ev in self.coord.read_events(self.cursor):
            self.cursor = ev["i"]
            self._handle(ev)
            if self.finished:
                return  # stopped (a fatal or a startup error): no plan follows
        now = self.clock()
        if now - self._last_hb_poll >= self.config.heartbeat_interval_s / 4:
            self._last_hb_poll = now
            self._poll_heartbeats(now)
        if self.pending_dead and window_over(self.procs, self.pending_dead, self.pending_exits,
                                             now - self.first_dead_t, self.config,
                                             self.domain_of):
            self._replan()
        elif not self.pending_dead and self.coord.generation_done(self.plans[-1]) and \
                (req := self.drains.take()) is not None:  # a planned swap (drain.py)
            plan = self.drains.plan(req, self.plans[-1], self._pool(), self._node_of_lid(),
                                    self.clock(), self.emit, self.log)
            self._fault_time = None  # a requested drain is no failure to time
            if plan is not None:  # the leaving keep their ranks until they leave
                self._take_ranks(plan, ())
        self.drains.settle(self.coord.generation_done)
        actives = self.drains.finishing(self.procs, self.plans)
        if actives and all(p.state == ProcState.DONE for p in actives) and not self.pending_dead:
            self.stop(f"{StopReason.COMPLETE.value}: all ranks finished", failed=False)

    def _handle(self, ev: dict) -> None:
        """One event. Whatever its handling raises is this record's end, never the
        decider's (a forged JOIN's nonce once raised TypeError out of the step): rejected,
        kept with the forged ones and logged, and the next event is handled."""
        try:
            self._on_event(ev)
        except Exception as exc:  # noqa: BLE001 - one record never stops the coordinator
            why = f"handling it raised {type(exc).__name__}: {exc}"
            self.rejected.append({"i": ev.get("i"), "why": why[:200],
                                  "claimed": {"kind": str(ev.get("kind"))[:40]}})
            self.log(f"ignored event {ev.get('i')} ({str(ev.get('kind'))[:40]}): {why[:300]}")

    def _on_event(self, ev: dict) -> None:
        handler = {EventKind.FORGED: self._on_forged, EventKind.JOIN: self._on_join,
                   EventKind.EXIT: self._on_exit, EventKind.DONE: self._on_done,
                   EventKind.FAULT_REQUEST: self._on_fault_request,
                   EventKind.FATAL: self._on_fatal,
                   EventKind.STARTUP_ERROR: self._on_startup_error,
                   EventKind.SPARE_NODE: self._on_spare_agent,
                   EventKind.DRAIN_REQUEST: self.drains.add_event}.get(ev["kind"])
        if handler is not None:
            handler(ev)

    def _on_forged(self, ev: dict) -> None:
        self.forged += 1
        claimed = ev.get("claimed", {})
        self.rejected.append({"i": ev["i"], "why": str(ev["why"])[:200],
                              "claimed": {"kind": str(claimed.get("kind"))[:40]}})
        self.log(f"ignored an event that is not signed with the job secret "
                 f"({ev['why']}): {str(ev.get('claimed', {}))[:120]}")
        self.coord.refuse_forged_join(ev.get("claimed", {}))

    def _on_join(self, ev: dict) -> None:
        lid = ev["lid"]
        if not st.well_formed_nonce(ev["nonce"]):  # no key can be made of it: not answered
            self.log(f"refused process {lid}: a malformed nonce {str(ev['nonce'])[:80]!r}")
            return
        if lid not in self.procs:
            self.coord.answer_admission(lid, ev["nonce"], ok=False, why="unknown process id")
            self.log(f"refused process {lid}: unknown id")
            return
        p = self.procs[lid]
        p.state, p.hb_change = ProcState.ALIVE, self.clock()
        p.progress_change = p.hb_change
        self.coord.answer_admission(lid, ev["nonce"], ok=True)

    def _on_exit(self, ev: dict) -> None:
        p = self.procs.get(ev["lid"])
        plan = self.drains.left(p.lid) if p is not None and ev["code"] == 0 else None
        if plan is not None:
            p.state, p.rank = ProcState.DONE, None  # a drained process left, swap done
            if plan.drain.to_standby:  # its slot stays in the job as a standby spare
                self._spawn_spare(p.node, p.lid)
        elif p is not None and p.state not in (ProcState.DEAD, ProcState.DONE):
            p.exit_code = ev["code"]
            self.pending_exits.add(p.lid)
            self._declare_dead(p, f"exited with code {ev['code']}", ev["t"])

    def _on_done(self, ev: dict) -> None:
        p = self.procs.get(ev["lid"])
        if p is not None and p.state != ProcState.DEAD:
            p.state = ProcState.DONE

    def _on_fault_request(self, ev: dict) -> None:
        self.note_fault(ev["t"])
        self.on_fault(ev)

    def _on_fatal(self, ev: dict) -> None:
        # a local error on one rank stops the job: a spare would only replay it
        reason = f"rank {ev['rank']} (process {ev['lid']}) stopped: {ev['error']}"
        self.log(reason + "\n" + ev.get("traceback", ""))
        self.stop(reason)

    def _on_startup_error(self, ev: dict) -> None:
        """A process failed before it attached: a rank's error stops the job, naming it; a
        standby spare's only takes it out of the pool (membership/startup.py says why)."""
        p = self.procs.get(ev["lid"])
        if p is not None and p.rank is not None and self.startup_error is None:
            self.startup_error = f"{ev['error']} (first raised by rank {p.rank})"
            self.stop(f"{StopReason.STARTUP.value}: {self.startup_error}")

    def _poll_heartbeats(self, now: float) -> None:
        if healed := self.coord.owned.heal():  # a forger overwrote a record members poll
            self.log(f"put back record(s) overwritten without the secret: {', '.join(healed)}")
        # a drain's plan is taken at the boundary the ranks agree on, not at once
        plan_t = now if self.drains.active is not None else self._plan_t
        for p, why, since, fence in scan(self.coord, self.procs, self.agents, now, self.config,
                                         self.gen, plan_t, self.log):
            self._fence(p, why, since) if fence else self._declare_dead(p, why, since)
        for node in self.stragglers.observe(self.procs):
            f = self.stragglers.flagged[-1]
            self.log(f"node {node} straggles: compute {f['compute_s']}s per iteration against "
                     f"a median of {f['median_s']}s: drain requested")
            self.drains.add(DrainRequest(node=node, reason="straggler", t=now))

    def _fence(self, p: Proc, why: str, since: float) -> None:
        self.log(f"fencing process {p.lid} (rank {p.rank}, node {p.node}): {why}")
        self.send_command(p.node, {"op": CommandOp.SIGNAL, "signal": "SIGKILL",
                                   "lids": [p.lid]})
        self._declare_dead(p, "fenced: " + why, since)

    def _declare_dead(self, p: Proc, why: str, t: float) -> None:
        p.state = ProcState.DEAD
        self.log(f"process {p.lid} (rank {p.rank}, node {p.node}) failed: {why}")
        if p.rank is None:  # an idle spare leaves the pool: no plan follows, and a fault
            if not self.pending_dead:  # noted for it must not time the next detection
                self._fault_time = None
            return
        self.pending_dead.add(p.lid)
        if self.first_dead_t is None:
            self.coord.declare_failing(self.gen)  # members wait for the plan, however long
            self.first_dead_t = self.clock()
            self._failure_t = min(t, self._fault_time or t)

    # ------------------------------------------------------------------ planning
    def new_lid(self) -> int:
        lid, self.next_lid = self.next_lid, self.next_lid + 1
        return lid

    def _restart_in_place(self) -> bool:
        """In-place replacements for the dead ranks that qualify (local_restart.py); True
        while one is still starting (the plan waits for it, bounded)."""
        starting = self.local.request(self.pending_dead, self.procs,
                                      lambda node: self.agents.alive(node, self.clock()),
                                      self._spawn_spare, self.emit, self.log,
                                      idle_spares=len(self._pool()))
        return starting and self.clock() - self.first_dead_t < self.config.local_restart_wait_s

    def _pool(self) -> list:
        """Idle spares ``(lid, node)``, in process order."""
        return [(p.lid, p.node) for p in sorted(self.procs.values(), key=lambda q: q.lid)
                if p.role == Role.SPARE and p.rank is None and p.state == ProcState.ALIVE
                and not p.standby]  # a warm standby serves its own node's crashes only

    def _replan(self) -> None:
        if self._restart_in_place():
            return
        # a drain under way: undone (its node stays to serve its copies), asked again later
        prev = self.plans[-1] if self.drains.active is None else \
            self.drains.cancel(self.plans, self.procs)
        pool = self._pool()
        reserved = self.local.ready(p.lid for p in self.procs.values()
                                    if p.rank is None and p.state == ProcState.ALIVE)
        try:
            plan = dataclasses.replace(plans.next_plan(
                prev, self.pending_dead, pool, self._node_of_lid(), t=self.clock(),
                t_failure=self._failure_t, reserved=reserved), gen=self.gen + 1)
        except NoSpareError as exc:
            self._no_spare(exc)
            return
        self.local.published(plan.gen, plan.spare_of_rank)
        if self._waiting_logged:
            self.waited_for_spare_s += self.clock() - self.first_dead_t
            self.emit(Event.SPARE_WAIT, generation=plan.gen,
                      waited_s=round(self.clock() - self.first_dead_t, 3))
        self._take_ranks(plan, self.pending_dead)
        self.log(f"generation {plan.gen}: ranks {list(plan.failed_ranks)} -> spares "
                 f"{[plan.spare_of_rank[r] for r in plan.failed_ranks]} "
                 f"(detected in {plan.detect_s:.3f}s)")
        self.pending_dead.clear()
        self.pending_exits.clear()
        self.first_dead_t = None
        self._waiting_logged, self._fault_time = False, None

    def _no_spare(self, exc: NoSpareError) -> None:
        """Wait (bounded) for spares that are still starting or, with
        --deadpool-on-no-spare wait, for a spare node to join; else stop the job naming the
        last committed iteration."""
        starting = [p for p in self.procs.values() if p.role == Role.SPARE and p.rank is None
                    and p.state == ProcState.STARTING]
        limit = max(self.config.spare_wait_s,
                    self.config.starting_spare_wait_s if starting else 0.0)
        if self.clock() - self.first_dead_t < limit:
            if not self._waiting_logged:
                self._waiting_logged = True
                self.log(f"no spare left for the failed rank(s): waiting up to {limit:.0f}s "
                         f"for {'a starting' if starting else 'a joining'} spare "
                         "(deadpool launch --join-as-spare adds a spare node)")
            return  # stays pending; planned again on the next step
        # any ranked process's last report names a committed iteration (commits are
        # collective), the dead ones' too: every survivor may have been fenced by now
        committed = max((p.hb_committed for p in self.procs.values() if p.rank is not None),
                        default=-1)
        self.stop(f"{StopReason.NO_SPARE.value}: {exc}; last committed iteration {committed}")

    def _take_ranks(self, plan: Plan, leaving) -> None:
        for lid in leaving:
            self.procs[lid].rank = None
        for rank, lid in plan.spare_of_rank.items():
            self.procs[lid].rank = rank
        self._publish(plan)

    def _spawn_spare(self, node: int, replaces: int, standby: bool = False) -> int:
        """A process started on ``node``: in a crashed one's slot (``replaces``), or a
        warm standby in place of the one that took a crashed rank."""
        new = self.new_lid()
        self.procs[new] = Proc(lid=new, node=node, role=Role.SPARE, standby=standby)
        self.send_command(node, {"op": CommandOp.SPAWN, "lid": new, "replaces": replaces,
                                 **({"standby": True} if standby else {})})
        return new

    def _on_spare_agent(self, ev: dict) -> None:
        """A node agent started with ``--join-as-spare``: its node id and process ids."""
        if not st.well_formed_nonce(ev["nonce"]):  # it could not be answered: no node
            self.log(f"refused a spare node: a malformed nonce {str(ev['nonce'])[:80]!r}")
            return
        node = max(p.node for p in self.procs.values()) + 1
        lids = [self.new_lid() for _ in range(int(ev["procs"]))]
        for lid in lids:
            self.procs[lid] = Proc(lid=lid, node=node, role=Role.SPARE)
        self.coord.answer_spare_node(ev["nonce"], node, lids)
        self.log(f"spare node {node} joined with processes {lids}")

    def stop(self, reason: str, failed: bool = True) -> None:
        """Stop the job (once): every member's watcher sees the reason and leaves."""
        if failed and self.failed_reason is None:
            self.failed_reason = reason
        if self.coord.set_shutdown(reason):
            self.log(f"shutdown: {reason}")
        self.finished = True
