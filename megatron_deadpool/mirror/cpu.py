"""What the mirror costs, in CPU seconds, from per-thread CPU clocks (load-independent: a
thread's clock only runs while it runs, however many processes share the cores).

    mirror_cpu_fraction = CPU s per snapshot of everything the mirror adds
                          / CPU s per step of the training main thread (less its mirror part)

"Everything the mirror adds": the mirror thread (copy, checksum, seal, exchange, receive and
header check of the buddies' copies, commit), the checksum pool's threads, the mirror group's gloo
threads (its ``gloo_tcp_loop`` I/O thread and its two ``pt_gloo_runloop`` workers, which run
the commit's all-reduce), and the main thread's own share (metadata capture, ``begin``, the
wait before the step), clocked with ``time.thread_time`` around those calls.

Other threads are read from ``/proc/self/task/<tid>/schedstat`` (nanoseconds of run time;
``stat`` utime + stime in clock ticks where schedstat is missing).
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass
from typing import Dict, Iterable, Optional

import torch

GLOO_THREAD_NAMES = ("gloo_tcp_loop", "pt_gloo_runloop")


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


@dataclass
class Sample:
    """Cumulative clocks at one point: the main thread's (all, and its mirror part), the
    mirror's threads, and the number of steps / snapshot jobs so far."""

    main_s: float
    main_mirror_s: float
    steps: int
    jobs: int = 0
    parts: Optional[dict] = None  # {"mirror_thread", "checksum_pool", "gloo"}: seconds
    phases: Optional[dict] = None  # the mirror thread's, per part of a job (Mirror.phase_cpu)

    @property
    def mirror_threads_s(self) -> float:
        return sum((self.parts or {}).values())


def window(start: Sample, last: Sample, end: Sample) -> Optional[dict]:
    """Per-step CPU between ``start`` (taken before a step's snapshot begins) and ``last``
    (main thread, after the last snapshot began); ``end``: the mirror's threads once the
    last job is done. None if the window holds no step or no job."""
    steps, jobs = last.steps - start.steps, end.jobs - start.jobs
    if steps <= 0 or jobs <= 0:
        return None
    main_mirror = last.main_mirror_s - start.main_mirror_s
    main_train = (last.main_s - start.main_s) - main_mirror
    threads = end.mirror_threads_s - start.mirror_threads_s
    per_job = (threads + main_mirror) / jobs
    per_step = main_train / steps
    parts = {f"{k}_cpu_per_job_s": v for k, v in _per_job(start.parts, end.parts, jobs).items()}
    return {"steps": steps, "jobs": jobs, **parts,
            "mirror_thread_phase_cpu_per_job_s": _per_job(start.phases, end.phases, jobs),
            "main_train_cpu_per_step_s": per_step,
            "mirror_cpu_per_job_s": per_job,
            "mirror_threads_cpu_per_job_s": threads / jobs,
            "main_mirror_cpu_per_job_s": main_mirror / jobs,
            "mirror_cpu_fraction": per_job / per_step if per_step > 0 else None}


def _per_job(start: Optional[dict], end: Optional[dict], jobs: int) -> dict:
    """Per key of ``start``: the seconds added by ``end``, per job."""
    return {k: ((end or {}).get(k, 0.0) - v) / jobs for k, v in (start or {}).items()}


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
    for _ in range(repeats):  # thread CPU clock, as the snapshot's copy (d2h.Copier)
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


def snapshot_stats(copy_times, nbytes: int, calib: Optional[dict], drop: int = 3) -> dict:
    """``snapshot_gbps``: bytes copied into the slot per second of copy time (median over
    the snapshots after the first ``drop``; host: the copying thread's CPU clock), against
    ``copy_gbps`` and ``copy_cold_gbps`` (``calibrate``, same clock)."""
    times = list(copy_times)[drop:] or list(copy_times)
    out = {"snapshot_s": statistics.median(times) if times else None,
           "snapshot_bytes": nbytes, "snapshots": len(times)}
    out["snapshot_gbps"] = nbytes / out["snapshot_s"] / 1e9 if out["snapshot_s"] else None
    if calib:
        out["copy_s"], out["checksum_s"] = calib["copy_s"], calib["crc_s"]
        out["copy_gbps"] = nbytes / calib["copy_s"] / 1e9 if calib["copy_s"] else None
        cold = calib.get("copy_cold_s")
        out["copy_cold_gbps"] = nbytes / cold / 1e9 if cold else None
        out["checksum_gbps"] = nbytes / calib["crc_s"] / 1e9 if calib["crc_s"] else None
    return out


class PhaseClock:
    """Adds the thread's CPU seconds since the previous lap to ``into[name]`` (None: off)."""

    def __init__(self, into: Optional[Dict[str, float]]):
        self.into, self.t = into, time.thread_time() if into is not None else 0.0

    def lap(self, name: str) -> None:
        if self.into is not None:
            t = time.thread_time()
            self.into[name] += t - self.t
            self.t = t


NO_CLOCK = PhaseClock(None)
