"""Reference GPT pretraining on megatron-core, a thin caller of ``megatron_deadpool.api``.

Run one process per rank (``deadpool launch`` does that):
    python -m megatron_deadpool.trainer.gpt --tensor-model-parallel-size 2 ... --mock-data
Bitwise deterministic on CPU: the same flags give the same final state fingerprint.
"""

from __future__ import annotations

import os
import sys
import time
from functools import partial
from types import SimpleNamespace

from ..base.errors import DeadpoolError
from .args import parse_args, validate


def _log(msg: str) -> None:
    print(msg, flush=True)


def preimport() -> None:
    """Import what ``build`` and ``train_step`` need before joining: a standby spare then
    pays for the imports while it waits, not after it is promoted (in the recovery's
    critical path). Nothing here depends on the rank a spare will take."""
    import megatron.core.distributed  # noqa: F401
    import megatron.core.distributed.finalize_model_grads  # noqa: F401
    import megatron.core.models.gpt.gpt_layer_specs  # noqa: F401
    import megatron.core.models.gpt.gpt_model  # noqa: F401
    import megatron.core.optimizer  # noqa: F401
    import megatron.core.optimizer_param_scheduler  # noqa: F401
    import megatron.core.pipeline_parallel  # noqa: F401
    import megatron.core.transformer.module  # noqa: F401
    import megatron.core.transformer.transformer_config  # noqa: F401


def build(args, device):
    """Model, DDP, distributed optimizer and scheduler, exactly as megatron-core builds them."""
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.transformer_config import TransformerConfig

    dtype = torch.bfloat16 if args.bf16 else torch.float32
    _seed(args.seed + 100 * ps.get_pipeline_model_parallel_rank())
    config = TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        hidden_dropout=args.hidden_dropout, attention_dropout=args.attention_dropout,
        use_cpu_initialization=True, params_dtype=dtype, pipeline_dtype=dtype,
        bf16=args.bf16, gradient_accumulation_fusion=False, bias_dropout_fusion=False,
        masked_softmax_fusion=False, apply_rope_fusion=False, persist_layer_norm=False,
        bias_activation_fusion=False,
    )
    model = GPTModel(
        config=config, transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=args.vocab_size, max_sequence_length=args.max_position_embeddings,
        pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type="learned_absolute",
    )
    if args.bf16:  # as Megatron-LM's get_model: bf16 everywhere (norms too), fp32 outputs
        from megatron.core.transformer.module import Float16Module

        model = Float16Module(config, model)
    if device.type == "cuda":
        model.cuda(device)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False, overlap_param_gather=False,
        use_distributed_optimizer=True)
    ddp = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)
    config.no_sync_func = ddp.no_sync
    config.finalize_model_grads_func = finalize_model_grads
    opt_config = OptimizerConfig(
        optimizer="adam", lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay,
        adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, clip_grad=args.clip_grad,
        bf16=args.bf16, params_dtype=dtype, use_distributed_optimizer=True)
    optimizer = get_megatron_optimizer(opt_config, [ddp])
    return [ddp], optimizer, _scheduler(args, optimizer)


def _seed(seed: int) -> None:
    """Every generator, as Megatron-LM's _set_random_seed does (it passes seed + 100 *
    pp_rank, so pipeline stages differ)."""
    import random

    import numpy as np
    import torch
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


def _scheduler(args, optimizer):
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    return OptimizerParamScheduler(
        optimizer, init_lr=0.0 if args.lr_warmup_iters else args.lr, max_lr=args.lr,
        min_lr=args.min_lr, lr_warmup_steps=args.lr_warmup_iters * args.global_batch_size,
        lr_decay_steps=args.train_iters * args.global_batch_size,
        lr_decay_style=args.lr_decay_style, start_wd=args.weight_decay,
        end_wd=args.weight_decay, wd_incr_steps=args.train_iters * args.global_batch_size,
        wd_incr_style="constant")


def _loss_func(loss_mask, output_tensor):
    import torch

    losses = output_tensor.float()
    loss = torch.sum(losses.view(-1) * loss_mask.view(-1)) / loss_mask.sum()
    return loss, {"lm loss": loss.detach().clone()}


def _forward_step(device, data_iterator, model):
    batch = next(data_iterator)
    b = {k: v.to(device) for k, v in batch.items()}
    out = model(b["tokens"], b["position_ids"], b["attention_mask"], labels=b["labels"])
    return out, partial(_loss_func, b["loss_mask"])


def train_step(args, state, model, optimizer, scheduler, device, deadpool):
    """One iteration: forward/backward over the global batch, then the optimizer step."""
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from .data import as_iterator, microbatches

    batches = microbatches(args.seed, state.consumed_train_samples, args.global_batch_size,
                           args.micro_batch_size, ps.get_data_parallel_world_size(),
                           ps.get_data_parallel_rank(), args.seq_length, args.vocab_size)
    for chunk in model:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    losses = get_forward_backward_func()(
        forward_step_func=partial(_forward_step, device), data_iterator=as_iterator(batches),
        model=model, num_microbatches=len(batches), seq_length=args.seq_length,
        micro_batch_size=args.micro_batch_size, decoder_seq_length=args.seq_length,
        forward_only=False)
    ok, grad_norm, _ = optimizer.step()  # deadpool waits here for the previous snapshot
    if not ok:
        raise RuntimeError("optimizer step was skipped (non-finite gradients)")
    scheduler.step(increment=args.global_batch_size)
    loss = None
    if ps.is_pipeline_last_stage(ignore_virtual=True):
        loss = torch.stack([x["lm loss"] for x in losses]).mean()
        torch.distributed.all_reduce(loss, group=ps.get_data_parallel_group())
        loss = (loss / ps.get_data_parallel_world_size()).item()
    return loss, grad_norm


def _quiet_known_warnings() -> None:
    """Megatron warns once per process about optional GPU packages; with 8+ processes that
    buries the training log."""
    import warnings

    for pattern in ("Apex is not installed", "Transformer Engine and Apex are not installed",
                    "full scope is deprecated", "The .grad attribute of a Tensor that is not"):
        warnings.filterwarnings("ignore", message=pattern)
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")


def _prepare(argv):
    """Everything before joining the job: flags, device, imports."""
    _quiet_known_warnings()
    args = parse_args(argv)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    validate(args, world_size)

    from ..base.worker_env import dump_stacks_on_crash, exit_with_launcher, log_to_stdout

    dump_stacks_on_crash()
    exit_with_launcher()  # a launcher killed outright leaves no orphans
    _choose_device(args)
    log_to_stdout()
    preimport()
    return args


def main(argv=None) -> int:
    from ..membership import startup

    try:
        args = _prepare(argv)
    except BaseException as exc:
        startup.report(exc)  # the job does not know this process yet: a startup error
        raise
    from .. import api

    deadpool = api.Deadpool.start(args.deadpool_config, device=args.device, backend=args.backend)
    try:
        device = deadpool.device
        deadpool.initialize_model_parallel(
            tensor_model_parallel_size=args.tensor_model_parallel_size,
            pipeline_model_parallel_size=args.pipeline_model_parallel_size)
        if deadpool.promoted and args.spare_build_delay > 0:
            time.sleep(args.spare_build_delay)  # a large model's build (tests)
        model, optimizer, scheduler = build(args, device)
        state = SimpleNamespace(iteration=0, consumed_train_samples=0)
        deadpool.attach(model=model, optimizer=optimizer, scheduler=scheduler, train_state=state)

        t_last = time.time()
        step_s = []
        while state.iteration < args.train_iters:
            try:
                deadpool.before_step(state.iteration)
                with deadpool.section("step"):
                    loss, grad_norm = train_step(args, state, model, optimizer, scheduler,
                                                 device, deadpool)
                state.iteration += 1
                state.consumed_train_samples += args.global_batch_size
                deadpool.after_step(state.iteration, loss=loss)
                _mock_save(args, state.iteration, deadpool)
            except Exception as exc:  # the one recovery boundary
                deadpool.recover(exc)  # re-raises when this is not a recoverable failure
                t_last = time.time()
                continue
            now = time.time()
            step_s.append(now - t_last)
            if loss is not None and state.iteration % args.log_interval == 0 and (
                    deadpool.rank == deadpool.world_size - 1):
                _log_iteration(args, state, optimizer, now - t_last, loss, grad_norm)
            t_last = now

        digest = deadpool.finish(model, optimizer, train_state=state, scheduler=scheduler,
                                 extra={"step_s": step_s, "iteration": state.iteration})
        if deadpool.rank == 0:
            _log(f"final_state_sha256 {digest}")
    except BaseException as exc:
        deadpool.shutdown(exc)  # report it and free the communicators: a clean exit
        raise
    return 0


def _mock_save(args, iteration: int, deadpool) -> None:
    """--mock-save-interval: what a synchronous checkpoint save looks like to the decider (a
    long phase in the save section), without writing anything or touching training state."""
    if args.mock_save_interval and iteration % args.mock_save_interval == 0:
        with deadpool.section("save"):
            time.sleep(args.mock_save_s)


def _choose_device(args) -> None:
    import torch

    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.backend is None:
        args.backend = "nccl" if args.device == "cuda" else "gloo"
    if args.device == "cpu":
        from ..adapters import cpu_mode

        cpu_mode.enable()
        torch.set_num_threads(1)  # fixed thread count: bitwise determinism on CPU
        torch.use_deterministic_algorithms(True)


def _log_iteration(args, state, optimizer, step_s: float, loss: float, grad_norm) -> None:
    """Megatron-LM's iteration line."""
    lr = optimizer.param_groups[0]["lr"]
    _log(f" [{time.strftime('%Y-%m-%d %H:%M:%S')}] iteration {state.iteration:8d}/"
         f"{args.train_iters:8d} | consumed samples: {state.consumed_train_samples:12d} |"
         f" elapsed time per iteration (ms): {step_s * 1000:.1f} |"
         f" learning rate: {lr:.6E} | global batch size: {args.global_batch_size:5d} |"
         f" lm loss: {loss:.6E} | grad norm: {float(grad_norm):.3f} |")


def entry(argv=None) -> int:
    try:
        return main(argv)
    except DeadpoolError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    sys.exit(entry())
