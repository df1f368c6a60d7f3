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

_lock = threading.Lock()
_tally: Dict[str, int] = dict.fromkeys(KINDS, 0)


def add(kind: str, n: int = 1) -> None:
    if kind not in _tally:
        raise KeyError(f"unknown count {kind!r}; one of {KINDS}")
    with _lock:
        _tally[kind] += n


def snapshot() -> Dict[str, int]:
    with _lock:
        return dict(_tally)


def delta(before: Mapping[str, int], after: Mapping[str, int]) -> Dict[str, int]:
    """What was counted between two snapshots (kinds that did not move left out)."""
    return {k: after[k] - before.get(k, 0) for k in KINDS if after.get(k, 0) != before.get(k, 0)}


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
