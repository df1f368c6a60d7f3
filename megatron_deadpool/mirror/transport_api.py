"""Mirror transport: one small interface for moving snapshot bytes between ranks, and its
contract, written here once. Every registered transport passes the same conformance test
(tests/test_transport.py, ``CONFORMANCE``: three real processes, one of which leaves).

    exchange(sends=[(dst, buf)], recvs=[(src, buf)])   point-to-point, all at once, blocking
    all_ok(flag) -> bool                               True iff every member passed True
    all_gather_int(v) -> [v of rank 0, 1, ...]         (slot sizes)
    all_gather_json(obj) -> [obj of rank 0, 1, ...]
    gather_from(v, ranks) -> {rank: v of rank}         (a holder's owners' slot sizes)

The contract (what a transport author must keep):

- **Buffers.** uint8 CPU tensors; receive buffers are preallocated by the caller, at least as
  large as what the sender sends, which fills their prefix (the rest is left as it was: a
  snapshot slot says in its header how much of it counts). A message larger than its
  receive buffer is refused. Every call takes an optional ``timeout_s`` (None: the
  transport's own, ``TransportContext.timeout_s``).
- **Authentication of every message.** A message is taken only if it was sent by a member
  of this job and generation: each is bound to the job's secret (``TransportContext.secret``),
  the generation (``gen``), its sender, its receiver and its place in their stream, and a
  message that fails that check is refused with an error, never copied into a buffer
  (docs/threat-model.md: the socket transport signs its handshakes and tags every frame,
  the gloo transport tags every message under its pair's key). A store-backed transport
  seals each value it writes (tests/test_common_changes.py builds one).
- **Collectives.** ``all_ok``, the gathers and ``gather_from`` go to
  ``TransportContext.collectives``: the generation's signed store rounds (rounds.py: O(K)
  work per rank for what the mirror asks). A transport never answers them from data only
  one member could forge.
- **A dead peer.** A call whose peer died or never answers ends within its ``timeout_s``
  with an error that recovery classifies as a peer failure (``TransportTimeout``,
  ``frames.PeerLost``, or the backend's connection error: recovery/classify.py
  ``is_comm_failure``); it never hangs and never returns as if the peer had answered.
- **Abort, from any thread.** The generation's abort (recovery/abort.py) shuts down the
  connections of the communicators it knows (a group the factory built through
  ``TransportContext.communicator`` among them) and then calls ``abort()``
  (``World.on_abort``), which must wake whatever that does not reach (the socket
  transport's own connections): a call blocked in the transport then ends with an error.
  ``abort`` is called from another thread than the blocked call, and more than once.
- **Release.** ``release()`` ends the generation: close what closes fast and return what
  must die off the critical path (a gloo group: reaper.py), or None. Nothing of a released
  transport is used again; the next generation builds a new one.
- **Kind.** ``kind`` is the transport's registry name; the rank results and the bench
  report it as ``mirror_transport``.
- **Hand-off.** One whose registry entry says ``handoff=True`` also carries a drain's
  one-to-one hand-off (mirror/handoff.py): built with ``purpose="handoff"``, two members, no
  collectives (only ``exchange``), and ``reachable`` answered without blocking.

This module is the interface only: a backend (socket_transport.py, gloo_transport.py)
imports it, and the registry (transport.py) imports the backends, each inside its factory.
A new transport: docs/architecture.md, "(b) Add a mirror transport".
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
