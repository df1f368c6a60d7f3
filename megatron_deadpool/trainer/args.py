"""Reference-trainer flags. Names follow Megatron-LM's ``pretrain_gpt.py`` so a command line
moves between the two unchanged. Validation is a pure function of (args, world size) so the
launcher can reject bad input once, before any worker starts."""

from __future__ import annotations

import argparse
from typing import List, Optional

from ..base.config import DeadpoolConfig
from ..base.errors import ConfigError
from ..flags import add_deadpool_args

REQUIRED = ("num_layers", "hidden_size", "num_attention_heads", "seq_length",
            "micro_batch_size", "global_batch_size", "train_iters")


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one clear line, no usage wall
        raise ConfigError(message)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="megatron_deadpool.trainer", description="reference GPT trainer "
                "on megatron-core (Megatron-LM flag names)", allow_abbrev=False)
    a = p.add_argument
    a("--tensor-model-parallel-size", type=int, default=1)
    a("--pipeline-model-parallel-size", type=int, default=1)
    a("--num-layers", type=int)
    a("--hidden-size", type=int)
    a("--ffn-hidden-size", type=int, default=None)
    a("--num-attention-heads", type=int)
    a("--seq-length", type=int)
    a("--max-position-embeddings", type=int, default=None)
    a("--micro-batch-size", type=int)
    a("--global-batch-size", type=int)
    a("--train-iters", type=int)
    a("--lr", type=float, default=1e-3)
    a("--min-lr", type=float, default=0.0)
    a("--lr-warmup-iters", type=int, default=0)
    a("--lr-decay-style", default="constant", choices=["constant", "linear", "cosine"])
    a("--weight-decay", type=float, default=0.01)
    a("--clip-grad", type=float, default=1.0)
    a("--adam-beta1", type=float, default=0.9)
    a("--adam-beta2", type=float, default=0.999)
    a("--hidden-dropout", type=float, default=0.1)
    a("--attention-dropout", type=float, default=0.1)
    a("--seed", type=int, default=1234)
    a("--mock-data", action="store_true", help="synthetic data (the only data source here)")
    a("--use-distributed-optimizer", action="store_true",
      help="accepted for Megatron compatibility; the optimizer is always distributed")
    a("--vocab-size", type=int, default=128)
    a("--bf16", action="store_true", help="bf16 params and compute, fp32 main params")
    a("--log-interval", type=int, default=1)
    a("--device", choices=["cpu", "cuda"], default=None,
      help="default: cuda if available, else cpu (CPU mode)")
    a("--backend", choices=["gloo", "nccl"], default=None,
      help="default: nccl on cuda, gloo on cpu")
    a("--untie-embeddings-and-output-weights", action="store_true")
    a("--mock-save-interval", type=int, default=0, metavar="N",
      help="a stand-in for a synchronous --save every N iterations: --mock-save-s seconds "
      "inside the save section (Deadpool.section), writing nothing (default: none)")
    a("--mock-save-s", type=float, default=0.0, metavar="S", help="see --mock-save-interval")
    a("--spare-build-delay", type=float, default=0.0, metavar="SECONDS",
      help="testing: a promoted spare waits this long before building its model, as a large "
           "model's build takes on a GPU (the survivors wait for it: "
           "--deadpool-spare-ready-timeout)")
    add_deadpool_args(p)
    return p


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def check_layout(world_size: int, tp: int, pp: int, micro_batch_size: Optional[int],
                 global_batch_size: Optional[int], cp: int = 1) -> int:
    """The parallel layout and batch sizes against the world size (also used by the
    launcher for ``--script``, where Megatron-LM would fail later in every rank). Returns the
    data-parallel size. Batch sizes that are not given are not checked."""
    for name, v in (("--tensor-model-parallel-size", tp), ("--pipeline-model-parallel-size", pp),
                    ("--context-parallel-size", cp), ("--micro-batch-size", micro_batch_size),
                    ("--global-batch-size", global_batch_size)):
        if v is not None and v <= 0:
            raise ConfigError(f"{name} must be positive, got {v}")
    model = tp * pp * cp
    if world_size % model:
        what = "tensor-parallel x pipeline-parallel" + (" x context-parallel" if cp > 1 else "")
        sizes = " x ".join(str(x) for x in ((tp, pp, cp) if cp > 1 else (tp, pp)))
        raise ConfigError(f"world size {world_size} is not divisible by {what} = {sizes} = "
                          f"{model}")
    dp = world_size // model
    if micro_batch_size and global_batch_size and global_batch_size % (micro_batch_size * dp):
        raise ConfigError(f"--global-batch-size {global_batch_size} is not divisible by "
                          f"--micro-batch-size x data-parallel = {micro_batch_size} x {dp}")
    return dp


def validate(args: argparse.Namespace, world_size: int) -> argparse.Namespace:
    """Check the flags against each other and the world size; fill derived values."""
    missing = ["--" + n.replace("_", "-") for n in REQUIRED if getattr(args, n) is None]
    if missing:
        raise ConfigError("missing required flag(s): " + " ".join(missing))
    if not args.mock_data:
        raise ConfigError("only --mock-data is supported by the reference trainer")
    for n in REQUIRED + ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                         "vocab_size"):
        if getattr(args, n) <= 0:
            raise ConfigError(f"--{n.replace('_', '-')} must be positive, got {getattr(args, n)}")
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    dp = check_layout(world_size, tp, pp, args.micro_batch_size, args.global_batch_size)
    if args.num_layers % pp:
        raise ConfigError(f"--num-layers {args.num_layers} is not divisible by "
                          f"--pipeline-model-parallel-size {pp}")
    if args.num_attention_heads % tp:
        raise ConfigError(f"--num-attention-heads {args.num_attention_heads} is not divisible "
                          f"by --tensor-model-parallel-size {tp}")
    if args.hidden_size % args.num_attention_heads:
        raise ConfigError(f"--hidden-size {args.hidden_size} is not divisible by "
                          f"--num-attention-heads {args.num_attention_heads}")
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    if args.max_position_embeddings < args.seq_length:
        raise ConfigError("--max-position-embeddings must be >= --seq-length")
    if args.vocab_size % tp:
        raise ConfigError(f"--vocab-size {args.vocab_size} is not divisible by "
                          f"--tensor-model-parallel-size {tp}")
    if args.spare_build_delay < 0:
        raise ConfigError(f"--spare-build-delay must be >= 0, got {args.spare_build_delay}")
    if args.backend == "nccl" and args.device == "cpu":
        raise ConfigError("--backend nccl needs --device cuda")
    if args.mock_save_interval < 0 or args.mock_save_s < 0:
        raise ConfigError("--mock-save-interval and --mock-save-s must be >= 0")
    args.data_parallel_size = dp
    args.deadpool_config = DeadpoolConfig.from_args(args)
    return args
