"""The membership plan of one generation, and the pure rule that makes the next one.

    gen 0:  rank_of {0:0 1:1 2:2 3:3}   node_of_rank [0 0 1 1]        spares: 4 (node 2)
    lid 2 dies  ->  next_plan(gen0, dead={2}, pool=[(4, 2), (5, 2)])
    gen 1:  rank_of {0:0 1:1 3:3 4:2}   node_of_rank [0 0 2 1]   failed_ranks (2,)
            spare_of_rank {2: 4}        prev_node_of_rank [0 0 1 1]

A plan is written by the decider only (signed, ``store.Coordinator.publish_plan``) and read
by every worker (``member.py``) and by the launcher's summary. Rank ids are stable: a spare
takes the dead rank's id, so buddies and restore sources are rank arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Hashable, Iterable, Mapping, Optional, Sequence, Tuple

from . import assign


@dataclass(frozen=True)
class Plan:
    gen: int
    world_size: int
    rank_of: Mapping[int, int]           # process id (lid) -> global rank
    node_of_rank: Tuple[Hashable, ...]
    prev_node_of_rank: Tuple[Hashable, ...] = ()
    failed_ranks: Tuple[int, ...] = ()
    spare_of_rank: Mapping[int, int] = field(default_factory=dict)  # rank -> lid that took it
    t: float = 0.0                       # when it was published (wall clock)
    t_failure: Optional[float] = None    # when the failure it answers happened
    # a planned swap (drain.py): {"node", "reason", "to_standby", "text"}; its failed_ranks
    # are the drained node's, whose processes are alive and leave at the agreed boundary
    drain: Optional[Mapping[str, Any]] = None

    def rank(self, lid: int) -> Optional[int]:
        """``lid``'s rank in this generation; None when it is not a member."""
        return self.rank_of.get(lid)

    @property
    def detect_s(self) -> float:
        return 0.0 if self.t_failure is None else self.t - self.t_failure

    def to_json(self) -> dict:
        return {"gen": self.gen, "world_size": self.world_size,
                "rank_of": {str(k): v for k, v in self.rank_of.items()},
                "node_of_rank": list(self.node_of_rank),
                "prev_node_of_rank": list(self.prev_node_of_rank),
                "failed_ranks": list(self.failed_ranks),
                "spare_of_rank": {str(k): v for k, v in self.spare_of_rank.items()},
                "t": self.t, "t_failure": self.t_failure, "drain": self.drain}

    @classmethod
    def from_json(cls, d: dict) -> "Plan":
        return cls(gen=int(d["gen"]), world_size=int(d["world_size"]),
                   rank_of={int(k): int(v) for k, v in d["rank_of"].items()},
                   node_of_rank=tuple(d["node_of_rank"]),
                   prev_node_of_rank=tuple(d.get("prev_node_of_rank", ())),
                   failed_ranks=tuple(d.get("failed_ranks", ())),
                   spare_of_rank={int(k): int(v) for k, v in d.get("spare_of_rank", {}).items()},
                   t=float(d.get("t", 0.0)), t_failure=d.get("t_failure"),
                   drain=d.get("drain"))


def initial_plan(rank_of: Mapping[int, int], node_of_lid: Mapping[int, Hashable],
                 world_size: int, t: float) -> Plan:
    nodes = _nodes(rank_of, node_of_lid, world_size)
    return Plan(gen=0, world_size=world_size, rank_of=dict(rank_of), node_of_rank=nodes,
                prev_node_of_rank=nodes, t=t)


def next_plan(prev: Plan, dead: Iterable[int], pool: Sequence[Tuple[int, Hashable]],
              node_of_lid: Mapping[int, Hashable], t: float,
              t_failure: Optional[float] = None,
              reserved: Optional[Mapping[int, int]] = None) -> Plan:
    """The plan after the processes ``dead`` failed: a dead rank with a ``reserved``
    replacement (rank -> lid: a process restarted in place on its healthy node) takes it;
    every other dead rank goes to a spare of ``pool`` (idle ``(lid, node)`` in order; policy
    in ``assign.py``). Raises NoSpareError (nothing assigned) when the pool is too small.
    Dead processes that held no rank (idle spares) only leave the pool."""
    dead, reserved = set(dead), dict(reserved or {})
    failed = sorted(prev.rank_of[lid] for lid in dead if lid in prev.rank_of)
    taken = set(reserved.values())
    mapping = assign.assign_spares([r for r in failed if r not in reserved],
                                   prev.node_of_rank, [s for s in pool if s[0] not in taken])
    mapping.update({r: lid for r, lid in reserved.items() if r in failed})
    rank_of = {lid: r for lid, r in prev.rank_of.items() if lid not in dead}
    rank_of.update({lid: r for r, lid in mapping.items()})
    return Plan(gen=prev.gen + 1, world_size=prev.world_size, rank_of=rank_of,
                node_of_rank=_nodes(rank_of, node_of_lid, prev.world_size),
                prev_node_of_rank=prev.node_of_rank, failed_ranks=tuple(failed),
                spare_of_rank=dict(mapping), t=t, t_failure=t_failure)


def _nodes(rank_of: Mapping[int, int], node_of_lid: Mapping[int, Hashable],
           world_size: int) -> Tuple[Hashable, ...]:
    out: Dict[int, Hashable] = {r: node_of_lid[lid] for lid, r in rank_of.items()}
    missing = [r for r in range(world_size) if r not in out]
    if missing:
        raise ValueError(f"plan leaves rank(s) {missing} without a process")
    return tuple(out[r] for r in range(world_size))
