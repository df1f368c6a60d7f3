"""The decider: the single writer of membership plans. It runs in the launcher agent of
node 0, next to the store.

It reads the event queue (joins, child exits, fault requests, completions), watches
heartbeats, fences hung processes through their node agent, and on failure publishes the
plan of the next generation::

    failure seen ──► grace window (collect the rest of the node) ──► assign spares (pure)
        ──► write dp/plan/{g+1} ──► bump dp/gen  (workers' watchers abort their groups)
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Set

from ..errors import NoSpareError
from ..launch.inject import SIGNALS, Fault
from . import assign
from . import store as st


@dataclass
class Proc:
    lid: int
    node: int
    role: str  # active | spare
    rank: Optional[int] = None
    state: str = "starting"  # starting | alive | dead | done
    hb_seq: int = -1
    hb_change: float = 0.0
    hb_iteration: int = 0
    hb_committed: int = -1
    progress_change: float = 0.0


@dataclass
class DeciderConfig:
    heartbeat_timeout_s: float = 5.0
    progress_timeout_s: float = 300.0
    heartbeat_interval_s: float = 0.5
    grace_s: float = 0.3
    # A failure with no idle spare waits this long for spares that are still starting
    # (e.g. replacements the launcher just started) before the job stops.
    starting_spare_wait_s: float = 30.0


@dataclass
class Decider:
    store: object
    procs: Dict[int, Proc]
    world_size: int
    token: str
    faults: List[Fault]
    send_command: Callable[[int, dict], None]  # (node, command) -> None
    config: DeciderConfig = field(default_factory=DeciderConfig)
    log: Callable[[str], None] = print

    def __post_init__(self):
        self.gen = 0
        self.cursor = 0
        self.pending_dead: Set[int] = set()
        self.first_dead_t: Optional[float] = None
        self.fault_records: List[dict] = []
        self.plans: List[dict] = []
        self.finished = False
        self.failed_reason: Optional[str] = None
        self._last_hb_poll = 0.0
        self._fault_time: Optional[float] = None
        self._agent_hb: Dict[int, tuple] = {}  # node -> (last value, when it changed)
        self.coord = st.Coordinator(self.store, self.token)
        self.rejected: List[dict] = []  # forged or replayed messages, never acted on
        self._train_t0: Optional[float] = None
        self._waiting_logged = False

    # ------------------------------------------------------------------ setup
    def node_of_rank(self) -> List[int]:
        out = [None] * self.world_size
        for p in self.procs.values():
            if p.rank is not None:
                out[p.rank] = p.node
        return out

    def publish_initial_plan(self) -> dict:
        plan = self._plan_dict(0, failed=[], spare_ranks={}, prev=self.node_of_rank())
        self.coord.publish_plan(plan)
        self.plans.append(plan)
        return plan

    def _plan_dict(self, gen, failed, spare_ranks, prev) -> dict:
        return {"gen": gen, "world_size": self.world_size,
                "rank_of": {str(p.lid): p.rank for p in self.procs.values()
                            if p.rank is not None},
                "node_of_rank": self.node_of_rank(), "prev_node_of_rank": prev,
                "failed_ranks": failed, "spare_ranks": spare_ranks, "t": time.time()}

    # ------------------------------------------------------------------ main step
    def step(self) -> None:
        if self.finished:
            return
        for ev in self.coord.read_events(self.cursor):
            self.cursor += 1
            self._on_event(ev)
        now = time.time()
        if now - self._last_hb_poll >= self.config.heartbeat_interval_s / 2:
            self._last_hb_poll = now
            self._poll_heartbeats(now)
        self._fire_timed_faults(now)
        if self.pending_dead and now - self.first_dead_t >= self.config.grace_s:
            self._replan()
        actives = [p for p in self.procs.values() if p.rank is not None]
        if actives and all(p.state == "done" for p in actives) and not self.pending_dead:
            self._shutdown("complete: all ranks finished")
            self.finished = True

    def _on_event(self, ev: dict) -> None:
        kind = ev["kind"]
        if kind == "forged":
            self.rejected.append(ev)
            claimed = ev.get("claimed", {})
            self.log(f"ignored an event that is not signed with the job secret "
                     f"({ev['why']}): {str(claimed)[:120]}")
            lid, nonce = claimed.get("lid"), claimed.get("nonce")
            if claimed.get("kind") == "join" and isinstance(lid, int) and isinstance(nonce, str):
                self.coord.answer_admission(lid, nonce, ok=False, why="wrong job secret")
            return
        if kind == "join":
            lid = ev["lid"]
            if lid not in self.procs:
                self.coord.answer_admission(lid, ev["nonce"], ok=False,
                                            why="unknown process id")
                self.log(f"refused process {lid}: unknown id")
                return
            self.procs[lid].state = "alive"
            self.procs[lid].hb_change = time.time()
            self.procs[lid].progress_change = time.time()
            self.coord.answer_admission(lid, ev["nonce"], ok=True)
        elif kind == "exit":
            p = self.procs.get(ev["lid"])
            if p is None or p.state in ("dead", "done"):
                return
            if ev["code"] == 0 and p.state == "done":
                return
            self._declare_dead(p, f"exited with code {ev['code']}", ev["t"])
        elif kind == "done":
            p = self.procs.get(ev["lid"])
            if p is not None and p.state != "dead":
                p.state = "done"
        elif kind == "fault_request":
            self._fire_fault(ev)
        elif kind == "fatal":
            # A local error (or an unrecoverable state) on one rank: stop the job with it;
            # spending a spare would only replay the same error.
            reason = f"rank {ev['rank']} (process {ev['lid']}) stopped: {ev['error']}"
            self.log(reason + "\n" + ev.get("traceback", ""))
            if self.failed_reason is None:
                self.failed_reason = reason
            self._shutdown(reason)
            self.finished = True

    def _fire_fault(self, ev: dict) -> None:
        idx = ev["index"]
        if self.store.check([st.k("inject", idx)]):
            return
        self.store.set(st.k("inject", idx), "fired")
        f = next(f for f in self.faults if f.index == idx)
        sig = SIGNALS[f.kind]
        if f.node is not None:
            victims = [p for p in self.procs.values()
                       if p.node == f.node and p.state not in ("dead", "done")]
        else:
            victims = [p for p in self.procs.values()
                       if p.rank == f.rank and p.state not in ("dead", "done")]
        t = time.time()
        for node in sorted({p.node for p in victims}):
            self.send_command(node, {"op": "signal", "signal": sig,
                                     "lids": [p.lid for p in victims if p.node == node]})
        rec = {"kind": f.kind, "node": f.node, "rank": f.rank,
               "ranks": sorted(p.rank for p in victims if p.rank is not None),
               "at_iter": f.iteration if f.at_s is None else ev.get("iteration"),
               "phase": f.phase if f.at_s is None else "unstaged", "t": t}
        if f.at_s is not None:
            rec["at_s"] = f.at_s
        self.fault_records.append(rec)
        self._fault_time = self._fault_time or t
        where = f"node {f.node}" if f.node is not None else f"rank {f.rank}"
        when = (f"at iteration {f.iteration} ({f.phase})" if f.at_s is None else
                f"{f.at_s:g}s after training began (unstaged, at iteration "
                f"{ev.get('iteration')})")
        self.log(f"injected {f.kind} on {where} {when}")

    def _fire_timed_faults(self, now: float) -> None:
        """Unstaged faults (``@t=S``): delivered from outside at a wall-clock instant, S
        seconds after the first rank reported a completed iteration, wherever the victims
        are (no fault point, no cooperation)."""
        timed = [f for f in self.faults if f.at_s is not None]
        if not timed:
            return
        if self._train_t0 is None:
            if any(p.hb_iteration >= 1 for p in self.procs.values() if p.rank is not None):
                self._train_t0 = now
            return
        for f in timed:
            if now - self._train_t0 >= f.at_s:
                it = max((p.hb_iteration for p in self.procs.values() if p.rank is not None),
                         default=0)
                self._fire_fault({"index": f.index, "iteration": it})

    def _poll_heartbeats(self, now: float) -> None:
        live = [p for p in self.procs.values() if p.state == "alive"]
        if not live:
            return
        beats = self.coord.heartbeats([p.lid for p in live])
        for p in live:
            hb = beats.get(p.lid)
            if hb is None:
                continue
            if hb["seq"] != p.hb_seq:
                p.hb_seq, p.hb_change = hb["seq"], now
            if hb["iteration"] != p.hb_iteration or hb["state"] != "ACTIVE":
                p.hb_iteration, p.progress_change = hb["iteration"], now
            p.hb_committed = hb["committed"]
        self._poll_agents(now)
        for p in live:
            if p.state != "alive":
                continue
            if now - p.hb_change > self.config.heartbeat_timeout_s:
                self._fence(p, f"heartbeat stale for {now - p.hb_change:.1f}s", p.hb_change)
            elif p.rank is not None and now - p.progress_change > self.config.progress_timeout_s:
                self._fence(p, f"no progress for {now - p.progress_change:.1f}s",
                            p.progress_change)

    def _poll_agents(self, now: float) -> None:
        """A node whose agent heartbeat went stale is lost: all its processes are dead (no
        fencing possible; they can never rejoin since no plan names them again)."""
        for node in sorted({p.node for p in self.procs.values()}):
            val = self.coord.agent_heartbeat(node)
            if val is None:
                continue
            last = self._agent_hb.get(node)
            if last is None or last[0] != val:
                self._agent_hb[node] = (val, now)
            elif now - last[1] > self.config.heartbeat_timeout_s:
                for p in self.procs.values():
                    if p.node == node and p.state in ("alive", "starting"):
                        self._declare_dead(p, f"node {node} lost (agent heartbeat stale for "
                                              f"{now - last[1]:.1f}s)", last[1])

    def _fence(self, p: Proc, why: str, since: float) -> None:
        self.log(f"fencing process {p.lid} (rank {p.rank}, node {p.node}): {why}")
        self.send_command(p.node, {"op": "signal", "signal": "SIGKILL", "lids": [p.lid]})
        self._declare_dead(p, "fenced: " + why, since)

    def _declare_dead(self, p: Proc, why: str, t: float) -> None:
        p.state = "dead"
        self.log(f"process {p.lid} (rank {p.rank}, node {p.node}) failed: {why}")
        if p.rank is None:
            return  # an idle spare: just leaves the pool
        self.pending_dead.add(p.lid)
        if self.first_dead_t is None:
            self.first_dead_t = time.time()
            self._failure_t = min(t, self._fault_time or t)

    # ------------------------------------------------------------------ planning
    def _replan(self) -> None:
        dead = [self.procs[lid] for lid in sorted(self.pending_dead)]
        failed = sorted(p.rank for p in dead)
        prev = self.node_of_rank()  # dead processes keep their rank until now
        pool = [(p.lid, p.node) for p in sorted(self.procs.values(), key=lambda q: q.lid)
                if p.role == "spare" and p.rank is None and p.state == "alive"]
        try:
            mapping = assign.assign_spares(failed, prev, pool)
        except NoSpareError as exc:
            starting = [p for p in self.procs.values()
                        if p.role == "spare" and p.rank is None and p.state == "starting"]
            if starting and time.time() - self.first_dead_t < self.config.starting_spare_wait_s:
                if not self._waiting_logged:
                    self._waiting_logged = True
                    self.log(f"no idle spare for ranks {failed}: waiting up to "
                             f"{self.config.starting_spare_wait_s:.0f}s for "
                             f"{len(starting)} starting spare process(es)")
                return  # stays pending; planned again on the next step
            committed = max((p.hb_committed for p in self.procs.values()
                             if p.rank is not None and p.state == "alive"), default=-1)
            self._shutdown(f"no spare left: {exc}; last committed iteration {committed}")
            self.failed_reason = f"no spare left: {exc}; last committed iteration {committed}"
            self.finished = True
            return
        for p in dead:
            p.rank = None
        for rank, lid in mapping.items():
            self.procs[lid].rank = rank
        self.gen += 1
        plan = self._plan_dict(self.gen, failed, {str(r): l for r, l in mapping.items()}, prev)
        plan["t_failure"] = self._failure_t
        plan["detect_s"] = plan["t"] - self._failure_t
        self.coord.publish_plan(plan)
        self.plans.append(plan)
        self.log(f"generation {self.gen}: ranks {failed} -> spares "
                 f"{[mapping[r] for r in failed]} (detected in {plan['detect_s']:.3f}s)")
        self.pending_dead.clear()
        self.first_dead_t = None
        self._waiting_logged = False
        self._fault_time = None

    def _shutdown(self, reason: str) -> None:
        if self.coord.set_shutdown(reason):
            self.log(f"shutdown: {reason}")
