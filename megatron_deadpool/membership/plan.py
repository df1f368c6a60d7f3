"""The pure rule that makes the next membership plan (the value is ``base/plan.py``).

    gen 0:  rank_of {0:0 1:1 2:2 3:3}   node_of_rank [0 0 1 1]        spares: 4 (node 2)
    lid 2 dies  ->  next_plan(gen0, dead={2}, pool=[(4, 2), (5, 2)])
    gen 1:  rank_of {0:0 1:1 3:3 4:2}   node_of_rank [0 0 2 1]   failed_ranks (2,)
            spare_of_rank {2: 4}        prev_node_of_rank [0 0 1 1]

Only the decider makes plans (``decider.py``, ``drain.py``). Rank ids are stable: a spare
takes the dead rank's id, so buddies and restore sources are rank arithmetic.
"""

from __future__ import annotations

from typing import Dict, Hashable, Iterable, Mapping, Optional, Sequence, Tuple

from ..base.plan import Plan
from . import assign

__all__ = ["initial_plan", "next_plan"]  # the Plan value is imported from base/plan.py


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
