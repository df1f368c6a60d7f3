"""Spare -> dead-rank assignment: a pure policy of (failed ranks, layout, spare pool).

    before:  node0 [r0 r1]  node1 [r2 r3]  node2 [r4 r5] ...   spare node4 [s8 s9]
    node1 dies:           node1 [ x  x ]
    after:   node0 [r0 r1]  node4 [r2 r3]  node2 [r4 r5] ...   (s8 -> r2, s9 -> r3)

A dead node's ranks move together onto one spare node when one has room (TP groups stay
inside a node); otherwise they are filled from the pool in order.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Dict, Hashable, Iterable, List, Sequence, Tuple

from ..errors import NoSpareError


def assign_spares(failed_ranks: Iterable[int], rank_to_node: Sequence[Hashable],
                  spares: Sequence[Tuple[int, Hashable]]) -> Dict[int, int]:
    failed = sorted(set(failed_ranks))
    for r in failed:
        if not 0 <= r < len(rank_to_node):
            raise ValueError(f"failed rank {r} is outside 0..{len(rank_to_node) - 1}")
    if len(failed) > len(spares):
        raise NoSpareError(f"{len(failed)} rank(s) failed ({failed}) but only {len(spares)} "
                           "spare process(es) are left")
    groups: "OrderedDict[Hashable, List[int]]" = OrderedDict()
    for r in failed:
        groups.setdefault(rank_to_node[r], []).append(r)
    free = list(spares)
    out: Dict[int, int] = {}
    for ranks in groups.values():
        by_node: "OrderedDict[Hashable, List[int]]" = OrderedDict()
        for sid, node in free:
            by_node.setdefault(node, []).append(sid)
        fit = next((sids for sids in by_node.values() if len(sids) >= len(ranks)), None)
        chosen = fit[:len(ranks)] if fit is not None else [sid for sid, _ in free[:len(ranks)]]
        for r, sid in zip(ranks, chosen):
            out[r] = sid
        used = set(chosen)
        free = [(sid, node) for sid, node in free if sid not in used]
    return out


def remaining_spares(spares: Sequence[Tuple[int, Hashable]], assignment: Dict[int, int]
                     ) -> List[Tuple[int, Hashable]]:
    used = set(assignment.values())
    return [(sid, node) for sid, node in spares if sid not in used]
