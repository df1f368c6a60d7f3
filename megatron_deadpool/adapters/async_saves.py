"""Megatron-LM's ``--async-save`` across a hot swap.

With ``--async-save`` (both tags need ``--use-persistent-ckpt-worker`` for it, else
Megatron turns it off) ``save_checkpoint`` plans the save collectively, hands the writes
to the rank's persistent writer process (``PersistentAsyncCaller``: a spawned interpreter,
which holds no process group; the writes fork their own children) and queues the request
in ``megatron.training.async_utils``. A later loop top finalizes it on every rank at once:
the write results gathered, ``.metadata`` written, rank 0's tracker file advanced.

A failure abandons every unfinalized save (:func:`abandon`, at the recovery, before the
rebuild): its finalize functions (closures over the dead generation's groups) are dropped
unrun, so the tracker is not advanced; the writer and every process it forked are killed
(they would go on writing into the abandoned iteration's directory); the write results
they left in the rank's results queue are drained (the next save's finalize reads that
queue); and the module gets a fresh queue, as ``initialize_megatron`` made it, whose
writer starts again. The dead ranks' writers died with their node (a node loss takes
the whole session: ``launch/agent.py``). Completing an interrupted save is never tried:
the dead ranks' shards of it are lost. The checkpoint cadence (``cadence.py``) writes
the abandoned save again when the restore lands on its iteration.

In CPU mode the writer, a fresh interpreter, lacks the CPU layer (its first call,
``torch.cuda.set_device(rank % device_count())``, divides by zero): :func:`cpu_writer`
makes it switch the layer on first.
"""

from __future__ import annotations

import inspect
import os
import signal
import time
from typing import Callable, Dict, List, Optional

_ORIGINAL: Optional[Callable] = None  # PersistentAsyncCaller.async_loop, once replaced


def cpu_writer() -> None:
    """CPU mode: the persistent writer enables the CPU layer before Megatron's loop runs
    (the target is pickled by name, so the spawned process imports this module)."""
    global _ORIGINAL
    from megatron.core.dist_checkpointing.strategies import async_utils as core

    if _ORIGINAL is None:
        _ORIGINAL = core.PersistentAsyncCaller.__dict__["async_loop"].__func__
        core.PersistentAsyncCaller.async_loop = staticmethod(_cpu_async_loop)


def _cpu_async_loop(*args, **kwargs):
    import torch

    from . import cpu_mode
    from megatron.core.dist_checkpointing.strategies import async_utils as core

    cpu_mode.enable()
    torch.set_num_threads(1)
    loop = _ORIGINAL or core.PersistentAsyncCaller.async_loop  # unreplaced in a new process
    return loop(*args, **kwargs)


# ---------------------------------------------------------------------------- abandon
def abandon(args) -> Dict[str, object]:
    """At a recovery, before the rebuild (every rank; a no-op without saves in flight):
    drop the unfinalized saves unfinalized, kill the writer process trees, drain the
    write results, and give ``megatron.training.async_utils`` a fresh queue. Returns
    {"dropped": saves abandoned, "killed": pids}."""
    from megatron.training import async_utils as au

    queue = au._async_calls_queue
    dropped = queue.get_num_unfinalized_calls() if queue is not None else 0
    killed: List[int] = []
    # Every rank that ever scheduled a save starts again from a fresh queue, also with
    # nothing in flight: the finalize agrees on the queues' call index (an all-reduce,
    # "Unmatched async calls" otherwise), and a promoted spare's queue is fresh. A kill as
    # a save began left some survivors with the save scheduled and others without.
    if queue is not None and (dropped or getattr(queue, "call_idx", -1) != -1):
        for proc in _writers(queue):
            killed += kill_tree(proc.pid)
            proc.join(timeout=5)
        queue.async_calls.clear()  # never finalized: no metadata, no tracker
        queue.close(abort=True)
        _fresh_queue(au, args)
    if dropped:
        print(f"[deadpool] abandoned {dropped} unfinalized async save(s); writer processes "
              f"killed: {killed}", flush=True)
    drain_results()
    return {"dropped": dropped, "killed": killed}


def _writers(queue) -> list:
    """The persistent writer processes behind ``queue`` (core_v0.16.1 keeps them on the
    queue's caller; core_v0.19.0 on the classes)."""
    callers = {id(c): c for c in (getattr(queue, "persistent_caller", None),
                                  getattr(type(queue), "_persistent_caller", None),
                                  *(call.async_caller for call in queue.async_calls))
               if c is not None}
    procs = [getattr(c, "process", None) for c in callers.values()]
    cls = type(next(iter(callers.values()), None))
    procs.append(getattr(cls, "_persistent_process", None))
    seen, out = set(), []
    for p in procs:
        if p is not None and getattr(p, "pid", None) and p.pid not in seen:
            seen.add(p.pid)
            out.append(p)
    return out


def _fresh_queue(au, args) -> None:
    """As ``initialize_megatron`` leaves it: a persistent queue (core_v0.19.0 also
    starts its writer now, ``forkserver`` as at startup)."""
    init = au.init_persistent_async_worker
    if not getattr(args, "use_persistent_ckpt_worker", False):
        au._async_calls_queue = type(au._async_calls_queue)()
    elif inspect.signature(init).parameters:
        au._async_calls_queue = None
        init(args.rank, "forkserver")
    else:
        init()


def drain_results() -> int:
    """Empty this rank's write-results queue (``filesystem_async._results_queue``): a
    save cut off after its writes left its results there, and the next save's finalize
    would read them as its own. Returns how many were dropped."""
    from queue import Empty

    from megatron.core.dist_checkpointing.strategies import filesystem_async as fa

    q, n = getattr(fa, "_results_queue", None), 0
    while q is not None:
        try:
            q.get_nowait()
            n += 1
        except (Empty, EOFError, OSError):
            break
    return n


# ---------------------------------------------------------------------------- processes
def process_tree(root: int, parent_of: Dict[int, int]) -> List[int]:
    """``root`` and all its descendants, parents first, from a {pid: parent pid} map.
    Pure."""
    children: Dict[int, List[int]] = {}
    for pid, ppid in parent_of.items():
        children.setdefault(ppid, []).append(pid)
    out, todo = [], [root]
    while todo:
        pid = todo.pop(0)
        if pid not in out:
            out.append(pid)
            todo += sorted(children.get(pid, ()))
    return out


def _parents() -> Dict[int, int]:
    out = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            out[int(name)] = int(stat.rsplit(")", 1)[1].split()[1])
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def kill_tree(root: int, timeout: float = 5.0) -> List[int]:
    """SIGKILL ``root`` and every descendant (stopped first, so none forks or is
    re-parented away in between); wait until none runs. Returns the pids."""
    tree: List[int] = []
    for _ in range(3):
        tree = process_tree(root, _parents())
        for pid in tree:
            _signal(pid, signal.SIGSTOP)
    for pid in tree:
        _signal(pid, signal.SIGKILL)
    deadline = time.monotonic() + timeout
    while any(_alive(p) for p in tree) and time.monotonic() < deadline:
        time.sleep(0.01)
    return tree


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
