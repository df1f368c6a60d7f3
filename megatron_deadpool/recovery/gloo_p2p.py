"""A survivor blocked in a gloo point-to-point wait reaches the new plan at the abort, not
at the gloo operation deadline (issue 38: a bf16 recovery took 21.7 s, 15 of them in one
"send operation to complete").

The abort wakes a p2p wait only through its connection: the socket shutdown (abort.py)
fails the pair, and gloo fails the operations queued on it. That covers the sockets the
abort knows (the groups built inside ``communicator_sockets``) while their pair is intact;
a wait whose connection the abort does not reach, or does not break, sits out the deadline:
a group that was not recorded, a peer that neither receives nor closes. Neither a timed
wait nor polling can get out of it: a timed ``wait`` that expires closes the pair
("Application timeout caused pair closure"), and ``is_completed`` of a gloo send stays false
until ``wait`` is called.

So on a gloo world the main thread does not wait in gloo at all. Each CPU ``isend``'s and
``irecv``'s work is wrapped (``AbortableP2P``): its ``wait`` hands the real wait to a waiter
thread and sleeps on an event that the waiter sets when gloo returns, or that the abort sets
(``abandon_all``, called by ``World.abort``). An abandoned wait raises a communication
failure (classify.py: "communicator was aborted"), which the recovery boundary takes as the
peer failure it is. A waiter still held in gloo is retired (it ends when its wait does, at
the old deadline) and the next generation's waits get a fresh one.

Cost on the happy path: one hand-off to the waiter thread per p2p wait (tens of
microseconds). CUDA tensors (NCCL, whose abort wakes everything) are not wrapped.
"""

from __future__ import annotations

import queue
import threading
from typing import Optional, Set

ABANDONED = "gloo p2p wait abandoned at the abort: communicator was aborted"
WAITER = "deadpool-gloo-p2p-wait"


class _Box:
    __slots__ = ("work", "done", "abandoned", "error")

    def __init__(self, work):
        self.work, self.done = work, threading.Event()
        self.abandoned, self.error = False, None


class _Waiter:
    """One thread that waits in gloo for the p2p works handed to it, in order."""

    def __init__(self):
        self.q: "queue.SimpleQueue[Optional[_Box]]" = queue.SimpleQueue()
        threading.Thread(target=self._run, daemon=True, name=WAITER).start()

    def _run(self) -> None:
        while True:
            box = self.q.get()
            if box is None:
                return
            try:
                box.work.wait()
            except BaseException as exc:  # noqa: BLE001 - handed to the thread that waits
                box.error = exc
            box.done.set()


_lock = threading.Lock()
_waiter: Optional[_Waiter] = None
_pending: Set[_Box] = set()
_epoch = 0  # aborts so far: a work made before the last one is never waited on in gloo


class AbortableP2P:
    """A gloo send's or receive's work whose ``wait`` the abort can end."""

    def __init__(self, work):
        while isinstance(work, AbortableP2P):  # wrapped twice: wait on the real one
            work = work._work
        self._work, self._box, self._epoch = work, None, _epoch

    def wait(self, timeout=None) -> bool:
        global _waiter
        if threading.current_thread().name == WAITER:  # never queue behind oneself
            return self._work.wait()
        if self._box is None:
            with _lock:
                if self._epoch != _epoch:  # issued before an abort, first waited after it
                    raise RuntimeError(ABANDONED)
                box = self._box = _Box(self._work)
                if _waiter is None:
                    _waiter = _Waiter()
                _pending.add(box)
                _waiter.q.put(box)
        box = self._box
        box.done.wait()
        with _lock:
            _pending.discard(box)
        if box.abandoned:
            raise RuntimeError(ABANDONED)
        if box.error is not None:
            raise box.error
        return True

    def is_completed(self) -> bool:
        return self._box is not None and self._box.done.is_set() and not self._box.abandoned

    def __getattr__(self, name):
        return getattr(self._work, name)


def abandon_all() -> int:
    """(any thread; the abort) End every p2p wait in progress with a communication
    failure and retire the waiter, which may be stuck in gloo. Returns how many."""
    global _waiter, _epoch
    with _lock:
        _epoch += 1
        boxes = list(_pending)
        _pending.clear()
        for box in boxes:
            box.abandoned = True
            box.done.set()
        if boxes and _waiter is not None:
            _waiter.q.put(None)  # it leaves once gloo lets go of it
            _waiter = None
    return len(boxes)


def install() -> None:
    """Wrap ``torch.distributed.isend`` and ``irecv`` (under both names that
    ``batch_isend_irecv`` and ``P2POp`` check them by) so that a CPU tensor's work is an
    ``AbortableP2P``."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    for name in ("isend", "irecv"):
        orig = getattr(c10d, name)
        if getattr(orig, "_deadpool_abortable", False):
            continue
        wrapped = _abortable(orig)
        setattr(c10d, name, wrapped)
        setattr(dist, name, wrapped)


def _abortable(orig):
    def p2p(tensor, *args, **kwargs):
        work = orig(tensor, *args, **kwargs)
        if work is None or tensor.device.type != "cpu" or isinstance(work, AbortableP2P):
            return work
        return AbortableP2P(work)

    p2p._deadpool_abortable = True
    p2p.__wrapped__ = orig
    p2p.__name__ = orig.__name__
    return p2p
