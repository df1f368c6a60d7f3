"""One generation's buddy exchange: its transport, this rank's buddies and the owners whose
copies it holds (placement.py), their receive sizes, and what it does over them:

    steady state:  send the sealed slot to the buddies, receive the owners' copies, check
                   each header (a failed one is a rejection), commit (commit.py)
    recovery:      the inventory for the restore decision, the transfer of missing copies,
                   the world's vote (all_ok), the re-protection of the restored iteration

``Mirror.set_topology`` creates one per generation (``disconnect`` drops it). What outlives a
generation is the mirror's and handed in as ``Holdings``: the own slots and held copies
(held.py) it fills and reads, the commit tracker, and ``Rejections`` (the count, the 'drop'
test fault and the hook that hears each rejection, for the job's whole life).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence

from ..base.errors import MirrorCorruptError, MirrorError
from . import placement, snapshot
from .commit import CommitTracker
from .held import HeldCopies, OwnSlots
from .meter import NO_CLOCK, PhaseClock
from .transport_api import MirrorTransport

# (holder, owner, iteration, why), on the mirror thread: recovery/alarms.py
RejectionHook = Callable[[int, int, int, str], None]


class Rejections:
    """The copies this rank refused, for the job's whole life (each generation's exchange
    reports here): counted, posted for the implicit commit (commit.py), heard by ``hook``."""

    def __init__(self, hook: Optional[RejectionHook] = None):
        self.count = 0  # copies this rank received that failed their check
        self.hook = hook
        self.discard_from: Optional[int] = None  # the 'drop' test fault: see drop_arrivals

    def drop_arrivals(self, iteration: int) -> None:
        """The 'drop' test fault (base/faults.py): reject every copy of ``iteration`` and later."""
        self.discard_from = iteration

    def discards(self, iteration: int) -> bool:
        return self.discard_from is not None and iteration >= self.discard_from

    def reject(self, holder: int, owner: int, iteration: int, why: str,
               post: Callable[[int], None]) -> None:
        """A received copy failed its check: counted, ``post``-ed (before this job ends:
        commit.py) and reported."""
        self.count += 1
        post(iteration)
        if self.hook is not None:
            self.hook(holder, owner, iteration, why)


@dataclass(frozen=True)
class Holdings:
    """A rank's snapshots in host memory: its own (``OwnSlots``) and those it holds for its
    buddies (``HeldCopies``). What a rank's exchanges fill and read, owned by its ``Mirror``
    for the job's life. ``ensure_layout``: the mirror's (a spare's own slots exist only once it
    has run)."""

    rank: int
    own: OwnSlots
    held: HeldCopies
    commits: CommitTracker
    rejections: Rejections
    ensure_layout: Callable[[], snapshot.Layout]


class Exchange:
    def __init__(self, holdings: Holdings, transport: MirrorTransport, buddies: Sequence[int],
                 holds: Sequence[int], replicas: int):
        self._h = holdings
        self.rank = holdings.rank
        self.transport = transport
        self.replicas = replicas  # 0: the local double-buffered snapshot only, no transport call
        self.buddies: List[int] = list(buddies)
        self.holds: List[int] = list(holds)  # owners whose copies this rank holds
        self._sizes: Optional[Dict[int, int]] = None  # held owners' slot sizes (allocated lazily)

    @classmethod
    def placed(cls, holdings: Holdings, transport: MirrorTransport, rank_to_node: Sequence,
               replicas: int, domains=None) -> "Exchange":
        """The exchange of a generation whose ranks are on ``rank_to_node`` (placement.py;
        ``domains``: each node's failure domain, or None)."""
        if replicas == 0:
            return cls(holdings, transport, [], [], replicas)
        b = placement.buddies(rank_to_node, replicas, domains)
        return cls(holdings, transport, b[holdings.rank],
                   placement.holders_of(b)[holdings.rank], replicas)

    def forget_sizes(self) -> None:
        """The layout changed: the receive slots are sized again at the next exchange."""
        self._sizes = None

    # ------------------------------------------------------------------ steady state
    def commit(self, iteration: int, clock: PhaseClock = NO_CLOCK) -> None:
        """Snapshot job ``iteration``'s exchange and commit (implicitly later, or with the
        collective: commit.py)."""
        self._exchange_and_commit(iteration, clock=clock)

    def _alloc_recv(self) -> None:
        if self._sizes is None:
            own = self._h.own.buffers()[0]  # the layout's slot size
            self._sizes = self.transport.gather_from(own.numel(), self.holds)
            self._h.held.allocate(self.holds, self._sizes)

    def _exchange_and_commit(self, iteration: int, skip=frozenset(),
                             collective: bool = False, clock: PhaseClock = NO_CLOCK) -> None:
        """Send this rank's slot to its buddies, receive its owners' slots, verify, commit
        (implicitly later unless ``collective``: commit.py). ``skip``: (owner, holder) pairs
        whose copy of ``iteration`` is already in place. Without replicas the local copy
        alone commits (no transport call)."""
        commits = self._h.commits
        if self.replicas == 0:
            commits.reset(iteration)
            return
        ok = self._swap(iteration, skip, clock)
        if commits.implicit and not collective:
            commits.verified(iteration, ok)
        elif commits.collective(iteration, self.transport.all_ok(ok)):
            self.drop_superseded()

    def _swap(self, iteration: int, skip, clock: PhaseClock) -> bool:
        """The transport's exchange of ``iteration``; True if every copy received verified."""
        self._alloc_recv()
        held = self._h.held
        owners = [o for o in self.holds if (o, self.rank) not in skip]
        recvs = [(o, held.receiving(o, iteration)) for o in owners]
        mine = self._h.own.sealed(iteration)
        self.transport.exchange([(b, mine) for b in self.buddies if (self.rank, b) not in skip],
                                recvs)
        clock.lap("exchange")
        ok = True
        for o, buf in recvs:  # the header here; the checksum once needed (held.py)
            try:
                if self._h.rejections.discards(iteration):
                    buf[:8].zero_()  # as if it never arrived: no magic
                snapshot.verify(buf, o, iteration, job=held.job, load_meta=False,
                                checksum=False)
                held.accept(o, iteration)
            except MirrorCorruptError as exc:
                ok = False
                self._h.rejections.reject(self.rank, o, iteration, str(exc),
                                          self._h.commits.rejected)
        clock.lap("verify")
        return ok

    def drop_superseded(self) -> None:
        """The copies of owners this generation's placement no longer gives this rank."""
        self._h.held.drop_owners_not_in(self.holds)

    # ------------------------------------------------------------------ recovery side
    def inventory(self) -> dict:
        """What this rank holds, for the restore decision (recovery/restore.py): only
        copies whose checksum holds."""
        h = self._h
        return {"own": h.own.iterations(), "committed": h.commits.committed,
                "copies": h.held.inventory()}

    def transfer_for_restore(self, iteration: int, serve: Sequence[int],
                             receive_from: Optional[int]) -> None:
        """Holders send their copy of ``iteration`` of each owner in ``serve`` (to the rank of
        the same id); a rank without its own copy receives it from ``receive_from`` into its
        own slot."""
        h = self._h
        sends = [(o, snapshot.sealed(h.held.slot(o, iteration))) for o in serve]
        recvs = []
        if receive_from is not None:
            h.ensure_layout()
            recvs = [(receive_from, h.own.slot(iteration))]
        self.transport.exchange(sends, recvs)
        if receive_from is not None:
            h.own.hold(iteration)  # verified by Mirror.verify_local

    def all_ok(self, ok: bool) -> bool:
        """The world's AND of ``ok`` (the transport's collective)."""
        return self.transport.all_ok(ok)

    def reprotect(self, iteration: int, skip=frozenset()) -> None:
        """Once ``iteration`` is restored: everything newer is dropped (its copies stay valid:
        a failure during re-protection can restore it again); send it to the (possibly new)
        buddies that do not hold it yet, and commit it."""
        h = self._h
        h.own.keep_only(iteration)
        h.held.drop_newer_than(iteration)
        h.commits.reset(iteration)
        self._exchange_and_commit(iteration, skip, collective=True)
        if h.commits.committed != iteration:
            raise MirrorError(f"re-protection of iteration {iteration} did not commit")
