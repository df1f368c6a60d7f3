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

Failure domains (issue 59): given each node's domain, "node" above reads "domain": a buddy
is never in its owner's domain and the K buddies are in K distinct domains, so one event
that takes a whole domain down (a rack, a leaf switch) leaves every copy of its ranks'
state alive. The cost: with domains of D consecutive nodes, a copy travels D nodes along
the ring instead of 1 (across the domains' uplinks instead of within the domain).
"""

from __future__ import annotations

from math import gcd
from typing import Dict, Hashable, List, Mapping, Optional, Sequence

from ..base.config import replicas_refusal
from ..base.errors import ConfigError

# Shifts tried per rank before falling back to the node ring: bounds the cost on degenerate
# layouts (one huge node next to tiny ones) to O(W * (_MAX_SHIFTS + K)).
_MAX_SHIFTS = 64


def buddies(rank_to_node: Sequence[Hashable], replicas: int,
            domain_of: Optional[Mapping[Hashable, Hashable]] = None) -> List[List[int]]:
    """Return, for every global rank, the ``replicas`` buddy ranks that hold its copy.

    ``rank_to_node[r]`` is the id of the node currently hosting rank ``r`` (any hashable).
    ``domain_of``: each node's failure domain (a switch, a rack, a power shelf: what one
    event can take down at once); a node it does not name is a domain of its own, and None
    (the default) makes every node its own domain, today's ring. A rank's K buddies are
    then in K domains other than its own and each other's: the shift and the ring skip
    nodes of a used domain, so a buddy is the nearest such node (the next domain's, for
    domains of consecutive nodes). Raises :class:`ConfigError` when ``replicas`` breaks the
    rule of K (``base/config.py: replicas_refusal``; here at least 1) for the layout's
    domains. Deterministic: every process computes the same answer.
    """
    world = len(rank_to_node)
    members: Dict[Hashable, List[int]] = {}  # insertion order = nodes by smallest rank
    pos: List[int] = []  # position of each rank among its node's ranks
    for r, node in enumerate(rank_to_node):
        ranks = members.setdefault(node, [])
        pos.append(len(ranks))
        ranks.append(r)
    def dom(node: Hashable) -> Hashable:
        return node if domain_of is None else ("domain", domain_of.get(node, ("node", node)))

    domains = len({dom(n) for n in members})
    why = replicas_refusal(replicas, "replicas", least=1, nodes=domains)
    if why and domain_of is not None and replicas_refusal(replicas, "replicas", least=1) is None:
        why = (f"replicas: {replicas} replica(s) need at least {replicas + 1} failure domains "
               f"(each copy in another domain), the job's nodes are in {domains}")
    if why:
        raise ConfigError(why)
    ring = list(members)
    index = {node: i for i, node in enumerate(ring)}
    seq, stride = _shift_space(rank_to_node, members, dom, domain_of is not None)
    at = {x: i for i, x in enumerate(seq)}
    tries = min(world // gcd(stride, world), _MAX_SHIFTS)  # shifts repeat after a cycle
    out: List[List[int]] = []
    for r in range(world):
        own = rank_to_node[r]
        used = {dom(own)}
        row: List[int] = []
        for m in range(1, tries):
            if len(row) == replicas:
                break
            b = seq[(at[r] + m * stride) % world]
            if dom(rank_to_node[b]) not in used:
                row.append(b)
                used.add(dom(rank_to_node[b]))
        if len(row) < replicas:  # node ring: j-th rank (mod size) of the next unused nodes
            i, j = index[own], pos[r]
            for step in range(1, len(ring)):
                if len(row) == replicas:
                    break
                node = ring[(i + step) % len(ring)]
                if dom(node) not in used:
                    ranks = members[node]
                    row.append(ranks[j % len(ranks)])
                    used.add(dom(node))
        out.append(row)
    return out


class Domains:
    """Each node's failure domain from ``--deadpool-failure-domains``: ``blocks:N`` (nodes
    N at a time by node index: 0..N-1, N..2N-1, ...: a rack of N nodes), or ``file:PATH``
    (JSON {node: domain}, nodes named as the plan names them; a node it does not list is a
    domain of its own)."""

    def __init__(self, spec: str):
        self.spec = spec
        kind, _, arg = spec.partition(":")
        self._block, self._map = 0, {}
        if kind == "blocks" and arg.isdigit() and int(arg) >= 1:
            self._block = int(arg)
        elif kind == "file" and arg:
            import json

            try:
                with open(arg) as f:
                    got = json.load(f)
            except (OSError, ValueError) as exc:
                raise ConfigError(f"--deadpool-failure-domains {spec}: {exc}") from None
            if not isinstance(got, dict):
                raise ConfigError(f"--deadpool-failure-domains {spec}: not a JSON object "
                                  "{node: domain}")
            self._map = {str(k): v for k, v in got.items()}
        else:
            raise ConfigError(f"--deadpool-failure-domains {spec!r}: give blocks:N (N >= 1 "
                              "consecutive nodes per domain) or file:PATH (JSON {node: "
                              "domain})")

    def get(self, node: Hashable, default=None):
        if self._block:
            return node // self._block if isinstance(node, int) else default
        return self._map.get(str(node), default)


def domains(spec: Optional[str]) -> Optional[Domains]:
    """``--deadpool-failure-domains``' mapping, or None (every node its own domain)."""
    return Domains(spec) if spec else None


def describe(spec: Optional[str]) -> str:
    """Which placement runs, for the summary and the logs."""
    return f"by failure domain ({spec})" if spec else "node ring (no failure domains given)"


def _shift_space(rank_to_node, members, dom, by_domain: bool):
    """The order the shift walks and its stride. Without domains: the ranks in their own
    order, the largest node's size. With: the ranks grouped by domain (then node, then
    position), the largest domain's size, so that a shift moves every rank by one domain:
    still a bijection (every rank holds K copies) when the domains are the same size."""
    if not by_domain:
        return list(range(len(rank_to_node))), max(len(v) for v in members.values())
    doms: Dict[Hashable, List[int]] = {}
    for node, ranks in members.items():  # nodes by smallest rank, then domains by first node
        doms.setdefault(dom(node), []).extend(ranks)
    return [r for ranks in doms.values() for r in ranks], max(len(v) for v in doms.values())


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
