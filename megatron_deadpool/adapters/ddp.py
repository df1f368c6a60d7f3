"""Megatron-core's data-parallel communication state across a hot swap: the bucket groups of
``DistributedDataParallel`` with ``--overlap-grad-reduce`` / ``--overlap-param-gather``.

An abort can leave a bucket group with a pending reduce-scatter or parameter all-gather on a
group of the dead generation. Waiting on it would fail (or, on gloo, talk to the old
sockets), so ``drop_pending`` forgets those handles without waiting. It also puts every
bucket group back to its first-batch mode on *every* rank: a promoted spare's bucket groups
are new and start in that mode, and a rank in it issues its reduce-scatters in
``finish_grad_sync`` order rather than as gradients become ready. Survivors and spares then
issue the redone iteration's collectives in one order; the values reduced are the same.

After the restore's forced parameter all-gather (``shard.copy_main_params_to_model``) every
bucket group is marked dispatched, so the forward pre-hooks of the redone iteration issue no
all-gather on a survivor, exactly as on a spare whose hooks are still off.
"""

from __future__ import annotations

from typing import Callable, Iterator, Optional, Sequence, Tuple

from .tags import TAGS

TAG_RESETS = {k: v for tag in TAGS for k, v in tag.bucket_group_resets.items()}


def bucket_groups(model_chunks: Sequence) -> Iterator:
    """Every bucket group of every DDP model chunk (dense and expert-parallel)."""
    for chunk in model_chunks:
        for name in ("bucket_groups", "expert_parallel_bucket_groups"):
            yield from getattr(chunk, name, None) or ()


def drop_pending(model_chunks: Sequence) -> int:
    """Forget every pending grad-reduce and param-gather handle (never waited on: their
    group is dead) and return the bucket groups to first-batch mode. Returns how many
    handles were dropped."""
    dropped = 0
    for bg in bucket_groups(model_chunks):
        for attr in ("grad_reduce_handle", "param_gather_handle"):
            if getattr(bg, attr, None) is not None:
                dropped += 1
            setattr(bg, attr, None)
        bg.param_gather_dispatched = False
        bg.per_param_grad_ready_counts = {}
        bg.golden_per_param_grad_ready_counts = {}
        bg.is_first_batch = True
        bg.is_last_microbatch = True
        for attr, value in TAG_RESETS.items():  # fields some tags add (tags.py)
            if hasattr(bg, attr):
                setattr(bg, attr, value)
    return dropped


def pending(model_chunks: Sequence) -> int:
    """How many bucket groups hold a pending handle (tests: zero after a recovery)."""
    return sum(1 for bg in bucket_groups(model_chunks)
               if bg.grad_reduce_handle is not None or bg.param_gather_handle is not None)


def forward_pre_hooks_on(model_chunks: Sequence) -> bool:
    """Whether the chunks' parameter all-gather forward pre-hooks are registered."""
    return any(len(getattr(c, "remove_forward_pre_hook_handles", None) or ()) > 0
               for c in model_chunks)


def set_forward_pre_hooks(model_chunks: Sequence, on: bool) -> None:
    """Register or remove the forward pre-hooks (no parameter sync: the restore did it)."""
    if on == forward_pre_hooks_on(model_chunks):
        return
    for chunk in model_chunks:
        if on:
            chunk.enable_forward_pre_hook()
        else:
            chunk.disable_forward_pre_hook(param_sync=False)


def realign_forward_pre_hooks(model_chunks: Sequence, args, after_first_step: bool
                              ) -> Tuple[bool, Optional[Callable]]:
    """After a recovery in Megatron-LM's ``train()``. With ``--overlap-param-gather`` it
    runs a process's first iteration with the pre-hooks off and ``config.param_sync_func``
    unset, and turns both on after it; an evaluation turns the hooks off while it runs.
    Returns (hooks on, held ``param_sync_func``) for the top of the redone iteration:

    - the pre-hooks are on unless this is the process's first iteration
      (``after_first_step`` false), as in a failure-free run;
    - ``param_sync_func`` (the interleaved schedule's all-gather dispatch, with
      ``--align-param-gather``) is unset for the redone iteration on every rank, as on a
      promoted spare, whose first iteration it is: a survivor would otherwise dispatch
      all-gathers that the spare never joins. The restore's forced all-gather already
      synced the parameters, so the redone iteration needs none. A held function goes back
      with ``release_param_sync`` once that iteration is done (``train()`` puts its own
      back after a first iteration)."""
    from megatron.core.utils import get_model_config
    from megatron.training.training import should_disable_forward_pre_hook

    if not should_disable_forward_pre_hook(args):
        return False, None
    set_forward_pre_hooks(model_chunks, after_first_step)
    config = get_model_config(model_chunks[0])
    held = config.param_sync_func if after_first_step else None
    config.param_sync_func = None
    return after_first_step, held


def release_param_sync(model_chunks: Sequence, held: Callable) -> None:
    """Put back the ``param_sync_func`` that ``realign_forward_pre_hooks`` held."""
    from megatron.core.utils import get_model_config

    get_model_config(model_chunks[0]).param_sync_func = held
