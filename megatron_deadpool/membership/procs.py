"""The processes of a job as the decider tracks them."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Callable, Dict, Hashable, List, Optional, Set, Tuple

from ..base.sections import GIL_SECTIONS, Section
from ..base.state import Role, WorkerState


class ProcState(str, enum.Enum):
    STARTING = "starting"  # started, not admitted yet
    ALIVE = "alive"
    DEAD = "dead"
    DONE = "done"


@dataclass
class Proc:
    lid: int
    node: int
    role: Role  # how it started: ACTIVE, or SPARE (promoted: it has a rank)
    rank: Optional[int] = None
    state: str = ProcState.STARTING
    standby: bool = False  # its node's warm standby: taken only by a local restart
    hb_seq: int = -1
    hb_change: float = 0.0
    hb_section: str = Section.STARTUP.value  # the section its last heartbeat named
    hb_section_n: int = 0  # how many sections it had entered by then (a new entry: progress)
    hb_rejected: int = 0  # heartbeats that did not advance (gen, seq): replays, never life
    hb_iteration: int = 0
    hb_committed: int = -1
    hb_compute_s: Optional[float] = None  # its own compute per iteration (straggler.py)
    hb_gen: int = -1  # the newest plan it took
    hb_state: str = ""  # its WorkerState
    progress_change: float = 0.0
    exit_code: Optional[int] = None


def observe(p: Proc, hb: dict, now: float) -> bool:
    """Take a heartbeat record into ``p``. Only a heartbeat whose (generation, sequence
    number) is strictly newer than the last one taken is a sign of life; an older one (a
    captured heartbeat written back) is rejected: False, counted in ``p.hb_rejected``. The
    same one read again is no news. A taken heartbeat is progress when it names a new
    iteration, a section entered since, or any state but ACTIVE (recovering, done)."""
    key, last = (hb.get("gen", -1), hb["seq"]), (p.hb_gen, p.hb_seq)
    if key <= last:
        if key < last:
            p.hb_rejected += 1
            return False
        return True
    p.hb_seq, p.hb_change, p.hb_gen = hb["seq"], now, key[0]
    section = (hb.get("section", Section.STEP.value), hb.get("section_n", 0))
    if (hb["iteration"] != p.hb_iteration or hb["state"] != WorkerState.ACTIVE
            or section != (p.hb_section, p.hb_section_n)):
        p.hb_iteration, p.progress_change = hb["iteration"], now
    p.hb_section, p.hb_section_n = section
    p.hb_committed, p.hb_state = hb["committed"], hb["state"]
    p.hb_compute_s = hb.get("compute_s")
    return True


def silent(p: Proc, now: float, cfg) -> bool:
    """A member whose heartbeat is older than the heartbeat timeout (maybe tolerated, in a
    section that may hold the GIL): the others may be waiting for it."""
    return p.rank is not None and now - p.hb_change > cfg.heartbeat_timeout_s


def excuse_waiters(live, now: float, cfg) -> None:
    """While a member is ``silent``, the members with fresh heartbeats and no progress are
    most likely waiting for it in a collective: their progress clock restarts, so that the
    silent one is judged (by its heartbeat or section timeout), not those waiting for it,
    and they get a full timeout again once it is replaced."""
    if any(silent(q, now, cfg) for q in live):
        for p in live:
            if p.rank is not None and not silent(p, now, cfg):
                p.progress_change = now


def hung(p: Proc, now: float, cfg, gen: int, plan_t: float) -> Optional[Tuple[str, float]]:
    """(why, since) if the live process ``p`` must be fenced, else None (pure):

    * its heartbeat is stale (SIGSTOP, a frozen node) for the heartbeat timeout; a rank in
      a section that may hold the GIL (startup, save, eval, data: the heartbeat thread cannot
      run there) for that section's timeout instead;
    * a member makes no progress (a new iteration, or a section change) for its current
      section's timeout (--deadpool-progress-timeout in the step section; a wait for a
      silent peer is not counted: ``excuse_waiters``);
    * a member of the newest generation (after a failure, published at ``plan_t``) that was
      training (attached: active or recovering) has not taken its plan in time: it is blocked
      where the abort did not reach it, and the others would wait for it at the rendezvous
      until their timeout. A member still starting up (imports, model build) is not judged
      by this: its startup may outlast the take-plan timeout on a loaded machine.
    """
    section_s = cfg.section_timeout_s(p.hb_section)
    gil = p.rank is not None and p.hb_section in GIL_SECTIONS
    if now - p.hb_change > (section_s if gil else cfg.heartbeat_timeout_s):
        where = f" in section {p.hb_section} (timeout {section_s:g}s)" if gil else ""
        return f"heartbeat stale for {now - p.hb_change:.1f}s{where}", p.hb_change
    if p.rank is None:
        return None
    if now - p.progress_change > section_s:
        return (f"no progress for {now - p.progress_change:.1f}s in section {p.hb_section} "
                f"(timeout {section_s:g}s)", p.progress_change)
    training = p.hb_state in (WorkerState.ACTIVE, WorkerState.RECOVERING)
    if training and gen >= 1 and p.hb_gen < gen and now - plan_t > cfg.take_plan_timeout_s:
        return f"did not take generation {gen}'s plan in {now - plan_t:.1f}s", plan_t
    return None


def window_over(procs: Dict[int, Proc], dead: Set[int], exited: Set[int], waited_s: float,
                cfg, domain_of: Optional[Callable[[int], Hashable]] = None) -> bool:
    """Whether the window after the first death (``dead``: declared since the last plan,
    ``exited``: those seen as exits) is over, so that one plan covers the whole failure.
    At once when every process of each node with an exit is dead (fenced and lost nodes
    need none: the heartbeat scan saw them all together); else after ``cfg.grace_s``. One
    policy for every failure: an injected node loss reaches all of a node's processes in
    one pass of its agent, as a real one does (launch/fault_driver.py). With failure domains
    (``domain_of``: a node's domain) the unit is the domain, not the node: a rack lost at
    once goes in one plan, and a lone node's loss waits up to ``cfg.grace_s`` for the rest
    of its domain (the cost of the domains). Pure."""
    live = (ProcState.ALIVE, ProcState.STARTING)
    unit = domain_of or (lambda n: n)
    units = {unit(procs[lid].node) for lid in dead & exited}
    if not any(unit(p.node) in units and p.state in live for p in procs.values()):
        return True
    return waited_s >= cfg.grace_s


class AgentClock:
    """Node agents' heartbeat counters. Only a larger counter is life (a replayed, older
    one is not); a node whose counter has not grown for the heartbeat timeout is lost."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self._grew: Dict[int, Tuple[int, float]] = {}  # node -> (counter, when it grew)

    def observe(self, node: int, counter: Optional[int], now: float) -> Optional[float]:
        """Take ``node``'s counter (None: none that verifies, e.g. one overwritten without
        the secret, which is no sign of life); when the node is lost, since when (else
        None). A node never seen alive is not judged here (it is still starting)."""
        last = self._grew.get(node)
        if last is None and counter is None:
            return None
        if last is None or (counter is not None and counter > last[0]):
            self._grew[node] = (counter, now)
            return None
        return last[1] if now - last[1] > self.timeout_s else None

    def alive(self, node: int, now: float) -> bool:
        last = self._grew.get(node)
        return last is not None and now - last[1] <= self.timeout_s

    def silent_since(self, node: int) -> Optional[float]:
        """When ``node``'s counter last grew (None: never seen)."""
        last = self._grew.get(node)
        return None if last is None else last[1]


# An agent beats every 0.25 s (launch/agent.py): silent this long while one of its processes
# is found hung, the node itself is taken to be gone (all its processes in one plan), not
# that process alone (a fence, and a second plan for the rest a moment later)
AGENT_SILENT_S = 1.0


def node_silent(node: int, live: List[Proc], agents: "AgentClock",
                now: float) -> Optional[float]:
    """Since when ``node`` has been silent as a whole, if it has for ``AGENT_SILENT_S``: its
    agent (which beats every 0.25 s and does nothing else) and every live process of it
    have sent nothing (a power loss, a kernel panic, a cut link). Not while any of them is
    in a section that may hold the GIL (startup, save, eval, data: it may not beat there,
    and a machine busy with them may starve the agent too), and never for a node with no
    live process: those wait for the heartbeat timeouts, as before. Before: a lost node
    waited for one of its processes' heartbeat timeout (2.4-3.2 s with 2 s in the fault
    matrix, 5 s by default). Pure."""
    quiet = agents.silent_since(node)
    mine = [p for p in live if p.node == node]
    if quiet is None or not mine or now - quiet <= AGENT_SILENT_S:
        return None
    if any(p.rank is None or p.hb_section in GIL_SECTIONS for p in mine):
        return None
    last = max(p.hb_change for p in mine)
    return max(quiet, last) if now - last > AGENT_SILENT_S else None


def scan(coord, procs: Dict[int, Proc], agents: "AgentClock", now: float, cfg, gen: int,
         plan_t: float, log) -> List[Tuple[Proc, str, float, bool]]:
    """One detection pass over the heartbeats: ``(process, why, since, fence)`` for each
    process found dead (``fence`` False: its node's agent heartbeat went stale, so no
    fencing is possible and no plan names it again) or hung (``fence`` True, ``hung``)."""
    out: List[Tuple[Proc, str, float, bool]] = []
    live = [p for p in procs.values() if p.state == ProcState.ALIVE]
    if not live:
        return out
    beats = coord.heartbeats([p.lid for p in live])
    for p in live:
        hb = beats.get(p.lid)
        if hb is not None and not observe(p, hb, now) and p.hb_rejected == 1:
            log(f"ignored a replayed (older) heartbeat of process {p.lid}")
    for node in sorted({p.node for p in procs.values()}):
        since = agents.observe(node, coord.agent_heartbeat(node), now)
        how = "lost (agent heartbeat stale"
        if since is None:
            since, how = node_silent(node, live, agents, now), "gone (agent and processes silent"
        if since is None:
            continue
        why = f"node {node} {how} for {now - since:.1f}s)"
        out += [(p, why, since, False) for p in procs.values()
                if p.node == node and p.state in (ProcState.ALIVE, ProcState.STARTING)]
    lost = {p.lid for p, *_ in out}
    excuse_waiters(live, now, cfg)  # a silent member is judged, not its waiters
    for p in live:
        verdict = hung(p, now, cfg, gen, plan_t)
        if p.lid in lost or verdict is None:
            continue
        since = agents.silent_since(p.node)
        if since is not None and now - since > min(AGENT_SILENT_S, agents.timeout_s / 2):
            gone = [q for q in procs.values() if q.node == p.node and q.lid not in lost
                    and q.state in (ProcState.ALIVE, ProcState.STARTING)]
            out += [(q, f"node {p.node} gone: {verdict[0]}, and its agent silent for "
                        f"{now - since:.1f}s", verdict[1], False) for q in gone]
            lost.update(q.lid for q in gone)
        else:
            out.append((p, *verdict, True))
    return out
