"""Megatron-LM's own checkpoints (``--save``/``--load``) across a hot swap.

``pretrain()`` keeps a ``checkpointing_context`` dict for the whole run and
``save_checkpoint`` caches its sharded save strategy there after the first save. With
``--ckpt-fully-parallel-save`` (the default) that strategy is a
``FullyParallelSaveStrategyWrapper`` holding the data-parallel group of the generation that
made it, and a cached save distribution computed over it. After a rebuild that group is
gone from torch's world map, and the next save raises ``Process group ... is not
initialized in the world group map``.

The context is a local of ``pretrain()``, out of the rebind walk's reach (model, DDP,
optimizer). So :class:`CheckpointContexts` wraps ``save_checkpoint`` in the training
module's namespace, remembers each context it is given, and after a recovery drops the
cached strategies: the next save builds them again on the new groups, exactly as the first
save of the run did (a promoted spare, whose context is new, does the same).
"""

from __future__ import annotations

import functools
import inspect
from typing import Callable, List, Optional

# What save_checkpoint / load_checkpoint cache in the context: each may hold a group.
CACHED_STRATEGIES = ("save_strategy", "load_strategy")


class CheckpointContexts:
    def __init__(self) -> None:
        self._contexts: List[dict] = []

    def wrap(self, training_module,
             after_save: Optional[Callable[[int], None]] = None) -> None:
        """Replace ``training_module.save_checkpoint`` (the name ``train()`` calls) by a
        wrapper that records the ``checkpointing_context`` it is given, and calls
        ``after_save(iteration)`` once the save call returns. Idempotent."""
        orig: Callable = training_module.save_checkpoint
        if getattr(orig, "_deadpool_contexts", None) is self:
            return
        sig = inspect.signature(orig)

        @functools.wraps(orig)
        def save_checkpoint(*args, **kwargs):
            bound = sig.bind_partial(*args, **kwargs).arguments
            ctx = bound.get("checkpointing_context")
            if isinstance(ctx, dict) and not any(c is ctx for c in self._contexts):
                self._contexts.append(ctx)
            out = orig(*args, **kwargs)
            if after_save is not None:
                after_save(bound["iteration"])
            return out

        save_checkpoint._deadpool_contexts = self
        training_module.save_checkpoint = save_checkpoint

    def forget_groups(self) -> List[str]:
        """After a rebuild: drop every cached strategy (they hold the old groups). Returns
        the keys dropped."""
        dropped = []
        for ctx in self._contexts:
            for key in CACHED_STRATEGIES:
                if ctx.pop(key, None) is not None:
                    dropped.append(key)
        return dropped


# ---------------------------------------------------------------------------- comparison
def load_tensors(checkpoint_dir: str) -> dict:
    """Every tensor of one ``torch_dist`` checkpoint iteration directory (e.g.
    ``ck/iter_0000008``), as a flat {key: tensor} dict, read in this process alone (no
    process group): each sharded tensor assembled whole."""
    import torch
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    sd: dict = {}
    _load_state_dict(sd, storage_reader=FileSystemReader(checkpoint_dir),
                     planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    flat = {}

    def walk(prefix, obj):
        if isinstance(obj, torch.Tensor):
            flat[prefix] = obj
        elif isinstance(obj, dict):
            for k, v in obj.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)

    walk("", sd)
    return flat


def compare(a_dir: str, b_dir: str) -> dict:
    """Whether two checkpoint iteration directories hold the same tensors, bit for bit:
    {"equal", "tensors", "only_in_a", "only_in_b", "differing"}."""
    import torch

    a, b = load_tensors(a_dir), load_tensors(b_dir)
    differing = sorted(k for k in a.keys() & b.keys()
                       if a[k].dtype != b[k].dtype or a[k].shape != b[k].shape
                       or not torch.equal(a[k].view(-1).view(torch.uint8)
                                          if a[k].numel() else a[k],
                                          b[k].view(-1).view(torch.uint8)
                                          if b[k].numel() else b[k]))
    only_a, only_b = sorted(a.keys() - b.keys()), sorted(b.keys() - a.keys())
    return {"equal": bool(a) and not (differing or only_a or only_b), "tensors": len(a),
            "only_in_a": only_a, "only_in_b": only_b, "differing": differing}
