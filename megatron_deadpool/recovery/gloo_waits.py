"""A survivor blocked in a gloo wait, point-to-point or collective, reaches the new plan
at the abort, not at the gloo operation deadline (issue 38: a bf16 recovery took 21.7 s,
15 of them in one "send operation to complete").

The abort wakes a gloo wait only through its connection: the socket shutdown (abort.py)
fails the pair, and gloo fails the operations queued on it. That covers the sockets the
abort knows (the groups built inside ``communicator_sockets``) while their pair is intact;
a wait whose connection the abort does not reach, or does not break, sits out the deadline:
a group that was not recorded, a peer that neither receives nor closes, a collective whose
dead member's socket the other members are not reading. Neither a timed wait nor polling
can get out of it: a timed ``wait`` that expires closes the pair ("Application timeout
caused pair closure"), and ``is_completed`` of a gloo send stays false until ``wait`` is
called.

So on a gloo world the main thread does not wait in gloo at all. Each CPU operation's work
is wrapped (``AbortableWork``): ``isend``/``irecv`` (and through them ``send``/``recv`` and
``batch_isend_irecv``), and the collectives in ``COLLECTIVES``, which run with
``async_op=True`` underneath and are waited on here when the caller asked for a blocking
call. A wrapped ``wait`` hands the real wait to the calling thread's waiter thread and
sleeps on an event that the waiter sets when gloo returns, or that the abort sets
(``abandon_all``, called by ``World.abort``). An abandoned wait raises a communication
failure (classify.py: "communicator was aborted"), which the recovery boundary takes as the
peer failure it is. A waiter still held in gloo is retired (it ends when its wait does, at
the old deadline) and the next generation's waits get a fresh one.

Cost on the happy path: one hand-off to a waiter thread per gloo wait (tens of
microseconds). CUDA tensors (NCCL, whose abort wakes everything) are not wrapped.
"""

from __future__ import annotations

import _thread
import inspect
import queue
import threading
from typing import Dict, Optional, Set

from . import group_ops

ABANDONED = "gloo wait abandoned at the abort: communicator was aborted"
WAITER = "deadpool-gloo-wait"
# the blocking-capable collectives Megatron-LM and this package call on gloo groups
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "_all_gather_base",
               "reduce_scatter_tensor", "_reduce_scatter_base", "broadcast", "reduce",
               "all_to_all_single", "barrier", "reduce_scatter", "gather", "scatter",
               "all_to_all")


class _Box:
    """One wait handed to a waiter. ``done`` is a lock held from the start and released
    once (gloo returned, or the abort): the caller blocks in its ``acquire``, the cheapest
    hand-back the standard library has (an Event is a Condition over a lock: several times
    the work per wait, paid on every gloo operation)."""

    __slots__ = ("work", "done", "finished", "abandoned", "error", "waiter", "ops")

    def __init__(self, work, waiter, ops=None):
        self.work, self.waiter, self.ops = work, waiter, ops  # ops: its group's tally
        self.done = _thread.allocate_lock()
        self.done.acquire()
        self.finished = self.abandoned = False
        self.error = None

    def finish(self) -> None:
        """(the waiter, or the abort: whichever comes first wakes the caller)"""
        self.finished = True
        try:
            self.done.release()
        except RuntimeError:  # released already by the other one
            pass


class _Waiter:
    """One thread that waits in gloo, in order, for the works one caller thread hands it."""

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
                if box.ops is not None:  # finished in gloo, even if the caller was woken
                    box.ops.done()       # by the abort first (group_ops.py)
            except BaseException as exc:  # noqa: BLE001 - handed to the thread that waits
                box.error = exc
            box.finish()
            # this frame runs until the next work: its locals must not keep the last one
            # (and what its error's frames hold) alive, where no heap scan can see them
            del box


_lock = threading.Lock()
_waiters: Dict[int, _Waiter] = {}  # caller thread's ident -> its waiter
_pending: Set[_Box] = set()
_epoch = 0  # aborts so far: a work made before the last one is never waited on in gloo
# From an abort until ``reopen`` (the aborted generation retired, or the next one live), no
# gloo operation starts: the main thread may still issue one before it learns of the abort,
# and on a group the abort did not shut (a kept one), a receive from a survivor that has
# moved on sat in gloo until its 15 s deadline (the stuck "recv" of the fault matrix and the
# bench, 2026-11-29)
_fenced = False


class AbortableWork:
    """A gloo operation's work whose ``wait`` the abort can end."""

    def __init__(self, work, ops: Optional[group_ops.Ops] = None):
        while isinstance(work, AbortableWork):  # wrapped twice: wait on the real one
            work = work._work
        self._work, self._box, self._epoch = work, None, _epoch
        self._ops = ops  # its group's tally (group_ops.py): done once it finished
        if ops is not None:
            ops.works.append(self)

    def wait(self, timeout=None) -> bool:
        if threading.current_thread().name == WAITER:  # never queue behind oneself
            self._work.wait()
            group_ops.waited(self._ops, self)
            self._ops, ops = None, self._ops
            if ops is not None:
                ops.done()
            return True
        if self._box is None:
            me = threading.get_ident()
            with _lock:
                if self._epoch != _epoch or _fenced:  # issued before an abort, first
                    raise RuntimeError(ABANDONED)       # waited on after it
                waiter = _waiters.get(me)
                if waiter is None:
                    waiter = _waiters[me] = _Waiter()
                self._hand_to(waiter)
        box = self._box
        if not box.finished:
            box.done.acquire()
        with _lock:
            _pending.discard(box)
        if box.abandoned:
            raise RuntimeError(ABANDONED)
        if box.error is not None:
            raise box.error
        return True

    def _hand_to(self, waiter: "_Waiter") -> None:
        """(under ``_lock``) queue this work on ``waiter``, which accounts for it from now
        on: its box is pending until waited for, its tally closed when gloo ends it."""
        box = self._box = _Box(self._work, waiter, self._ops)
        group_ops.waited(self._ops, self)
        self._ops = None
        _pending.add(box)
        waiter.q.put(box)

    def is_completed(self) -> bool:
        return self._box is not None and self._box.finished and not self._box.abandoned

    def never_waited(self) -> bool:
        return self._box is None and self._ops is not None

    def wait_for(self, timeout_s: float) -> bool:
        """(a recovery completing a group's collectives, repair.py) wait for at most
        ``timeout_s``; whether it finished without error. The wait in gloo runs on a waiter
        of its own, never on this thread: gloo's ``Work.wait(timeout)`` was seen to sit out
        the group's whole 15 s deadline on a work caught in flight (pretrain_gpt.py kills,
        2026-11-30: every rank's rebuild_groups took 15.5 s). A work not finished in time
        stays with its waiter, which closes its tally when gloo ends it; the abort ends it
        like any other wait."""
        if self._box is None:
            with _lock:
                waiter = _Waiter()
                self._hand_to(waiter)
                waiter.q.put(None)  # one work: the waiter ends after it
        box = self._box
        if not box.finished and not box.done.acquire(timeout=max(timeout_s, 0.001)):
            return False
        with _lock:
            _pending.discard(box)
        return not box.abandoned and box.error is None

    def __getattr__(self, name):
        return getattr(self._work, name)


def abandon_all() -> int:
    """(any thread; the abort) End every gloo wait in progress with a communication
    failure and retire the waiters that may be stuck in gloo; no gloo operation starts
    until ``reopen``. Returns how many waits."""
    global _epoch, _fenced
    with _lock:
        _epoch += 1
        _fenced = True
        boxes = list(_pending)
        _pending.clear()
        stuck = {id(b.waiter): b.waiter for b in boxes}
        for box in boxes:
            box.abandoned = True
            box.finish()
        for ident, waiter in list(_waiters.items()):
            if id(waiter) in stuck:
                waiter.q.put(None)  # it leaves once gloo lets go of it
                del _waiters[ident]
    return len(boxes)


def reopen() -> None:
    """(the main thread, once the aborted generation is retired, World.retire, or the next
    one is live, World.init_process_group: a world formed again after a failed formation is
    never retired) gloo operations may start again, on the groups kept and the new ones."""
    global _fenced
    with _lock:
        _fenced = False


def _refuse_if_fenced() -> None:
    """An operation issued between an abort and ``reopen`` fails at once, before gloo has
    it: nothing is posted on the group (its tally stays as it was), no wait can sit."""
    if _fenced:
        raise RuntimeError(ABANDONED)


def install() -> None:
    """Wrap ``torch.distributed``'s ``isend``/``irecv`` (under both names that
    ``batch_isend_irecv`` and ``P2POp`` check them by), ``COLLECTIVES`` and the coalescing
    manager (``_abortable_coalescing``) so that a gloo operation's wait is an
    ``AbortableWork``'s."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    for name in ("isend", "irecv") + COLLECTIVES:
        orig = getattr(c10d, name, None)
        if orig is None or getattr(orig, "_deadpool_abortable", False):
            continue
        if name not in ("isend", "irecv") and "async_op" not in inspect.signature(orig).parameters:
            continue  # a torch whose collective cannot run asynchronously: left as it is
        wrapped = _abortable_p2p(orig) if name in ("isend", "irecv") else _abortable(orig)
        setattr(c10d, name, wrapped)
        if getattr(dist, name, None) is orig:
            setattr(dist, name, wrapped)
    _install_coalescing(dist, c10d)
    _rebind_held(c10d)


def _rebind_held(c10d) -> int:
    """Every module imported already that holds one of torch's own functions under any name
    gets the wrapper instead: megatron-core binds its sequence-parallel and bucket
    collectives at import (``dist_all_gather_func = torch.distributed.all_gather_into_tensor``
    in tensor_parallel/mappings.py and layers.py, ``dist_reduce_scatter_func`` likewise,
    param_and_grad_buffer.py's ``_coalescing_manager``), and an operation issued through such
    a name was neither tallied (group_ops.py: its group looked idle and was kept) nor
    abandoned at the abort (it ran to gloo's deadline, which closes every pair of the group:
    "Application timeout caused pair closure"). Modules imported later read the wrapped
    names from ``torch.distributed``. Returns how many names were rebound."""
    import sys

    wrapped = {}
    for name in ("isend", "irecv", "_coalescing_manager") + COLLECTIVES:
        w = getattr(c10d, name, None)
        if getattr(w, "_deadpool_abortable", False):
            wrapped[id(w.__wrapped__)] = w
    rebound = 0
    for mod in list(sys.modules.values()):
        try:
            names = vars(mod)
            held = [(k, wrapped[id(v)]) for k, v in list(names.items())
                    if id(v) in wrapped and v is wrapped[id(v)].__wrapped__]
        except Exception:  # noqa: BLE001 - not a module, or one whose dict misbehaves
            continue
        for key, w in held:
            try:
                setattr(mod, key, w)
                rebound += 1
            except Exception:  # noqa: BLE001 - a read-only module attribute
                continue
    return rebound


def _mark(wrapper, orig):
    wrapper._deadpool_abortable = True
    wrapper.__wrapped__ = orig
    wrapper.__name__ = orig.__name__
    wrapper.__doc__ = orig.__doc__
    return wrapper


def _abortable_p2p(orig):
    names = list(inspect.signature(orig).parameters)[1:]  # (dst|src, group, tag, group_*)
    send = orig.__name__ == "isend"

    def p2p(tensor, *args, **kwargs):
        if tensor.device.type == "cpu":
            _refuse_if_fenced()
        work = orig(tensor, *args, **kwargs)
        if work is None or tensor.device.type != "cpu" or isinstance(work, AbortableWork):
            return work
        arguments = dict(zip(names, args))
        arguments.update(kwargs)
        return AbortableWork(work, _p2p_issued(arguments, send))

    return _mark(p2p, orig)


def _p2p_issued(arguments: dict, send: bool) -> Optional[group_ops.Ops]:
    """The tally of a message to or from a peer (its global rank) on its group."""
    import torch.distributed as dist

    group = arguments.get("group")
    peer = arguments.get("dst" if send else "src")
    if peer is None:
        local = arguments.get("group_dst" if send else "group_src")
        peer = dist.get_global_rank(group, local) if local is not None else None
    return group_ops.issued(group, peer, send) if peer is not None else None


def _on_gloo(arguments: dict) -> bool:
    """A CPU tensor goes to gloo; without a tensor (a barrier), the group's backend says."""
    import torch
    import torch.distributed as dist

    for value in arguments.values():
        if isinstance(value, (list, tuple)) and value:
            value = value[0]
        if isinstance(value, torch.Tensor):
            return value.device.type == "cpu"
    try:
        return dist.get_backend(arguments.get("group")) == "gloo"
    except (ValueError, RuntimeError):  # not a member of that group: torch's own answer
        return False


def _abortable(orig):
    names = list(inspect.signature(orig).parameters)  # has async_op (install checks)
    at = names.index("async_op")

    def collective(*args, **kwargs):
        arguments = dict(zip(names, args))  # what a signature bind gives, for less
        arguments.update(kwargs)
        if not _on_gloo(arguments):
            return orig(*args, **kwargs)
        _refuse_if_fenced()
        blocking = not arguments.get("async_op", False)
        if len(args) > at:
            args = args[:at] + (True,) + args[at + 1:]
        else:
            kwargs["async_op"] = True
        work = orig(*args, **kwargs)
        if work is None or type(work).__name__ == "_IllegalWork":  # not a member; coalescing
            return None if blocking else work
        if not isinstance(work, AbortableWork):  # not wrapped (and counted) further in:
            # on CPU the device mode's __torch_function__ calls this wrapper again
            work = AbortableWork(work, group_ops.issued(
                arguments.get("group"), desc=describe(orig.__name__, arguments)))
        if not blocking:
            return work
        work.wait()
        return None

    return _mark(collective, orig)


def _install_coalescing(dist, c10d) -> None:
    """torch's ``_coalescing_manager`` waits on its work itself when the block ends (Megatron's
    data-parallel reduce-scatter and all-gather of buckets): wrapped under torch's names (and
    by ``_rebind_held`` under any module's that imported it already: megatron-core's
    param_and_grad_buffer)."""
    orig = getattr(c10d, "_coalescing_manager", None)
    if orig is None or getattr(orig, "_deadpool_abortable", False):
        return
    wrapped = _abortable_coalescing(orig)
    for mod in (c10d, dist):  # other modules' names: _rebind_held
        if getattr(mod, "_coalescing_manager", None) is orig:
            setattr(mod, "_coalescing_manager", wrapped)


def _abortable_coalescing(orig):
    """On a gloo group the block's ops run asynchronously and their works are waited on as
    ``AbortableWork``s: at the block's end if the caller asked for a blocking block, else
    by the caller's ``cm.wait()``."""
    import contextlib

    @contextlib.contextmanager
    def coalescing(group=None, device=None, async_ops=False):
        if not _on_gloo({"group": group}) or (device is not None and
                                                torch_device_type(device) != "cpu"):
            with orig(group=group, device=device, async_ops=async_ops) as cm:
                yield cm
            return
        _refuse_if_fenced()
        with orig(group=group, device=device, async_ops=True) as cm:
            yield cm
            desc = _describe_coalesced(group)  # (torch takes the block's ops as it leaves)
        cm.works[:] = [w if w is None or isinstance(w, AbortableWork)
                       else AbortableWork(w, group_ops.issued(group, desc=desc))
                       for w in cm.works]
        if not async_ops:
            cm.wait()
            cm.works.clear()

    return _mark(coalescing, orig)


def torch_device_type(device) -> str:
    import torch

    return torch.device(device).type


# What a collective was, so that a member of its group that never issued it can issue the
# same one (recovery/repair.py completes a group caught with it in flight): the function's
# name, the output's and the input's element counts, the dtype, the reduction. Only these
# can be issued again from a description; any other is None (its group is rebuilt).
_OUT_IN = {"all_reduce": ("tensor", None),
           "reduce_scatter_tensor": ("output", "input"), "_reduce_scatter_base":
           ("output", "input"), "reduce_scatter_single": ("output", "input"),
           "all_gather_into_tensor": ("output_tensor", "input_tensor"),
           "_all_gather_base": ("output_tensor", "input_tensor"),
           "all_gather_single": ("output_tensor", "input_tensor"), "barrier": (None, None)}


def describe(name: str, arguments: dict) -> Optional[list]:
    """``[False, [[name, out numel, in numel, dtype, reduction]]]``, or None."""
    if name not in _OUT_IN:
        return None
    out_key, in_key = _OUT_IN[name]
    out, inp = arguments.get(out_key) if out_key else None, \
        arguments.get(in_key) if in_key else None
    if (out_key and out is None) or (in_key and inp is None):
        return None
    op = arguments.get("op") if "op" in arguments else None
    t = out if out is not None else inp
    return [False, [[name, out.numel() if out is not None else 0,
                     inp.numel() if inp is not None else 0,
                     str(t.dtype) if t is not None else None, _op_name(op)]]]


def _describe_coalesced(group) -> Optional[list]:
    """A coalescing block's ops, as torch queued them for ``group``: ``[True, [...]]``."""
    from torch.distributed import distributed_c10d as c10d

    ops = c10d._world.pg_coalesce_state.get(group or c10d._get_default_group(), [])
    out = []
    for op in ops:
        name = getattr(op.op, "__name__", "")
        if name not in ("all_reduce", "all_gather_single", "reduce_scatter_single"):
            return None
        dst = getattr(op, "dst_tensor", None)
        out.append([name, dst.numel() if dst is not None else 0, op.tensor.numel(),
                    str(op.tensor.dtype), _op_name(getattr(op, "redop", None))])
    return [True, out] if out else None


def _op_name(op) -> Optional[str]:
    return None if op is None else str(op).split(".")[-1]


def issue_again(group, desc: list) -> list:
    """Issue on ``group`` (a gloo group of this process) the collectives ``desc`` describes
    (``describe``), on zeros, asynchronously, through the wrapped functions (so they are
    tallied like the originals). Returns their works; raises on a description it cannot
    issue."""
    import torch
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    coalesced, ops = desc
    calls = []
    for name, n_out, n_in, dtype, op in ops:
        kind = getattr(torch, str(dtype).replace("torch.", "")) if dtype else torch.float32
        fn = getattr(c10d, name)
        out, inp = torch.zeros(n_out, dtype=kind), torch.zeros(n_in, dtype=kind)
        red = {} if op is None else {"op": getattr(dist.ReduceOp, op)}
        if name == "all_reduce":  # one tensor (a coalesced one's is counted as the input)
            out = torch.zeros(max(n_out, n_in), dtype=kind)
            calls.append(lambda fn=fn, out=out, red=red: fn(out, group=group, async_op=True,
                                                            **red))
        elif name == "barrier":
            calls.append(lambda fn=fn: fn(group=group, async_op=True))
        else:
            calls.append(lambda fn=fn, out=out, inp=inp, red=red:
                         fn(out, inp, group=group, async_op=True, **red))
    if not coalesced:
        return [call() for call in calls]
    with c10d._coalescing_manager(group=group, async_ops=True) as cm:
        for call in calls:
            call()
    return list(cm.works)
