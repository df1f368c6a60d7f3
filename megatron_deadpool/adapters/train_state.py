"""Capture and re-apply everything a rank needs to resume besides its tensors: RNG states
(python, numpy, torch, CUDA, megatron's tracker), the training counters, the scheduler and
the grad scaler. Used by the mirror (snapshot metadata) and by restore.

The training state is any object with ``iteration`` and ``consumed_train_samples``; one that
also has ``extra_state() -> dict`` and ``load_extra_state(dict)`` carries more (the Megatron-LM
integration keeps validation samples, FLOPs and the do_* flags there).
"""

from __future__ import annotations

import array
import random
from typing import Any, Dict

import torch


def _to_bytes(t: torch.Tensor) -> bytes:
    if t.device.type == "cpu" and t.dtype == torch.uint8 and t.is_contiguous():
        return t.numpy().tobytes()  # RNG states: ByteTensors (a few us instead of ~12)
    return t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()


def compact_rng(rng: dict) -> dict:
    """For the mirror's metadata: Python's state as packed 32-bit words (pickling its
    625-int tuple costs ~20 us a step). ``apply_rng`` reads both forms; ``capture`` keeps
    the tuple (the state fingerprint, ``canonical_bytes``, is computed from it)."""
    version, words, gauss = rng["python"]
    return dict(rng, python={"version": version, "words": array.array("I", words).tobytes(),
                             "gauss": gauss})


def _python_state(v):
    if isinstance(v, dict):
        return v["version"], tuple(array.array("I", v["words"])), v["gauss"]
    return v


def _from_bytes(b: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(b), dtype=torch.uint8)


def capture_rng(with_cuda: bool) -> dict:
    """Every generator a training step draws from. Tensors go in as raw bytes: pickling
    torch tensors costs milliseconds per step on the mirror thread."""
    import numpy as np
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    rng = {"python": random.getstate(), "numpy": np.random.get_state(),
           "torch": _to_bytes(torch.get_rng_state()),
           "tracker": {k: _to_bytes(v) for k, v in get_cuda_rng_tracker().get_states().items()}}
    if with_cuda:
        rng["cuda"] = _to_bytes(torch.cuda.get_rng_state())
    return rng


def apply_rng(rng: dict) -> None:
    import numpy as np
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    get_cuda_rng_tracker().set_states({k: _from_bytes(v) for k, v in rng["tracker"].items()})
    if "cuda" in rng:
        torch.cuda.set_rng_state(_from_bytes(rng["cuda"]))
    torch.set_rng_state(_from_bytes(rng["torch"]))
    np.random.set_state(rng["numpy"])
    random.setstate(_python_state(rng["python"]))


def capture(iteration: int, train_state, scheduler, optimizer, with_cuda: bool) -> dict:
    meta: Dict[str, Any] = {
        "iteration": iteration,
        "consumed_train_samples": int(train_state.consumed_train_samples),
        "rng": capture_rng(with_cuda),
    }
    if hasattr(train_state, "extra_state"):
        meta["extra"] = train_state.extra_state()
    if scheduler is not None:
        meta["scheduler_num_steps"] = int(scheduler.num_steps)
        if hasattr(scheduler, "state_dict"):  # its settings too: after a --load with
            # --use-checkpoint-opt_param-scheduler they come from the checkpoint, and a
            # promoted spare, which never loads one, built its own from the arguments
            meta["scheduler"] = {k: v for k, v in scheduler.state_dict().items()
                                 if v is None or isinstance(v, (int, float, str))}
    scaler = getattr(optimizer, "grad_scaler", None)
    if scaler is not None and hasattr(scaler, "state_dict"):
        meta["grad_scaler"] = scaler.state_dict()
    return meta


def apply(meta: dict, train_state, scheduler, optimizer) -> None:
    train_state.iteration = meta["iteration"]
    train_state.consumed_train_samples = meta["consumed_train_samples"]
    if "extra" in meta and hasattr(train_state, "load_extra_state"):
        train_state.load_extra_state(meta["extra"])
    if scheduler is not None and "scheduler_num_steps" in meta:
        for k, v in meta.get("scheduler", {}).items():
            if hasattr(scheduler, k):
                setattr(scheduler, k, v)
        scheduler.num_steps = meta["scheduler_num_steps"]
        scheduler.step(increment=0)
    scaler = getattr(optimizer, "grad_scaler", None)
    if scaler is not None and "grad_scaler" in meta:
        scaler.load_state_dict(meta["grad_scaler"])
    apply_rng(meta["rng"])


def canonical_bytes(meta) -> bytes:
    """A byte string that depends only on the values in ``meta`` (pickle also encodes which
    objects are shared, which differs between processes with equal state)."""
    import json

    import numpy as np

    def norm(v):
        if isinstance(v, bytes):
            return {"bytes": v.hex()}
        if isinstance(v, np.ndarray):
            return {"array": v.tolist(), "dtype": str(v.dtype)}
        if isinstance(v, torch.Tensor):
            return {"tensor": _to_bytes(v).hex(), "dtype": str(v.dtype)}
        if isinstance(v, dict):
            return {str(k): norm(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [norm(x) for x in v]
        if isinstance(v, np.generic):
            return v.item()
        return v

    return json.dumps(norm(meta), sort_keys=True, separators=(",", ":")).encode()


class MegatronTrainState:
    """What Megatron-LM keeps outside model and optimizer that a restore must bring back:
    counters on ``args`` plus the FLOPs total that ``train()`` keeps in a local."""

    EXTRA = ("consumed_valid_samples", "skipped_train_samples", "do_train", "do_valid",
             "do_test")

    def __init__(self, args):
        self.args = args
        self.iteration = args.iteration
        self.flops = float(getattr(args, "num_floating_point_operations_so_far", 0) or 0)

    @property
    def consumed_train_samples(self) -> int:
        return self.args.consumed_train_samples

    @consumed_train_samples.setter
    def consumed_train_samples(self, v: int) -> None:
        self.args.consumed_train_samples = v

    def extra_state(self) -> dict:
        out = {k: getattr(self.args, k) for k in self.EXTRA if hasattr(self.args, k)}
        out["flops"] = self.flops
        return out

    def load_extra_state(self, d: dict) -> None:
        for k in self.EXTRA:
            if k in d:
                setattr(self.args, k, d[k])
        self.flops = d.get("flops", self.flops)
        self.args.iteration = self.iteration
        self.args.num_floating_point_operations_so_far = self.flops
