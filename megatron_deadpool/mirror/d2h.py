"""Copy the live tensors into a host slot: one copy per contiguous run of source memory,
issued by the mirror thread on a side CUDA stream that first waits for the optimizer step.

    main thread:  optimizer.step(k) ── record(step_done) ── fwd/bwd(k+1) ...
    side stream:                       wait(step_done) ── D2H run 0, run 1, ... ── done
    mirror thread:                     issue the copies ── done.synchronize() ── seal ...

A run is a stretch of consecutive layout entries that are adjacent both in one source
storage and in the slot; the slot offsets never depend on addresses (a promoted spare must
compute the same layout), so a run only merges what happens to be adjacent on both sides.
With megatron-core 0.16.1 and torch AdamW most shard tensors are separate allocations
(fp32 main params are clones, the moments are created per parameter), so most runs hold
one tensor; ``Copier.runs`` says how many copies a snapshot takes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import torch

from ..base.errors import MirrorCorruptError


def _flat_u8(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8)


@dataclass
class Run:
    offset: int  # in the slot
    nbytes: int
    src: Optional[torch.Tensor]  # flat uint8 view of the source run, or None: see tensor
    tensor: Optional[torch.Tensor] = None  # a non-contiguous tensor, flattened at copy time

    def source(self) -> torch.Tensor:
        return self.src if self.src is not None else _flat_u8(self.tensor)


def plan(layout, tensors: Sequence[torch.Tensor]) -> List[Run]:
    """The copies that fill a slot of ``layout`` from ``tensors`` (views only: no data is
    copied or allocated here)."""
    if len(tensors) != len(layout.entries):
        raise MirrorCorruptError(f"snapshot expects {len(layout.entries)} tensors, "
                                 f"got {len(tensors)}")
    runs: List[Run] = []
    cur = None  # [storage, byte offset in storage, slot offset, nbytes, device]
    for e, t in zip(layout.entries, tensors):
        if e.nbytes == 0:
            continue
        if not t.is_contiguous():
            _flush(runs, cur)
            cur = None
            runs.append(Run(e.offset, e.nbytes, None, t))
            continue
        storage = t.untyped_storage()
        start = t.data_ptr() - storage.data_ptr()
        if (cur is not None and cur[0].data_ptr() == storage.data_ptr()
                and 0 <= start - (cur[1] + cur[3]) == e.offset - (cur[2] + cur[3])):
            cur[3] = e.offset + e.nbytes - cur[2]  # the same gap (or none) on both sides
            continue
        _flush(runs, cur)
        cur = [storage, start, e.offset, e.nbytes, t.device]
    _flush(runs, cur)
    return runs


def _flush(runs: List[Run], cur) -> None:
    if cur is None:
        return
    storage, start, offset, nbytes, device = cur
    src = torch.empty(0, dtype=torch.uint8, device=device).set_(storage, start, (nbytes,))
    runs.append(Run(offset, nbytes, src))


class Copier:
    """Runs the copies of one slot. On the host: one ``torch.cat`` into the slot's packed
    tensor area (``torch._foreach_copy_`` over cached views if the runs are not back to
    back), no per-tensor Python loop. With a CUDA stream the copies are asynchronous
    D2H into pinned memory, ordered after ``step_done``; the time the side stream spent on
    them is measured with CUDA events (``gpu_copy_s``). ``copy_times`` keeps the side-stream
    seconds of recent snapshots' copies (GPU only: a host copy is timed by the meter's
    ``copy`` lap, meter.py)."""

    KEEP_TIMES = 4096

    def __init__(self, stream: Optional["torch.cuda.Stream"] = None):
        self.stream = stream
        self.copies = 0  # copies issued, all snapshots
        self.bytes = 0
        self.gpu_copy_s = 0.0
        self.runs: Optional[int] = None  # runs of the last plan copied
        self.copy_times: List[float] = []
        self._total: tuple = (None, 0)  # (runs, their bytes): summed once per plan
        # per slot: (the plan, dst views, sources, flatten). The plan itself is held and
        # compared, never its id(): a freed plan's address comes back for a new list, and an
        # id key served a new plan the views of an old one (a test plants it).
        self._views: Dict[int, tuple] = {}
        if stream is not None:
            self._start = torch.cuda.Event(enable_timing=True)
            self._done = torch.cuda.Event(enable_timing=True)

    def _pairs(self, slot: torch.Tensor, runs: Sequence[Run]):
        """(destination, sources) for ``slot``, built once per slot and plan: when the runs
        lie back to back in the slot (the packed layout), one destination view for a single
        ``torch.cat``; otherwise one view per run. Runs of non-contiguous tensors are
        flattened at each copy (none in the reference)."""
        key = slot.data_ptr()
        cached = self._views.get(key)
        if cached is None or cached[0] is not runs:  # a new plan: the old views go
            if len(self._views) > 8:  # slots reallocated: drop the others' views
                self._views.clear()
            packed = all(a.offset + a.nbytes == b.offset for a, b in zip(runs, runs[1:]))
            dst = ([slot[runs[0].offset:runs[-1].offset + runs[-1].nbytes]] if packed and runs
                   else [slot[r.offset:r.offset + r.nbytes] for r in runs])
            src = [r.src for r in runs]
            cached = self._views[key] = (runs, dst, src, any(x is None for x in src))
        _, dst, src, flatten = cached
        return dst, ([r.source() for r in runs] if flatten else src)

    def copy(self, slot: torch.Tensor, runs: Sequence[Run], step_done=None) -> None:
        if self.stream is None:
            dst, src = self._pairs(slot, runs)  # timed by the meter's copy lap
            if len(dst) == 1 and len(src) > 1:
                torch.cat(src, out=dst[0])  # one op: no per-tensor dispatch
            elif dst:
                torch._foreach_copy_(dst, src)
        else:
            with torch.cuda.stream(self.stream):
                if step_done is not None:
                    self.stream.wait_event(step_done)
                self._start.record(self.stream)
                for r in runs:
                    slot[r.offset:r.offset + r.nbytes].copy_(r.source(), non_blocking=True)
                self._done.record(self.stream)
            self._done.synchronize()
            dt = self._start.elapsed_time(self._done) / 1000.0
            self.gpu_copy_s += dt
            self._keep(dt)
        self.copies += len(runs)
        self.runs = len(runs)
        if self._total[0] is not runs:
            self._total = (runs, sum(r.nbytes for r in runs))
        self.bytes += self._total[1]

    def _keep(self, dt: float) -> None:
        if len(self.copy_times) >= self.KEEP_TIMES:
            del self.copy_times[:self.KEEP_TIMES // 2]
        self.copy_times.append(dt)
