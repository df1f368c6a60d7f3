"""Last-resort persistence (``--deadpool-fallback-save DIR``, ``--deadpool-resume DIR``):
sealed mirror slots written as files, byte for byte what the mirror holds in memory.

    DIR/iter_00000012/rank3-of-8.snap    header + tensors + metadata (snapshot.py format)

A file is written under a temporary name, flushed and renamed, so a reader never sees half
a file. Several holders of the same copy may write it; the content is the same. An
iteration is *complete* when every rank of its world has a file; a resume loads the newest
complete iteration and verifies each file (checksum, owner, iteration, layout) before it
touches the live tensors.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Dict, List, Optional, Set, Tuple

import torch

from ..errors import ConfigError

_ITER = re.compile(r"^iter_(\d{8})$")
_FILE = re.compile(r"^rank(\d+)-of-(\d+)\.snap$")


def slot_path(root: str, iteration: int, rank: int, world: int) -> str:
    return os.path.join(root, f"iter_{iteration:08d}", f"rank{rank}-of-{world}.snap")


def write_slot(root: str, slot: torch.Tensor, iteration: int, rank: int, world: int) -> int:
    """Write one sealed slot; returns the bytes written (0: the file already exists)."""
    path = slot_path(root, iteration, rank, world)
    if os.path.exists(path):
        return 0
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(memoryview(slot.numpy()))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return slot.numel()


def read_slot(root: str, iteration: int, rank: int, world: int) -> torch.Tensor:
    with open(slot_path(root, iteration, rank, world), "rb") as f:
        data = bytearray(f.read())
    return torch.frombuffer(data, dtype=torch.uint8)


@dataclass(frozen=True)
class Saved:
    """What a directory holds: per (iteration, world), the ranks with a file, and bytes."""

    ranks: Dict[Tuple[int, int], Set[int]]
    nbytes: Dict[Tuple[int, int], int]

    def complete(self, world: Optional[int] = None) -> List[Tuple[int, int]]:
        """(iteration, world) pairs with a file for every rank, newest first."""
        return sorted(((it, w) for (it, w), rs in self.ranks.items()
                       if rs == set(range(w)) and (world is None or w == world)),
                      reverse=True)


def scan(root: str) -> Saved:
    ranks: Dict[Tuple[int, int], Set[int]] = {}
    nbytes: Dict[Tuple[int, int], int] = {}
    if not os.path.isdir(root):
        return Saved(ranks, nbytes)
    for d in os.listdir(root):
        m = _ITER.match(d)
        if not m:
            continue
        for name in os.listdir(os.path.join(root, d)):
            f = _FILE.match(name)
            if f:
                key = (int(m.group(1)), int(f.group(2)))
                ranks.setdefault(key, set()).add(int(f.group(1)))
                nbytes[key] = nbytes.get(key, 0) + os.path.getsize(os.path.join(root, d, name))
    return Saved(ranks, nbytes)


def newest_complete(root: str, world: int) -> int:
    """The iteration to resume from. Raises ConfigError naming what the directory holds."""
    saved = scan(root)
    done = saved.complete(world)
    if done:
        return done[0][0]
    held = ", ".join(f"iteration {it} of world {w}: ranks {sorted(rs)}"
                     for (it, w), rs in sorted(saved.ranks.items())) or "nothing"
    raise ConfigError(f"--deadpool-resume {root}: no iteration saved for all {world} ranks "
                      f"(it holds {held})")


def prune_own(root: str, rank: int, world: int, keep_from: int) -> None:
    """Delete this rank's files older than ``keep_from`` (periodic saves keep two)."""
    saved = scan(root)
    for (it, w), rs in saved.ranks.items():
        if w == world and it < keep_from and rank in rs:
            try:
                os.remove(slot_path(root, it, rank, w))
                os.rmdir(os.path.dirname(slot_path(root, it, rank, w)))
            except OSError:
                pass  # other ranks' files are still there, or a peer removed it first


# ---------------------------------------------------------------- mirror side
def save_held(mirror, root: str, world: int) -> List[Tuple[int, int, int]]:
    """Write every verified slot this process holds: its own and its buddy copies, each
    iteration still in memory. Returns [(rank, iteration, bytes written)]."""
    from . import snapshot

    held = [(mirror.rank, it, mirror.own[it % 2]) for it in mirror.own_iter if it >= 0]
    held += [(o, it, mirror.recv[o][it % 2]) for o, its in mirror.recv_iter.items()
             for it in its if it >= 0]
    out = []
    for owner, it, slot in held:
        try:
            snapshot.verify(slot, owner, it, job=mirror.job)
        except Exception:  # noqa: BLE001 - a torn or foreign slot is not worth saving
            continue
        out.append((owner, it, write_slot(root, slot, it, owner, world)))
    return out


def periodic(mirror, root: str, every: int, world: int, iteration: int) -> None:
    """After ``iteration`` committed (mirror thread): every ``every`` iterations, write this
    rank's own slot, so that a shard whose every in-memory copy dies can come from disk. Two
    saves are kept."""
    if every <= 0 or iteration % every:
        return
    write_slot(root, mirror.own[iteration % 2], iteration, mirror.rank, world)
    prune_own(root, mirror.rank, world, keep_from=iteration - every)


def adopt(mirror, data: torch.Tensor, iteration: int) -> None:
    """Load a saved slot as this rank's own copy of ``iteration``: verified against its own
    header's job id and this rank's layout, then re-stamped with this job's id."""
    from . import snapshot

    layout = mirror.ensure_layout()
    slot = mirror.own[iteration % 2]
    if data.numel() != slot.numel():
        raise ConfigError(f"saved state of rank {mirror.rank} iteration {iteration} has "
                          f"{data.numel()} bytes; this model's snapshot has {slot.numel()} "
                          f"(a different model, layout or optimizer)")
    snapshot.verify(data, mirror.rank, iteration, layout, job=snapshot.read_header(data)["job"])
    slot.copy_(data)
    snapshot.restamp_job(slot, mirror.job)
    mirror.own_iter[iteration % 2] = iteration
