"""Mirror transport: one small interface for moving snapshot bytes between ranks.

Every implementation passes the same conformance test (tests/test_transport.py).

    exchange(sends=[(dst, buf)], recvs=[(src, buf)])   point-to-point, all at once, blocking
    all_ok(flag) -> bool                               True iff every member passed True
    all_gather_int(v) -> [v of rank 0, 1, ...]         (slot sizes)
    all_gather_json(obj) -> [obj of rank 0, 1, ...]
    gather_from(v, ranks) -> {rank: v of rank}         (a holder's owners' slot sizes)

The collectives go to the generation's store as rounds (rounds.py: O(K) work per rank for
what the mirror asks), or, for the gloo transport, to its world-wide gloo group.

Transports are built by name through a registry, the way torch elastic registers its
rendezvous backends: ``create_transport(name, TransportContext)``. A new transport is one
class, one ``@register_transport("name")`` factory and one entry in the conformance test
(and its name in ``base/config.py``'s ``MIRROR_TRANSPORTS``, the flag's choices).

Buffers are uint8 CPU tensors; receive buffers are preallocated by the caller, at least as
large as what the sender sends, which fills their prefix (the rest is left as it was: a
snapshot slot says in its header how much of it counts). Every call takes an optional
``timeout_s``.
"""

from __future__ import annotations

import abc
import json
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ..base import counts
from ..base.errors import ConfigError, TransportTimeout


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
    kind: str  # reported by the bench ("mirror_transport")

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

    # Lifecycle. The generation's abort (recovery/abort.py) shuts down the connections of
    # the communicators (the gloo group's among them) and then calls ``abort`` (World.on_abort),
    # which wakes whatever that does not reach (the socket transport's own connections).
    def abort(self) -> None:
        """Make a call blocked in this transport end now, with an error (any thread)."""

    def release(self):
        """The generation is over: close what closes fast, and return what must die off the
        critical path (a gloo group: reaper.py), or None."""
        return self


class GlooTransport(MirrorTransport):
    """A dedicated gloo group over CPU tensors, so mirror traffic never queues behind
    training collectives (and works next to NCCL). It runs the mirror's collectives, and
    its exchange with ``--deadpool-mirror-transport gloo`` (socket_transport.py: the
    default exchange)."""

    kind = "gloo"

    def __init__(self, timeout_s: float = 600.0, group=None,
                 create_timeout_s: Optional[float] = None):
        """``timeout_s``: each operation's deadline (config.gloo_op_timeout_s: gloo leaves a
        send queued on a failed connection waiting until it); ``create_timeout_s``: the
        group's creation, which waits for every member (a promoted spare builds its model
        first), default ``timeout_s``."""
        import torch.distributed as dist
        from torch.distributed import distributed_c10d as c10d

        self._dist = dist
        self.timeout_s = timeout_s
        if group is None:
            group = dist.new_group(backend="gloo",
                                   timeout=timedelta(seconds=create_timeout_s or timeout_s))
            c10d._set_pg_timeout(timedelta(seconds=timeout_s), group)
        self.group = group
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()

    def _wait(self, works, timeout_s: Optional[float], what: str) -> None:
        limit = timedelta(seconds=self.timeout_s if timeout_s is None else timeout_s)
        for w in works:
            try:
                w.wait(limit)
            except RuntimeError as exc:
                if "Timed out" in str(exc) or "timed out" in str(exc):
                    raise TransportTimeout(f"mirror {what}: no answer in "
                                           f"{limit.total_seconds():g}s") from exc
                raise

    def exchange(self, sends, recvs, timeout_s=None) -> None:
        dist = self._dist
        count_messages(sends, recvs)
        works = [dist.irecv(buf, src=src, group=self.group) for src, buf in recvs]
        works += [dist.isend(buf, dst=dst, group=self.group) for dst, buf in sends]
        self._wait(works, timeout_s, "exchange")

    def all_ok(self, ok: bool, timeout_s=None) -> bool:
        t = torch.tensor([1 if ok else 0], dtype=torch.int64)
        count_collective(8)
        self._wait([self._dist.all_reduce(t, op=self._dist.ReduceOp.MIN, group=self.group,
                                          async_op=True)], timeout_s, "commit")
        return bool(t.item())

    def all_gather_int(self, value: int, timeout_s=None) -> List[int]:
        out = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
        count_collective(8 * self.world_size)  # what arrives: one value per rank
        self._wait([self._dist.all_gather(out, torch.tensor([int(value)], dtype=torch.int64),
                                          group=self.group, async_op=True)],
                   timeout_s, "all_gather")
        return [int(t.item()) for t in out]

    def all_gather_json(self, obj, timeout_s=None) -> List:
        data = json.dumps(obj).encode()
        sizes = self.all_gather_int(len(data), timeout_s)
        n = max(sizes)
        mine = torch.zeros(n, dtype=torch.uint8)
        mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        out = [torch.empty(n, dtype=torch.uint8) for _ in range(self.world_size)]
        count_collective(n * self.world_size)
        self._wait([self._dist.all_gather(out, mine, group=self.group, async_op=True)],
                   timeout_s, "all_gather")
        return [json.loads(bytes(t[:k].tolist())) for t, k in zip(out, sizes)]


@dataclass(frozen=True)
class TransportContext:
    """What one generation offers a transport."""

    store: Any                          # this generation's c10d store
    rank: int
    world_size: int
    collectives: Any                    # all_ok / gather_from / all_gather_*: the store's
                                        # rounds (rounds.py) or a gloo group (GlooTransport)
    store_host: str = "127.0.0.1"       # the store's host: a listener is published on the
                                        # route toward it (the factory resolves its address)
    secret: Optional[str] = None        # the job's (handshakes, signed addresses)
    gen: int = 0
    timeout_s: float = 600.0            # each operation's deadline


Factory = Callable[[TransportContext], MirrorTransport]
_FACTORIES: Dict[str, Factory] = {}


def register_transport(name: str) -> Callable[[Factory], Factory]:
    def add(factory: Factory) -> Factory:
        if name in _FACTORIES:
            raise ValueError(f"mirror transport {name!r} is registered twice")
        _FACTORIES[name] = factory
        return factory
    return add


def _load_builtin() -> None:
    from . import socket_transport  # noqa: F401 - registers "socket"


def transport_names() -> List[str]:
    _load_builtin()
    return sorted(_FACTORIES)


def create_transport(name: str, ctx: TransportContext) -> MirrorTransport:
    _load_builtin()
    factory = _FACTORIES.get(name)
    if factory is None:
        raise ConfigError(f"unknown mirror transport {name!r}; registered: "
                          f"{', '.join(sorted(_FACTORIES))}")
    return factory(ctx)


@register_transport("gloo")
def _gloo(ctx: TransportContext) -> MirrorTransport:
    if not isinstance(ctx.collectives, GlooTransport):
        raise ConfigError("the gloo mirror transport needs the mirror's gloo group")
    return ctx.collectives
