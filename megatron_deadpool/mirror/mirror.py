"""The per-rank mirror: double-buffered local snapshots, buddy copies, commit tracking and
the restore paths.

Steady state, per iteration k (the only sync point is right before step k+1)::

    main:   fwd/bwd(k) | wait(job k-1) | optimizer.step(k) | begin(k) | fwd/bwd(k+1) ...
    mirror:                                                 copy k -> seal -> send to buddies
                                                            -> verify received -> all_ok
                                                            -> committed = k
    (implicit commit, commit.py: no all_ok; k commits when job k+1 begins)

Slot parity is ``iteration % 2``: the copy of k-1 (committed) stays intact while k is in
flight, and job k must be done before step k+1 may overwrite the state it reads.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ..base.errors import MirrorCorruptError, MirrorError
from . import d2h, flat, placement, snapshot
from .commit import CommitTracker
from .held import HeldCopies, OwnSlots
from .jobs import JobThread, SnapshotJob
from .meter import NO_CLOCK, NO_METER, NullMeter, PhaseClock
from .transport_api import MirrorTransport

TensorsFn = Callable[[], Sequence[Tuple[str, torch.Tensor]]]


class Mirror:
    def __init__(self, rank: int, replicas: int, meta_capacity: int = 1 << 16,
                 use_cuda: bool = False, flat_state: bool = True, job: int = 0,
                 meter: NullMeter = NO_METER):
        self.rank = rank
        self.job = job  # snapshot.job_id(secret): copies of another job are refused
        self.meter = meter  # measurement hooks (meter.py); no-ops unless one is attached
        self.flat_state = flat_state  # re-home the sources into flat buffers (flat.py)
        self.replicas = replicas
        self.meta_capacity = meta_capacity
        self.use_cuda = use_cuda
        self.pin = use_cuda and torch.cuda.is_available()
        self.transport: Optional[MirrorTransport] = None
        self.buddies: List[int] = []
        self.holds: List[int] = []  # owners whose copies this rank holds
        self._tensors_fn: Optional[TensorsFn] = None
        self._tensors: Optional[List[torch.Tensor]] = None
        self._stale = False
        self.commits = CommitTracker()
        self.rejected_copies = 0  # copies this rank received that failed their check
        self.discard_from: Optional[int] = None  # the 'drop' test fault: see drop_arrivals
        self.layout: Optional[snapshot.Layout] = None
        self.own = OwnSlots(rank)  # this rank's double buffer (held.py)
        self.held = HeldCopies(job)  # the copies of the owners this rank is a buddy of
        self._sizes: Optional[Dict[int, int]] = None  # held owners' slot sizes (a generation)
        self.fault_hook: Optional[Callable[[int], None]] = None  # after the seal (faults)
        self.on_committed: Optional[Callable[[int], None]] = None  # e.g. fallback saves
        # (holder, owner, iteration, why), on the mirror thread: recovery/alarms.py
        self.on_copy_rejected: Optional[Callable[[int, int, int, str], None]] = None
        # Only the own slots receive D2H copies: they alone are pinned (buddy copies arrive
        # over the CPU transport). One side stream; the main thread only records an event.
        self.copier = d2h.Copier(torch.cuda.Stream() if self.pin else None)
        self._step_done = torch.cuda.Event() if self.pin else None
        self._runs: Optional[List[d2h.Run]] = None
        self._jobs = JobThread(self._run_job, "deadpool-mirror", self._on_thread_start)

    # ------------------------------------------------------------------ wiring
    def set_sources(self, tensors_fn: TensorsFn) -> None:
        self._tensors_fn = tensors_fn

    def set_hooks(self, fault=None, committed=None, copy_rejected=None) -> None:
        """Who hears of the mirror thread's moments, on that thread: ``fault(iteration)``
        after the seal, ``committed(iteration)``, ``copy_rejected(holder, owner, it, why)``."""
        self.fault_hook, self.on_committed, self.on_copy_rejected = fault, committed, copy_rejected

    def set_topology(self, transport: MirrorTransport, rank_to_node: Sequence,
                     board=None) -> None:
        """(Re)connect to a generation: new transport, buddy placement and rejection board
        (commit.py). Receive buffers are reallocated lazily at the next exchange."""
        self.transport = transport
        self.commits.board = board
        self._sizes = None
        if self.replicas == 0:  # the local double-buffered snapshot only
            self.buddies, self.holds = [], []
            return
        b = placement.buddies(rank_to_node, self.replicas)
        self.buddies = b[self.rank]
        self.holds = placement.holders_of(b)[self.rank]

    def ensure_layout(self) -> snapshot.Layout:
        # The metadata capacity is fixed (not measured) so that a promoted spare computes
        # the same slot size as the rank it replaces.
        if self.layout is None or self._stale:
            named = list(self._tensors_fn())
            self._tensors = [t for _, t in named]
            if self.flat_state:
                flat.consolidate(self._tensors)
            self._runs = None
            self._stale = False
            layout = snapshot.Layout(named, self.meta_capacity)
            if self.layout is not None and layout.layout_id == self.layout.layout_id:
                return self.layout
            if self.layout is not None:  # e.g. an optimizer whose state differs from placeholders
                self._sizes = None
            self.layout = layout
            self.own.allocate(self.layout.total_bytes, self.pin)
        return self.layout

    def refresh_sources(self) -> None:
        """The live tensors may have changed (the optimizer state was created or reset):
        fetch them again before the next copy in or out."""
        self._stale = True

    @property
    def committed(self) -> int:
        return self.commits.committed

    @property
    def failed_commits(self) -> int:
        return self.commits.failed

    @property
    def implicit_commit(self) -> bool:
        return self.commits.implicit

    @implicit_commit.setter
    def implicit_commit(self, implicit: bool) -> None:
        self.commits.implicit = implicit

    def memory(self) -> dict:
        """Host bytes of every slot (own and held), and how many of them are pinned."""
        slots = self.own.buffers() + self.held.buffers()
        return {"host_bytes": sum(b.numel() for b in slots),
                "pinned_bytes": sum(b.numel() for b in slots if b.is_pinned())}

    # ------------------------------------------------------------------ steady state
    def begin(self, iteration: int, meta: dict) -> None:
        """Start snapshot ``iteration`` (called right after its optimizer step)."""
        self.ensure_layout()
        if self._runs is None:
            self._runs = d2h.plan(self.layout, self._tensors)
        self.own.rewrite(iteration)  # its slot holds nothing until the job seals it
        if self._step_done is not None:
            # Reused: the job of the previous record is done (wait() before every step).
            self._step_done.record()
        self.meter.snapshot_began()
        self._jobs.submit(SnapshotJob(iteration, meta, self._step_done))

    def wait(self) -> None:
        """Block until the in-flight job is done (before the next step mutates the state).
        Raises MirrorError if it failed."""
        waited = self._jobs.wait()
        if waited is not None:
            self.meter.waited(waited)
        err = self._jobs.take_error()
        if err is not None:
            raise MirrorError(f"mirror job failed: {type(err).__name__}: {err}") from err

    def quiesce(self, timeout_s: float) -> bool:
        """Wait for the mirror thread to go idle (during recovery, after the abort)."""
        return self._jobs.quiesce(timeout_s)

    def disconnect(self) -> None:
        """The generation's transport is gone (aborted): none until ``set_topology``."""
        self.transport = None

    def run_on_thread(self, fn: Callable[[], object]):
        """``fn()`` on the mirror thread once it is idle (measurements under the thread's
        own priority); its result. Not a snapshot job: not measured."""
        self.wait()
        call = self._jobs.call(fn)
        if "result" not in call.box:
            self.wait()  # raises the call's error
        return call.box.get("result")

    def _on_thread_start(self) -> None:
        if self.copier.stream is not None:
            torch.cuda.set_device(self.copier.stream.device)

    def _run_job(self, job: SnapshotJob) -> None:
        with self.meter.job(job.iteration) as clock:
            self._snapshot_job(job, clock)

    def _snapshot_job(self, job: SnapshotJob, clock: PhaseClock) -> None:
        iteration = job.iteration
        if self.commits.implicit:  # step ``iteration`` has returned: see commit.py
            done = self.commits.settle(iteration)
            if done is not None:
                self._drop_superseded()
                if self.on_committed is not None:
                    self.on_committed(done)
        slot = self.own.slot(iteration)
        self.copier.copy(slot, self._runs, job.step_done)
        clock.lap("copy")
        snapshot.seal(slot, self.layout, self.rank, iteration, job.meta, self.job)
        clock.lap("seal")
        self.own.hold(iteration)
        if self.fault_hook is not None:
            self.fault_hook(iteration)
        self._exchange_and_commit(iteration, clock=clock)
        if self.on_committed is not None and self.committed == iteration:
            self.on_committed(iteration)  # e.g. a periodic fallback save (persist.py)

    def _alloc_recv(self) -> None:
        if self._sizes is None:
            self._sizes = self.transport.gather_from(self.layout.total_bytes, self.holds)
            self.held.allocate(self.holds, self._sizes)

    def _exchange_and_commit(self, iteration: int, skip=frozenset(),
                             collective: bool = False, clock: Optional[PhaseClock] = None) -> None:
        """Send this rank's slot to its buddies, receive its owners' slots, verify, commit
        (implicitly later unless ``collective``: commit.py). ``skip``: (owner, holder) pairs
        whose copy of ``iteration`` is already in place. Without replicas the local copy
        alone commits (no transport call)."""
        if self.replicas == 0:
            self.commits.reset(iteration)
            return
        self._alloc_recv()
        owners = [o for o in self.holds if (o, self.rank) not in skip]
        recvs = [(o, self.held.receiving(o, iteration)) for o in owners]
        mine = self.own.sealed(iteration)
        self.transport.exchange([(b, mine) for b in self.buddies if (self.rank, b) not in skip],
                                recvs)
        clock = clock or NO_CLOCK  # recovery's exchanges are not snapshot jobs
        clock.lap("exchange")
        ok = True
        for o, buf in recvs:  # the header here; the checksum once needed (held.py)
            try:
                if self.discard_from is not None and iteration >= self.discard_from:
                    buf[:8].zero_()  # as if it never arrived: no magic
                snapshot.verify(buf, o, iteration, job=self.job, load_meta=False,
                                checksum=False)
                self.held.accept(o, iteration)
            except MirrorCorruptError as exc:
                ok = False
                self._rejected(o, iteration, str(exc))
        clock.lap("verify")
        if self.commits.implicit and not collective:
            self.commits.verified(iteration, ok)
        elif self.commits.collective(iteration, self.transport.all_ok(ok)):
            self._drop_superseded()

    def _rejected(self, owner: int, iteration: int, why: str) -> None:
        """A received copy failed its check: counted, reported, and posted for the implicit
        commit before this job ends (commit.py)."""
        self.rejected_copies += 1
        self.commits.rejected(iteration)
        if self.on_copy_rejected is not None:
            self.on_copy_rejected(self.rank, owner, iteration, why)

    def drop_arrivals(self, iteration: int) -> None:
        """The 'drop' test fault (base/faults.py): reject every copy of ``iteration`` and later."""
        self.discard_from = iteration

    def _drop_superseded(self) -> None:
        self.held.drop_owners_not_in(self.holds)

    # ------------------------------------------------------------------ recovery side
    def held_slots(self) -> List[Tuple[int, int, torch.Tensor]]:
        """``(owner, iteration, slot)`` of every slot this rank holds, its own first."""
        return self.own.copies() + self.held.copies()

    def restore_local(self, iteration: int) -> dict:
        """Verify the local copy of ``iteration`` and load it into the live tensors."""
        meta = self.verify_local(iteration)
        self.load_local(iteration)
        return meta

    def verify_local(self, iteration: int) -> dict:
        """Verify the local copy of ``iteration`` against the live tensors' layout; its
        metadata. Nothing is loaded (``load_local``)."""
        self.refresh_sources()
        layout = self.ensure_layout()
        return snapshot.verify(self.own.slot(iteration), self.rank, iteration, layout, self.job)

    def load_local(self, iteration: int) -> None:
        """Load the local copy of ``iteration``, verified (``verify_local``), into the live
        tensors."""
        snapshot.copy_tensors_out(self.own.slot(iteration), self.layout, self._tensors)
        self.refresh_sources()

    def inventory(self) -> dict:
        """What this rank holds, for the restore decision (recovery/restore.py): only
        copies whose checksum holds."""
        return {"own": self.own.iterations(), "committed": self.committed,
                "copies": self.held.inventory()}

    def transfer_for_restore(self, iteration: int, serve: Sequence[int],
                             receive_from: Optional[int]) -> None:
        """Holders send their copy of ``iteration`` of each owner in ``serve`` (to the rank of
        the same id); a rank without its own copy receives it from ``receive_from`` into its
        own slot."""
        sends = [(o, snapshot.sealed(self.held.slot(o, iteration))) for o in serve]
        recvs = []
        if receive_from is not None:
            self.ensure_layout()
            recvs = [(receive_from, self.own.slot(iteration))]
        self.transport.exchange(sends, recvs)
        if receive_from is not None:
            self.own.hold(iteration)  # verified by verify_local

    def reprotect(self, iteration: int, skip=frozenset()) -> None:
        """Once ``iteration`` is restored: everything newer is dropped (its copies stay valid:
        a failure during re-protection can restore it again); send it to the (possibly new)
        buddies that do not hold it yet, and commit it."""
        self.own.keep_only(iteration)
        self.held.drop_newer_than(iteration)
        self.commits.reset(iteration)
        self._exchange_and_commit(iteration, skip, collective=True)
        if self.committed != iteration:
            raise MirrorError(f"re-protection of iteration {iteration} did not commit")

    def close(self) -> None:
        self._jobs.close()
        self.transport = None
