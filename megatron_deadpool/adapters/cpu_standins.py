"""Stand-ins, in CPU mode only (``cpu_mode.enable``), for megatron-core features whose GPU
implementations (apex, Transformer Engine) are absent on CPU. Each one does what the GPU
module does, in plain torch, and nothing else:

* ``sequence_parallel_norm``: ``--sequence-parallel`` with the local layer spec.
  megatron-core's ``WrappedTorchNorm`` refuses it ("sequence parallel not supported by
  torch LayerNorm"); apex's ``FusedLayerNorm`` and TE's norms support it by marking their
  parameters ``sequence_parallel``, so that ``finalize_model_grads`` all-reduces their
  gradients over the tensor-parallel group (each TP rank saw only its sequence slice). The
  stand-in builds the same torch norm and marks its parameters the same way.
* ``moe_router_gemm``: core_v0.16.1's ``moe_utils`` imports ``te_general_gemm`` from TE
  and leaves the name undefined when TE is absent, so MoE routing raises ``NameError`` in
  ``router_gating_linear``. core_v0.19.0 sets it to ``None`` (the plain matmul path);
  the stand-in does the same on 0.16.1.
* ``empty_adam_state_dict``: ``--load`` on the fp32 torch-Adam path (below), including a
  ``step`` tensor that the load shares between all parameters (``_unshare_steps``).
* ``overlapped_p2p_sends``: the interleaved pipeline's overlapped p2p (``_p2p_ops``) on gloo.
  The schedule frees each sent output (``deallocate_output_tensor``: ``out.data = ...``)
  before it waits on its ``isend``; gloo's send work keeps the tensor object, whose storage
  that swap frees, so the send read freed memory (bf16 + VPP: NaN at iteration 1; fp32 +
  VPP: silently different gradients). Each send request keeps the sent storage until waited.
"""

from __future__ import annotations

import torch


def install() -> None:
    sequence_parallel_norm()
    moe_router_gemm()
    empty_adam_state_dict()
    overlapped_p2p_sends()


def sequence_parallel_norm() -> None:
    try:
        from megatron.core.transformer import torch_norm
    except ImportError:  # megatron-core not installed: nothing to patch
        return
    cls = torch_norm.WrappedTorchNorm
    orig = cls.__new__
    if getattr(orig, "_deadpool_cpu", False):
        return

    def __new__(klass, config, *args, **kwargs):
        if not getattr(config, "sequence_parallel", False):
            return orig(klass, config, *args, **kwargs)
        config.sequence_parallel = False  # (a copy would run the config's checks again)
        try:
            norm = orig(klass, config, *args, **kwargs)
        finally:
            config.sequence_parallel = True
        for param in norm.parameters():  # as TE's and apex's norms do
            setattr(param, "sequence_parallel", True)
        return norm

    __new__._deadpool_cpu = True
    cls.__new__ = staticmethod(__new__)


def moe_router_gemm() -> None:
    try:
        from megatron.core.transformer.moe import moe_utils
    except ImportError:
        return
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def empty_adam_state_dict() -> None:
    """``--load`` stand-ins (two upstream limits of the fp32, torch-Adam path). Without Apex
    or TE (CPU), core_v0.16.1's
    ``DistributedOptimizer.state_dict`` asserts that torch Adam's state holds exactly one
    ``step`` value; before the first step that state is empty, and ``load_checkpoint``
    builds the state dict to load into before any step: the assertion fails and no
    checkpoint can be loaded. Here an empty state reads as step 0 while the state dict is
    built (a template: the loaded checkpoint's values replace it); the state stays empty."""
    try:
        from megatron.core.optimizer import distrib_optimizer as do
    except ImportError:  # megatron-core not installed: nothing to patch
        return
    orig = do.DistributedOptimizer.state_dict
    if getattr(orig, "_deadpool_cpu", False):
        return

    def state_dict(self):
        inner = self.optimizer
        if (getattr(do, "HAVE_APEX_OR_TE", True) or not isinstance(inner, torch.optim.Optimizer)
                or len(inner.state)):
            return orig(self)
        try:
            for group in inner.param_groups:
                for p in group["params"]:
                    inner.state[p]["step"] = torch.zeros(())
            return orig(self)
        finally:
            inner.state.clear()

    state_dict._deadpool_cpu = True
    do.DistributedOptimizer.state_dict = state_dict
    # And in fp32 training the main params are views of the model's leaf parameters, so
    # the load's in-place copy into them needs no_grad (``_set_main_param_and_optimizer_
    # states`` runs without it).
    load = do.DistributedOptimizer.load_state_dict

    def load_state_dict(self, sd):
        steps = _checkpoint_steps(sd)  # read before the load, which may consume sd
        with torch.no_grad():
            out = load(self, sd)
        _unshare_steps(self.optimizer)
        if not getattr(do, "HAVE_APEX_OR_TE", True):
            _restore_steps(self.optimizer, steps)
        return out

    do.DistributedOptimizer.load_state_dict = load_state_dict


def _unshare_steps(inner) -> None:
    """The same path loads torch Adam's per-parameter ``step`` as *one* tensor shared by
    every parameter's state (``s["step"] = step`` for all), so that after a ``--load`` each
    step of torch's single-tensor Adam increments it once per parameter, and every copy of
    the state sees a layout that a freshly built optimizer does not have (a promoted spare's
    restore refused the buddy's copy: "layout mismatch"). Each parameter gets its own step,
    as torch Adam creates it."""
    if not isinstance(inner, torch.optim.Optimizer):
        return
    seen = set()
    for state in inner.state.values():
        step = state.get("step")
        if isinstance(step, torch.Tensor):
            if id(step) in seen:
                state["step"] = step.detach().clone()
            seen.add(id(state["step"]))


def _checkpoint_steps(sd) -> set:
    groups = ((sd or {}).get("optimizer") or {}).get("param_groups") or []
    return {float(g["step"]) for g in groups if "step" in g}


def _restore_steps(inner, steps: set) -> None:
    """The same load sets torch Adam's ``step`` from the checkpoint's ``param_groups`` and
    then, in ``load_parameter_state_from_dp_reshardable``, copies over it the ``step`` that
    the sharded state dict was built with before the load (a template: 0), so a resumed
    run's bias correction started again from step 1. The checkpoint's step is put back.
    The load also leaves that step in torch Adam's param groups, which an optimizer that
    never loaded has not (torch Adam keeps it per parameter): it is removed there, or the
    resumed state differs from the uninterrupted one in its param groups."""
    if len(steps) != 1 or not isinstance(inner, torch.optim.Optimizer):
        return
    step = next(iter(steps))
    for state in inner.state.values():
        if isinstance(state.get("step"), torch.Tensor):
            state["step"].fill_(step)
    if isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
        for group in inner.param_groups:
            group.pop("step", None)


class _KeepSent:
    """A p2p request that holds the storage it sends from until it is waited on."""

    def __init__(self, req, sent: torch.Tensor):
        self._req, self._sent = req, sent

    def wait(self, *args, **kwargs):
        out = self._req.wait(*args, **kwargs)
        self._sent = None
        return out

    def __getattr__(self, name):
        return getattr(self._req, name)


def overlapped_p2p_sends() -> None:
    """megatron-core's non-batched p2p path (``_p2p_ops``, the interleaved schedule's
    overlapped p2p) returns un-waited ``isend`` requests, and the schedule then frees the
    sent output's storage (``deallocate_output_tensor``). NCCL orders that by CUDA streams;
    gloo's ``SendWork`` keeps only the tensor object, so its send read freed, reused memory.
    Each send request here keeps a second reference to the sent storage until its wait."""
    try:
        from megatron.core.pipeline_parallel import p2p_communication as p2p
    except ImportError:  # megatron-core not installed: nothing to patch
        return
    orig = getattr(p2p, "_p2p_ops", None)
    if orig is None or getattr(orig, "_deadpool_cpu", False):
        return

    def _p2p_ops(**kwargs):
        reqs = orig(**kwargs)
        for key, name in (("send_next", "tensor_send_next"), ("send_prev", "tensor_send_prev")):
            if key in reqs:
                reqs[key] = _KeepSent(reqs[key], kwargs[name].detach())
        return reqs

    _p2p_ops._deadpool_cpu = True
    p2p._p2p_ops = _p2p_ops
