"""The mirror's observer: every measurement of what protection costs, in one place, beside
the logic instead of inside it. The protection path (control/attachment.py, the mirror
thread) calls the hooks of the meter it was given; ``NO_METER`` makes them no-ops. A launched
job attaches a ``Meter`` (progress line, rank results, the bench, the straggler check read
it); no other module reads a thread clock.

    main thread:   after_step() around a step's end (metadata, begin of its snapshot),
                   on_main() around its other mirror work (the wait in the optimizer step)
    mirror thread: job() around each snapshot job, with laps per part (copy, seal, ...)

``mirror_cpu_fraction`` = CPU s per snapshot of everything the mirror adds (the mirror
thread, the checksum pool, the mirror group's gloo threads ``gloo_tcp_loop`` and
``pt_gloo_runloop``, the main thread's share) / CPU s per step of the training main thread
less its mirror share. Per-thread clocks are load-independent (a thread's clock runs only
while it runs): ``time.thread_time`` on the calling thread, ``/proc/self/task/<tid>/
schedstat`` (``stat`` utime + stime where it is missing) for the others.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import threading
import time
from typing import Dict, Iterable, Iterator, List, Optional

import torch

from .cost import Sample, snapshot_stats, window

GLOO_THREAD_NAMES = ("gloo_tcp_loop", "pt_gloo_runloop")
CHECKSUM_THREAD_PREFIX = "deadpool-crc"  # snapshot.py's pool (its threads' names start so)
JOB_PARTS = ("copy", "seal", "exchange", "verify")  # a snapshot job's parts (phase_cpu)
CPU_WINDOW_START = 3  # steps before it (startup, first allocations) are not counted
KEEP_TIMES = 256  # copy times kept for the snapshot statistics
COMPUTE_STEPS = 5  # iterations in a rank's compute-time median (heartbeats carry it)
cpu_clock = time.thread_time  # the calling thread's CPU s (the slow fault burns on it too)


# ---------------------------------------------------------------- thread clocks
def thread_names() -> dict:
    """``{native id: name}`` of this process's threads (Linux /proc; empty elsewhere)."""
    out = {}
    try:
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/comm") as f:
                    out[int(tid)] = f.read().strip()
            except OSError:  # the thread ended meanwhile
                pass
    except OSError:
        pass
    return out


def started_threads(before: dict, names, settle_s: float = 0.5) -> set:
    """Native ids of the threads called one of ``names`` that started after ``before`` (a
    ``thread_names()``). A new native thread carries its creator's name until it runs and
    names itself, which can take a while on busy cores: wait for that, at most settle_s."""
    creator = thread_names().get(threading.get_native_id())
    deadline = time.monotonic() + settle_s
    while True:
        new = {t: n for t, n in thread_names().items() if t not in before}
        if creator not in new.values() or time.monotonic() >= deadline:
            return {t for t, n in new.items() if n in names}
        time.sleep(0.002)


def thread_cpu_s(tid: int) -> Optional[float]:
    """CPU seconds of one thread of this process; None once it is gone."""
    try:
        with open(f"/proc/self/task/{tid}/schedstat") as f:
            return int(f.read().split()[0]) / 1e9
    except (OSError, ValueError, IndexError):
        pass
    try:
        with open(f"/proc/self/task/{tid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def threads_cpu_s(tids: Iterable[int]) -> float:
    return sum(x for x in (thread_cpu_s(t) for t in tids) if x is not None)


def checksum_pool_cpu_s() -> float:
    """CPU seconds of the checksum pool's threads so far (they do nothing else)."""
    return threads_cpu_s(t for t, n in thread_names().items()
                         if n.startswith(CHECKSUM_THREAD_PREFIX))


class PhaseClock:
    """Adds the thread's CPU seconds since the previous lap to ``into[name]`` (None: off)."""

    def __init__(self, into: Optional[Dict[str, float]], laps: Optional[dict] = None):
        self.into, self.laps = into, laps
        self.t = time.thread_time() if into is not None else 0.0

    def lap(self, name: str) -> None:
        if self.into is not None:
            t = time.thread_time()
            self.into[name] += t - self.t
            if self.laps is not None:
                self.laps[name] = t - self.t
            self.t = t


NO_CLOCK = PhaseClock(None)


# ---------------------------------------------------------------- calibration
EVICT_BYTES = 64 << 20  # written between cold copies: more than this machine's caches


def calibrate(nbytes: int, repeats: int = 21) -> dict:
    """The limit for the snapshot's copy: a plain torch copy of ``nbytes`` from one
    contiguous host buffer into a preallocated one (median of ``repeats``; the same two
    buffers every time, so they stay in cache), the same copy right after every cache level
    was overwritten (``copy_cold_s``: a snapshot reads what the optimizer step wrote, with
    other processes in between), and the checksum's speed on the same bytes. Run on the
    mirror thread (same priority)."""
    from . import snapshot

    src = torch.empty(max(nbytes, 1), dtype=torch.uint8).random_(0, 256)
    dst = torch.zeros_like(src)
    evict = torch.zeros(EVICT_BYTES, dtype=torch.uint8)
    copy, cold, crc = [], [], []
    for _ in range(repeats):  # thread CPU clock, as the snapshot's copy lap
        t0 = time.thread_time()
        dst.copy_(src)
        t1 = time.thread_time()
        snapshot.checksum(dst)
        crc.append(time.thread_time() - t1)
        copy.append(t1 - t0)
    for _ in range(repeats):  # after the warm ones: the eviction would disturb them
        evict.add_(1)
        t0 = time.thread_time()
        dst.copy_(src)
        cold.append(time.thread_time() - t0)
    return {"copy_s": statistics.median(copy), "crc_s": statistics.median(crc),
            "copy_cold_s": statistics.median(cold)}


# ---------------------------------------------------------------- the observer
class NullMeter:
    """The hooks the protection path calls; this one measures nothing."""

    attached = False

    @contextlib.contextmanager
    def on_main(self) -> Iterator[None]:
        yield

    @contextlib.contextmanager
    def after_step(self, mirror_on: bool) -> Iterator[None]:
        yield

    def waited(self, seconds: float) -> None:
        pass

    @contextlib.contextmanager
    def job(self, iteration: int) -> Iterator[PhaseClock]:
        yield NO_CLOCK

    def snapshot_began(self) -> None:
        pass

    def gloo_threads(self, tids: set) -> None:
        pass

    def restored(self) -> None:
        pass

    def compute_s(self) -> Optional[float]:
        return None

    def progress(self, iteration: int) -> dict:
        return {"mirror_lag_s": None, "mirror_wait_s": None}

    def report(self, mirror) -> dict:
        return {}


NO_METER = NullMeter()


class Meter(NullMeter):
    """Clocks the main thread's mirror share, each snapshot job (wall, CPU, per part), the
    waits, the mirror group's gloo threads and the checksum pool; the CPU window opens at
    the ``CPU_WINDOW_START``-th step and closes at the end (a recovery reopens it)."""

    attached = True

    def __init__(self):
        self.main_mirror_s = 0.0
        self.waits, self.wait_s = 0, 0.0
        self.jobs, self.job_s, self.job_cpu_s = 0, 0.0, 0.0
        self.phase_cpu = dict.fromkeys(JOB_PARTS, 0.0)
        self.copy_times: List[float] = []  # each job's copy lap (host: thread CPU clock)
        self.steps = {"on": 0, "off": 0}  # the bench's switch: steps snapshotted or not
        self.gloo_tids: set = set()
        self.main_tid: Optional[int] = None
        self.last_done: Optional[tuple] = None  # (iteration, perf_counter) of the last job
        self._t_begin = 0.0  # the newest snapshot's start (progress)
        self._wait_mark = 0.0
        self._cpu_start: Optional[Sample] = None
        self._cpu_last: Optional[Sample] = None
        self._step_mark: Optional[tuple] = None  # (main CPU, its mirror part) at a step end
        self._compute: List[float] = []  # recent steps' main-thread compute seconds

    @contextlib.contextmanager
    def on_main(self) -> Iterator[None]:
        """Around the main thread's other mirror work (the wait in the optimizer step)."""
        c0 = time.thread_time()
        try:
            yield
        finally:
            self.main_mirror_s += time.thread_time() - c0

    @contextlib.contextmanager
    def after_step(self, mirror_on: bool) -> Iterator[None]:
        """Around a step's end on the main thread (its snapshot begins inside): the window's
        first sample before it, the last one after it, its time the main thread's share."""
        c0 = time.thread_time()
        self.main_tid = threading.get_native_id()
        if self._step_mark is not None:  # the step's own compute: not the mirror's share
            self._compute.append((c0 - self._step_mark[0])
                                 - (self.main_mirror_s - self._step_mark[1]))
            del self._compute[:-COMPUTE_STEPS]
        self._step_mark = (c0, self.main_mirror_s)
        self.steps["on" if mirror_on else "off"] += 1
        if sum(self.steps.values()) == CPU_WINDOW_START:
            self._cpu_start = self._sample(c0, with_threads=True)
        try:
            yield
        finally:
            c1 = time.thread_time()
            self.main_mirror_s += c1 - c0
            self._cpu_last = self._sample(c1)

    def snapshot_began(self) -> None:
        self._t_begin = time.perf_counter()

    def waited(self, seconds: float) -> None:
        self.waits += 1
        self.wait_s += seconds

    @contextlib.contextmanager
    def job(self, iteration: int) -> Iterator[PhaseClock]:
        t0, c0 = time.perf_counter(), time.thread_time()
        laps: dict = {}
        try:
            yield PhaseClock(self.phase_cpu, laps)
            self.last_done = (iteration, time.perf_counter())  # copied, sent and verified
        finally:
            self.job_s += time.perf_counter() - t0
            self.job_cpu_s += time.thread_time() - c0
            self.jobs += 1
            if "copy" in laps:
                self.copy_times.append(laps["copy"])
                del self.copy_times[:-KEEP_TIMES]

    def gloo_threads(self, tids: set) -> None:
        """A new generation's mirror group: its threads; the CPU window restarts."""
        self.gloo_tids = set(tids)
        self._cpu_start = None

    def restored(self) -> None:
        self.last_done = None  # the first step after a restore waits for no snapshot
        self._step_mark, self._compute = None, []  # a rebuilt world: new compute samples

    def compute_s(self) -> Optional[float]:
        """The main thread's CPU seconds per iteration, less its mirror work: the rank's own
        compute (a wait in a collective blocks, off the CPU), the median of the last
        COMPUTE_STEPS iterations, for the straggler check (membership/straggler.py). None
        before two iterations."""
        return statistics.median(self._compute) if self._compute else None

    def progress(self, iteration: int) -> dict:
        """``mirror_lag_s``: how long after the previous optimizer step its snapshot was
        copied, sent and verified (None: none, e.g. the first step after a restore);
        ``mirror_wait_s``: how long this optimizer step waited."""
        waited, self._wait_mark = self.wait_s - self._wait_mark, self.wait_s
        done = self.last_done
        lag = done[1] - self._t_begin if done and done[0] == iteration - 1 else None
        return {"mirror_lag_s": lag, "mirror_wait_s": waited}

    def _sample(self, main_s: float, with_threads: bool = False) -> Sample:
        s = Sample(main_s, self.main_mirror_s, sum(self.steps.values()))
        if with_threads:
            s.jobs = self.jobs
            s.parts = {"mirror_thread": self.job_cpu_s, "checksum_pool": checksum_pool_cpu_s(),
                       "gloo": threads_cpu_s(self.gloo_tids)}
            s.phases = dict(self.phase_cpu)
        return s

    def report(self, mirror) -> dict:
        """The rank's measurements once its last job is done (``mirror``: for its layout
        and a calibration copy on its thread)."""
        c = mirror.copier  # copies issued per snapshot, bytes, side-stream seconds
        out = {"main_tid": self.main_tid, "gloo_tids": sorted(self.gloo_tids),
               "mirror_waits": self.waits, "mirror_wait_s": self.wait_s,
               "mirror_jobs": self.jobs, "mirror_job_s": self.job_s,
               "bench_steps": dict(self.steps),
               "mirror_copies": {"copies": c.copies, "bytes": c.bytes,
                                 "gpu_copy_s": c.gpu_copy_s, "runs": c.runs}}
        if self._cpu_start is not None and self._cpu_last is not None:
            end = self._sample(0.0, with_threads=True)
            out["mirror_cpu"] = window(self._cpu_start, self._cpu_last, end)
        layout = mirror.layout
        if layout is not None and self.jobs:
            n = layout.tensor_bytes
            times = mirror.copier.copy_times if mirror.pin else self.copy_times
            calib = None if mirror.pin else mirror.run_on_thread(lambda: calibrate(n))
            out["snapshot"] = snapshot_stats(times, n, calib)
        return out
