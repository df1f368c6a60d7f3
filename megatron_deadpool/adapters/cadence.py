"""Megatron-LM's checkpoint cadence across a hot swap.

``train()`` saves at the end of a loop body (``iteration % save_interval == 0``), after
the session's ``after_step`` (megatron/lm.py) began that iteration's snapshot and after its
evaluation. A restore to iteration r therefore lands *before* the save at r. Without a redo,
a save that the failure interrupted (or abandoned: ``async_saves.py``) is never written, and
the run's next checkpoint comes one interval late.

:class:`Saves` redoes it, like ``evaluation.Evaluations``: after a restore to r (a
survivor's ``recover``, a promoted spare's ``attach``) it is armed when the failure-free
run saved at r (r reached by a step of this run: not the initial commit), and every rank
runs it at its next ``before_step`` (or when ``train()`` returns, after a restore to the
last iteration), after the redone evaluation. It is skipped when the save directory
already holds r complete (the tracker names r or later and r's directory exists: the
tracker is written only once every rank's writes are finalized); the ranks agree on that
with one all-reduce. A partial directory is removed before the save writes it again.
"""

from __future__ import annotations

import os
import shutil
from typing import Any, Dict, Optional

TRACKER = "latest_checkpointed_iteration.txt"  # Megatron's tracker file


def due(args, iteration: int, meta: Optional[dict]) -> bool:
    """Whether the failure-free run saved at ``iteration`` (the condition ``train()``
    uses), for a restore of ``meta``. Pure."""
    if meta is None or meta.get("initial"):
        return False
    interval = getattr(args, "save_interval", None)
    return bool(getattr(args, "save", None) and interval and iteration % interval == 0)


def iteration_dir(save_dir: str, iteration: int) -> str:
    return os.path.join(save_dir, f"iter_{iteration:07d}")


def tracked(save_dir: str) -> Optional[int]:
    """The iteration Megatron's tracker file names (None: no tracker, or "release")."""
    try:
        with open(os.path.join(save_dir, TRACKER)) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def complete(save_dir: str, iteration: int) -> bool:
    """Whether ``save_dir`` holds a finalized save of ``iteration``."""
    t = tracked(save_dir)
    return t is not None and t >= iteration and os.path.isdir(iteration_dir(save_dir,
                                                                              iteration))


def remove_partial(save_dir: str, iteration: int) -> bool:
    """Remove an unfinalized ``iteration`` directory (never a symbolic link)."""
    d = iteration_dir(save_dir, iteration)
    if os.path.isdir(d) and not os.path.islink(d) and not complete(save_dir, iteration):
        shutil.rmtree(d)
        return True
    return False


class Saves:
    def __init__(self) -> None:
        self._due: Optional[int] = None
        self.redone = []  # iterations saved again (the launch summary's counters)

    def arm(self, args, iteration: int, meta: Optional[dict]) -> None:
        """After a restore to ``iteration`` with metadata ``meta``."""
        self._due = iteration if due(args, iteration, meta) else None

    def run_if_due(self, training_module, args, iteration: int, flops: float,
                   train_args: Optional[Dict[str, Any]]) -> bool:
        """Where the redone evaluation runs: save ``iteration`` as ``train()`` does
        (``save_checkpoint_and_time``), unless every rank sees it complete."""
        if self._due is None or self._due != iteration or train_args is None:
            self._due = None
            return False
        self._due = None
        if not _any_rank(not complete(args.save, iteration)):
            return False
        import torch.distributed as dist

        if dist.get_rank() == 0:
            remove_partial(args.save, iteration)
        dist.barrier()
        x = train_args
        training_module.save_checkpoint_and_time(
            iteration, x["model"], x["optimizer"], x["opt_param_scheduler"], flops,
            x["checkpointing_context"], train_data_iterator=x.get("train_data_iterator"))
        self.redone.append(iteration)
        print(f"[deadpool] the save at iteration {iteration} written again after the restore "
              "(checkpoint cadence)", flush=True)
        return True


def _any_rank(flag: bool) -> bool:
    import torch
    import torch.distributed as dist

    device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
    t = torch.tensor([int(flag)], dtype=torch.int32, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())
