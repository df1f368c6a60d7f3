"""The mirror's one background thread and its typed work items. Jobs run one at a time, in
order; the main thread waits for the one in flight before the next step mutates the state it
reads, and a job's error is handed to that wait.

    main:    submit(SnapshotJob) ... wait() ─► raises the job's error, if any
    thread:  SnapshotJob ─► run_job(job)        Call ─► fn() (not a snapshot job)
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union

from .threads import lower_thread_priority


@dataclass(frozen=True)
class SnapshotJob:
    """Copy, seal, send and verify ``iteration``'s state."""

    iteration: int
    meta: dict
    step_done: Any = None  # a CUDA event recorded after the optimizer step, or None


@dataclass(frozen=True)
class Call:
    """Run ``fn`` on the thread (``JobThread.call``); its result lands in ``box``."""

    fn: Callable[[], object]
    box: dict = field(default_factory=dict)


class _Stop:
    """Ends the thread (``JobThread.close``)."""


Item = Union[SnapshotJob, Call, _Stop]


class JobThread:
    def __init__(self, run_job: Callable[[SnapshotJob], None], name: str,
                 on_start: Callable[[], None] = lambda: None):
        self._run_job, self._on_start = run_job, on_start
        self.tid: Optional[int] = None  # the thread's native id
        self.error: Optional[BaseException] = None  # the last job's, until waited for
        self._q: "queue.Queue[Item]" = queue.Queue()
        self._idle = threading.Event()
        self._idle.set()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: SnapshotJob) -> None:
        self._idle.clear()
        self._q.put(job)

    def wait(self) -> Optional[float]:
        """Block until idle; the seconds waited (None: it was idle already)."""
        if self._idle.is_set():
            return None
        t0 = time.perf_counter()
        self._idle.wait()
        return time.perf_counter() - t0

    def take_error(self) -> Optional[BaseException]:
        err, self.error = self.error, None
        return err

    def quiesce(self, timeout_s: float) -> bool:
        """Wait for the thread to go idle (during recovery, after the abort); its error is
        dropped."""
        ok = self._idle.wait(timeout_s)
        self.error = None
        return ok

    def call(self, fn: Callable[[], object]) -> Call:
        """Run ``fn`` on the thread once idle and wait for it (its error: ``take_error``)."""
        self.wait()
        item = Call(fn)
        self._idle.clear()
        self._q.put(item)
        self._idle.wait()
        return item

    def _loop(self) -> None:
        self.tid = threading.get_native_id()
        lower_thread_priority(self.tid)
        self._on_start()
        while True:
            item = self._q.get()
            if isinstance(item, _Stop):
                return
            try:
                if isinstance(item, Call):
                    item.box["result"] = item.fn()
                else:
                    self._run_job(item)
            except BaseException as exc:  # noqa: BLE001 - handed to the main thread by wait
                self.error = exc
            finally:
                if self._q.empty():
                    self._idle.set()

    def close(self) -> None:
        self._q.put(_Stop())
        self._thread.join(timeout=10)
