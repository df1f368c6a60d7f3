"""Buddy placement: a pure function of the rank -> node map ("node ring").

    node0 [r0 r1] --> node1 [r2 r3] --> node2 [r4 r5] --> node3 [r6 r7] --+
      ^                                                                   |
      +-------------------------------------------------------------------+
    r0's copy lives on r2, r2's on r4, ... (K replicas: the next K nodes)

Nodes are ordered by their smallest rank; the rank at local position j of node i sends to
the rank at position j (mod size) of node i+k, k = 1..K. A buddy is never on its owner's
node, and with equal node sizes every node receives exactly K nodes' worth of bytes.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Dict, Hashable, List, Sequence

from ..errors import ConfigError


def buddies(rank_to_node: Sequence[Hashable], replicas: int) -> List[List[int]]:
    if replicas < 1:
        raise ConfigError(f"replicas must be >= 1, got {replicas}")
    members: Dict[Hashable, List[int]] = defaultdict(list)
    for r, node in enumerate(rank_to_node):
        members[node].append(r)
    nodes = sorted(members, key=lambda n: members[n][0])
    if len(nodes) < replicas + 1:
        raise ConfigError(f"{replicas} replica(s) need at least {replicas + 1} nodes, "
                          f"the layout has {len(nodes)}")
    index = {n: i for i, n in enumerate(nodes)}
    pos = {r: j for n in nodes for j, r in enumerate(members[n])}
    out = []
    for r, node in enumerate(rank_to_node):
        i, j = index[node], pos[r]
        row = []
        for k in range(1, replicas + 1):
            target = members[nodes[(i + k) % len(nodes)]]
            row.append(target[j % len(target)])
        out.append(row)
    return out


def holders_of(buddy_lists: Sequence[Sequence[int]]) -> List[List[int]]:
    out: List[List[int]] = [[] for _ in buddy_lists]
    for owner, bs in enumerate(buddy_lists):
        for b in bs:
            out[b].append(owner)
    return [sorted(x) for x in out]


def received_bytes_per_node(rank_to_node: Sequence[Hashable], buddy_lists: Sequence[Sequence[int]],
                            bytes_per_rank: Sequence[int]) -> Dict[Hashable, int]:
    out: Dict[Hashable, int] = defaultdict(int)
    for owner, bs in enumerate(buddy_lists):
        for b in bs:
            out[rank_to_node[b]] += bytes_per_rank[owner]
    return dict(out)
