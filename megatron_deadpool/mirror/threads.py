"""The mirror's threads yield the CPU to training: per-thread niceness (Linux)."""

from __future__ import annotations

import os
import threading
import time

MIRROR_NICE = 10  # the mirror yields the CPU to training (data loading, kernel launches)


def lower_thread_priority(tid: int, nice: int = MIRROR_NICE) -> None:
    """Raise one thread's niceness (Linux: setpriority applies per thread id). Allowed for
    unprivileged processes; a no-op where unsupported."""
    try:
        cur = os.getpriority(os.PRIO_PROCESS, tid)
        os.setpriority(os.PRIO_PROCESS, tid, max(cur, nice))
    except (OSError, AttributeError):
        pass


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
    names itself, which can take a while on busy cores: wait for that, at most
    ``settle_s``."""
    creator = thread_names().get(threading.get_native_id())
    deadline = time.monotonic() + settle_s
    while True:
        new = {t: n for t, n in thread_names().items() if t not in before}
        if creator not in new.values() or time.monotonic() >= deadline:
            return {t for t, n in new.items() if n in names}
        time.sleep(0.002)
