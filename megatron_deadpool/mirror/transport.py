"""The mirror transport registry, the one list of transports: each is built by name, the way
torch elastic registers its rendezvous backends: ``create_transport(name, TransportContext)``.

Each factory imports its backend inside itself (as ``torch.distributed.elastic.rendezvous.
registry`` does), so a backend imports only the interface (transport_api.py) and never this
registry: no import cycle, and a backend's dependencies load only when it is chosen (this
module itself loads no torch: the flags read it). An entry says everything a caller asks of
a transport, so no caller names a backend:

    @register_transport("name", "its line in the flag's help", handoff=True|False)
    def _name(ctx: TransportContext) -> MirrorTransport: ...   # builds what it needs

- ``--deadpool-mirror-transport`` offers every entry: its choices are the names and its help
  the entries' lines (``add_transport_arg``, in the flags: megatron_deadpool/flags.py);
- the factory builds the collectives and communicators it needs from the context (the gloo
  entry its gloo group, through ``ctx.communicator``);
- ``handoff``: the entry serves a drain's one-to-one hand-off (``purpose="handoff"``, no
  collectives; mirror/handoff.py asks ``handoff_transport()``).

A new transport is one backend module and one entry here, plus its ``CONFORMANCE`` entry in
tests/test_transport.py (a test fails if a registered transport is missing there).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple, TypeVar

from ..base.errors import ConfigError, DeadpoolError

if TYPE_CHECKING:  # the interface loads torch: only the backends import it at run time
    from .transport_api import MirrorTransport

FLAG = "--deadpool-mirror-transport"
_Made = TypeVar("_Made")


def _as_is(build: Callable[[], _Made]) -> _Made:
    """A communicator built as it is (no runtime around it: tests, benchmarks)."""
    return build()


@dataclass(frozen=True)
class TransportContext:
    """What one generation offers a transport."""

    store: Any                          # this generation's c10d store
    rank: int
    world_size: int
    collectives: Any                    # all_ok / gather_from / all_gather_*: the store's
                                        # signed rounds (rounds.py); None: the backend's own
                                        # (the gloo group's: tests, benchmarks)
    store_host: str = "127.0.0.1"       # the store's host: a listener is published on the
                                        # route toward it (the factory resolves its address)
    secret: Optional[str] = None        # the job's (handshakes, signed addresses)
    gen: int = 0
    timeout_s: float = 600.0            # each operation's deadline
    purpose: str = "mirror"             # or "handoff": a drain's one-to-one exchange
                                        # (mirror/handoff.py), which needs no collectives
    create_timeout_s: Optional[float] = None  # a communicator's creation (waits for every
                                              # member); None: ``timeout_s``
    # builds a communicator of the transport's own (``communicator(lambda: group)``) as the
    # generation's abort expects it: control/link.py records its sockets for the abort and
    # lowers its I/O threads' priority; as it is without a runtime (tests)
    communicator: Callable[[Callable[[], Any]], Any] = _as_is
    # rank -> the record store of its node (recovery/world.py ``record_stores``): a rank's
    # listener address is published there, not on the job's one store; None: ``store``
    at: Optional[Callable[[int], Any]] = None


Factory = Callable[[TransportContext], "MirrorTransport"]


@dataclass(frozen=True)
class Entry:
    """One registered transport."""

    name: str
    help: str                           # its line in ``--deadpool-mirror-transport``'s help
    factory: Factory
    handoff: bool = False               # serves a drain's hand-off (``purpose="handoff"``)


_ENTRIES: Dict[str, Entry] = {}  # in registration order: the flag's choices and help


def register_transport(name: str, help: str, handoff: bool = False
                       ) -> Callable[[Factory], Factory]:
    def add(factory: Factory) -> Factory:
        if name in _ENTRIES:
            raise ValueError(f"mirror transport {name!r} is registered twice")
        _ENTRIES[name] = Entry(name, help, factory, handoff)
        return factory
    return add


def transport_names() -> List[str]:
    return sorted(_ENTRIES)


def choices() -> Tuple[str, ...]:
    """The flag's choices, in registration order."""
    return tuple(_ENTRIES)


def checked_name(name: object) -> str:
    """``name`` if it is a registered transport; ConfigError naming the flag and the choices
    otherwise."""
    if name not in _ENTRIES:
        raise ConfigError(f"{FLAG} must be one of {choices()}, got {name!r}")
    return str(name)


def handoff_transport() -> str:
    """The transport that carries a drain's hand-off (the first entry that serves it)."""
    return next(e.name for e in _ENTRIES.values() if e.handoff)


def add_transport_arg(group, default: str) -> None:
    """``--deadpool-mirror-transport`` on an argparse group: every entry is a choice, and
    its help is the entries' lines."""
    lines = [f"'{e.name}', {e.help}" for e in _ENTRIES.values()]
    listed = lines[0] if len(lines) == 1 else f"{', '.join(lines[:-1])}, or {lines[-1]}"
    group.add_argument(FLAG, choices=choices(), default=default,
                       help=f"how snapshots reach the buddies: {listed} (default %(default)s)")


def create_transport(name: str, ctx: TransportContext) -> "MirrorTransport":
    entry = _ENTRIES.get(name)
    if entry is None:
        raise ConfigError(f"unknown mirror transport {name!r}; registered: "
                          f"{', '.join(sorted(_ENTRIES))}")
    return entry.factory(ctx)


@register_transport("socket", "a TCP connection per (rank, buddy) pair", handoff=True)
def _socket(ctx: TransportContext) -> "MirrorTransport":
    from .socket_transport import SocketTransport, local_address

    if ctx.secret is None or (ctx.collectives is None and ctx.purpose != "handoff"):
        raise DeadpoolError("the socket mirror transport needs the job secret and collectives")
    return SocketTransport(ctx.store, ctx.rank, ctx.world_size, ctx.collectives, local_address(
        ctx.store_host), ctx.secret, ctx.gen, timeout_s=ctx.timeout_s, purpose=ctx.purpose,
        at=ctx.at)


@register_transport("gloo", "send/recv on the mirror's gloo group (the collectives are "
                    "the generation's signed store rounds with either)")
def _gloo(ctx: TransportContext) -> "MirrorTransport":
    from .gloo_transport import GlooTransport

    return ctx.communicator(lambda: GlooTransport(
        timeout_s=ctx.timeout_s, create_timeout_s=ctx.create_timeout_s, secret=ctx.secret,
        gen=ctx.gen, rounds=ctx.collectives))
