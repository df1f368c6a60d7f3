"""What Megatron-LM's checkpoint lacks for an exact resume, written beside each ``--save``
and put back after ``--load`` (with ``--deadpool``).

A resumed run differed from the uninterrupted one from its first step (CPU mode, TP2.PP2.DP2,
dropout on: iteration 5's loss 5.195248 after a resume at 4 against 5.194838), for two
reasons, both measured by comparing every rank's tensors at the start of iteration 5:

* RNG. Megatron-LM saves one RNG state per (pipeline, tensor) rank and hands every
  data-parallel replica replica 0's on ``--load``; the data iterators it builds after the
  load draw from the generators again.
* The parameters every tensor-parallel rank holds whole (norms, row-parallel biases, position
  embeddings). Each TP rank updates its own copy, and in CPU mode the copies drift apart:
  the hidden dropout draws from the CPU generator, which only TP rank 0's data loader also
  draws from. The checkpoint's model section keeps TP rank 0's copy; its optimizer section
  (``dp_reshardable``) holds each rank's own main params, but in fp32 they are views of the
  model params and the load leaves TP rank 0's values in both: every TP rank > 0 resumed
  with TP rank 0's norms and biases.

So each rank writes, at each save, its generators' states (``train_state.capture_rng``:
Python, numpy, torch, CUDA, megatron-core's tracker, dropout's included) and, with TP > 1,
its own copy of the TP-replicated state (``shard.tp_replicated_state``: model params, main
params, moments; a few vectors per layer)::

    <save>/deadpool_exact/iter_<iteration:07d>/rank<R>.bin     (mirror/metadata.py format)

After a ``--load`` of that iteration every rank puts the tensors back at once (before the
data iterators are built) and its generators at the start of the first step (after them). A
checkpoint written without them, or with a file that cannot be read (torn, corrupt), still
loads with Megatron-LM's own state; the resume is then not exact, and one line names the file
and says so. Each file is written durably (fsync, atomic rename).
"""

from __future__ import annotations

import logging
import os
from typing import Optional

from ..base.errors import MirrorCorruptError
from ..mirror import metadata
from . import shard
from .train_state import capture_rng

log = logging.getLogger("megatron_deadpool")
FOLDER = "deadpool_exact"


def path(root: str, iteration: int, rank: int) -> str:
    return os.path.join(root, FOLDER, f"iter_{iteration:07d}", f"rank{rank}.bin")


def _replicated(model, optimizer, tp_size: int) -> dict:
    return shard.tp_replicated_state(model, optimizer) if tp_size > 1 else {}


def save(root: str, iteration: int, rank: int, world_size: int, with_cuda: bool,
         model, optimizer, tp_size: int) -> str:
    """Write what this rank needs after ``iteration`` durably (written to a temporary file,
    flushed to disk, renamed over the final name, the folder flushed: a crash leaves the old
    file or the new one, never a torn one); returns the path."""
    p = path(root, iteration, rank)
    os.makedirs(os.path.dirname(p), exist_ok=True)
    blob = metadata.encode({"iteration": iteration, "rank": rank, "world_size": world_size,
                            "rng": capture_rng(with_cuda),
                            "tp_replicated": _replicated(model, optimizer, tp_size)})
    with open(p + ".tmp", "wb") as f:
        f.write(blob)
        f.flush()
        os.fsync(f.fileno())
    os.replace(p + ".tmp", p)
    folder = os.open(os.path.dirname(p), os.O_RDONLY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)
    return p


def load(root: str, iteration: int, rank: int, world_size: int, model, optimizer,
         tp_size: int) -> Optional[dict]:
    """After Megatron-LM's ``--load`` of ``iteration``: put this rank's TP-replicated state
    back and return its generators' states (for the start of the first step), or None
    with one line saying the resume is not exact when they are missing or of another
    layout."""
    p = path(root, iteration, rank)
    if not os.path.exists(p):
        log.warning("--load of iteration %d: nothing of DeadPool's beside the checkpoint "
                    "(written without --deadpool): the resume is not exact", iteration)
        return None
    try:
        with open(p, "rb") as f:
            body = metadata.decode(f.read())
    except (OSError, MirrorCorruptError) as exc:
        log.warning("--load of iteration %d: DeadPool's states in %s cannot be read (%s): "
                    "Megatron-LM's own state is used, the resume is not exact", iteration, p,
                    exc)
        return None
    if (body.get("iteration"), body.get("rank"), body.get("world_size")) != \
            (iteration, rank, world_size):
        log.warning("--load of iteration %d: DeadPool's states in %s are of iteration %s, "
                    "rank %s, world size %s: not used, the resume is not exact", iteration,
                    p, body.get("iteration"), body.get("rank"), body.get("world_size"))
        return None
    saved = body.get("tp_replicated", {})
    if saved or tp_size > 1:
        try:
            if tp_size == 1:
                raise ValueError("saved with tensor parallelism, loaded without")
            shard.load_tp_replicated_state(model, optimizer, saved)
        except ValueError as exc:
            log.warning("--load of iteration %d: DeadPool's tensor-parallel copies in %s "
                        "not used (%s): the resume is not exact", iteration, p, exc)
    return body["rng"]
