"""One generation's link: how this rank's mirror reaches the others in that generation. It is
built by ``Links.connect(plan)`` once the generation's world has formed, handed to the
recovery steps and to the attachment, and ends with the generation (``abort``, then
``release``: its sockets and its gloo group die on the reaper thread).

    generation g:  world formed ─► connect(plan) ─► link g (transport from the registry,
                   store rounds, rejection board, listener address)
                   failure ─► abort (any thread) ─► retire ─► release ─► reaper
    generation g+1: connect(plan') ─► link g+1 ...

What outlives a generation (the mirror's slots and held copies, the model) is the
attachment's (control/attachment.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

from ..base.plan import Plan
from ..mirror import handoff, meter as meters
from ..mirror.commit import RejectionBoard
from ..mirror.rounds import StoreRounds, barrier
from ..mirror.threads import lower_thread_priority
from ..mirror.transport import TransportContext, checked_name, create_transport
from ..recovery import restore
from ..recovery.abort import communicator_sockets


NO_BUDDY_TRANSPORT = "gloo"  # the registered transport with no buddies (--deadpool-replicas 0)


@dataclass(frozen=True)
class MirrorSettings:
    """How this worker's mirror is built and reached (from ``DeadpoolConfig``)."""

    replicas: int = 1
    create_timeout_s: float = 600.0   # the gloo mirror group's creation (waits for all)
    op_timeout_s: float = 600.0       # each of the mirror's operations (and store rounds)
    transport: str = "socket"         # a name in the transport registry (mirror/transport.py)
    store_host: str = "127.0.0.1"     # a listener is published on the route toward it
    secret: Optional[str] = None      # the socket transport's handshakes, signed addresses
    job_id: int = 0                   # snapshot.job_id(secret): other jobs' copies refused
    fallback_dir: Optional[str] = None
    fallback_every: int = 0
    failure_domains: str = ""         # --deadpool-failure-domains (mirror/placement.py)

    def __post_init__(self):
        checked_name(self.transport)  # ConfigError naming the flag and the registry's names
        from ..mirror import placement

        placement.domains(self.failure_domains)  # a bad spec: ConfigError before the job

    @property
    def transport_name(self) -> str:
        """The registered transport: the chosen one, or with no buddies the gloo group."""
        return self.transport if self.replicas else NO_BUDDY_TRANSPORT


@dataclass(frozen=True)
class Link:
    """How the mirror reaches the other ranks in one generation: the mirror transport, the
    store rounds of its collectives, the rejection board, the generation's store and the
    placement's nodes."""

    nodes: tuple                      # the plan's node of each rank (buddy placement)
    transport: object                 # a registered MirrorTransport
    rounds: StoreRounds
    board: RejectionBoard             # where a holder posts a copy it rejected (mirror/commit.py)
    store: object                     # the generation's default store

    def abort(self) -> None:
        """Wake whatever waits on the transport (a dead peer); any thread may call it."""
        self.transport.abort()

    def release(self):
        """What of it must die on the reaper thread (its sockets, its gloo group)."""
        return self.transport.release()

    @property
    def refused(self) -> int:
        """Connections its listener refused (a failed handshake: an impostor)."""
        return getattr(self.transport, "refused", 0)


class Links:
    """The holder of the current generation's ``Link``, replaced by each recovery; ``abort`` may
    come from any thread (``World.on_abort``: the transport's own sockets are not abort.py's)."""

    def __init__(self, settings: MirrorSettings, meter: meters.NullMeter = meters.NO_METER,
                 records: Optional[Callable[[Plan], Callable[[int], Any]]] = None):
        self.settings, self.meter = settings, meter
        self.records = records  # plan -> where each rank's round records are (World's)
        self.current: Optional[Link] = None
        self._retired: Optional[Link] = None
        self.refused = 0  # mirror connections refused by earlier generations' listeners

    def connect(self, plan: Plan) -> Link:
        """This generation's link. The transport comes from the registry by name; its
        collectives are rounds on the generation's store (mirror/rounds.py: O(K) work per
        rank); a transport that needs a communicator of its own builds it in its factory
        (the gloo transport: a world-wide gloo group), through ``_communicator``."""
        from torch.distributed import distributed_c10d as c10d

        s, store = self.settings, c10d._get_default_store()  # this generation's (world.py)
        rank, world = c10d.get_rank(), c10d.get_world_size()
        at = self.records(plan) if self.records else None  # each node's record store
        rounds = StoreRounds(store, rank, world, s.op_timeout_s, s.secret, plan.gen, at=at)
        transport = create_transport(s.transport_name, TransportContext(
            store, rank, world, rounds, s.store_host, s.secret, plan.gen, s.op_timeout_s,
            create_timeout_s=s.create_timeout_s, communicator=self._communicator, at=at))
        self.current = Link(tuple(plan.node_of_rank), transport, rounds,
                            RejectionBoard(store, s.secret, plan.gen), store)
        return self.current

    def _communicator(self, build: Callable[[], Any]) -> Any:
        """A transport's own communicator, built by its factory (the gloo transport's
        world-wide group, gloo_transport.py) so that the abort shuts its connections down,
        and its I/O threads run at a lower priority and are metered."""
        before = meters.thread_names()
        with communicator_sockets():
            made = build()
        tids = meters.started_threads(before, meters.GLOO_THREAD_NAMES)  # its I/O threads
        for tid in tids:
            lower_thread_priority(tid)
        self.meter.gloo_threads(tids)
        return made

    def abort(self) -> None:
        """Wake whatever waits on the current transport (a dead peer)."""
        if self.current is not None:
            self.current.abort()

    def retire(self) -> None:
        """The generation is over: its link is no longer current (released later)."""
        self._retired, self.current = self.current, None

    def release(self) -> list:
        """What of the retired link must die on the reaper thread."""
        old, self._retired = self._retired, None
        if old is None:
            return []
        self.refused += old.refused
        return [old.release()]

    def summary(self) -> dict:
        """For the rank's results: the transport's kind and the refused connections."""
        link = self.current
        return {"mirror_transport": getattr(link.transport, "kind", None) if link else None,
                # connections that failed the socket transport's handshake (impostors)
                "mirror_refused_peers": self.refused + (link.refused if link else 0)}

    def barrier(self, plan: Plan, prefix: str, timeout_s: float) -> None:
        """Every member of ``plan``'s generation reached the barrier of keys ``prefix``
        (mirror/rounds.py ``barrier``: a round of the store tree on the node record
        stores); the abort or ``timeout_s`` (TransportTimeout) ends a wait for a member
        that never comes."""
        from torch.distributed import distributed_c10d as c10d

        at = self.records(plan) if self.records else None
        barrier(self.current.store, c10d.get_rank(), c10d.get_world_size(), timeout_s,
                self.settings.secret, plan.gen, prefix, at=at)

    def hand_off(self, attachment, gen: int, rank: int, timeout_s: float,
                 iteration: Optional[int] = None):
        """A drain's direct path (mirror/handoff.py) over the current link, for generation
        ``gen`` (the drain's): send the attachment's own slot ``iteration`` (returns the
        sender), or receive it into the attachment's mirror (returns its iteration, or
        None: the restore takes the buddy's copy)."""
        s, link = self.settings, self.current
        args = (link.store, s.store_host, s.secret, gen, rank)
        if iteration is not None:
            return handoff.Sender(attachment.mirror, *args, iteration, timeout_s)
        restore.create_optimizer_state(attachment.optimizer)  # what a slot is checked against
        return handoff.receive(attachment.mirror, *args, timeout_s)
