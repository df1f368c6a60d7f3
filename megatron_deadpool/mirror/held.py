"""The copies this rank holds for other ranks (their buddy): two slots per owner (slot parity
is ``iteration % 2``, as for the own slots), the iteration each one holds (-1: none or being
rewritten), and which have passed their checksum. Owned by ``Mirror`` (mirror.py)."""

from __future__ import annotations

import logging
from typing import Dict, Iterable, List, Mapping, Sequence, Set, Tuple

import torch

from ..base.errors import MirrorCorruptError
from . import snapshot

log = logging.getLogger(__name__)


class HeldCopies:
    def __init__(self, job: int = 0):
        self.job = job  # snapshot.job_id(secret): copies of another job are refused
        self.slots: Dict[int, List[torch.Tensor]] = {}
        self.iters: Dict[int, List[int]] = {}
        self.crc_checked: Set[Tuple[int, int]] = set()  # (owner, slot index) whose CRC held

    def allocate(self, owners: Iterable[int], sizes: Mapping[int, int]) -> None:
        """Two receive slots per owner, of its slot size. Not pinned: buddy copies travel
        over the CPU transport, never to a device. Copies of owners no longer held (the
        placement changed) stay valid, and restorable, until ``drop_owners_not_in``."""
        for o in owners:
            old = self.slots.get(o)
            if old is None or old[0].numel() != sizes[o]:
                self.slots[o] = [snapshot.alloc_slot(sizes[o], False) for _ in range(2)]
                self.iters[o] = [-1, -1]

    def slot(self, owner: int, iteration: int) -> torch.Tensor:
        return self.slots[owner][iteration % 2]

    def receiving(self, owner: int, iteration: int) -> torch.Tensor:
        """The slot that ``iteration``'s copy of ``owner`` is about to overwrite."""
        idx = iteration % 2
        self.iters[owner][idx] = -1
        self.crc_checked.discard((owner, idx))
        return self.slots[owner][idx]

    def accept(self, owner: int, iteration: int) -> None:
        """The copy in place passed its header check."""
        self.iters[owner][iteration % 2] = iteration

    def holds(self, owner: int, iteration: int) -> bool:
        its = self.iters.get(owner)
        return its is not None and iteration >= 0 and its[iteration % 2] == iteration

    def inventory(self) -> Dict[str, List[int]]:
        """``{owner: [iterations]}`` of the copies whose checksum holds. A copy is checked by
        its header when it arrives (every step, per holder, the checksum would read the
        whole slot again) and by its checksum when it is first needed, here: one damaged in
        transit or in memory since is dropped, and the restore decision picks an iteration
        that every rank holds intact."""
        for o, its in self.iters.items():
            for idx, it in enumerate(its):
                if it < 0 or (o, idx) in self.crc_checked:
                    continue
                try:
                    snapshot.verify(self.slots[o][idx], o, it, job=self.job, load_meta=False)
                    self.crc_checked.add((o, idx))
                except MirrorCorruptError as exc:
                    log.warning("held copy dropped: %s", exc)
                    its[idx] = -1
        return {str(o): sorted(i for i in its if i >= 0)
                for o, its in self.iters.items() if any(i >= 0 for i in its)}

    def copies(self) -> List[Tuple[int, int, torch.Tensor]]:
        """``(owner, iteration, slot)`` of every copy held."""
        return [(o, it, self.slots[o][it % 2]) for o, its in self.iters.items()
                for it in its if it >= 0]

    def drop_newer_than(self, iteration: int) -> None:
        self.iters = {o: [i if i <= iteration else -1 for i in its]
                      for o, its in self.iters.items()}

    def drop_owners_not_in(self, owners: Iterable[int]) -> None:
        keep = set(owners)
        for o in [o for o in self.slots if o not in keep]:
            del self.slots[o], self.iters[o]  # superseded by the new placement

    def buffers(self) -> List[torch.Tensor]:
        return [b for bufs in self.slots.values() for b in bufs]
