"""Pure rules of the Megatron-LM integration (no Megatron import): which flags ``--deadpool``
refuses, which megatron-core wheel the reference trainer supports, and the CPU-only flags
``deadpool launch --device cpu`` adds. Used by ``lm.py`` and by the launcher before any
worker starts. Also which Megatron-LM functions run in which section (``mark_sections``)."""

from __future__ import annotations

import functools
from typing import Callable, ContextManager, List, Tuple

from ..base.errors import ConfigError

# The megatron-core *wheel* the reference trainer and the demo run on (Python 3.11, the local
# CPU torch). Megatron-LM trees are identified by tag instead (tags.py).
SUPPORTED_MEGATRON = ("0.16.1",)


# ---------------------------------------------------------------------------- pure checks
def unsupported_args(args, ft_launcher: bool = False) -> List[str]:
    """Megatron-LM settings that ``--deadpool`` v1 refuses, each with the reason. Pure:
    a function of the parsed arguments, and of ``ft_launcher``: whether NVRx's ft_launcher
    runs ``deadpool launch`` (``--enable-ft-package`` needs it: ``adapters/ft_package.py``)."""
    g = lambda name, default=None: getattr(args, name, default)  # noqa: E731
    rules = [
        (g("inprocess_restart"), "--inprocess-restart (NVRx in-process restart): both would "
         "own the recovery of the same failure; use one of them"),
        (g("enable_ft_package") and not ft_launcher, "--enable-ft-package (NVRx fault-"
         "tolerance package) needs NVRx's ft_launcher to run deadpool launch (ft_launcher "
         "--nproc-per-node 1 ... deadpool launch ...): it restarts the job when DeadPool "
         "stops, DeadPool swaps the ranks"),
        (not g("use_distributed_optimizer"), "training without --use-distributed-optimizer "
         "(DeadPool mirrors distributed-optimizer shards)"),
        (g("async_save") and g("async_strategy") == "nvrx", "--async-save with --async-"
         "strategy nvrx (core_v0.19.0's default; untested through a swap: use mcore)"),
        (g("fp8") is not None, "--fp8-format (FP8: Transformer Engine's scaling state is "
         "mirrored, but a swap under FP8 has not yet run on a GPU)"),
        (g("non_persistent_ckpt_type") == "local", "--non-persistent-ckpt-type local"),
        ((g("context_parallel_size") or 1) > 1, "--context-parallel-size > 1"),
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
        # flags of core_v0.19.0 (absent on core_v0.16.1: getattr gives the default)
        (g("full_validation"), "--full-validation (the evaluation length is agreed by a "
         "collective while the data iterators are built, which a promoted spare builds "
         "alone)"),
        (g("step_batch_size_schedule") is not None, "--step-batch-size-schedule (untested "
         "through a swap)"),
        (g("exit_signal_handler_for_training"), "--exit-signal-handler-for-training (its "
         "handler ends the job on a signal that DeadPool's fault handling uses)"),
        ((g("gtp_weight_remat_size") or 1) > 1, "--tensor-parallel-num-weight-shards beyond "
         "the TP size (weight-rematerialization groups, untested through a swap)"),
        (g("use_precision_aware_optimizer"), "--use-precision-aware-optimizer (its main "
         "params and moments are read through copies, so a restore could not write them "
         "back)"),
    ]
    return [why for bad, why in rules if bad]


def unsupported_argv(argv: List[str], ft_launcher: bool = False) -> List[str]:
    """``unsupported_args`` on a raw Megatron-LM command line, for ``deadpool launch`` to
    refuse before any worker starts (the workers check the fully parsed arguments again)."""
    import argparse

    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    for flag in ("--inprocess-restart", "--enable-ft-package", "--use-distributed-optimizer",
                 "--async-save",
                 "--perform-rl-step", "--hybrid-context-parallel", "--fake-process-group",
                 "--multiple-validation-sets", "--tp-comm-overlap", "--use-megatron-fsdp",
                 "--use-torch-fsdp2", "--use-precision-aware-optimizer", "--full-validation",
                 "--exit-signal-handler-for-training"):
        p.add_argument(flag, action="store_true")
    p.add_argument("--use-nccl-ub", action="store_true", dest="nccl_ub")
    for flag in ("--context-parallel-size", "--num-distributed-optimizer-instances"):
        p.add_argument(flag, type=int, default=1)
    p.add_argument("--fp8-format", dest="fp8", default=None)
    for flag in ("--non-persistent-ckpt-type", "--dataloader-type", "--yaml-cfg",
                 "--cuda-graph-impl", "--step-batch-size-schedule", "--async-strategy"):
        p.add_argument(flag, default=None)
    p.add_argument("--rampup-batch-size", nargs="*", default=None)
    p.add_argument("--phase-transition-iterations", default=None)
    ns, _ = p.parse_known_args(argv)
    return unsupported_args(ns, ft_launcher)


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


# Megatron-LM's long phases, as named in ``megatron.training.training`` (train() and
# pretrain() look them up there at each call), and the section each one runs in.
SECTION_OF = {"save_checkpoint": "save", "evaluate_and_print_results": "eval",
              "build_train_valid_test_data_iterators": "data"}


def mark_sections(module, section: Callable[[str], ContextManager]) -> None:
    """Wrap ``module``'s checkpoint save, evaluation and data-iterator build so that each
    runs inside ``section(name)`` (``Deadpool.section``: that section's progress timeout,
    and a stale heartbeat, e.g. while the dataset helpers hold the GIL, judged by it too).
    Idempotent; the patch series stays as it is."""
    for name, sec in SECTION_OF.items():
        fn = getattr(module, name, None)
        if fn is not None and not hasattr(fn, "_deadpool_section"):
            setattr(module, name, _in_section(fn, sec, section))


def _in_section(fn, name: str, section: Callable[[str], ContextManager]):
    @functools.wraps(fn)
    def wrapper(*a, **k):
        with section(name):
            return fn(*a, **k)

    wrapper._deadpool_section = name
    return wrapper
