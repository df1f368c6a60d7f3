"""Refuse, at startup, Megatron configurations whose process groups cannot be rebound at
runtime (their communicators are baked into objects DeadPool cannot reach or rebuild)."""

from __future__ import annotations

from typing import List, Optional, Sequence

from ..base.errors import UnsupportedConfigError


def unsupported_features(model_chunks: Sequence) -> List[str]:
    found = []
    for chunk in model_chunks:
        cfg = getattr(chunk, "config", None)
        ddp = getattr(chunk, "ddp_config", None)
        if cfg is not None:
            if getattr(cfg, "tp_comm_overlap", False):
                found.append("TP communication overlap / userbuffers (--tp-comm-overlap)")
            if getattr(cfg, "enable_cuda_graph", False) or getattr(
                    cfg, "cuda_graph_impl", "none") not in ("none", None):
                found.append("CUDA graphs (--cuda-graph-impl / --enable-cuda-graph)")
        if ddp is not None:
            if getattr(ddp, "nccl_ub", False):
                found.append("NCCL user buffers (--use-nccl-ub)")
            if getattr(ddp, "use_megatron_fsdp", False):
                found.append("Megatron-FSDP (--use-megatron-fsdp)")
        if type(chunk).__name__ in ("FullyShardedDataParallel", "TorchFullyShardedDataParallel"):
            found.append(f"{type(chunk).__name__}")
    return sorted(set(found))


def unsupported_optimizer(optimizer) -> List[str]:
    """Optimizer settings whose live state DeadPool cannot write back in place."""
    from .shard import distributed_optimizers

    found = []
    for opt in distributed_optimizers(optimizer):
        cfg = getattr(opt, "config", None)
        if getattr(cfg, "use_precision_aware_optimizer", False):
            # Its _get_main_param_and_optimizer_states returns unscaled copies
            # (get_unscaled_state): a snapshot would read them, but a restore would write
            # into temporaries and leave the optimizer's real state untouched.
            found.append("the precision-aware optimizer (--use-precision-aware-optimizer): "
                         "its main params and moments are returned as copies, so a restore "
                         "could not write them back")
    return sorted(set(found))


def step_barrier(optimizer) -> Optional[str]:
    """None if ``optimizer.step`` returns on a rank only once every rank has entered it: each
    distributed optimizer clips gradients (``clip_grad > 0``) by a norm all-reduced over a
    group of the world's size (megatron-core 0.16.1: ``grad_stats_parallel_group``, the whole
    world for the distributed optimizer). Otherwise the reason it does not (the mirror then
    commits with its own collective, mirror/commit.py)."""
    import torch.distributed as dist

    from .shard import distributed_optimizers

    if not dist.is_initialized():
        return "no process group"
    world = dist.get_world_size()
    for opt in distributed_optimizers(optimizer):
        clip = getattr(getattr(opt, "config", None), "clip_grad", 0.0) or 0.0
        if clip <= 0:
            return "gradient clipping is off (--clip-grad 0)"
        group = opt.get_grad_stats_parallel_group()
        size = dist.get_world_size(group)
        if size != world:
            return f"the gradient norm is reduced over {size} of {world} ranks"
    return None


def check_supported(model_chunks: Sequence, optimizer=None) -> None:
    bad = unsupported_features(model_chunks)
    if optimizer is not None:
        bad += unsupported_optimizer(optimizer)
    if bad:
        raise UnsupportedConfigError(
            "--deadpool does not support: " + "; ".join(bad)
            + ". Disable these features or run without --deadpool.")


def parallel_layout(world: int) -> tuple:
    """(world, tp, pp, dp) of this job, from megatron's parallel state (what fallback files
    are saved and resumed under: mirror/persist.py)."""
    from megatron.core import parallel_state as ps

    return (world, ps.get_tensor_model_parallel_world_size(),
            ps.get_pipeline_model_parallel_world_size(), ps.get_data_parallel_world_size())
