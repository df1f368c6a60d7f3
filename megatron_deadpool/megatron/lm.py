"""Megatron-LM integration: what the patch series in ``patches/`` adds to Megatron-LM. Each
patch hunk is one call into this module or on the ``Session`` that ``join`` returns (the one
object the patched code holds); the logic lives here, on top of the same public API
(``api.Deadpool``) the reference trainer uses.

    arguments.py   add_megatron_arguments: parser = deadpool_lm.add_args(parser)
    initialize.py  _initialize_distributed: deadpool = deadpool_lm.join(args)
                       (a spare blocks here; with --deadpool it wraps training.py's save,
                       eval, data builds in sections)
                   deadpool.initialize_model_parallel(...)   (recorded for replay)
    training.py    pretrain(): deadpool_lm.session().attach(model, optimizer, scheduler,
                                                            dataset_provider)
                   train():    deadpool = deadpool_lm.session()
                               is_first_iteration = not deadpool.promoted
                               loop body inside ``try:``
                                   deadpool.before_step(iteration)
                                   ... Megatron's step, log, eval, save ...
                                   deadpool.after_step(iteration, flops, loss_dict)
                               except Exception as exc:
                                   (iteration, flops, train_iter, valid_iter,
                                    pre_hook_enabled) = deadpool.recover(exc)
    end            ``deadpool launch --script`` (launch/child.py) calls lm.finish().

Without ``--deadpool`` the session is a ``Session``, whose hooks do nothing (``recover``
re-raises) but log the loss, so the patched script trains exactly like the unpatched one; with
it, a ``Joined`` session.
"""

from __future__ import annotations

import inspect
import os
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Callable, Optional

from ..base.config import DeadpoolConfig
from ..base.errors import ConfigError, UnsupportedConfigError
from ..adapters.quiet import CollectiveSuppressor
from ..adapters import async_saves, cadence, ddp, tags, training_globals
from ..adapters import exact_resume, ft_package
from ..adapters.checkpoints import CheckpointContexts
from ..adapters.evaluation import Evaluations
from ..adapters.iterators import PretrainIterators
from ..adapters.lm_rules import mark_sections, unsupported_args
from ..adapters.train_state import MegatronTrainState
from ..flags import add_deadpool_args


@dataclass
class Built:
    """What ``pretrain()`` built: a rollback's inputs and the end-of-run fingerprint's."""
    model: Any = None
    optimizer: Any = None
    scheduler: Any = None
    dataset_provider: Optional[Callable] = None


@dataclass
class Adapters:
    """What a joined session wraps in Megatron's training module and redoes after a restore:
    the checkpoint contexts, the data iterators, the evaluation and the save due."""
    checkpoints: CheckpointContexts = field(default_factory=CheckpointContexts)
    iterators: PretrainIterators = field(default_factory=PretrainIterators)
    evaluations: Evaluations = field(default_factory=Evaluations)
    saves: cadence.Saves = field(default_factory=cadence.Saves)  # the checkpoint cadence


class Session:
    """One process's hooks with ``--deadpool`` off: no-ops (``recover`` re-raises), except
    the loss log and the end-of-run fingerprint under ``deadpool launch``, which a handle
    with the mirror off writes (it changes no training state)."""

    def __init__(self, args) -> None:
        self.args = args
        self.built = Built()
        self.state: Optional[MegatronTrainState] = None  # joined: the one the mirror keeps
        self._plain = None

    @property
    def joined(self) -> bool:
        """Whether this process joined the job: from then on its runtime reports its errors
        (``launch/child.py`` reports the ones before)."""
        return False

    @property
    def promoted(self) -> bool:
        """A promoted spare does not run ``train()``'s first-iteration log (its extra barrier
        and timer gather would run on the spare alone)."""
        return False

    def runtime(self):
        """The ``api.Deadpool`` that logs and fingerprints: here one with the mirror off."""
        if self._plain is None:
            import torch.distributed as dist

            from .. import api
            from ..adapters import cpu_mode

            self._plain = api.Deadpool.over_default_group(
                DeadpoolConfig(), "cpu" if cpu_mode.is_enabled() else "cuda",
                dist.get_backend())
        return self._plain

    def initialize_model_parallel(self, *args, **kwargs) -> None:
        from megatron.core import parallel_state as ps

        ps.initialize_model_parallel(*args, **kwargs)

    def attach(self, model, optimizer, scheduler, dataset_provider=None) -> None:
        self.built = Built(model, optimizer, scheduler, dataset_provider)

    def capture(self, model, optimizer, scheduler) -> None:
        """What ``setup_model_and_optimizer`` returned, for a script without the attach hook
        (``capture_setup``)."""
        if self.built.model is None:
            self.built = Built(model, optimizer, scheduler)

    def before_step(self, iteration: int) -> None:
        pass

    def after_step(self, iteration: int, flops: float, loss_dict: Optional[dict] = None
                   ) -> None:
        loss = _logged_loss(loss_dict)
        if loss is not None:
            self.runtime().after_step(iteration, loss=loss)

    def recover(self, exc: BaseException):
        raise exc

    def shutdown(self, exc: Optional[BaseException]) -> None:
        pass

    def finish(self) -> Optional[str]:
        """After the script returns: the same fingerprint and results as the reference
        trainer (``final_state_sha256``; joined, also recoveries and mirror counters)."""
        import torch.distributed as dist

        if self.built.model is None or not dist.is_initialized():
            return None
        handle = self.runtime()
        from megatron.training.global_vars import get_args

        args = get_args()
        state = self.state or MegatronTrainState(args)
        if self.state is None:  # no after_step hook ran (unpatched): args.iteration is not kept
            state.iteration = getattr(args, "curr_iteration", args.iteration) + 1 \
                if getattr(args, "curr_iteration", None) is not None else args.iteration
        # FLOPs are a logging total that only the patched loop keeps: not part of the
        # fingerprint (it must match between the patched and the unpatched script).
        fingerprinted = SimpleNamespace(
            iteration=state.iteration, consumed_train_samples=args.consumed_train_samples,
            extra_state=lambda: {k: v for k, v in state.extra_state().items()
                                 if k != "flops"})
        b = self.built
        digest = handle.finish(b.model, b.optimizer, train_state=fingerprinted,
                               scheduler=b.scheduler, extra={"iteration": state.iteration})
        if handle.rank == 0:
            print(f"final_state_sha256 {digest}", flush=True)
        return digest


class Joined(Session):
    """With ``--deadpool``: the process joined the job through ``handle``; its hooks keep the
    mirror, and ``recover`` is the recovery boundary around ``train()``'s loop body."""

    def __init__(self, args, handle, tag: tags.Tag) -> None:
        super().__init__(args)
        self.handle = handle          # api.Deadpool
        self.tag = tag                # the Megatron-LM tree's (tags.py)
        self.adapters = Adapters()
        self.quiet: Optional[CollectiveSuppressor] = None  # a promoted spare's startup
        self.train_args: Optional[dict] = None  # what pretrain() gave train() (_wrap_train)
        self.start_iteration: Optional[int] = None  # the first one train() ran here
        self.held_param_sync: Any = None  # ddp.realign_forward_pre_hooks: after the redo
        self._rng_pending = False  # restored at attach: the RNG is applied again at the start
        self._loaded_rng: Optional[dict] = None  # --load's RNG, applied again at the start

    @property
    def joined(self) -> bool:
        return True

    @property
    def promoted(self) -> bool:
        return self.handle.promoted

    def runtime(self):
        return self.handle

    def initialize_model_parallel(self, *args, **kwargs) -> None:
        """``mpu.initialize_model_parallel``, recorded for replay on rebuilds."""
        from megatron.core import parallel_state as ps

        bound = inspect.signature(ps.initialize_model_parallel).bind(*args, **kwargs)
        self.handle.initialize_model_parallel(**bound.arguments)

    def attach(self, model, optimizer, scheduler, dataset_provider=None) -> None:
        """``pretrain()``, after the model and optimizer exist and before the data iterators
        are built. A promoted spare returns restored (``args.iteration`` and the consumed
        samples included) and then walks the rest of Megatron's startup with its collectives
        suppressed, until its first ``before_step``."""
        super().attach(model, optimizer, scheduler, dataset_provider)
        self.state = MegatronTrainState(self.args)
        import megatron.training.training as training_module

        self.adapters.checkpoints.wrap(training_module, after_save=self._save_exact)
        self.adapters.iterators.wrap(training_module)
        self._wrap_train(training_module)
        self.handle.attach(model=model, optimizer=optimizer, scheduler=scheduler,
                           train_state=self.state)
        # restored here: a promoted spare, or every rank of --deadpool-resume
        self._rng_pending = self.handle.restored_meta is not None
        if not self._rng_pending and getattr(self.args, "load", None) and self.args.iteration:
            self._loaded_rng = exact_resume.load(  # its tensors now, its RNG at the start
                self.args.load, self.args.iteration, self.handle.rank, self.handle.world_size,
                model, optimizer, self.args.tensor_model_parallel_size)
        if self._rng_pending:
            self.adapters.iterators.restored()  # pretrain() builds them next, as restored
            self._arm_redos()
        if self.handle.promoted:
            self.quiet = CollectiveSuppressor()
            self.quiet.start()

    def before_step(self, iteration: int) -> None:
        """Top of the loop body. On a promoted spare the first call ends the solitary
        startup: collectives are real again and the restored RNG is re-applied (building the
        data iterators drew from it)."""
        if self.start_iteration is None:
            self.start_iteration = iteration
        self._end_solitary_startup(iteration)
        self.handle.before_step(iteration)

    def after_step(self, iteration: int, flops: float, loss_dict: Optional[dict] = None
                   ) -> None:
        """After ``iteration``, consumed samples, the scheduler and FLOPs are updated:
        snapshot (off the critical path) and record the loss for the launch summary."""
        loss = _logged_loss(loss_dict)
        self.state.iteration = iteration
        self.state.flops = float(flops)
        if self.held_param_sync is not None:  # only after a restore (ddp.py)
            ddp.release_param_sync(self.built.model, self.held_param_sync)
            self.held_param_sync = None
        self.handle.after_step(iteration, loss=loss)

    def recover(self, exc: BaseException):
        """The recovery boundary around the whole loop body. Re-raises ``exc`` when it is not
        a job failure. Otherwise returns, after the world, the groups and the state are
        rebuilt, what ``train()`` keeps in locals: (iteration, FLOPs, train iterator, valid
        iterator, whether the forward pre-hooks are on)."""
        args, model = self.args, self.built.model
        # the cached save strategies and unfinalized async saves hold the old groups: gone
        self.adapters.checkpoints.forget_groups()  # before the rebuild and its audit (the
        async_saves.abandon(args)                  # next --save builds them on the new groups)
        self.handle.recover(exc)
        from megatron.training import training

        chunks = len(model) if args.virtual_pipeline_model_parallel_size else None
        train_it, valid_it = self.adapters.iterators.rebuild(
            training, self.built.dataset_provider, chunks)
        self._reapply_rng()
        training_globals.reset_after_restore(self.state.iteration)
        self.tag.forget_collective_caches(self.built.optimizer)
        self._arm_redos()
        # --overlap-param-gather: pre-hooks on as in a failure-free run (off in the first step)
        it = self.state.iteration  # (at the last iteration the loop ends: no hooks, no sync)
        hooks_on, self.held_param_sync = ddp.realign_forward_pre_hooks(
            model, args, self.start_iteration < it < args.train_iters)
        return self.state.iteration, self.state.flops, train_it, valid_it, hooks_on

    def shutdown(self, exc: Optional[BaseException]) -> None:
        """The script ended with ``exc``: report it and free the communicators."""
        self.handle.shutdown(exc)

    def _end_solitary_startup(self, iteration: int) -> None:
        """A promoted spare's collectives are real again (restored RNG re-applied); on every
        rank, a restore's redone evaluation, then its save run (evaluation.py, cadence.py)."""
        from megatron.training import training

        if self.quiet is not None:
            self.quiet.stop()
            self.quiet = None
        if self._rng_pending:  # building the data iterators drew from the restored RNG
            self._rng_pending = False
            self._reapply_rng()
        if self._loaded_rng is not None:  # the same after Megatron-LM's own --load
            from ..adapters.train_state import apply_rng
            apply_rng(self._loaded_rng)
            self._loaded_rng = None
        self.adapters.evaluations.run_if_due(training, iteration, self.adapters.iterators.valid(),
                                             self.train_args, self.tag.eval_kwargs)
        self.adapters.saves.run_if_due(training, self.args, iteration, self.state.flops,
                                       self.train_args)

    def _arm_redos(self) -> None:  # after a restore: the evaluation and save due at its iteration
        for redo in (self.adapters.evaluations, self.adapters.saves):
            redo.arm(self.args, self.state.iteration, self.handle.restored_meta)

    def _wrap_train(self, training_module) -> None:
        """Record what pretrain() gives ``train()`` (the evaluation's inputs; on some tags
        holders of process groups, rebound like the model's), and, when it returns after a
        restore to the last iteration (its loop ran no ``before_step``), end a spare's
        solitary startup and redo the evaluation there. Idempotent."""
        orig = training_module.train
        if getattr(orig, "_deadpool_session", None) is self:
            return
        sig = inspect.signature(orig)

        def train(*a, **k):
            self.train_args = dict(sig.bind_partial(*a, **k).arguments)
            holders = [self.train_args.get(n) for n in self.tag.train_group_holders]
            self.handle.protect_groups_of([h for h in holders if h is not None])
            out = orig(*a, **k)
            self._end_solitary_startup(self.state.iteration)
            return out

        train._deadpool_session = self
        training_module.train = train

    def _save_exact(self, iteration: int) -> None:
        """Beside each ``--save``: what the checkpoint lacks for an exact resume, this rank's
        RNG states and tensor-parallel copies (adapters/exact_resume.py)."""
        from ..adapters import cpu_mode

        if getattr(self.args, "save", None):
            exact_resume.save(self.args.save, iteration, self.handle.rank,
                              self.handle.world_size, not cpu_mode.is_enabled(),
                              self.built.model, self.built.optimizer,
                              self.args.tensor_model_parallel_size)

    def _reapply_rng(self) -> None:
        if self.handle.restored_meta is not None:
            from ..adapters.train_state import apply_rng
            apply_rng(self.handle.restored_meta["rng"])


def _logged_loss(loss_dict: Optional[dict]) -> Optional[float]:
    """The step's loss for the launch summary (only under ``deadpool launch``)."""
    if loss_dict and "lm loss" in loss_dict and results_dir():
        return float(loss_dict["lm loss"])
    return None


# ---------------------------------------------------------------------------- the hooks
# Megatron-LM's initialize_megatron() gives pretrain() nothing back, so the session join()
# makes is kept here, the one process-wide reference (as Megatron keeps its args): the
# patched code reads it with session() and holds it.
_session: Optional[Session] = None


def add_args(parser):
    """arguments.py: the ``--deadpool*`` group (same flags as the reference trainer)."""
    return add_deadpool_args(parser)


def join(args) -> Session:
    """initialize.py ``_initialize_distributed``: the process's session. With ``--deadpool``,
    check the configuration, join the job and initialize torch.distributed (a spare blocks
    here until it is promoted to a dead rank's id); without it, a session whose hooks do
    nothing."""
    global _session
    if not getattr(args, "deadpool", False):
        _session = Session(args)
        return _session
    from megatron.training import training  # <tree>/megatron/training/training.py

    tag = tags.patched_tag(os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(training.__file__)))))
    bad = unsupported_args(args, ft_package.launcher_is_client())
    if bad:
        raise UnsupportedConfigError("--deadpool does not support: " + "; ".join(bad))
    from .. import api
    from ..adapters import cpu_mode

    device = "cpu" if cpu_mode.is_enabled() else "cuda"
    backend = args.distributed_backend
    if device == "cpu" and backend != "gloo":
        raise ConfigError("--deadpool in CPU mode needs --distributed-backend gloo")
    handle = api.Deadpool.start(DeadpoolConfig.from_args(args), device=device, backend=backend)
    _session = Joined(args, handle, tag)
    args.rank, args.world_size = handle.rank, handle.world_size
    if handle.promoted:
        training_globals.adopt_rank(args)
        args.local_rank = handle.local_rank  # a node's standby: the GPU it took
    mark_sections(training, handle.section)  # save, eval, data: their own timeouts
    return _session


def session() -> Session:
    """training.py: the session ``join`` made (none made, as when Megatron skips
    ``_initialize_distributed`` or runs unpatched: one with ``--deadpool`` off)."""
    global _session
    if _session is None:
        _session = Session(None)
    return _session


# ---------------------------------------------------------------------------- end
def capture_setup() -> None:
    """Record the model and optimizer Megatron-LM's ``setup_model_and_optimizer`` returns,
    so that the end-of-run fingerprint also works for a script without the attach hook (the
    unpatched script, or ``--deadpool`` off)."""
    from megatron.training import training as training_module

    orig = training_module.setup_model_and_optimizer

    def setup_model_and_optimizer(*a, **k):
        model, optimizer, scheduler = orig(*a, **k)
        session().capture(model, optimizer, scheduler)
        return model, optimizer, scheduler

    training_module.setup_model_and_optimizer = setup_model_and_optimizer


def finish() -> Optional[str]:
    """After the script returns (``launch/child.py``): ``Session.finish``."""
    return _session.finish() if _session is not None else None


def joined() -> bool:
    """Whether this process joined the job (``join`` with ``--deadpool``)."""
    return _session is not None and _session.joined


def shutdown(exc: Optional[BaseException]) -> None:
    """The script ended with ``exc``: a joined session reports it and frees the
    communicators (clean exit)."""
    if _session is not None:
        _session.shutdown(exc)


def results_dir() -> Optional[str]:
    return os.environ.get("DEADPOOL_RESULTS_DIR")
