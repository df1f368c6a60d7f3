"""Communication-free access to a rank's distributed-optimizer shard and to the state that
has no data-parallel replica, plus the state fingerprint used by tests, demo and checks."""

from __future__ import annotations

import hashlib
import itertools
from typing import Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import torch

STATE_KEYS = ("param", "exp_avg", "exp_avg_sq", "step")


def distributed_optimizers(optimizer) -> List:
    """The DistributedOptimizer instances inside a (Chained)optimizer, in order."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    opts = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    out = [o for o in opts if isinstance(o, DistributedOptimizer)]
    if not out:
        raise TypeError("megatron-deadpool needs --use-distributed-optimizer "
                        f"(got {type(optimizer).__name__})")
    return out


def _model_params_in_shard_order(opt) -> Iterator[torch.nn.Parameter]:
    for gbuf_range_maps in opt.gbuf_ranges:
        for _dtype, per_bucket in gbuf_range_maps.items():
            for gbuf_range_map in per_bucket:
                for model_param in gbuf_range_map["param_map"]:
                    yield model_param


def optimizer_state_empty(optimizer) -> bool:
    """True before the first optimizer step (torch Adam creates its state lazily)."""
    return all(not opt.optimizer.state for opt in distributed_optimizers(optimizer))


def _per_param_step(inner) -> bool:
    """torch Adam/AdamW keep ``step`` per parameter; TE/apex FusedAdam per param group."""
    return isinstance(inner, (torch.optim.Adam, torch.optim.AdamW))


def shard_tensors(optimizer, placeholders: bool = False) -> List[Tuple[str, torch.Tensor]]:
    """(name, tensor) for every fp32 main param, exp_avg, exp_avg_sq and step of this rank's
    shard, in a canonical order: every main param, then every exp_avg, and so on (the
    moments of all params can then share one flat buffer, ``mirror/flat.py``). Before the
    first step the optimizer state does not exist yet: with ``placeholders`` the moments
    (and, for torch Adam, the per-parameter step) are stood in for by the zeros the first
    step will create (lazy initialization), so the snapshot layout is already the
    steady-state one; without, only the main params are yielded. A step kept per param
    group is in ``group_state``."""
    by_key = {key: [] for key in STATE_KEYS}  # grouped by key: see mirror/flat.py
    for oi, opt in enumerate(distributed_optimizers(optimizer)):
        per_param_step = _per_param_step(opt.optimizer)
        for pi, model_param in enumerate(_model_params_in_shard_order(opt)):
            tensors = opt._get_main_param_and_optimizer_states(model_param)
            if placeholders and len(tensors) == 1:
                main = tensors["param"]
                tensors = {"param": main, "exp_avg": torch.zeros_like(main),
                           "exp_avg_sq": torch.zeros_like(main)}
                if per_param_step:
                    tensors["step"] = torch.tensor(0.0, dtype=torch.float32)
            for key in STATE_KEYS:
                t = tensors.get(key)
                if isinstance(t, torch.Tensor):
                    by_key[key].append((f"opt{oi}.p{pi}.{key}", t))
    return [item for key in STATE_KEYS for item in by_key[key]]


def reset_optimizer_state(optimizer) -> None:
    """Back to the state before the first step: torch Adam re-creates it lazily."""
    for opt in distributed_optimizers(optimizer):
        opt.optimizer.state.clear()


# Per-group fields the optimizer itself advances (TE/apex FusedAdam: Adam's step). The
# scheduler's fields (lr, weight_decay) are restored through the scheduler.
GROUP_STATE_KEYS = ("step",)


def _scalar(v):
    if isinstance(v, torch.Tensor):
        return {"tensor": v.item()}
    return v


def group_state(optimizer) -> List[List[dict]]:
    """Per inner optimizer, per param group: the fields in GROUP_STATE_KEYS it holds (plain
    Python values, for the snapshot metadata)."""
    return [[{k: _scalar(g[k]) for k in GROUP_STATE_KEYS if k in g}
             for g in opt.optimizer.param_groups]
            for opt in distributed_optimizers(optimizer)]


def load_group_state(optimizer, state: List[List[dict]]) -> None:
    """Put ``group_state`` back; a field the snapshot lacks is removed (a fresh optimizer
    never stepped)."""
    opts = distributed_optimizers(optimizer)
    if len(state) != len(opts) or any(len(s) != len(o.optimizer.param_groups)
                                      for s, o in zip(state, opts)):
        raise ValueError("snapshot param groups do not match the optimizer's")
    for saved_groups, opt in zip(state, opts):
        for saved, g in zip(saved_groups, opt.optimizer.param_groups):
            for k in GROUP_STATE_KEYS:
                v = saved.get(k)
                if v is None:
                    g.pop(k, None)
                elif isinstance(v, dict):
                    if isinstance(g.get(k), torch.Tensor):
                        g[k].fill_(v["tensor"])
                    else:
                        g[k] = torch.tensor(v["tensor"])
                else:
                    g[k] = v


def unreplicated_tensors(model_chunks: Sequence[torch.nn.Module], dp_size: int
                         ) -> List[Tuple[str, torch.Tensor]]:
    """Tensors no DP peer can give back: every param when DP == 1; params without grads and
    module buffers always."""
    out = []
    for ci, chunk in enumerate(model_chunks):
        for name, p in chunk.named_parameters():
            if dp_size == 1 or not p.requires_grad:
                out.append((f"chunk{ci}.{name}", p.data))
        for name, b in chunk.named_buffers():
            if b is not None:
                out.append((f"chunk{ci}.buffer.{name}", b))
    return out


def _tp_replicated(param) -> bool:
    return not getattr(param, "tensor_model_parallel", False)


def tp_replicated_state(model_chunks, optimizer) -> Dict[str, torch.Tensor]:
    """The state of the parameters each tensor-parallel rank holds whole (norms, row-parallel
    biases, position embeddings): the model params (``chunk<c>.<name>``) and their optimizer
    shard's entries (``opt<o>.p<i>.<key>``: main param, moments, step), as {name: tensor}.
    Each TP rank updates its own copy, and the copies can differ (CPU mode: dropout on the
    CPU generator, which only TP rank 0's data loader draws from); a Megatron-LM checkpoint
    keeps TP rank 0's. Only meaningful with TP > 1 (with TP 1 it is every parameter)."""
    out = {}
    for ci, chunk in enumerate(model_chunks):
        for name, p in chunk.named_parameters():
            if _tp_replicated(p):
                out[f"chunk{ci}.{name}"] = p.data
    for oi, opt in enumerate(distributed_optimizers(optimizer)):
        for pi, model_param in enumerate(_model_params_in_shard_order(opt)):
            if _tp_replicated(model_param):
                states = opt._get_main_param_and_optimizer_states(model_param)
                for key, t in sorted(states.items()):  # (a loaded state's order differs)
                    if isinstance(t, torch.Tensor):
                        out[f"opt{oi}.p{pi}.{key}"] = t
    return out


def load_tp_replicated_state(model_chunks, optimizer, saved: Dict[str, torch.Tensor]) -> None:
    """Put ``tp_replicated_state`` back: model params, then main params and optimizer state
    (through the optimizer's own setter). ValueError, with nothing changed, when the names,
    shapes or dtypes are not this rank's."""
    def layout(tensors):
        return {k: (tuple(v.shape), v.dtype) for k, v in tensors.items()}

    mine, theirs = layout(tp_replicated_state(model_chunks, optimizer)), layout(saved)
    if mine != theirs:
        k = sorted(mine.keys() ^ theirs.keys()) or [k for k in mine if mine[k] != theirs[k]]
        raise ValueError(f"{len(theirs)} saved tensors, {len(mine)} here, first differing: "
                         f"{k[0]} (another layout or optimizer state)")
    with torch.no_grad():
        for ci, chunk in enumerate(model_chunks):
            for name, p in chunk.named_parameters():
                if _tp_replicated(p):
                    p.data.copy_(saved[f"chunk{ci}.{name}"])
        for oi, opt in enumerate(distributed_optimizers(optimizer)):
            for pi, model_param in enumerate(_model_params_in_shard_order(opt)):
                if _tp_replicated(model_param):
                    prefix = f"opt{oi}.p{pi}."
                    opt._set_main_param_and_optimizer_states(model_param, {
                        k[len(prefix):]: v for k, v in saved.items() if k.startswith(prefix)})


def copy_main_params_to_model(optimizer, model_chunks) -> None:
    """After the main params were restored: rebuild the model params exactly as a step does
    (copy main -> param buffer, then the DP all-gather of the param buffer)."""
    for opt in distributed_optimizers(optimizer):
        opt._copy_main_params_to_model_params()
    for chunk in model_chunks:
        chunk.start_param_sync(force_sync=True)


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous().view(-1)
    return memoryview(t.view(torch.uint8).numpy())


def _param_bytes(model_chunks) -> Iterator[bytes]:
    """Every parameter, then every module buffer (MoE routers keep their load-balancing
    state there: ``local_tokens_per_expert``, ``expert_bias``)."""
    for ci, chunk in enumerate(model_chunks):
        for name, p in chunk.named_parameters():
            yield f"chunk{ci}.{name}".encode()
            yield _tensor_bytes(p.data)
        for name, b in chunk.named_buffers():
            if b is not None:
                yield f"chunk{ci}.buffer.{name}".encode()
                yield _tensor_bytes(b)


def _optimizer_bytes(optimizer) -> Iterator[bytes]:
    for name, t in shard_tensors(optimizer):
        yield name.encode()
        yield _tensor_bytes(t)
    groups = group_state(optimizer)
    if any(g for gs in groups for g in gs):  # per-group step (FusedAdam); torch Adam: none
        yield repr(groups).encode()


def _sha(chunks: Iterable[bytes]):
    h = hashlib.sha256()
    for c in chunks:
        h.update(c)
    return h


def rank_digest(model_chunks: Iterable[torch.nn.Module], optimizer,
                resume_state: Optional[dict] = None) -> str:
    """SHA-256 of this rank's model params and optimizer shard (main params, exp_avg,
    exp_avg_sq, step), in a fixed order, plus ``resume_state`` (``state.capture``: RNG
    states, iteration, consumed samples, scheduler, grad scaler) when given."""
    from .train_state import canonical_bytes

    head = [canonical_bytes(resume_state)] if resume_state is not None else []
    return _sha(itertools.chain(head, _param_bytes(model_chunks),
                                _optimizer_bytes(optimizer))).hexdigest()


def digest_parts(model_chunks: Iterable[torch.nn.Module], optimizer,
                 resume_state: Optional[dict] = None) -> dict:
    """The state ``rank_digest`` covers, hashed per part (16 hex digits): ``params``,
    ``optimizer`` and each resume-state field, the RNG generators one by one. Written next
    to the fingerprint at the end of a job, it names what differs when two fingerprints do."""
    from .train_state import canonical_bytes

    def short(chunks: Iterable[bytes]) -> str:
        return _sha(chunks).hexdigest()[:16]

    parts = {}
    for key, value in (resume_state or {}).items():
        fields = {f"rng.{k}": v for k, v in value.items()} if key == "rng" else {key: value}
        parts.update({k: short([canonical_bytes(v)]) for k, v in fields.items()})
    parts["params"] = short(_param_bytes(model_chunks))
    parts["optimizer"] = short(_optimizer_bytes(optimizer))
    return parts


def combine_digests(digests_in_rank_order: Sequence[str]) -> str:
    """The job's state fingerprint: SHA-256 over every rank's digest in global rank order."""
    h = hashlib.sha256()
    for r, d in enumerate(digests_in_rank_order):
        h.update(f"{r}:{d};".encode())
    return h.hexdigest()


def gather_digests(digest: str, device: torch.device, group=None) -> list:
    """Every rank's ``rank_digest`` in global rank order, gathered as 32 raw bytes each on
    ``device`` (the group backend's) -- values only: an object collective would unpickle
    what peers send."""
    import torch.distributed as dist

    raw = bytes.fromhex(digest)
    if len(raw) != 32:
        raise ValueError(f"a rank digest is 32 bytes of SHA-256, got {len(raw)}")
    mine = torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(device)
    out = [torch.empty(32, dtype=torch.uint8, device=device)
           for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, mine, group=group)
    return [bytes(t.cpu().tolist()).hex() for t in out]
