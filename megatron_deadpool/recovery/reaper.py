"""Where an aborted generation's communicators die: on a thread of their own, off the
recovery's critical path.

Destroying a gloo process group is slow for a reason that has nothing to do with its
size: every socket it unregisters from its device's event loop waits for that loop's next
tick, and an idle loop ticks every 10 ms (gloo ``tcp::Loop::run``'s ``epoll_wait``
timeout). A rank of the demo holds about 20 groups, so dropping them took ~0.1 s of wall
time, and they used to be dropped on the main thread in the middle of ``rebuild_groups``
(when ``rebind`` replaced the last reference), where every other rank waited for it.

    abort ─► destroy_world ─► release (slots set to None, groups handed over) ─► rendezvous …
                                   └──► reaper thread: drop group 1, group 2, …

The main thread goes on to the rendezvous, which is mostly waiting on the store and on
connections, while the reaper waits on the old loops. ``wait`` lets a caller that must see
them gone (the heap audit, the exit) wait for it.
"""

from __future__ import annotations

import threading
from typing import List


class Reaper:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._batches: List[list] = []
        self._busy = False
        self._thread = None

    def drop(self, objs: list) -> None:
        """Take over ``objs`` (the caller keeps no other reference) and let them die on the
        reaper thread, in order."""
        if not objs:
            return
        with self._cond:
            self._batches.append(objs)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="deadpool-reaper",
                                                daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._batches:
                    self._busy = False
                    self._cond.notify_all()
                    self._cond.wait()
                objs, self._busy = self._batches.pop(0), True
            while objs:
                objs.pop()  # the last reference: its destructor runs here
            del objs

    def pending(self) -> bool:
        with self._cond:
            return bool(self._batches) or self._busy

    def wait(self, timeout_s: float) -> bool:
        """True once everything handed over has been dropped (False: not in ``timeout_s``)."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._batches and not self._busy,
                                       timeout=timeout_s)
