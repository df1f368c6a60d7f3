"""Spare -> dead-rank assignment: a pure policy of (failed ranks, layout, spare pool).

    before:  node0 [r0 r1]  node1 [r2 r3]  node2 [r4 r5]      spares: node4 [s8 s9]
    node1 dies:             node1 [ x  x ]
    after:   node0 [r0 r1]  node4 [r2 r3]  node2 [r4 r5]      (s8 -> r2, s9 -> r3)

Policy, per group of failed ranks that lived on the same node (groups ordered by their
smallest failed rank):

  1. the first spare node (pool order) with at least as many free spares as the group has
     failed ranks takes the whole group, so a dead node's ranks move together and its
     tensor-parallel group stays inside one node;
  2. otherwise the group is filled from the remaining spares in pool order (spread fill).

Within a group, failed ranks (ascending) get the chosen spares in pool order. Spares are
never reused. If fewer spares are free than ranks failed, :class:`NoSpareError` is raised
before anything is assigned.
"""

from __future__ import annotations

from typing import Dict, Hashable, Iterable, List, Sequence, Tuple

from ..base.errors import NoSpareError

Spare = Tuple[int, Hashable]  # (spare_id, node)


def _brief(ranks: List[int], limit: int = 8) -> str:
    shown = ", ".join(map(str, ranks[:limit]))
    return f"[{shown}{', ...' if len(ranks) > limit else ''}]"


def assign_spares(failed_ranks: Iterable[int], rank_to_node: Sequence[Hashable],
                  spares: Sequence[Spare]) -> Dict[int, int]:
    """Return ``{dead global rank: spare_id}``.

    ``rank_to_node[r]`` is the node that hosted rank ``r`` when it failed; ``spares`` is the
    ordered pool of idle spare processes as ``(spare_id, node)``. Duplicate failed ranks are
    ignored; a rank outside ``0..len(rank_to_node)-1`` raises ``ValueError``.
    """
    world = len(rank_to_node)
    failed = sorted(set(failed_ranks))
    for r in failed:
        if not 0 <= r < world:
            raise ValueError(f"failed rank {r} is outside 0..{world - 1}")
    if len(failed) > len(spares):
        raise NoSpareError(f"{len(failed)} rank(s) failed {_brief(failed)} but only "
                           f"{len(spares)} spare process(es) are left")
    groups: Dict[Hashable, List[int]] = {}  # insertion order = by smallest failed rank
    for r in failed:
        groups.setdefault(rank_to_node[r], []).append(r)
    free: List[Spare] = list(spares)
    out: Dict[int, int] = {}
    for ranks in groups.values():
        by_node: Dict[Hashable, List[int]] = {}  # insertion order = pool order
        for sid, node in free:
            by_node.setdefault(node, []).append(sid)
        fit = next((sids for sids in by_node.values() if len(sids) >= len(ranks)), None)
        chosen = fit[:len(ranks)] if fit is not None else [sid for sid, _ in free[:len(ranks)]]
        out.update(zip(ranks, chosen))
        used = set(chosen)
        free = [s for s in free if s[0] not in used]
    return out
