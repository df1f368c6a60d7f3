"""Capacity planning for a preset (``configs/presets/*.json``) on a system: how many bytes
of optimizer shard each rank mirrors, and how much host memory the mirror takes per node,
for K = 1 and K = 2 buddy copies. Pure functions of the preset, the system and the node
count (``deadpool plan`` prints them and refuses a layout that does not fit).

What the mirror holds per rank (docs/how-it-works.md; ``mirror/mirror.py``):
* the distributed-optimizer shard: fp32 main params + Adam ``exp_avg`` + ``exp_avg_sq`` =
  12 bytes per element, ``ceil(params_per_rank / dp)`` elements (bucket padding ignored);
* with DP = 1 the bf16 model params too (no DP replica to gather them from), 2 bytes each;
* a fixed 64 KiB metadata area (RNG states, counters, scheduler).
Host memory per rank: its own slot double-buffered plus K buddies' slots double-buffered,
``2 * (1 + K) * slot``; per node: ``gpus_per_node`` times that.

Parameter count: Megatron GPT with learned absolute positions, biases, LayerNorm and tied
embeddings. Per layer ``4h^2 + 2hf + 9h + f`` (f: FFN size). TP splits the QKV, projection
and MLP weights, the column-parallel biases and the (padded) word embedding; LayerNorms,
row-parallel biases and position embeddings are replicated. The rank counted is the one on
the heaviest pipeline stage (the first holds the embeddings; with PP > 1 the last holds a
copy of the tied word embedding).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional

from .config import replicas_refusal

GB = 10 ** 9
META_BYTES = 1 << 16
SHARD_BYTES_PER_ELEMENT = 12  # fp32 main param + exp_avg + exp_avg_sq
MODEL_PARAM_BYTES = 2         # bf16


@dataclass(frozen=True)
class System:
    name: str
    gpus_per_node: int
    host_bytes: int   # host memory per node
    what: str         # where the number comes from


SYSTEMS = {
    "perlmutter": System("perlmutter", 4, 256 * GB,
                         "NERSC Perlmutter GPU node: 4 x A100, 256 GB DDR4 host memory"),
    "vista": System("vista", 1, 120 * GB,
                    "TACC Vista GH200 node: 1 GH200, 120 GB LPDDR5X per superchip"),
}

# The mirror may use at most this share of a node's host memory; the rest is for the OS,
# the trainer processes, data loaders and communication buffers.
DEFAULT_HOST_FRACTION = 0.75


class PlanError(ValueError):
    """The preset, system or node count do not make a valid layout."""


@dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    dp: int
    nodes: int
    gpus_per_node: int


def layout_for(preset: dict, system: System, nodes: Optional[int] = None) -> Layout:
    try:
        s = preset["systems"][system.name]
    except KeyError:
        raise PlanError(f"preset {preset.get('name')} has no layout for {system.name}") from None
    nodes = nodes if nodes is not None else s["nodes"]
    tp, pp, m = s["tp"], s["pp"], preset["model"]
    gpus = nodes * system.gpus_per_node
    if nodes < 1 or gpus % (tp * pp):
        raise PlanError(f"{nodes} node(s) x {system.gpus_per_node} GPU(s) is not a multiple "
                        f"of TP{tp} x PP{pp} = {tp * pp}")
    if m["num_layers"] % pp or m["num_attention_heads"] % tp:
        raise PlanError(f"TP{tp} x PP{pp} does not divide {m['num_layers']} layers / "
                        f"{m['num_attention_heads']} heads")
    dp = gpus // (tp * pp)
    t = preset["train"]
    if t["global_batch_size"] % (t["micro_batch_size"] * dp):
        raise PlanError(f"global batch {t['global_batch_size']} is not a multiple of micro "
                        f"batch {t['micro_batch_size']} x DP{dp}")
    return Layout(tp, pp, dp, nodes, system.gpus_per_node)


def _ffn(m: dict) -> int:
    return m.get("ffn_hidden_size") or 4 * m["hidden_size"]


def padded_vocab(vocab: int, tp: int, multiple: int = 128) -> int:
    step = multiple * tp
    return -(-vocab // step) * step


def total_params(m: dict) -> int:
    h, f, L = m["hidden_size"], _ffn(m), m["num_layers"]
    layer = 4 * h * h + 2 * h * f + 9 * h + f
    return L * layer + (m["vocab_size"] + m["seq_length"]) * h + 2 * h


def params_per_rank(m: dict, tp: int, pp: int) -> int:
    """Parameters held by one rank of the heaviest pipeline stage."""
    h, f, L = m["hidden_size"], _ffn(m), m["num_layers"]
    layer = (4 * h * h + 3 * h + 2 * h * f + f) // tp + 2 * h + 4 * h  # sharded + replicated
    stage = (L // pp) * layer
    word = padded_vocab(m["vocab_size"], tp) * h // tp
    first = stage + word + m["seq_length"] * h
    last = stage + 2 * h + (word if pp > 1 else 0)
    return max(first, last) if pp > 1 else first + 2 * h


def shard_bytes(m: dict, lay: Layout) -> int:
    return SHARD_BYTES_PER_ELEMENT * math.ceil(params_per_rank(m, lay.tp, lay.pp) / lay.dp)


def mirror_slot_bytes(m: dict, lay: Layout) -> int:
    unreplicated = MODEL_PARAM_BYTES * params_per_rank(m, lay.tp, lay.pp) if lay.dp == 1 else 0
    return shard_bytes(m, lay) + unreplicated + META_BYTES


def host_bytes_per_rank(m: dict, lay: Layout, replicas: int) -> int:
    return 2 * (1 + replicas) * mirror_slot_bytes(m, lay)


def host_bytes_per_node(m: dict, lay: Layout, replicas: int) -> int:
    return lay.gpus_per_node * host_bytes_per_rank(m, lay, replicas)


def plan(preset: dict, system_name: str, nodes: Optional[int] = None,
         host_fraction: float = DEFAULT_HOST_FRACTION) -> Dict:
    """The table ``deadpool plan`` prints, as a dict: layout, bytes per rank and per node for
    K = 1 and 2, the host limit, and for each K whether it fits."""
    if system_name not in SYSTEMS:
        raise PlanError(f"unknown system {system_name!r} (known: {', '.join(SYSTEMS)})")
    if not 0 < host_fraction <= 1:
        raise PlanError("the host memory fraction must be in (0, 1]")
    system = SYSTEMS[system_name]
    m = preset["model"]
    lay = layout_for(preset, system, nodes)
    limit = int(system.host_bytes * host_fraction)
    per_k = {}
    for k in (1, 2):
        node = host_bytes_per_node(m, lay, k)
        per_k[k] = {"host_bytes_per_rank": host_bytes_per_rank(m, lay, k),
                    "host_bytes_per_node": node, "fits": node <= limit}
    return {"preset": preset["name"], "system": system.name, "system_what": system.what,
            "layout": lay.__dict__, "params_total": total_params(m),
            "params_per_rank": params_per_rank(m, lay.tp, lay.pp),
            "optimizer_shard_bytes_per_rank": shard_bytes(m, lay),
            "mirror_bytes_per_rank": mirror_slot_bytes(m, lay),
            "host_limit_bytes": limit, "host_bytes": system.host_bytes,
            "host_fraction": host_fraction, "replicas": per_k}


def refusal(table: Dict, replicas: int) -> Optional[str]:
    """None when the mirror with ``replicas`` copies fits, else the reason, naming the limit."""
    why = replicas_refusal(replicas, "--replicas", least=min(table["replicas"]),
                           most=max(table["replicas"]))
    if why:
        raise PlanError(why)
    need = table["replicas"][replicas]["host_bytes_per_node"]
    if need <= table["host_limit_bytes"]:
        return None
    return (f"the mirror with K={replicas} needs {need / GB:.1f} GB of host memory per node, "
            f"over the limit of {table['host_limit_bytes'] / GB:.1f} GB "
            f"({table['host_fraction']:.0%} of {table['host_bytes'] / GB:.0f} GB: "
            f"{table['system_what']})")


def format_table(table: Dict) -> List[str]:
    lay = table["layout"]
    g = lambda b: f"{b / GB:.2f} GB"  # noqa: E731
    lines = [f"preset {table['preset']} on {table['system']}: {table['system_what']}",
             f"layout TP{lay['tp']} x PP{lay['pp']} x DP{lay['dp']} on {lay['nodes']} node(s)"
             f" x {lay['gpus_per_node']} GPU(s); {table['params_total'] / 1e9:.2f} B params, "
             f"{table['params_per_rank'] / 1e6:.1f} M per rank",
             f"optimizer shard per rank   {g(table['optimizer_shard_bytes_per_rank'])}",
             f"mirror slot per rank       {g(table['mirror_bytes_per_rank'])}",
             f"host limit per node        {g(table['host_limit_bytes'])} "
             f"({table['host_fraction']:.0%} of {table['host_bytes'] / GB:.0f} GB)"]
    for k, row in table["replicas"].items():
        lines.append(f"K={k}: host per rank {g(row['host_bytes_per_rank'])}, per node "
                     f"{g(row['host_bytes_per_node'])}  {'fits' if row['fits'] else 'DOES NOT FIT'}")
    return lines


def trainer_flags(preset: dict, lay: Layout) -> List[str]:
    """The trainer flags (Megatron-LM names) for this preset and layout."""
    m = preset["model"]
    flags = ["--tensor-model-parallel-size", str(lay.tp),
             "--pipeline-model-parallel-size", str(lay.pp),
             "--num-layers", str(m["num_layers"]), "--hidden-size", str(m["hidden_size"]),
             "--num-attention-heads", str(m["num_attention_heads"]),
             "--seq-length", str(m["seq_length"]),
             "--max-position-embeddings", str(m["seq_length"]),
             "--vocab-size", str(m["vocab_size"])]
    if m.get("ffn_hidden_size"):
        flags += ["--ffn-hidden-size", str(m["ffn_hidden_size"])]
    t = preset["train"]
    flags += ["--micro-batch-size", str(t["micro_batch_size"]),
              "--global-batch-size", str(t["global_batch_size"])]
    return flags + list(t.get("flags", []))
