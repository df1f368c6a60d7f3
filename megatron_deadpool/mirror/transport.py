"""The mirror transport registry: transports are built by name, the way torch elastic
registers its rendezvous backends: ``create_transport(name, TransportContext)``.

Each factory imports its backend inside itself (as ``torch.distributed.elastic.rendezvous.
registry`` does), so a backend imports only the interface (transport_api.py) and never this
registry: no import cycle, and a backend's dependencies load only when it is chosen. A new
transport is one backend module, one ``@register_transport("name")`` factory here and one
entry in the conformance test (tests/test_transport.py), plus its name in ``base/config.py``'s
``MIRROR_TRANSPORTS`` (the flag's choices).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

from ..base.errors import ConfigError, DeadpoolError
from .transport_api import MirrorTransport


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
    purpose: str = "mirror"             # or "handoff": a drain's one-to-one exchange
                                        # (mirror/handoff.py), which needs no collectives


Factory = Callable[[TransportContext], MirrorTransport]
_FACTORIES: Dict[str, Factory] = {}


def register_transport(name: str) -> Callable[[Factory], Factory]:
    def add(factory: Factory) -> Factory:
        if name in _FACTORIES:
            raise ValueError(f"mirror transport {name!r} is registered twice")
        _FACTORIES[name] = factory
        return factory
    return add


def transport_names() -> List[str]:
    return sorted(_FACTORIES)


def create_transport(name: str, ctx: TransportContext) -> MirrorTransport:
    factory = _FACTORIES.get(name)
    if factory is None:
        raise ConfigError(f"unknown mirror transport {name!r}; registered: "
                          f"{', '.join(sorted(_FACTORIES))}")
    return factory(ctx)


@register_transport("gloo")
def _gloo(ctx: TransportContext) -> MirrorTransport:
    from .gloo_transport import GlooTransport

    if not isinstance(ctx.collectives, GlooTransport):
        raise ConfigError("the gloo mirror transport needs the mirror's gloo group")
    return ctx.collectives


@register_transport("socket")
def _socket(ctx: TransportContext) -> MirrorTransport:
    from .socket_transport import SocketTransport, local_address

    if ctx.secret is None or (ctx.collectives is None and ctx.purpose != "handoff"):
        raise DeadpoolError("the socket mirror transport needs the job secret and collectives")
    return SocketTransport(ctx.store, ctx.rank, ctx.world_size, ctx.collectives, local_address(
        ctx.store_host), ctx.secret, ctx.gen, timeout_s=ctx.timeout_s, purpose=ctx.purpose)
