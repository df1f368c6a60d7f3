"""The membership plan of one generation, as a value: who holds which rank on which node,
what changed since the last plan, and the drain it carries when it is a planned swap.

    gen 1:  rank_of {0:0 1:1 3:3 4:2}   node_of_rank [0 0 2 1]   failed_ranks (2,)
            spare_of_rank {2: 4}        prev_node_of_rank [0 0 1 1]   drain None

A plan is written by the decider only (signed, ``store.Coordinator.publish_plan``) and read
by every worker and by the launcher's summary; the rule that makes the next one is in
``membership/plan.py``. Rank ids are stable: a spare takes the dead rank's id, so buddies
and restore sources are rank arithmetic. ``to_json`` is what is signed: its keys and values
are part of the store's format.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable, List, Mapping, Optional, Tuple


@dataclass(frozen=True)
class Drain:
    """A planned swap (``membership/drain.py``): node ``node``'s processes ``leaving`` are
    alive and leave at the boundary the ranks agree on."""
    node: int
    reason: str = "request"          # request, slurm or straggler (drain.REASONS)
    to_standby: bool = False         # the leaving processes are replaced by standby spares
    text: str = ""                   # the operator's --reason
    leaving: Tuple[int, ...] = ()    # the drained node's process ids (lids)

    def to_json(self) -> dict:
        return {"node": self.node, "reason": self.reason, "to_standby": self.to_standby,
                "text": self.text, "leaving": list(self.leaving)}

    @classmethod
    def from_json(cls, d: dict) -> "Drain":
        return cls(node=d["node"], reason=d.get("reason", "request"),
                   to_standby=d.get("to_standby", False), text=d.get("text", ""),
                   leaving=tuple(d.get("leaving", ())))


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
    # a planned swap: its failed_ranks are the drained node's, whose processes are alive
    drain: Optional[Drain] = None
    # str(node) -> (host, port) of that node's record store (launch/agent.py), signed with
    # the plan so that no member reads an address from the job's store in a recovery
    node_stores: Mapping[str, Tuple[str, int]] = field(default_factory=dict)

    def rank(self, lid: int) -> Optional[int]:
        """``lid``'s rank in this generation; None when it is not a member."""
        return self.rank_of.get(lid)

    def lids_beside(self, rank: int) -> List[int]:
        """The processes on ``rank``'s node in this plan (its own included), by rank."""
        node = self.node_of_rank[rank]
        return sorted((lid for lid, r in self.rank_of.items() if self.node_of_rank[r] == node),
                      key=self.rank_of.__getitem__)

    def node_store(self, node: Hashable) -> Optional[Tuple[str, int]]:
        """(host, port) of ``node``'s record store as the plan carries it, or None."""
        return self.node_stores.get(str(node))

    def newcomers(self) -> set:
        """The processes that took a rank in this plan (spares, standbys)."""
        return set(self.spare_of_rank.values())

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
                "t": self.t, "t_failure": self.t_failure,
                "drain": None if self.drain is None else self.drain.to_json(),
                "node_stores": {n: [h, int(pt)] for n, (h, pt) in self.node_stores.items()}}

    @classmethod
    def from_json(cls, d: dict) -> "Plan":
        drain = d.get("drain")
        return cls(gen=int(d["gen"]), world_size=int(d["world_size"]),
                   rank_of={int(k): int(v) for k, v in d["rank_of"].items()},
                   node_of_rank=tuple(d["node_of_rank"]),
                   prev_node_of_rank=tuple(d.get("prev_node_of_rank", ())),
                   failed_ranks=tuple(d.get("failed_ranks", ())),
                   spare_of_rank={int(k): int(v) for k, v in d.get("spare_of_rank", {}).items()},
                   t=float(d.get("t", 0.0)), t_failure=d.get("t_failure"),
                   drain=None if drain is None else Drain.from_json(drain),
                   node_stores={str(n): (str(a[0]), int(a[1]))
                                for n, a in d.get("node_stores", {}).items()})


# ---------------------------------------------------------------------- plan deltas
# A survivor holds the plan of generation g - 1 and reads only what changed in g (issue 57:
# a full plan is O(W) bytes, and every member reading it made the rendezvous O(W^2) bytes
# through the job's one store). A member without g - 1 (a promoted spare, a skipped
# generation), or whose applied delta does not give the plan's digest, reads the full plan.
_DICTS = ("rank_of", "spare_of_rank", "node_stores")
_LISTS = ("node_of_rank", "prev_node_of_rank", "failed_ranks")


def digest(plan_json: dict) -> str:
    """SHA-256 of a plan's canonical JSON (what a delta must rebuild exactly)."""
    import hashlib
    import json

    return hashlib.sha256(json.dumps(plan_json, sort_keys=True, separators=(",", ":"))
                          .encode()).hexdigest()


def _base(prev: dict, key: str) -> list:
    """What a list field of the next plan is written against: prev_node_of_rank against the
    previous plan's node_of_rank (the usual case: they are equal), every other against
    itself."""
    return prev["node_of_rank"] if key == "prev_node_of_rank" else prev[key]


def delta(prev: "Plan", new: "Plan") -> dict:
    """What changed from ``prev`` to ``new``: O(changed ranks) bytes, plus the digest of
    ``new``'s JSON."""
    p, n = prev.to_json(), new.to_json()
    out = {"gen": new.gen, "from": prev.gen, "digest": digest(n)}
    for key, v in n.items():
        if key in _DICTS:
            out[key] = {"set": {x: y for x, y in v.items() if p[key].get(x) != y},
                        "gone": [x for x in p[key] if x not in v]}
        elif key in _LISTS:
            base = _base(p, key)
            out[key] = {"n": len(v), "set": {str(i): y for i, y in enumerate(v)
                                             if i >= len(base) or base[i] != y}}
        elif key != "gen":
            out[key] = v
    return out


def apply_delta(prev: "Plan", d: dict) -> "Plan":
    """``prev`` with delta ``d`` applied; ValueError when ``d`` is not from ``prev`` or
    does not rebuild the plan it was made from (its digest)."""
    p = prev.to_json()
    try:
        if int(d["from"]) != prev.gen:
            raise ValueError(f"a delta from generation {d['from']}, not {prev.gen}")
        out = {"gen": int(d["gen"])}
        for key in p:
            if key in _DICTS:
                got = {x: y for x, y in p[key].items() if x not in set(d[key]["gone"])}
                got.update(d[key]["set"])
                out[key] = got
            elif key in _LISTS:
                base, n = _base(p, key), int(d[key]["n"])
                out[key] = [d[key]["set"].get(str(i), base[i] if i < len(base) else None)
                            for i in range(n)]
            elif key != "gen":
                out[key] = d[key]
        if digest(out) != d["digest"]:
            raise ValueError("the applied delta does not give the plan's digest")
        return Plan.from_json(out)
    except (KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"a malformed plan delta ({exc!r})") from None
