"""Refuse, at startup, Megatron configurations whose process groups cannot be rebound at
runtime (their communicators are baked into objects DeadPool cannot reach or rebuild)."""

from __future__ import annotations

from typing import List, Sequence

from ..errors import UnsupportedConfigError


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


def check_supported(model_chunks: Sequence) -> None:
    bad = unsupported_features(model_chunks)
    if bad:
        raise UnsupportedConfigError(
            "--deadpool cannot rebind the process groups of: " + "; ".join(bad)
            + ". Disable these features or run without --deadpool.")
