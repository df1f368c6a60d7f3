"""What each gloo group has done, in a form its members can compare at a recovery (issue
51): the collectives issued on it, how many of its operations are still unfinished, and
for point-to-point the messages sent to and received from each peer. A group whose members
are all alive is kept only if these agree on every member (recovery/repair.py): a group
with an operation in flight, or a message one member sent and the other never took, would
carry the failed iteration's traffic into the next one.

``gloo_waits.py`` tallies every gloo operation it wraps (all of Megatron's and this
package's on CPU tensors); an operation that is never waited on stays unfinished, so its
group is rebuilt. Keyed by the group's c10d name, which is unique in a process.
"""

from __future__ import annotations

import collections
import threading
from typing import Dict, List, Optional, Sequence, Tuple

RECENT = 8  # the last collectives' descriptions kept per group (completable at most this many)


class Ops:
    __slots__ = ("collectives", "open", "sent", "received", "recent", "works")

    def __init__(self):
        self.collectives = 0
        self.open = 0          # operations issued and not yet waited on successfully
        self.sent: Dict[int, int] = {}      # peer (global rank) -> messages
        self.received: Dict[int, int] = {}
        # the last collectives issued, each as gloo_waits.describe made it (None: one that
        # cannot be issued again from its description): what a member that never issued
        # them needs to issue to complete them (repair.py, "complete")
        self.recent: "collections.deque" = collections.deque(maxlen=RECENT)
        # the last works not waited on yet (gloo_waits.AbortableWork; dropped from here when
        # waited on): a completion waits on them itself, their owner may have let them go
        # (a recovery resets megatron's bucket handles)
        self.works: "collections.deque" = collections.deque(maxlen=RECENT)

    def done(self) -> None:
        """One operation of this group finished (its wait returned without an error)."""
        with _lock:
            self.open -= 1


_lock = threading.Lock()
_ops: Dict[str, Ops] = {}


def name_of(group) -> Optional[str]:
    """The c10d name of ``group`` (None: the default group); None if it has none."""
    if group is None:
        from torch.distributed import distributed_c10d as c10d

        group = c10d._world.default_pg
    return getattr(group, "group_name", None) if group is not None else None


def issued(group, peer: Optional[int] = None, send: bool = False,
           desc: Optional[list] = None) -> Optional[Ops]:
    """An operation was issued on ``group`` (a message to or from global rank ``peer``,
    or a collective, ``desc`` its description); returns the record whose ``done`` its
    successful wait calls."""
    name = name_of(group)
    if name is None:
        return None
    with _lock:
        ops = _ops.get(name)
        if ops is None:
            ops = _ops[name] = Ops()
        ops.open += 1
        if peer is None:
            ops.collectives += 1
            ops.recent.append(desc)
        else:
            side = ops.sent if send else ops.received
            side[peer] = side.get(peer, 0) + 1
    return ops


def kept_account(name: str, collectives: int) -> str:
    """The account of a group whose members may keep it: its name and collectives."""
    return f"keep:{name}:c{collectives}"


def digest(name: str, me: int, members: Sequence[int]) -> str:
    """This member's account of group ``name``: equal on every member of a group that may
    be kept, "keep:..." then; anything else means rebuild. Point-to-point traffic is
    compared only in a group of two (each side's view of the one pair); a larger group
    that carried it is rebuilt."""
    with _lock:
        ops = _ops.get(name) or Ops()
        if ops.open:
            return f"open:{ops.open}"
        collectives, sent, received = ops.collectives, dict(ops.sent), dict(ops.received)
    if not sent and not received:
        return kept_account(name, collectives)
    if len(members) != 2:
        return "p2p"
    peer = members[0] if members[1] == me else members[1]
    up, down = (sent.get(peer, 0), received.get(peer, 0)) if me < peer else \
        (received.get(peer, 0), sent.get(peer, 0))
    return f"{kept_account(name, collectives)}:p{up},{down}"


def in_flight(name: str) -> Optional[Tuple[str, List[list]]]:
    """A group caught with collectives in flight that a member which never issued them
    could complete: (the account its members would agree on without them, their
    descriptions in the order issued); None if it has none open, carried point-to-point
    traffic, or one of them cannot be described (repair.py then rebuilds it)."""
    with _lock:
        ops = _ops.get(name)
        if ops is None or not ops.open or ops.sent or ops.received \
                or ops.open > len(ops.recent):
            return None
        descs = list(ops.recent)[-ops.open:]
        if any(d is None for d in descs):
            return None
        return kept_account(name, ops.collectives - ops.open), descs


def works_of(name: str) -> list:
    """The last works issued on group ``name`` and not waited on yet."""
    with _lock:
        ops = _ops.get(name)
        return list(ops.works) if ops is not None else []


def waited(ops: Optional[Ops], work) -> None:
    """``work`` of ``ops``' group is being waited on: no longer held here."""
    if ops is None:
        return
    with _lock:
        try:
            ops.works.remove(work)
        except ValueError:
            pass


def open_count(name: str) -> int:
    with _lock:
        ops = _ops.get(name)
        return ops.open if ops is not None else 0


def forget(name: str) -> None:
    """The group ``name`` is gone."""
    with _lock:
        _ops.pop(name, None)
