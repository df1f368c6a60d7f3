"""Buddy placement: a pure function of the rank -> node map ("rank-shift ring").

Each rank's mirror copy goes to K buddy ranks on K other nodes. With P = ranks per node
(the largest node), copy k of rank r goes to rank (r + k*P) mod W:

    node0 [r0 r1]   node1 [r2 r3]   node2 [r4 r5]   node3 [r6 r7]      K=1, P=2, W=8
      r0 -> r2        r2 -> r4        r4 -> r6        r6 -> r0
      r1 -> r3        r3 -> r5        r5 -> r7        r7 -> r1

For equal-sized nodes of consecutive ranks this is exactly the "node ring" (the j-th rank of
node i sends to the j-th rank of node i+k), and it stays so after a whole node is replaced:
spares take over the dead ranks' global ids, so the placement does not even change.

Why shift ranks instead of walking the node ring: a shift is a bijection on ranks, so every
rank holds exactly K copies (host memory = own double buffer + K buddy double buffers) even
after *single* ranks moved to spare nodes. A node ring over uneven nodes would pile the copies
of a full node onto the lone rank of a half-used spare node:

    node2 [r4 r5 r6 r7] -> node4 [r9]      node ring: r9 holds 4 copies
                                            rank shift: r9 holds 1 copy

Safety first: a shift that lands on the owner's node or on a node already used for this rank
is skipped; after at most _MAX_SHIFTS tries (or a full cycle) the node ring fills the rest.
A buddy is never on its owner's node and the K buddies are on K distinct nodes.
"""

from __future__ import annotations

from math import gcd
from typing import Dict, Hashable, List, Sequence

from ..base.config import replicas_refusal
from ..base.errors import ConfigError

# Shifts tried per rank before falling back to the node ring: bounds the cost on degenerate
# layouts (one huge node next to tiny ones) to O(W * (_MAX_SHIFTS + K)).
_MAX_SHIFTS = 64


def buddies(rank_to_node: Sequence[Hashable], replicas: int) -> List[List[int]]:
    """Return, for every global rank, the ``replicas`` buddy ranks that hold its copy.

    ``rank_to_node[r]`` is the id of the node currently hosting rank ``r`` (any hashable).
    Raises :class:`ConfigError` when ``replicas`` breaks the rule of K
    (``base/config.py: replicas_refusal``; here at least 1) for the layout's nodes.
    Deterministic: every process computes the same answer.
    """
    world = len(rank_to_node)
    members: Dict[Hashable, List[int]] = {}  # insertion order = nodes by smallest rank
    pos: List[int] = []  # position of each rank among its node's ranks
    for r, node in enumerate(rank_to_node):
        ranks = members.setdefault(node, [])
        pos.append(len(ranks))
        ranks.append(r)
    why = replicas_refusal(replicas, "replicas", least=1, nodes=len(members))
    if why:
        raise ConfigError(why)
    ring = list(members)
    index = {node: i for i, node in enumerate(ring)}
    stride = max(len(v) for v in members.values())
    tries = min(world // gcd(stride, world), _MAX_SHIFTS)  # shifts repeat after a cycle
    out: List[List[int]] = []
    for r in range(world):
        own = rank_to_node[r]
        used = {own}
        row: List[int] = []
        for m in range(1, tries):
            if len(row) == replicas:
                break
            b = (r + m * stride) % world
            if rank_to_node[b] not in used:
                row.append(b)
                used.add(rank_to_node[b])
        if len(row) < replicas:  # node ring: j-th rank (mod size) of the next unused nodes
            i, j = index[own], pos[r]
            for step in range(1, len(ring)):
                if len(row) == replicas:
                    break
                node = ring[(i + step) % len(ring)]
                if node not in used:
                    ranks = members[node]
                    row.append(ranks[j % len(ranks)])
                    used.add(node)
        out.append(row)
    return out


def holders_of(buddy_lists: Sequence[Sequence[int]]) -> List[List[int]]:
    """Inverse of :func:`buddies`: for each rank, the sorted owners whose copies it holds."""
    world = len(buddy_lists)
    out: List[List[int]] = [[] for _ in range(world)]
    for owner, bs in enumerate(buddy_lists):
        for b in bs:
            if not 0 <= b < world:
                raise ValueError(f"rank {owner} has buddy {b}, outside 0..{world - 1}")
            out[b].append(owner)
    return [sorted(x) for x in out]
