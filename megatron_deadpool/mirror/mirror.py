"""The per-rank mirror: double-buffered local snapshots taken on its own thread, the copies
it holds for other ranks, the commit, and the local restore. The buddy exchange of each
generation (transport, buddies, receive sizes, rejections; recovery's inventory, transfer
and re-protection) is ``exchange.py``'s ``Exchange``, which ``set_topology`` creates.

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

from typing import Callable, List, Optional, Sequence, Tuple

import torch

from ..base.errors import MirrorError
from . import d2h, flat, snapshot
from .commit import CommitTracker
from .exchange import Exchange, Holdings, Rejections
from .held import HeldCopies, OwnSlots
from .jobs import JobThread, SnapshotJob
from .meter import NO_METER, NullMeter, PhaseClock
from .transport_api import MirrorTransport

TensorsFn = Callable[[], Sequence[Tuple[str, torch.Tensor]]]


class Mirror:
    """``sources``: the live tensors to mirror; ``commits`` (read by whoever reports them)
    and ``rejections`` (its hook, the 'drop' fault) are handed in or made here."""

    def __init__(self, rank: int, replicas: int, meta_capacity: int = 1 << 16,
                 use_cuda: bool = False, flat_state: bool = True, job: int = 0,
                 meter: NullMeter = NO_METER, sources: Optional[TensorsFn] = None,
                 commits: Optional[CommitTracker] = None,
                 rejections: Optional[Rejections] = None, domains=None):
        self.rank = rank
        self.domains = domains  # each node's failure domain (placement.Domains), or None
        self.job = job  # snapshot.job_id(secret): copies of another job are refused
        self.meter = meter  # measurement hooks (meter.py); no-ops unless one is attached
        self.flat_state = flat_state  # re-home the sources into flat buffers (flat.py)
        self.replicas = replicas
        self.meta_capacity = meta_capacity
        self.use_cuda = use_cuda
        self.pin = use_cuda and torch.cuda.is_available()
        self._tensors_fn = sources
        self._tensors: Optional[List[torch.Tensor]] = None
        self._stale = False
        self.commits = commits if commits is not None else CommitTracker()
        self.rejections = rejections if rejections is not None else Rejections()
        self.layout: Optional[snapshot.Layout] = None
        self.own = OwnSlots(rank)  # this rank's double buffer (held.py)
        self.held = HeldCopies(job)  # the copies of the owners this rank is a buddy of
        self.exchange: Optional[Exchange] = None  # the current generation's (set_topology)
        self.fault_hook: Optional[Callable[[int], None]] = None  # after the seal (faults)
        self.on_committed: Optional[Callable[[int], None]] = None  # e.g. fallback saves
        # Only the own slots receive D2H copies: they alone are pinned (buddy copies arrive
        # over the CPU transport). One side stream; the main thread only records an event.
        self.copier = d2h.Copier(torch.cuda.Stream() if self.pin else None)
        self._step_done = torch.cuda.Event() if self.pin else None
        self._runs: Optional[List[d2h.Run]] = None
        self._jobs = JobThread(self._run_job, "deadpool-mirror", self._on_thread_start)
        # what each generation's exchange fills and reads (exchange.py)
        self.holdings = Holdings(rank, self.own, self.held, self.commits, self.rejections,
                                 self._ensure_layout)

    # ------------------------------------------------------------------ wiring
    def set_hooks(self, fault=None, committed=None) -> None:
        """Who hears of the mirror thread's moments, on that thread: ``fault(iteration)``
        after the seal, ``committed(iteration)`` (a rejected copy: ``Rejections.hook``)."""
        self.fault_hook, self.on_committed = fault, committed

    def set_topology(self, transport: MirrorTransport, rank_to_node: Sequence,
                     board=None) -> None:
        """(Re)connect to a generation: its exchange (new transport and buddy placement) and
        rejection board (commit.py). Receive buffers are reallocated lazily at the next
        exchange."""
        self.commits.board = board
        self.exchange = Exchange.placed(self.holdings, transport, rank_to_node, self.replicas,
                                        self.domains)

    def _ensure_layout(self) -> snapshot.Layout:
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
            if self.layout is not None and self.exchange is not None:
                self.exchange.forget_sizes()  # e.g. optimizer state unlike the placeholders
            self.layout = layout
            self.own.allocate(self.layout.total_bytes, self.pin)
        return self.layout

    def refresh_sources(self) -> None:
        """The live tensors may have changed (the optimizer state was created or reset):
        fetch them again before the next copy in or out."""
        self._stale = True

    def memory(self) -> dict:
        """Host bytes of every slot (own and held), and how many of them are pinned."""
        slots = self.own.buffers() + self.held.buffers()
        return {"host_bytes": sum(b.numel() for b in slots),
                "pinned_bytes": sum(b.numel() for b in slots if b.is_pinned())}

    # ------------------------------------------------------------------ steady state
    def begin(self, iteration: int, meta: dict) -> None:
        """Start snapshot ``iteration`` (called right after its optimizer step)."""
        self._ensure_layout()
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
        """The generation's transport is gone (aborted): no exchange until ``set_topology``."""
        self.exchange = None

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
                self.exchange.drop_superseded()
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
        self.exchange.commit(iteration, clock)
        if self.on_committed is not None and self.commits.committed == iteration:
            self.on_committed(iteration)  # e.g. a periodic fallback save (persist.py)

    # ------------------------------------------------------------------ recovery side
    def verify_local(self, iteration: int) -> dict:
        """Verify the local copy of ``iteration`` against the live tensors' layout; its
        metadata. Nothing is loaded (``load_local``)."""
        self.refresh_sources()
        layout = self._ensure_layout()
        return snapshot.verify(self.own.slot(iteration), self.rank, iteration, layout, self.job)

    def load_local(self, iteration: int) -> None:
        """Load the local copy of ``iteration``, verified (``verify_local``), into the live
        tensors."""
        snapshot.copy_tensors_out(self.own.slot(iteration), self.layout, self._tensors)
        self.refresh_sources()

    def close(self) -> None:
        self._jobs.close()
        self.exchange = None
