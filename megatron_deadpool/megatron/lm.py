"""Megatron-LM integration: the calls that the patch series in ``patches/`` adds to
Megatron-LM (tag core_v0.16.1). Each patch hunk is one call into this module; the logic lives
here, on top of the same public API (``api.Deadpool``) the reference trainer uses.

    arguments.py   add_megatron_arguments: parser = lm.add_args(parser)
    initialize.py  _initialize_distributed: lm.join(args)   (a spare blocks here; with
                   --deadpool it wraps training.py's save, eval, data builds in sections)
                   lm.initialize_model_parallel(...)               (recorded for replay)
    training.py    pretrain(): lm.attach(model, optimizer, scheduler, dataset_provider)
                   train():    is_first_iteration = not lm.promoted()
                               loop body inside ``try:``
                                   lm.before_step(iteration)
                                   ... Megatron's step, log, eval, save ...
                                   lm.after_step(iteration, flops, loss_dict)
                               except Exception as exc:
                                   (iteration, flops, train_iter, valid_iter,
                                    pre_hook_enabled) = lm.recover(exc)
    end            ``deadpool launch --script`` (launch/child.py) calls lm.finish().

With ``--deadpool`` off every call is a no-op (``recover`` re-raises), so the patched script
trains exactly like the unpatched one.
"""

from __future__ import annotations

import inspect
import os
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Callable, Optional

from ..base.config import DeadpoolConfig, add_deadpool_args
from ..base.errors import ConfigError, UnsupportedConfigError
from ..recovery.quiet import CollectiveSuppressor
from ..adapters import async_saves, cadence, ddp, tags, training_globals
from ..adapters.checkpoints import CheckpointContexts
from ..adapters.evaluation import Evaluations
from ..adapters.iterators import PretrainIterators
from ..adapters.lm_rules import mark_sections, unsupported_args
from ..adapters.train_state import MegatronTrainState

# ---------------------------------------------------------------------------- session
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
    checkpoints: CheckpointContexts = field(default_factory=CheckpointContexts)
    iterators: PretrainIterators = field(default_factory=PretrainIterators)
    evaluations: Evaluations = field(default_factory=Evaluations)
    saves: cadence.Saves = field(default_factory=cadence.Saves)  # the checkpoint cadence
    tag: Optional[tags.Tag] = None  # the Megatron-LM tree's (tags.py), with --deadpool
    train_args: Optional[dict] = None  # what pretrain() gave train() (_wrap_train)
    start_iteration: Optional[int] = None  # the first iteration train() ran in this process
    held_param_sync: Any = None   # ddp.realign_forward_pre_hooks: back after the redone step


_S = _Session()


def _enabled() -> bool:
    return _S.handle is not None


def _plain_handle():
    """Without ``--deadpool``: a handle with the mirror off, for the loss log and the
    end-of-run fingerprint under ``deadpool launch`` (it changes no training state)."""
    if _S.plain is None:
        import torch.distributed as dist

        from .. import api
        from ..adapters import cpu_mode

        _S.plain = api.Deadpool.over_default_group(
            DeadpoolConfig(), "cpu" if cpu_mode.is_enabled() else "cuda", dist.get_backend())
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
    from megatron.training import training  # <tree>/megatron/training/training.py

    _S.tag = tags.patched_tag(os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(training.__file__)))))
    bad = unsupported_args(args)
    if bad:
        raise UnsupportedConfigError("--deadpool does not support: " + "; ".join(bad))
    from .. import api
    from ..adapters import cpu_mode

    device = "cpu" if cpu_mode.is_enabled() else "cuda"
    backend = args.distributed_backend
    if device == "cpu" and backend != "gloo":
        raise ConfigError("--deadpool in CPU mode needs --distributed-backend gloo")
    _S.handle = api.Deadpool.start(DeadpoolConfig.from_args(args), device=device,
                                   backend=backend)
    args.rank, args.world_size = _S.handle.rank, _S.handle.world_size
    if _S.handle.promoted:
        training_globals.adopt_rank(args)
    mark_sections(training, _S.handle.section)  # save, eval, data: their own timeouts


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
    import megatron.training.training as training_module

    _S.checkpoints.wrap(training_module)
    _S.iterators.wrap(training_module)
    _wrap_train(training_module)
    _S.handle.attach(model=model, optimizer=optimizer, scheduler=scheduler,
                     train_state=_S.state)
    if _S.handle.promoted:
        _S.iterators.restored()  # pretrain() builds its iterators next, at restored counters
        _arm_redos()
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
    if _S.start_iteration is None:
        _S.start_iteration = iteration
    _end_solitary_startup(iteration)
    _S.handle.before_step(iteration)


def _end_solitary_startup(iteration: int) -> None:
    """A promoted spare's collectives are real again (restored RNG re-applied); on every
    rank, a restore's redone evaluation, then its save run (evaluation.py, cadence.py)."""
    from megatron.training import training

    if _S.quiet is not None:
        _S.quiet.stop()
        _S.quiet = None
        _reapply_rng()
    _S.evaluations.run_if_due(training, iteration, _S.iterators.valid(), _S.train_args,
                              _S.tag.eval_kwargs)
    _S.saves.run_if_due(training, _S.args, iteration, _S.state.flops, _S.train_args)


def _arm_redos() -> None:  # after a restore: the evaluation and save due at its iteration
    for redo in (_S.evaluations, _S.saves):
        redo.arm(_S.args, _S.state.iteration, _S.handle.restored_meta)


def _wrap_train(training_module) -> None:
    """Record what pretrain() gives ``train()`` (the evaluation's inputs; on some tags
    holders of process groups, rebound like the model's), and, when it returns after a
    restore to the last iteration (its loop ran no ``before_step``), end a spare's
    solitary startup and redo the evaluation there. Idempotent."""
    orig = training_module.train
    if getattr(orig, "_deadpool", False):
        return
    sig = inspect.signature(orig)

    def train(*a, **k):
        _S.train_args = dict(sig.bind_partial(*a, **k).arguments)
        holders = [_S.train_args.get(n) for n in _S.tag.train_group_holders]
        _S.handle.protect_groups_of([h for h in holders if h is not None])
        out = orig(*a, **k)
        _end_solitary_startup(_S.state.iteration)
        return out

    train._deadpool = True
    training_module.train = train


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
    if _S.held_param_sync is not None:  # only after a restore (ddp.realign_forward_pre_hooks)
        ddp.release_param_sync(_S.model, _S.held_param_sync)
        _S.held_param_sync = None
    _S.handle.after_step(iteration, loss=loss)


def recover(exc: BaseException):
    """The recovery boundary around the whole loop body. Re-raises ``exc`` when it is not a
    job failure. Otherwise returns, after the world, the groups and the state are rebuilt,
    what ``train()`` keeps in locals: (iteration, FLOPs, train iterator, valid iterator,
    whether the forward pre-hooks are on)."""
    if not _enabled():
        raise exc
    # the cached save strategies and unfinalized async saves hold the old groups: gone
    _S.checkpoints.forget_groups()  # before the rebuild and its audit (the next --save
    async_saves.abandon(_S.args)    # builds them on the new groups)
    _S.handle.recover(exc)
    from megatron.training import training

    chunks = len(_S.model) if _S.args.virtual_pipeline_model_parallel_size else None
    train_it, valid_it = _S.iterators.rebuild(training, _S.dataset_provider, chunks)
    _reapply_rng()
    training_globals.reset_after_restore(_S.state.iteration)
    _S.tag.forget_collective_caches(_S.optimizer)
    _arm_redos()
    # --overlap-param-gather: pre-hooks on as in a failure-free run (off in the first step)
    it = _S.state.iteration  # (at the last iteration the loop ends: no hooks, no sync)
    hooks_on, _S.held_param_sync = ddp.realign_forward_pre_hooks(
        _S.model, _S.args, _S.start_iteration < it < _S.args.train_iters)
    return _S.state.iteration, _S.state.flops, train_it, valid_it, hooks_on


def _reapply_rng() -> None:
    if _S.handle.restored_meta is not None:
        from ..adapters.train_state import apply_rng
        apply_rng(_S.handle.restored_meta["rng"])


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


def joined() -> bool:
    """Whether this process joined the job (``join`` with ``--deadpool``): from then on its
    runtime reports its errors (``launch/child.py`` reports the ones before)."""
    return _enabled()


def shutdown(exc: Optional[BaseException]) -> None:
    """The script ended with ``exc``: report it and free the communicators (clean exit)."""
    if _S.handle is not None:
        _S.handle.shutdown(exc)


def results_dir() -> Optional[str]:
    return os.environ.get("DEADPOOL_RESULTS_DIR")
