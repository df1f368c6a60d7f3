"""The recovery's work that can grow with the world size W, counted where it is done
(issue 39: count, then time). Pure: a process-wide tally of integers, no I/O.

    kind              counted by                               what it is
    new_group_calls   recovery/counting.py (new_group)         every group creation this
                                                               process takes part in, member
                                                               or not (torch makes every rank
                                                               call new_group for every group)
    groups_created    counting.py (new_group, the world)       groups this process is a member of
    group_members     counting.py                              their sizes, summed
    connections       counting.py (gloo: a full mesh, size-1   TCP connections opened: gloo pairs
                      per group), mirror/socket_transport.py   and the mirror's own sockets
    store_ops         counting.py (CountingStore)              operations on this generation's
                                                               store (gloo's rendezvous, the
                                                               mirror's addresses)
    control_store_ops counting.py (main_connection)            operations of the membership's
                                                               main connection on the job's one
                                                               store: plan reads, the rendezvous
                                                               and ready barriers, the waits for
                                                               a declared failure, the reports
    record_store_ops  counting.py (counted)                    operations on the node record
                                                               stores (the rounds' records: a
                                                               rank's own node's and its parent's,
                                                               not the job's one store)
    messages, bytes   mirror/transport_api.py (the backends)   the mirror's sends, receives and
                                                               collectives (inventory, commits)
    groups_kept,      recovery/repair.py (a survivor's         groups a recovery kept (no member
    kept_members      replay)                                  failed, every account agreed),
                                                               their sizes summed
    groups_rebuilt,   repair.py; world.py (the default group)  groups a survivor made again: a
    rebuilt_members,                                           member failed, or (also counted
    rebuilt_connec-                                            as rebuilt_unsettled) an operation
    tions, rebuilt_                                            was in flight; sizes summed, and
    unsettled, un-                                             their gloo connections (size - 1;
    settled_connec-                                            unsettled_connections: those of
    tions                                                      the groups no member of died)
    groups_shrunk,    (NCCL's shrink: not used yet, always 0   communicators shrunk in place
    shrunk_members    on gloo)

Apart (``DETAIL``, not work of their own: parts of the counts above, so the count law does
not fit them; recovery/repair.py, a survivor's replay):

    dead_groups,         the groups a survivor rebuilt because one of their members died
    dead_group_members,  (the spare in its place), their sizes summed, their gloo
    dead_group_connec-   connections, and the ``store_ops`` made while torch created them:
    tions, dead_group_   what the dead ranks' own groups cost; the rest of a phase's
    store_ops            ``connections`` and ``store_ops`` is work outside them
    groups_completed     groups caught with collectives in flight, completed and kept
                         (repair.py ``_complete``; also counted in groups_kept)

``PhaseTimer`` (recovery/phases.py) takes a ``snapshot`` when a phase begins and adds the
``delta`` to that phase when it ends, so a recovery's report carries, per phase, what this
rank did in it.
"""

from __future__ import annotations

import threading
from typing import Dict, Mapping

KINDS = ("new_group_calls", "groups_created", "group_members", "connections", "store_ops",
         "control_store_ops", "record_store_ops", "messages", "bytes", "groups_kept", "kept_members", "groups_rebuilt",
         "rebuilt_members", "rebuilt_connections", "rebuilt_unsettled",
         "unsettled_connections", "groups_shrunk", "shrunk_members")

DETAIL = ("dead_groups", "dead_group_members", "dead_group_connections", "dead_group_store_ops",
          "groups_completed")
_lock = threading.Lock()
_tally: Dict[str, int] = dict.fromkeys(KINDS + DETAIL, 0)


def add(kind: str, n: int = 1) -> None:
    if kind not in _tally:
        raise KeyError(f"unknown count {kind!r}; one of {KINDS + DETAIL}")
    with _lock:
        _tally[kind] += n


def snapshot() -> Dict[str, int]:
    with _lock:
        return dict(_tally)


def delta(before: Mapping[str, int], after: Mapping[str, int]) -> Dict[str, int]:
    """What was counted between two snapshots (kinds that did not move left out)."""
    return {k: after[k] - before.get(k, 0) for k in KINDS + DETAIL
            if after.get(k, 0) != before.get(k, 0)}


def merge(into: Dict[str, int], more: Mapping[str, int]) -> Dict[str, int]:
    for k, v in more.items():
        into[k] = into.get(k, 0) + v
    return into


def per_phase_max(reports, phases) -> Dict[str, Dict[str, int]]:
    """Per phase and kind, the largest count among ``reports`` (each a rank's
    ``{phase: {kind: n}}``): the most work one rank did in that phase."""
    out: Dict[str, Dict[str, int]] = {}
    for ph in phases:
        for rep in reports:
            for k, v in (rep.get(ph) or {}).items():
                out.setdefault(ph, {})[k] = max(out.get(ph, {}).get(k, 0), v)
    return out


def outside_dead_groups(counted: Mapping[str, int]) -> Dict[str, int]:
    """One rank's counts in one phase -> its connections and store operations outside the
    dead ranks' own groups (DETAIL): the work that must not grow with the world."""
    return {k: counted.get(k, 0) - counted.get(f"dead_group_{k}", 0)
            for k in ("connections", "store_ops")}


def busiest(reports, phase: str = "rebuild_groups") -> Dict:
    """Of ``reports`` (each ``{"rank", "counts": {phase: {kind: n}}}``), the rank with the
    most connections in ``phase`` (then the most store operations): its counts there, the
    dead ranks' groups it rebuilt (how many, their members) and what it did outside them;
    and the most any of them did outside the dead ranks' groups. {} without counts."""
    mine = [(r["rank"], (r.get("counts") or {}).get(phase) or {}) for r in reports]
    mine = [(rank, c) for rank, c in mine if c]
    if not mine:
        return {}
    rank, c = max(mine, key=lambda x: (x[1].get("connections", 0), x[1].get("store_ops", 0)))
    outside = [outside_dead_groups(x) for _, x in mine]
    return {"phase": phase, "rank": rank, "counts": dict(c),
            "dead_groups": c.get("dead_groups", 0),
            "dead_group_members": c.get("dead_group_members", 0),
            "outside_dead_groups": outside_dead_groups(c),
            "outside_dead_groups_most": {k: max(o[k] for o in outside)
                                         for k in ("connections", "store_ops")}}
