"""Megatron-LM's data iterators across a recovery.

After a rollback the loaders are rebuilt at the restored consumed samples (the session's
``recover``, megatron/lm.py), and ``train()`` gets the new iterators. But ``pretrain()``
keeps the ones it built and, after ``train()`` returns, its final evaluation reads its valid
iterator: one that the recovery left where it stood when the failure struck (a survivor), so
that evaluation read other batches than a failure-free run's. :class:`PretrainIterators`
remembers what ``pretrain()`` built and moves each rebuilt iterator's state into it, so
every holder reads the rebuilt stream. """

from __future__ import annotations

import contextlib
import functools
from typing import Any, List, Optional, Tuple

from .quiet import CollectiveSuppressor


class PretrainIterators:
    def __init__(self, get_args=None) -> None:
        self._get_args = get_args or _megatron_args  # Megatron's global args
        # (train, valid) of each build pretrain() made: one, or one per model chunk with
        # virtual pipeline stages (a list of iterators per kind, each chunk its own)
        self._built: List[Tuple[Any, Any]] = []
        self._recording = True  # pretrain()'s builds; a rebuild is not recorded
        self._restored = False  # the counters on args come from a DeadPool restore
        self._datasets = DatasetMemo()  # a rebuild makes new loaders, not new datasets

    def wrap(self, training_module) -> None:
        """Record the (train, valid) iterators ``build_train_valid_test_data_iterators``
        returns in ``training_module`` while pretrain() builds them; idempotent."""
        orig = training_module.build_train_valid_test_data_iterators
        if getattr(orig, "_deadpool_iterators", None) is self:
            return

        @functools.wraps(orig)
        def build_train_valid_test_data_iterators(provider, *a, **k):
            args = self._get_args() if self._restored else None
            with _counters_as_restored(args):
                out = orig(self._datasets.of(provider), *a, **k)
            if self._recording:
                self._built.append((out[0], out[1]))
            return out

        build_train_valid_test_data_iterators._deadpool_iterators = self
        training_module.build_train_valid_test_data_iterators = \
            build_train_valid_test_data_iterators

    def restored(self) -> None:
        """The training state was restored by DeadPool (a promoted spare's attach, before
        pretrain() builds its iterators; every rebuild): builds start the loaders at the
        restored counters (_counters_as_restored)."""
        self._restored = True

    def valid(self) -> Any:
        """The valid iterator pretrain() and train() hold (a list per model chunk with
        virtual pipeline stages; None before it is built)."""
        valid = [v for _, v in self._built]
        return valid if len(valid) > 1 else (valid[0] if valid else None)

    def rebuild(self, training_module, dataset_provider, chunks: Optional[int]
                ) -> Tuple[Any, Any]:
        """Data iterators at the restored consumed samples, moved into the ones pretrain()
        holds. Saved microbatches cannot be re-fed after a rollback of up to two steps, so
        the loaders are rebuilt: once, or once per model chunk (``chunks``, with virtual
        pipeline stages, as pretrain() does). The build's collectives (dataset barriers,
        the do_* broadcast) run suppressed on every rank, exactly as on a promoted spare;
        the do_* flags stay as restored."""
        from ..base.errors import ConfigError

        if dataset_provider is None:
            raise ConfigError("the session's attach() was called without the dataset provider; the "
                              "data iterators cannot be rebuilt after a recovery")
        providers = [dataset_provider] if chunks is None else \
            [_for_stage(dataset_provider, vp) for vp in range(chunks)]
        self._recording = False
        self.restored()
        quiet = CollectiveSuppressor()
        quiet.start()
        try:
            new = [training_module.build_train_valid_test_data_iterators(p)[:2]
                   for p in providers]
        finally:
            quiet.stop()
        old = self._built if len(self._built) == len(new) else [(None, None)] * len(new)
        pairs = [(_in_place(o[0], n[0]), _in_place(o[1], n[1])) for o, n in zip(old, new)]
        if chunks is None:
            return pairs[0]
        return [t for t, _ in pairs], [v for _, v in pairs]


class DatasetMemo:
    """The datasets a provider built, per provider and arguments, for the next build.

    A rebuild after a recovery needs new loaders at the restored consumed samples, not new
    datasets: a dataset is indexed by sample, and the loader's sampler holds the position.
    Building them again (the index files, the blend, the builder's barriers) was most of a
    survivor's first step after the restore (Megatron-LM's data setup: about 1.2 s here)."""

    def __init__(self) -> None:
        self._built: dict = {}

    def of(self, provider):
        """``provider``, answering a call it answered before from the memo."""
        if provider is None or getattr(provider, "_deadpool_memo", None) is self:
            return provider
        base = getattr(provider, "func", provider)
        fixed = tuple(sorted(getattr(provider, "keywords", {}).items()))  # vp_stage

        @functools.wraps(base)
        def memoized(*a, **k):
            key = (id(base), fixed, repr(a), repr(sorted(k.items())))
            if key not in self._built:
                self._built[key] = provider(*a, **k)
            return self._built[key]

        memoized.__dict__.update(getattr(provider, "__dict__", {}))  # is_distributed
        memoized._deadpool_memo = self
        return memoized


@contextlib.contextmanager
def _counters_as_restored(args):
    """Megatron's build rewrites a consumed-samples counter of 0 from ``args.iteration``
    (checkpoints older than the counters) and starts that loader there. After a restore a
    0 is real: restored to the first evaluation's iteration, before it ran,
    ``consumed_valid_samples`` is 0, and the rewrite (one evaluation's samples) made the
    redone evaluation read later batches and count twice. So the build sees iteration 0;
    its only other reader, ``--phase-transition-iterations``, is refused with --deadpool."""
    if args is None or not getattr(args, "iteration", 0):
        yield
        return
    iteration, args.iteration = args.iteration, 0
    try:
        yield
    finally:
        args.iteration = iteration


def _megatron_args():
    try:
        from megatron.training.global_vars import get_args
    except ImportError:  # megatron-core alone (no training loop): no counters to keep
        return None
    return get_args()


def _for_stage(provider, vp_stage: int):
    """pretrain()'s per-chunk provider with virtual pipeline stages."""
    p = functools.partial(provider, vp_stage=vp_stage)
    if getattr(provider, "is_distributed", False):
        p.is_distributed = True
    return p


def _in_place(old, new):
    if old is None or new is None or type(old) is not type(new) or not hasattr(old, "__dict__"):
        return new
    old.__dict__.clear()
    old.__dict__.update(new.__dict__)
    return old
