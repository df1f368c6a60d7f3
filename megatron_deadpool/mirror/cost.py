"""The arithmetic of what the mirror costs, from the meter's clock readings (meter.py reads
the clocks; this module only divides): the per-step CPU window and the snapshot's copy
bandwidth against a plain copy."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Optional


@dataclass
class Sample:
    """Cumulative clocks at one point: the main thread's (all, and its mirror part), the
    mirror's threads, and the number of steps / snapshot jobs so far."""

    main_s: float
    main_mirror_s: float
    steps: int
    jobs: int = 0
    parts: Optional[dict] = None  # {"mirror_thread", "checksum_pool", "gloo"}: seconds
    phases: Optional[dict] = None  # the mirror thread's, per part of a job

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
