"""The sealed slots a rank holds, two per owner (slot parity is ``iteration % 2``): its own
double buffer (``OwnSlots``), and the copies it holds for other ranks as their buddy
(``HeldCopies``): the iteration each slot holds (-1: none or being rewritten) and, for held
copies, which have passed their checksum. Owned by ``Mirror`` (mirror.py) and filled by its
generation's ``Exchange`` (exchange.py); nobody else indexes a slot or writes what it holds."""

from __future__ import annotations

import logging
from typing import Dict, Iterable, List, Mapping, Set, Tuple

import torch

from ..base.errors import MirrorCorruptError
from . import snapshot

log = logging.getLogger(__name__)


class OwnSlots:
    """This rank's own snapshots in host memory, a double buffer: the snapshot of ``iteration`` is
    written into slot ``iteration % 2``, so the copy of ``iteration - 1`` stays intact while it
    is in flight. Pinned when CUDA is present: these slots alone receive D2H copies."""

    def __init__(self, rank: int):
        self.rank = rank
        self._slots: List[torch.Tensor] = []
        self._iters = [-1, -1]  # the iteration each slot holds; -1: none or being rewritten

    def allocate(self, nbytes: int, pin: bool) -> None:
        """Two empty slots of a (new) layout's size."""
        self._slots = [snapshot.alloc_slot(nbytes, pin) for _ in range(2)]
        self._iters = [-1, -1]

    def rewrite(self, iteration: int) -> None:
        """A snapshot of ``iteration`` is about to overwrite its slot: it holds nothing until
        ``hold(iteration)``."""
        self._iters[iteration % 2] = -1

    def slot(self, iteration: int) -> torch.Tensor:
        """The whole slot of ``iteration``'s parity, whatever it holds now."""
        return self._slots[iteration % 2]

    def sealed(self, iteration: int) -> torch.Tensor:
        """The used part of ``iteration``'s slot (``snapshot.sealed``): what travels."""
        return snapshot.sealed(self._slots[iteration % 2])

    def hold(self, iteration: int) -> None:
        """``iteration``'s slot now holds it (sealed here, or received from a holder)."""
        self._iters[iteration % 2] = iteration

    def adopt(self, iteration: int, data: torch.Tensor, job: int) -> None:
        """A verified slot of this rank (from a file, or from a hand-off) becomes its own
        copy of ``iteration``, stamped with ``job`` (this job's id)."""
        slot = self._slots[iteration % 2]
        slot.copy_(data)
        snapshot.restamp_job(slot, job)
        self._iters[iteration % 2] = iteration

    def iterations(self) -> List[int]:
        """The iterations held, oldest first."""
        return sorted(i for i in self._iters if i >= 0)

    def copies(self) -> List[Tuple[int, int, torch.Tensor]]:
        """``(rank, iteration, slot)`` of every slot that holds an iteration, in slot order
        (as ``HeldCopies.copies``)."""
        return [(self.rank, it, self._slots[it % 2]) for it in self._iters if it >= 0]

    def keep_only(self, iteration: int) -> None:
        """Every slot but the one holding ``iteration`` holds nothing (after a restore)."""
        self._iters = [i if i == iteration else -1 for i in self._iters]

    def buffers(self) -> List[torch.Tensor]:
        return list(self._slots)


class HeldCopies:
    """The copies of other ranks' snapshots that this rank holds as their buddy, by rank,
    checked (``inventory``) before any is sent back in a restore."""

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
