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

import queue
import threading
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ..errors import MirrorCorruptError, MirrorError
from . import d2h, flat, placement, snapshot
from .commit import CommitTracker
from .cpu import NO_CLOCK, PhaseClock
from .held import HeldCopies
from .threads import lower_thread_priority
from .transport import MirrorTransport

TensorsFn = Callable[[], Sequence[Tuple[str, torch.Tensor]]]
PHASES = ("copy", "seal", "exchange", "verify")  # a snapshot job's parts (phase_cpu)


class Mirror(HeldCopies):
    def __init__(self, rank: int, replicas: int, meta_capacity: int = 1 << 16,
                 use_cuda: bool = False, flat_state: bool = True):
        self.rank = rank
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
        self.own: List[torch.Tensor] = []
        self.own_iter = [-1, -1]
        self.recv: Dict[int, List[torch.Tensor]] = {}
        self.recv_iter: Dict[int, List[int]] = {}
        self.crc_checked: set = set()  # (owner, slot index) whose checksum held (held.py)
        self.last_done: Optional[Tuple[int, float]] = None  # (iteration, perf_counter)
        self.waits = 0
        self.wait_s = 0.0
        self.jobs = 0
        self.job_s = 0.0
        self.job_cpu_s = 0.0  # the mirror thread's CPU clock over its snapshot jobs
        self.phase_cpu = dict.fromkeys(PHASES, 0.0)  # the same, per part of the job
        self.tid: Optional[int] = None  # the mirror thread's native id
        self.last_error: Optional[BaseException] = None
        self._q: "queue.Queue" = queue.Queue()
        self._idle = threading.Event()
        self._idle.set()
        # Only the own slots receive D2H copies: they alone are pinned (buddy copies arrive
        # over the CPU transport). One side stream; the main thread only records an event.
        self.copier = d2h.Copier(torch.cuda.Stream() if self.pin else None)
        self._step_done = torch.cuda.Event() if self.pin else None
        self._runs: Optional[List[d2h.Run]] = None
        self._thread = threading.Thread(target=self._loop, name="deadpool-mirror", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ wiring
    def set_sources(self, tensors_fn: TensorsFn) -> None:
        self._tensors_fn = tensors_fn

    def set_topology(self, transport: MirrorTransport, rank_to_node: Sequence) -> None:
        """(Re)connect to a generation: new transport and buddy placement. Receive buffers are
        reallocated lazily at the next exchange."""
        self.transport = transport
        self._sizes: Optional[List[int]] = None
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
            self.own = [snapshot.alloc_slot(self.layout.total_bytes, self.pin) for _ in range(2)]
            self.own_iter = [-1, -1]
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

    def _slots(self) -> List[torch.Tensor]:
        return list(self.own) + [b for bufs in self.recv.values() for b in bufs]

    @property
    def host_bytes(self) -> int:
        return sum(b.numel() for b in self._slots())

    @property
    def pinned_bytes(self) -> int:
        return sum(b.numel() for b in self._slots() if b.is_pinned())

    def copy_stats(self) -> dict:
        """Copies issued per snapshot, bytes and side-stream seconds (all snapshots)."""
        c = self.copier
        return {"copies": c.copies, "bytes": c.bytes, "gpu_copy_s": c.gpu_copy_s,
                "runs": len(self._runs) if self._runs is not None else None}

    # ------------------------------------------------------------------ steady state
    def begin(self, iteration: int, meta: dict) -> None:
        """Start snapshot ``iteration`` (called right after its optimizer step)."""
        self.ensure_layout()
        if self._runs is None:
            self._runs = d2h.plan(self.layout, self._tensors)
        self.own_iter[iteration % 2] = -1  # this slot is being rewritten
        if self._step_done is not None:
            # Reused: the job of the previous record is done (wait() before every step).
            self._step_done.record()
        self._idle.clear()
        self._q.put(("snapshot", iteration, meta, self._step_done))

    def wait(self) -> None:
        """Block until the in-flight job is done (before the next step mutates the state).
        Raises MirrorError if it failed."""
        if not self._idle.is_set():
            t0 = time.perf_counter()
            self._idle.wait()
            self.waits += 1
            self.wait_s += time.perf_counter() - t0
        if self.last_error is not None:
            err, self.last_error = self.last_error, None
            raise MirrorError(f"mirror job failed: {type(err).__name__}: {err}") from err

    def quiesce(self, timeout_s: float) -> bool:
        """Wait for the mirror thread to go idle (during recovery, after the abort)."""
        ok = self._idle.wait(timeout_s)
        self.last_error = None
        return ok

    def _loop(self) -> None:
        self.tid = threading.get_native_id()
        lower_thread_priority(self.tid)
        if self.copier.stream is not None:
            torch.cuda.set_device(self.copier.stream.device)
        while True:
            item = self._q.get()
            if item is None:
                return
            t0, c0 = time.perf_counter(), time.thread_time()
            kind, iteration, meta, event = item
            try:
                if kind == "call":  # run_on_thread: not a snapshot job, not counted
                    meta["result"] = iteration()
                    continue
                self._snapshot_job(iteration, meta, event)
            except BaseException as exc:  # noqa: BLE001 - handed to the main thread by wait()
                self.last_error = exc
            finally:
                if kind != "call":
                    self.job_s += time.perf_counter() - t0
                    self.job_cpu_s += time.thread_time() - c0
                    self.jobs += 1
                if self._q.empty():
                    self._idle.set()

    def run_on_thread(self, fn: Callable[[], object]):
        """``fn()`` on the mirror thread once it is idle (measurements under the thread's
        own priority); its result. Not a snapshot job: no counter moves."""
        self.wait()
        box: dict = {}
        self._idle.clear()
        self._q.put(("call", fn, box, None))
        self._idle.wait()
        if "result" not in box:
            self.wait()  # raises the call's error
        return box.get("result")

    def _snapshot_job(self, iteration: int, meta: dict, event) -> None:
        clock = PhaseClock(self.phase_cpu)
        if self.commits.implicit:  # step ``iteration`` has returned: see commit.py
            done = self.commits.settle(iteration)
            if done is not None:
                self._drop_superseded()
                if self.on_committed is not None:
                    self.on_committed(done)
        idx = iteration % 2
        slot = self.own[idx]
        self.copier.copy(slot, self._runs, event)
        clock.lap("copy")
        snapshot.seal(slot, self.layout, self.rank, iteration, meta, self.job)
        clock.lap("seal")
        self.own_iter[idx] = iteration
        self._maybe_fault(iteration)
        self._exchange_and_commit(iteration, clock=clock)
        self.last_done = (iteration, time.perf_counter())
        if self.on_committed is not None and self.committed == iteration:
            self.on_committed(iteration)  # e.g. a periodic fallback save (persist.py)

    fault_hook: Optional[Callable[[int], None]] = None
    on_committed: Optional[Callable[[int], None]] = None
    # (holder, owner, iteration, why), on the mirror thread: recovery/alarms.py
    on_copy_rejected: Optional[Callable[[int, int, int, str], None]] = None
    job: int = 0  # snapshot.job_id(secret): copies of another job are refused

    def _maybe_fault(self, iteration: int) -> None:
        if self.fault_hook is not None:
            self.fault_hook(iteration)

    def _alloc_recv(self) -> None:
        if self._sizes is not None:
            return
        self._sizes = self.transport.all_gather_int(self.layout.total_bytes)
        for o in self.holds:
            old = self.recv.get(o)
            if old is None or old[0].numel() != self._sizes[o]:
                # Not pinned: buddy copies travel over the CPU transport, never to a device.
                self.recv[o] = [snapshot.alloc_slot(self._sizes[o], False) for _ in range(2)]
                self.recv_iter[o] = [-1, -1]
        # Copies of owners this rank no longer holds (the placement changed) stay valid, and
        # restorable, until a newer iteration commits (see _exchange_and_commit).

    def _exchange_and_commit(self, iteration: int, skip=frozenset(),
                             collective: bool = False, clock: Optional[PhaseClock] = None) -> None:
        """Send this rank's slot to its buddies, receive its owners' slots, verify, commit
        (implicitly later unless ``collective``: commit.py). ``skip``: (owner, holder) pairs
        whose copy of ``iteration`` is already in place. Without replicas the local copy
        alone commits (no transport call)."""
        if self.replicas == 0:
            self.commits.reset(iteration)
            return
        idx = iteration % 2
        self._alloc_recv()
        owners = [o for o in self.holds if (o, self.rank) not in skip]
        for o in owners:
            self.recv_iter[o][idx] = -1
            self.crc_checked.discard((o, idx))
        mine = snapshot.sealed(self.own[idx])
        self.transport.exchange([(b, mine) for b in self.buddies if (self.rank, b) not in skip],
                                [(o, self.recv[o][idx]) for o in owners])
        clock = clock or NO_CLOCK  # recovery's exchanges are not snapshot jobs
        clock.lap("exchange")
        ok = True
        for o in owners:  # the header here; the checksum once the copy is needed (held.py)
            try:
                if self.discard_from is not None and iteration >= self.discard_from:
                    self.recv[o][idx][:8].zero_()  # as if it never arrived: no magic
                snapshot.verify(self.recv[o][idx], o, iteration, job=self.job,
                                load_meta=False, checksum=False)
                self.recv_iter[o][idx] = iteration
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
        """The 'drop' test fault (faults.py): reject every copy of ``iteration`` and later."""
        self.discard_from = iteration

    def _drop_superseded(self) -> None:
        for o in [o for o in self.recv if o not in self.holds]:
            del self.recv[o], self.recv_iter[o]  # superseded by the new placement

    def close(self) -> None:
        self._q.put(None)
        self._thread.join(timeout=10)
        self.transport = None
