"""Local restart: a process that crashed on a healthy node is restarted in its slot instead
of spending a spare node (spares are for dead nodes).

    node 2 [r4 r5 | standby]   r5 crashes (exit -9), node 2's agent and r4 still alive
      ─► decider: restart r5 in place (up to --deadpool-max-local-restarts per rank)
      ─► warm: node 2's standby (started with the job, imports done, waiting like a spare)
         is reserved at once ─► next_plan(..., reserved={5: standby}) ─► promoted like a
         spare; node 2's agent starts a new standby in the background (the refill)
      ─► cold (no idle standby on the node, --deadpool-local-standby 0): the agent starts a
         process (new lid) in r5's slot ─► it joins ─► reserved and promoted the same way

A node whose processes all died, or whose agent went silent, is a dead node: spares.
If the replacement does not come up within the starting-spare wait, the rank takes a spare.

A second crash on the node before its refill is up (its standby still starting): an idle
spare process takes the rank at once, as for a dead node, rather than wait for a process
still starting (11.5 s on CPU, issue 58); with no idle spare, the refill (or a cold start)
takes it when it is up.
"""

from __future__ import annotations

from typing import Callable, Dict, Iterable, List, Mapping, Optional

from ..base.vocabulary import Event
from .procs import Proc, ProcState


class LocalRestarts:
    def __init__(self, limit: int):
        self.limit = limit
        self.used: Dict[int, int] = {}       # rank -> restarts spent
        self.reserved: Dict[int, int] = {}   # rank -> lid of its in-place replacement
        self.records: List[dict] = []

    def eligible(self, rank: int, node_healthy: bool, live_peers_on_node: int) -> bool:
        """Pure rule: the node is healthy (agent heartbeat fresh, another process of the
        node alive) and the rank has restarts left."""
        return (node_healthy and live_peers_on_node > 0 and rank not in self.reserved
                and self.used.get(rank, 0) < self.limit)

    def reserve(self, rank: int, node: int, new_lid: int, replaces: int, exit_code,
                warm: bool = False) -> None:
        self.used[rank] = self.used.get(rank, 0) + 1
        self.reserved[rank] = new_lid
        self.records.append({"rank": rank, "node": node, "exit_code": exit_code,
                             "lid": new_lid, "replaces": replaces, "generation": None,
                             "warm": warm})

    def ready(self, alive_lids: Iterable[int]) -> Dict[int, int]:
        alive = set(alive_lids)
        return {r: lid for r, lid in self.reserved.items() if lid in alive}

    def published(self, gen: int, used: Dict[int, int]) -> None:
        """Plan ``gen`` gave ``used`` (rank -> lid) to their replacements; the rest fell
        back to spares."""
        for rec in self.records:
            if rec["generation"] is None and used.get(rec["rank"]) == rec["lid"]:
                rec["generation"] = gen
        self.reserved.clear()

    def request(self, dead: Iterable[int], procs: Mapping[int, Proc],
                node_healthy: Callable[[int], bool],
                spawn: Callable[[int, int, bool], int],
                emit: Callable[..., None], log: Callable[[str], None],
                idle_spares: int = 0) -> bool:
        """Request in-place replacements for the dead ranks that qualify: the node's idle
        warm standby, refilled by ``spawn(node, replaces, standby=True)``, else a process
        started cold by ``spawn(node, replaces, False)`` (each returns the new lid); True
        while a replacement is still starting. A rank whose node's standby is still
        starting (a refill) is left to the spares while ``idle_spares`` (the idle spare
        processes) last; with no standby at all (--deadpool-local-standby 0) the cold
        restart in place is the user's choice, kept."""
        for lid in sorted(dead):
            p = procs[lid]
            peers = [q for q in procs.values() if q.node == p.node and q.lid != lid
                     and q.state in (ProcState.ALIVE, ProcState.DONE)
                     and not (q.standby and q.rank is None)]  # an idle standby is no sign
            if not self.eligible(p.rank, node_healthy(p.node), len(peers)):
                continue
            standby = node_standby(procs, p.node, taken=self.reserved.values())
            if standby is not None and procs[standby].state != ProcState.ALIVE and idle_spares:
                idle_spares -= 1
                log(f"rank {p.rank} (process {lid}) crashed on healthy node {p.node}, which "
                    "has no idle standby now (its refill is starting): an idle spare takes it")
                continue
            if standby is not None:
                spawn(p.node, standby, True)  # the refill starts now, off the recovery's path
                new = standby
            else:
                new = spawn(p.node, lid, False)
            warm = standby is not None and procs[standby].state == ProcState.ALIVE
            self.reserve(p.rank, p.node, new, lid, p.exit_code, warm=warm)
            emit(Event.LOCAL_RESTART, rank=p.rank, node=p.node, exit_code=p.exit_code,
                 lid=new, replaces=lid, warm=warm)
            log(f"rank {p.rank} (process {lid}) crashed on healthy node {p.node}: "
                + (f"its warm standby {new} takes it" if warm else
                   f"its standby {new}, still starting, takes it" if standby is not None
                   else f"restarting it in place as process {new} (cold: no standby)"))
        return any(procs[lid].state == ProcState.STARTING for lid in self.reserved.values())


def node_standby(procs: Mapping[int, Proc], node: int, taken: Iterable[int] = ()
                 ) -> Optional[int]:
    """``node``'s standby for a crashed rank, holding no rank and not reserved: an idle one
    (the lowest lid), else one still starting (a refill: further along than a process
    started now); None: none."""
    busy = set(taken)
    free = [q for q in procs.values() if q.standby and q.node == node and q.rank is None
            and q.lid not in busy]
    for state in (ProcState.ALIVE, ProcState.STARTING):
        lids = [q.lid for q in free if q.state == state]
        if lids:
            return min(lids)
    return None
