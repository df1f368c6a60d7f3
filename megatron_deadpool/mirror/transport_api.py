"""Mirror transport: one small interface for moving snapshot bytes between ranks.

Every implementation passes the same conformance test (tests/test_transport.py).

    exchange(sends=[(dst, buf)], recvs=[(src, buf)])   point-to-point, all at once, blocking
    all_ok(flag) -> bool                               True iff every member passed True
    all_gather_int(v) -> [v of rank 0, 1, ...]         (slot sizes)
    all_gather_json(obj) -> [obj of rank 0, 1, ...]
    gather_from(v, ranks) -> {rank: v of rank}         (a holder's owners' slot sizes)

The collectives go to the generation's store as rounds (rounds.py: O(K) work per rank for
what the mirror asks), or, for the gloo transport, to its world-wide gloo group.

Buffers are uint8 CPU tensors; receive buffers are preallocated by the caller, at least as
large as what the sender sends, which fills their prefix (the rest is left as it was: a
snapshot slot says in its header how much of it counts). Every call takes an optional
``timeout_s``.

Each transport names itself in ``kind`` (a registered one: its registry name), which the
rank results and the bench report as ``mirror_transport``. One whose registry entry serves a drain's hand-off
(``handoff=True``, mirror/handoff.py) is built with ``purpose="handoff"``, two members and
no collectives (only ``exchange``), and answers ``reachable`` without blocking.

This module is the interface only: a backend (socket_transport.py, gloo_transport.py)
imports it, and the registry (transport.py) imports the backends, each inside its factory.
"""

from __future__ import annotations

import abc
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from ..base import counts


def count_messages(*pairs: Sequence[Tuple[int, torch.Tensor]]) -> None:
    """Count the messages and bytes of an exchange's sends and receives (base/counts.py)."""
    for pair in pairs:
        counts.add("messages", len(pair))
        counts.add("bytes", sum(buf.numel() * buf.element_size() for _, buf in pair))


def count_collective(nbytes: int) -> None:
    counts.add("messages")
    counts.add("bytes", nbytes)


class MirrorTransport(abc.ABC):
    """Every call is collective over the members and blocks until done; ``timeout_s`` (None:
    the transport's default) bounds it: a peer that never answers raises TransportTimeout, a
    peer that died may also surface as its backend's connection error."""

    rank: int
    world_size: int
    kind: str  # its name in the rank results and the bench's "mirror_transport"
               # (control/link.py, apps/bench.py): a registered transport's registry name

    @abc.abstractmethod
    def exchange(self, sends: Sequence[Tuple[int, torch.Tensor]],
                 recvs: Sequence[Tuple[int, torch.Tensor]],
                 timeout_s: Optional[float] = None) -> None:
        """Send each buffer to its destination and fill each receive buffer from its source."""

    @abc.abstractmethod
    def all_ok(self, ok: bool, timeout_s: Optional[float] = None) -> bool:
        """Collective AND across all members (the commit barrier)."""

    @abc.abstractmethod
    def all_gather_int(self, value: int, timeout_s: Optional[float] = None) -> List[int]:
        """Every member's int, in rank order."""

    @abc.abstractmethod
    def all_gather_json(self, obj, timeout_s: Optional[float] = None) -> List:
        """Every member's JSON-serializable object, in rank order."""

    def gather_from(self, value, ranks: Sequence[int], timeout_s: Optional[float] = None
                    ) -> Dict[int, Any]:
        """Collective: every member gives its JSON value and gets those of ``ranks`` (a
        holder, its owners' slot sizes). Here through ``all_gather_json``; the store's
        rounds read only those ranks (rounds.py)."""
        every = self.all_gather_json(value, timeout_s)
        return {r: every[r] for r in ranks}

    def reachable(self, peer: int) -> bool:
        """Whether an ``exchange`` with ``peer`` could start now, answered without waiting
        (a hand-off's sender polls it, so that an abort ends its wait): here always."""
        return True

    # Lifecycle. The generation's abort (recovery/abort.py) shuts down the connections of
    # the communicators (the gloo group's among them) and then calls ``abort`` (World.on_abort),
    # which wakes whatever that does not reach (the socket transport's own connections).
    def abort(self) -> None:
        """Make a call blocked in this transport end now, with an error (any thread)."""

    def release(self):
        """The generation is over: close what closes fast, and return what must die off the
        critical path (a gloo group: reaper.py), or None."""
        return self
