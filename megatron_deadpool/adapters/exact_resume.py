"""What Megatron-LM's checkpoint lacks for an exact resume, written beside each ``--save``
and put back after ``--load`` (with ``--deadpool``).

Megatron-LM saves one RNG state per (pipeline, tensor) rank and hands every data-parallel
replica replica 0's on ``--load``; the data iterators it builds after the load draw from
the generators again. A resumed run then differs from the uninterrupted one from its first
step (CPU mode, dropout on: iteration 5's loss 5.184229 after a resume at 4 against 5.183771
uninterrupted). So each rank writes its own generators' states (``train_state.capture_rng``:
Python, numpy, torch, CUDA, and megatron-core's tracker, dropout's included) at each save::

    <save>/deadpool_rng/iter_<iteration:07d>/rank<R>.bin     (mirror/metadata.py format)

and after a ``--load`` of that iteration every rank applies its own at the start of the
first step, after the iterators are built. A checkpoint written without them still loads;
the resume is then not exact, and one line says so.
"""

from __future__ import annotations

import logging
import os
from typing import Optional

from ..mirror import metadata
from .train_state import capture_rng

log = logging.getLogger("megatron_deadpool")
FOLDER = "deadpool_rng"


def path(root: str, iteration: int, rank: int) -> str:
    return os.path.join(root, FOLDER, f"iter_{iteration:07d}", f"rank{rank}.bin")


def save(root: str, iteration: int, rank: int, world_size: int, with_cuda: bool) -> str:
    """Write this rank's generators after ``iteration`` (atomically); returns the path."""
    p = path(root, iteration, rank)
    os.makedirs(os.path.dirname(p), exist_ok=True)
    blob = metadata.encode({"iteration": iteration, "rank": rank, "world_size": world_size,
                            "rng": capture_rng(with_cuda)})
    with open(p + ".tmp", "wb") as f:
        f.write(blob)
    os.replace(p + ".tmp", p)
    return p


def load(root: str, iteration: int, rank: int, world_size: int) -> Optional[dict]:
    """This rank's generators saved with ``iteration``, or None (with one line saying the
    resume is not exact) when they are missing or from another layout."""
    p = path(root, iteration, rank)
    if not os.path.exists(p):
        log.warning("--load of iteration %d: no DeadPool RNG states beside the checkpoint "
                    "(written without --deadpool): the resume is not exact", iteration)
        return None
    with open(p, "rb") as f:
        body = metadata.decode(f.read())
    if (body.get("iteration"), body.get("rank"), body.get("world_size")) != \
            (iteration, rank, world_size):
        log.warning("--load of iteration %d: the DeadPool RNG states in %s are of iteration "
                    "%s, rank %s, world size %s: not used, the resume is not exact", iteration,
                    p, body.get("iteration"), body.get("rank"), body.get("world_size"))
        return None
    return body["rng"]
