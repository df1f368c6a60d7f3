"""Megatron-LM's checkpointing context across a hot swap (adapters/checkpoints.py): the
save strategies that ``save_checkpoint`` caches hold the old generation's groups, so a
recovery must drop them. Pure: a stand-in training module with Megatron's signature."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import torch

from megatron_deadpool.adapters.checkpoints import CheckpointContexts, compare


def _training_module(calls):
    def save_checkpoint(iteration, model, optimizer, opt_param_scheduler,
                        num_floating_point_operations_so_far, checkpointing_context=None,
                        non_persistent_ckpt=False):
        calls.append(iteration)
        if checkpointing_context is not None:
            checkpointing_context.setdefault("save_strategy", object())

    return SimpleNamespace(save_checkpoint=save_checkpoint)


def test_a_recovery_drops_the_cached_strategies_of_every_context_seen():
    mod = _training_module([])
    ctx_positional, ctx_keyword = {}, {"load_strategy": object(), "other": 1}
    contexts = CheckpointContexts()
    contexts.wrap(mod)
    contexts.wrap(mod)  # idempotent: one wrapper, not two
    mod.save_checkpoint(4, None, None, None, 0.0, ctx_positional)
    mod.save_checkpoint(4, None, None, None, 0.0, checkpointing_context=ctx_keyword)
    mod.save_checkpoint(4, None, None, None, 0.0)  # no context: nothing to remember
    assert "save_strategy" in ctx_positional and "save_strategy" in ctx_keyword
    assert sorted(contexts.forget_groups()) == ["load_strategy", "save_strategy",
                                                "save_strategy"]
    assert ctx_positional == {} and ctx_keyword == {"other": 1}
    mod.save_checkpoint(8, None, None, None, 0.0, ctx_positional)
    assert "save_strategy" in ctx_positional  # rebuilt by the next save


def test_compare_reads_torch_dist_checkpoints_bit_for_bit(tmp_path):
    import torch.distributed.checkpoint as dcp

    a = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3), "x": {"b": torch.ones(2)}}
    b = {"w": a["w"].clone(), "x": {"b": torch.ones(2)}}
    dcp.save(a, checkpoint_id=str(tmp_path / "a"), no_dist=True)
    dcp.save(b, checkpoint_id=str(tmp_path / "b"), no_dist=True)
    r = compare(str(tmp_path / "a"), str(tmp_path / "b"))
    assert r["equal"] and r["tensors"] == 2 and r["differing"] == []
    b["w"][1, 2] = torch.nextafter(b["w"][1, 2], torch.tensor(100.0))  # one ulp
    dcp.save(b, checkpoint_id=str(tmp_path / "c"), no_dist=True)
    r = compare(str(tmp_path / "a"), str(tmp_path / "c"))
    assert not r["equal"] and r["differing"] == ["w"]


class _Rerun:  # Megatron's RerunDataIterator: state in instance attributes
    def __init__(self, it):
        self.iterable, self.saved_microbatches = it, []

    def __next__(self):
        return next(self.iterable)


def _module(at=None):
    """Megatron's build as far as the tests need it: the provider makes the datasets, the
    loaders start at the consumed samples (``at[0]``)."""
    at = [0] if at is None else at

    def build(provider):
        return (_Rerun(iter(provider("train")[at[0]:])), _Rerun(iter(provider("valid")[at[0]:])),
                None)

    return SimpleNamespace(build_train_valid_test_data_iterators=build)


def test_rebuilt_iterators_reach_the_ones_pretrain_keeps():
    """pretrain()'s final evaluation reads the valid iterator it built: after a recovery
    that object must read the rebuilt stream (it read other batches than a failure-free
    run before)."""
    from megatron_deadpool.adapters.iterators import PretrainIterators

    start = [0]
    mod = _module(start)
    its = PretrainIterators()
    its.wrap(mod)
    its.wrap(mod)
    provider = lambda split: [f"{split}{i}" for i in range(4)]  # noqa
    kept_train, kept_valid, _ = mod.build_train_valid_test_data_iterators(provider)
    assert next(kept_valid) == "valid0"  # the failure struck after one eval batch
    start[0] = 2  # the restored samples
    train, valid = its.rebuild(mod, provider, chunks=None)
    assert train is kept_train and valid is kept_valid and its.valid() is kept_valid
    assert next(kept_valid) == "valid2" and next(kept_train) == "train2"
    train, valid = its.rebuild(mod, provider, chunks=None)  # a rebuild is not recorded
    assert valid is kept_valid and len(its._built) == 1


def test_rebuilt_iterators_per_model_chunk():
    """With virtual pipeline stages pretrain() builds one pair per model chunk, each with
    the provider bound to its ``vp_stage``: the rebuild does the same, chunk by chunk."""
    from megatron_deadpool.adapters.iterators import PretrainIterators

    mod = _module()
    its = PretrainIterators()
    its.wrap(mod)
    provider = lambda split, vp_stage: [f"{split}{vp_stage}.{i}" for i in range(3)]  # noqa
    kept = [mod.build_train_valid_test_data_iterators(
        lambda split, vp=vp: provider(split, vp_stage=vp)) for vp in range(2)]
    for t, _, _ in kept:
        next(t)
    train, valid = its.rebuild(mod, provider, chunks=2)
    assert [t is k[0] for t, k in zip(train, kept)] == [True, True]
    assert [next(t) for t in train] == ["train0.0", "train1.0"]
    assert its.valid() == valid and [next(v) for v in valid] == ["valid0.0", "valid1.0"]


def test_a_rebuild_makes_new_loaders_on_the_datasets_already_built():
    """The datasets are built once per provider and model chunk: a rebuild after a
    recovery makes new loaders at the restored samples on them (building them again was
    most of the first step after a restore)."""
    from megatron_deadpool.adapters.iterators import PretrainIterators

    start, calls = [0], []
    mod = _module(start)
    its = PretrainIterators()
    its.wrap(mod)

    def provider(split, vp_stage=None):
        calls.append((split, vp_stage))
        return [f"{split}{vp_stage}.{i}" for i in range(4)]
    provider.is_distributed = True
    for vp in range(2):
        stage = functools.partial(provider, vp_stage=vp)
        stage.is_distributed = True
        mod.build_train_valid_test_data_iterators(stage)
    assert len(calls) == 4
    start[0] = 3
    train, valid = its.rebuild(mod, provider, chunks=2)
    train, valid = its.rebuild(mod, provider, chunks=2)
    assert len(calls) == 4  # no dataset built again
    assert [next(t) for t in train] == ["train0.3", "train1.3"]
    assert [next(v) for v in valid] == ["valid0.3", "valid1.3"]
    seen = []  # the provider's attributes reach the build (is_distributed)
    mod.build_train_valid_test_data_iterators = lambda p: seen.append(p.is_distributed)
    its.wrap(mod)
    mod.build_train_valid_test_data_iterators(stage)
    assert seen == [True]


def test_a_build_after_a_restore_keeps_the_restored_consumed_samples():
    """Megatron's build sets ``consumed_valid_samples`` from the iteration when it is 0
    (checkpoints older than the counter). Restored to the first evaluation's iteration,
    before it ran, 0 is real: the derived value made the redone evaluation count twice
    (a CI run's fingerprint differed in ``consumed_valid_samples``, 96 against 80). Before
    any restore the build's own rule stands (a --load of an old checkpoint)."""
    from types import SimpleNamespace

    from megatron_deadpool.adapters.iterators import PretrainIterators

    args = SimpleNamespace(iteration=4, consumed_train_samples=32, consumed_valid_samples=0)
    mod = _module()
    orig = mod.build_train_valid_test_data_iterators

    def build(provider):  # megatron/training/training.py's backward compatibility
        if args.iteration > 0 and args.consumed_valid_samples == 0:
            args.consumed_valid_samples = args.iteration // 4 * 2 * 8
        starts.append(args.consumed_valid_samples)  # where the valid loader starts
        return orig(provider)
    starts = []
    mod.build_train_valid_test_data_iterators = build
    its = PretrainIterators(get_args=lambda: args)
    its.wrap(mod)
    provider = lambda split: [f"{split}{i}" for i in range(4)]  # noqa
    mod.build_train_valid_test_data_iterators(provider)
    assert args.consumed_valid_samples == 16  # no restore yet: Megatron's rule
    args.consumed_valid_samples = 0  # restored to iteration 4, before its evaluation
    its.rebuild(mod, provider, chunks=None)
    assert (args.consumed_train_samples, args.consumed_valid_samples) == (32, 0)
    assert starts == [16, 0] and args.iteration == 4  # the loader starts at the restored 0
    its2 = PretrainIterators(get_args=lambda: args)  # a promoted spare: restored first,
    its2.restored()  # then pretrain() builds
    mod.build_train_valid_test_data_iterators = build
    its2.wrap(mod)
    mod.build_train_valid_test_data_iterators(provider)
    assert args.consumed_valid_samples == 0 and starts[-1] == 0 and args.iteration == 4
