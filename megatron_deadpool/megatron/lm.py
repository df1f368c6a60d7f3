"""Megatron-LM integration: the calls that the patch series in ``patches/`` adds to
Megatron-LM (tag core_v0.16.1). Each patch hunk is one call into this module; the logic lives
here, on top of the same public API (``api.Deadpool``) the reference trainer uses.

    arguments.py   add_megatron_arguments: parser = lm.add_args(parser)
    initialize.py  _initialize_distributed: lm.join(args)          (a spare blocks here)
                   lm.initialize_model_parallel(...)               (recorded for replay)
    training.py    pretrain(): lm.attach(model, optimizer, scheduler, dataset_provider)
                   train():    is_first_iteration = not lm.promoted()
                               loop body inside ``try:``
                                   lm.before_step(iteration)
                                   ... Megatron's step, log, eval, save ...
                                   lm.after_step(iteration, flops, loss_dict)
                               except Exception as exc:
                                   (iteration, flops, train_iter, valid_iter) = lm.recover(exc)
    end            ``deadpool launch --script`` runs the script through
                   ``launch/child.py``, which calls lm.finish() after it returns.

With ``--deadpool`` off every call is a no-op (``recover`` re-raises), so the patched script
trains exactly like the unpatched one.
"""

from __future__ import annotations

import inspect
import os
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Callable, List, Optional, Tuple

from ..config import DeadpoolConfig, add_deadpool_args
from ..errors import ConfigError, UnsupportedConfigError
from ..recovery.quiet import CollectiveSuppressor

SUPPORTED_MEGATRON = ("0.16.1",)


# ---------------------------------------------------------------------------- pure checks
def unsupported_args(args) -> List[str]:
    """Megatron-LM settings that ``--deadpool`` v1 refuses, each with the reason. Pure:
    a function of the parsed arguments only."""
    g = lambda name, default=None: getattr(args, name, default)  # noqa: E731
    rules = [
        (g("inprocess_restart"), "--inprocess-restart (NVRx in-process restart): both would "
         "own the recovery of the same failure; use one of them"),
        (g("enable_ft_package"), "--enable-ft-package (NVRx fault-tolerance package): it "
         "restarts the job on a failure that DeadPool recovers in place"),
        (not g("use_distributed_optimizer"), "training without --use-distributed-optimizer "
         "(DeadPool mirrors distributed-optimizer shards)"),
        (g("overlap_grad_reduce"), "--overlap-grad-reduce (pending reduce handles cannot "
         "survive an abort)"),
        (g("overlap_param_gather"), "--overlap-param-gather (forward pre-hooks hold pending "
         "all-gathers)"),
        (g("async_save"), "--async-save (a background save worker holds old groups)"),
        (g("non_persistent_ckpt_type") == "local", "--non-persistent-ckpt-type local"),
        (g("virtual_pipeline_model_parallel_size") is not None,
         "virtual pipeline parallelism (--num-layers-per-virtual-pipeline-stage)"),
        ((g("context_parallel_size") or 1) > 1, "--context-parallel-size > 1"),
        ((g("expert_model_parallel_size") or 1) > 1, "--expert-model-parallel-size > 1"),
        ((g("num_distributed_optimizer_instances") or 1) > 1,
         "--num-distributed-optimizer-instances > 1"),
        (g("rampup_batch_size") is not None, "--rampup-batch-size"),
        (bool(g("phase_transition_iterations")), "--phase-transition-iterations"),
        (g("perform_rl_step"), "RL training (--perform-rl-step)"),
        (g("hybrid_context_parallel"), "--hybrid-context-parallel"),
        (g("dataloader_type") == "external", "--dataloader-type external (DeadPool rebuilds "
         "iterators from consumed samples)"),
        (g("yaml_cfg") is not None, "--yaml-cfg"),
        (g("fake_process_group"), "--fake-process-group"),
        (g("multiple_validation_sets"), "--multiple-validation-sets"),
        (g("tp_comm_overlap"), "--tp-comm-overlap (userbuffers communicators cannot be "
         "rebound)"),
        ((g("cuda_graph_impl") or "none") != "none", "CUDA graphs (--cuda-graph-impl)"),
        (g("nccl_ub"), "--use-nccl-ub (NCCL user buffers)"),
        (g("use_megatron_fsdp"), "--use-megatron-fsdp"),
        (g("use_torch_fsdp2"), "--use-torch-fsdp2"),
    ]
    return [why for bad, why in rules if bad]


def unsupported_argv(argv: List[str]) -> List[str]:
    """``unsupported_args`` on a raw Megatron-LM command line, for ``deadpool launch`` to
    refuse before any worker starts (the workers check the fully parsed arguments again)."""
    import argparse

    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    for flag in ("--inprocess-restart", "--enable-ft-package", "--use-distributed-optimizer",
                 "--overlap-grad-reduce", "--overlap-param-gather", "--async-save",
                 "--perform-rl-step", "--hybrid-context-parallel", "--fake-process-group",
                 "--multiple-validation-sets", "--tp-comm-overlap", "--use-megatron-fsdp",
                 "--use-torch-fsdp2"):
        p.add_argument(flag, action="store_true")
    p.add_argument("--use-nccl-ub", action="store_true", dest="nccl_ub")
    for flag in ("--context-parallel-size", "--expert-model-parallel-size",
                 "--num-distributed-optimizer-instances"):
        p.add_argument(flag, type=int, default=1)
    for flag in ("--non-persistent-ckpt-type", "--dataloader-type", "--yaml-cfg",
                 "--cuda-graph-impl", "--num-layers-per-virtual-pipeline-stage",
                 "--num-virtual-stages-per-pipeline-rank"):
        p.add_argument(flag, default=None)
    p.add_argument("--rampup-batch-size", nargs="*", default=None)
    p.add_argument("--phase-transition-iterations", default=None)
    ns, _ = p.parse_known_args(argv)
    ns.virtual_pipeline_model_parallel_size = (
        ns.num_layers_per_virtual_pipeline_stage or ns.num_virtual_stages_per_pipeline_rank)
    return unsupported_args(ns)


def check_megatron_version(version: str) -> None:
    if version not in SUPPORTED_MEGATRON:
        raise ConfigError(
            f"--deadpool supports Megatron-LM {', '.join(SUPPORTED_MEGATRON)} (tag core_v0.16.1); "
            f"this tree is {version}. Check out core_v0.16.1 and apply patches/ with "
            "scripts/apply_patches.sh")


def check_installed_megatron_core() -> None:
    """The reference trainer runs on the installed megatron-core: with ``--deadpool``,
    another version is refused at launch, before any worker starts."""
    from importlib import metadata

    try:
        version = metadata.version("megatron-core")
    except metadata.PackageNotFoundError:
        raise ConfigError("megatron-core is not installed: pip install "
                          f"megatron-core=={SUPPORTED_MEGATRON[0]}") from None
    if version not in SUPPORTED_MEGATRON:
        raise ConfigError(f"--deadpool supports megatron-core {', '.join(SUPPORTED_MEGATRON)}; "
                          f"the installed one is {version} (pip install "
                          f"megatron-core=={SUPPORTED_MEGATRON[0]})")


def cpu_flags(argv: List[str]) -> List[str]:
    """The Megatron-LM flags ``deadpool launch --device cpu`` adds when they are missing.
    Pure. Each entry: (flag present-test names, flags to add)."""
    have = {a.split("=", 1)[0] for a in argv if a.startswith("--")}
    added: List[str] = []
    for names, add in CPU_FLAGS:
        if not have.intersection(names):
            added += add
    return list(argv) + added


# (flags that count as "already given", flags to add)
CPU_FLAGS: Tuple[Tuple[Tuple[str, ...], List[str]], ...] = (
    (("--transformer-impl",), ["--transformer-impl", "local"]),
    (("--distributed-backend",), ["--distributed-backend", "gloo"]),
    (("--no-gradient-accumulation-fusion", "--gradient-accumulation-fusion"),
     ["--no-gradient-accumulation-fusion"]),
    (("--no-persist-layer-norm",), ["--no-persist-layer-norm"]),
    (("--no-masked-softmax-fusion",), ["--no-masked-softmax-fusion"]),
    (("--no-bias-gelu-fusion",), ["--no-bias-gelu-fusion"]),
    (("--no-bias-dropout-fusion",), ["--no-bias-dropout-fusion"]),
    (("--no-rope-fusion",), ["--no-rope-fusion"]),
    (("--num-workers",), ["--num-workers", "0"]),
    (("--eval-iters",), ["--eval-iters", "0"]),
    (("--eval-interval",), ["--eval-interval", "1000"]),
)


# ---------------------------------------------------------------------------- session
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


@dataclass
class _Session:
    handle: Any = None            # api.Deadpool, with --deadpool only
    args: Any = None
    model: Any = None
    optimizer: Any = None
    scheduler: Any = None
    dataset_provider: Optional[Callable] = None
    state: Optional[MegatronTrainState] = None
    quiet: Optional[CollectiveSuppressor] = None
    plain: Any = None             # api.Deadpool with the mirror off (no --deadpool)


_S = _Session()


def _enabled() -> bool:
    return _S.handle is not None


def _plain_handle():
    """Without ``--deadpool``: a handle with the mirror off, for the loss log and the
    end-of-run fingerprint under ``deadpool launch`` (it changes no training state)."""
    if _S.plain is None:
        import torch.distributed as dist

        from .. import api
        from . import cpu_mode

        h = api.Deadpool(DeadpoolConfig(), "cpu" if cpu_mode.is_enabled() else "cuda",
                         dist.get_backend())
        h.rank, h.world_size = dist.get_rank(), dist.get_world_size()
        _S.plain = h
    return _S.plain


# ---------------------------------------------------------------------------- hooks
def add_args(parser):
    """arguments.py: the ``--deadpool*`` group (same flags as the reference trainer)."""
    return add_deadpool_args(parser)


def join(args) -> None:
    """initialize.py ``_initialize_distributed``: with ``--deadpool``, check the
    configuration, join the job and initialize torch.distributed (a spare blocks here until
    it is promoted to a dead rank's id). Without it, nothing happens."""
    _S.args = args
    if not getattr(args, "deadpool", False):
        return
    from megatron.core import package_info

    check_megatron_version(package_info.__version__)
    bad = unsupported_args(args)
    if bad:
        raise UnsupportedConfigError("--deadpool does not support: " + "; ".join(bad))
    from .. import api
    from . import cpu_mode

    device = "cpu" if cpu_mode.is_enabled() else "cuda"
    backend = args.distributed_backend
    if device == "cpu" and backend != "gloo":
        raise ConfigError("--deadpool in CPU mode needs --distributed-backend gloo")
    _S.handle = api.Deadpool.start(DeadpoolConfig.from_args(args), device=device,
                                   backend=backend)
    args.rank, args.world_size = _S.handle.rank, _S.handle.world_size
    if _S.handle.promoted:
        _adopt_rank_globals(args)


def _adopt_rank_globals(args) -> None:
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


def initialize_model_parallel(*args, **kwargs) -> None:
    """initialize.py: ``mpu.initialize_model_parallel``, recorded for replay on rebuilds."""
    from megatron.core import parallel_state as ps

    if not _enabled():
        ps.initialize_model_parallel(*args, **kwargs)
        return
    bound = inspect.signature(ps.initialize_model_parallel).bind(*args, **kwargs)
    _S.handle.initialize_model_parallel(**bound.arguments)


def attach(model, optimizer, scheduler, dataset_provider=None) -> None:
    """training.py ``pretrain()``, after the model and optimizer exist and before the data
    iterators are built. A promoted spare returns restored (``args.iteration`` and the
    consumed samples included) and then walks the rest of Megatron's startup with its
    collectives suppressed, until its first ``before_step``."""
    _S.model, _S.optimizer, _S.dataset_provider = model, optimizer, dataset_provider
    _S.scheduler = scheduler
    if not _enabled():
        return
    _S.state = MegatronTrainState(_S.args)
    _S.handle.attach(model=model, optimizer=optimizer, scheduler=scheduler,
                     train_state=_S.state)
    if _S.handle.promoted:
        _S.quiet = CollectiveSuppressor()
        _S.quiet.start()


def promoted() -> bool:
    """training.py ``train()``: a promoted spare does not run the first-iteration log (its
    extra barrier and timer gather would run on the spare alone)."""
    return _enabled() and _S.handle.promoted


def before_step(iteration: int) -> None:
    """Top of the training loop body. On a promoted spare the first call ends the solitary
    startup: collectives are real again and the restored RNG is re-applied (building the
    data iterators drew from it)."""
    if not _enabled():
        return
    if _S.quiet is not None:
        _S.quiet.stop()
        _S.quiet = None
        _reapply_rng()
    _S.handle.before_step(iteration)


def after_step(iteration: int, flops: float, loss_dict: Optional[dict] = None) -> None:
    """After ``iteration``, consumed samples, the scheduler and FLOPs are updated: snapshot
    (off the critical path) and record the loss for the launch summary."""
    loss = None
    if loss_dict and "lm loss" in loss_dict and results_dir():
        loss = float(loss_dict["lm loss"])
    if not _enabled():
        if loss is not None:
            _plain_handle().after_step(iteration, loss=loss)
        return
    _S.state.iteration = iteration
    _S.state.flops = float(flops)
    _S.handle.after_step(iteration, loss=loss)


def recover(exc: BaseException):
    """The recovery boundary around the whole loop body. Re-raises ``exc`` when it is not a
    job failure. Otherwise returns, after the world, the groups and the state are rebuilt,
    what ``train()`` keeps in locals: (iteration, FLOPs, train iterator, valid iterator)."""
    if not _enabled():
        raise exc
    _S.handle.recover(exc)
    train_it, valid_it = _rebuild_iterators()
    _reapply_rng()
    _reset_training_singletons(_S.state.iteration)
    return _S.state.iteration, _S.state.flops, train_it, valid_it


def _reapply_rng() -> None:
    from . import state as state_io

    meta = _S.handle.restored_meta
    if meta is not None:
        state_io.apply_rng(meta["rng"])


def _rebuild_iterators():
    """Data iterators at the restored consumed samples. Saved microbatches cannot be
    re-fed after a rollback of up to two steps, so the loaders are rebuilt. The build's
    collectives (dataset barriers, the do_* broadcast) run suppressed on every rank, exactly
    as on a promoted spare; the do_* flags stay as restored."""
    from megatron.training.training import build_train_valid_test_data_iterators

    if _S.dataset_provider is None:
        raise ConfigError("lm.attach() was called without the dataset provider; the data "
                          "iterators cannot be rebuilt after a recovery")
    quiet = CollectiveSuppressor()
    quiet.start()
    try:
        train_it, valid_it, _ = build_train_valid_test_data_iterators(_S.dataset_provider)
    finally:
        quiet.stop()
    return train_it, valid_it


def _reset_training_singletons(iteration: int) -> None:
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


# ---------------------------------------------------------------------------- end
def capture_setup(training_module) -> None:
    """Record the model and optimizer ``setup_model_and_optimizer`` returns, so that the
    end-of-run fingerprint also works for a script without the attach hook (the unpatched
    script, or ``--deadpool`` off)."""
    orig = training_module.setup_model_and_optimizer

    def setup_model_and_optimizer(*a, **k):
        model, optimizer, scheduler = orig(*a, **k)
        if _S.model is None:
            _S.model, _S.optimizer, _S.scheduler = model, optimizer, scheduler
        return model, optimizer, scheduler

    training_module.setup_model_and_optimizer = setup_model_and_optimizer


def finish() -> Optional[str]:
    """After the script returns: the same fingerprint and results as the reference trainer
    (``final_state_sha256``; with ``--deadpool`` also recoveries and mirror counters)."""
    import torch.distributed as dist

    if _S.model is None or not dist.is_initialized():
        return None
    handle = _S.handle if _S.handle is not None else _plain_handle()
    from megatron.training.global_vars import get_args

    args = get_args()
    state = _S.state or MegatronTrainState(args)
    if _S.state is None:  # no after_step hook ran (unpatched): args.iteration is not kept
        state.iteration = getattr(args, "curr_iteration", args.iteration) + 1 \
            if getattr(args, "curr_iteration", None) is not None else args.iteration
    # FLOPs are a logging total that only the patched loop keeps: not part of the fingerprint
    # (it must match between the patched and the unpatched script).
    fingerprinted = SimpleNamespace(
        iteration=state.iteration, consumed_train_samples=args.consumed_train_samples,
        extra_state=lambda: {k: v for k, v in state.extra_state().items() if k != "flops"})
    digest = handle.finish(_S.model, _S.optimizer, train_state=fingerprinted,
                           scheduler=_S.scheduler, extra={"iteration": state.iteration})
    if handle.rank == 0:
        print(f"final_state_sha256 {digest}", flush=True)
    return digest


def shutdown(exc: Optional[BaseException]) -> None:
    """The script ended with ``exc``: report it and free the communicators (clean exit)."""
    if _S.handle is not None:
        _S.handle.shutdown(exc)


def results_dir() -> Optional[str]:
    return os.environ.get("DEADPOOL_RESULTS_DIR")
