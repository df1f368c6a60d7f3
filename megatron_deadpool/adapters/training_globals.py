"""Megatron-LM's process-global training state (``megatron.training.global_vars``, the
timers, the rerun state machine) where a hot swap needs it set: on a promoted spare, which
parsed its arguments before it knew its rank, and on every rank after a restore."""

from __future__ import annotations


def adopt_rank(args) -> None:
    """A spare parsed its arguments before it knew its rank (RANK was unset): redo what
    ``set_global_variables`` decided from ``args.rank``, and never load a checkpoint on its
    own (its state comes from the buddy's memory)."""
    from megatron.training import global_vars as gv

    if args.rank == args.world_size - 1:
        if gv._GLOBAL_TENSORBOARD_WRITER is None:
            gv._set_tensorboard_writer(args)
        if gv._GLOBAL_WANDB_WRITER is None:
            gv._set_wandb_writer(args)
    args.load = None
    args.pretrained_checkpoint = None


def reset_after_restore(iteration: int) -> None:
    """Started timers trip ``assert not self._started``; the rerun state machine left in
    INITIAL_RUN would skip the retried step."""
    from megatron.core.rerun_state_machine import RerunState, get_rerun_state_machine
    from megatron.training.global_vars import get_timers

    timers = get_timers()
    for t in list(getattr(timers, "_timers", {}).values()):
        if getattr(t, "_started", False):
            t.stop()
    timers("interval-time", log_level=0).start()
    rsm = get_rerun_state_machine()
    rsm.state = RerunState.NOT_RUNNING_YET
    rsm.current_iteration = iteration
