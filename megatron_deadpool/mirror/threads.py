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
