"""The mirror's threads yield the CPU to training: per-thread niceness (Linux)."""

from __future__ import annotations

import os

MIRROR_NICE = 10  # the mirror yields the CPU to training (data loading, kernel launches)


def lower_thread_priority(tid: int, nice: int = MIRROR_NICE) -> None:
    """Raise one thread's niceness (Linux: setpriority applies per thread id). Allowed for
    unprivileged processes; a no-op where unsupported."""
    try:
        cur = os.getpriority(os.PRIO_PROCESS, tid)
        os.setpriority(os.PRIO_PROCESS, tid, max(cur, nice))
    except (OSError, AttributeError):
        pass


def native_thread_ids(name: str) -> set:
    """Native ids of this process's threads called ``name`` (Linux /proc)."""
    out = set()
    try:
        for tid in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().strip() == name:
                    out.add(int(tid))
    except OSError:
        pass
    return out
