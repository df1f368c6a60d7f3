"""Buddy placement: a pure function of the rank -> node map ("rank-shift ring").

    node0 [r0 r1]   node1 [r2 r3]   node2 [r4 r5]   node3 [r6 r7]
      r0 -> r2        r2 -> r4        r4 -> r6        r6 -> r0      (K=1: shift by P=2)
      r1 -> r3        r3 -> r5        r5 -> r7        r7 -> r1

Rank r's k-th copy goes to rank (r + k*P) mod W, P = ranks per node (the largest node).
Ranks keep their global ids when spares take over, so the shift stays a bijection: every rank
holds exactly K copies and host memory stays at own double buffer + K buddy double buffers,
even after single ranks moved to spare nodes. If a shift lands on the owner's node (possible
once a spare node hosts ranks of different original nodes) or on a node already used, the
next shift is tried, then any rank on an unused node. A buddy is never on its owner's node.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Dict, Hashable, List, Sequence

from ..errors import ConfigError


def buddies(rank_to_node: Sequence[Hashable], replicas: int) -> List[List[int]]:
    if replicas < 1:
        raise ConfigError(f"replicas must be >= 1, got {replicas}")
    world = len(rank_to_node)
    counts = Counter(rank_to_node)
    if len(counts) < replicas + 1:
        raise ConfigError(f"{replicas} replica(s) need at least {replicas + 1} nodes, "
                          f"the layout has {len(counts)}")
    stride = max(counts.values())
    out = []
    for r in range(world):
        used = {rank_to_node[r]}
        row: List[int] = []
        m = 1
        while len(row) < replicas and m < world:
            b = (r + m * stride) % world
            if rank_to_node[b] not in used:
                row.append(b)
                used.add(rank_to_node[b])
            m += 1
        if len(row) < replicas:  # tiny or degenerate layouts: any rank on an unused node
            for b in range(world):
                if len(row) == replicas:
                    break
                if rank_to_node[b] not in used:
                    row.append(b)
                    used.add(rank_to_node[b])
        out.append(row)
    return out


def holders_of(buddy_lists: Sequence[Sequence[int]]) -> List[List[int]]:
    out: List[List[int]] = [[] for _ in buddy_lists]
    for owner, bs in enumerate(buddy_lists):
        for b in bs:
            out[b].append(owner)
    return [sorted(x) for x in out]


def received_bytes_per_node(rank_to_node: Sequence[Hashable],
                            buddy_lists: Sequence[Sequence[int]],
                            bytes_per_rank: Sequence[int]) -> Dict[Hashable, int]:
    out: Dict[Hashable, int] = defaultdict(int)
    for owner, bs in enumerate(buddy_lists):
        for b in bs:
            out[rank_to_node[b]] += bytes_per_rank[owner]
    return dict(out)
