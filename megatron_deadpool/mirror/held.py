"""The mirror's recovery side: what a rank holds (its own slots, its owners' copies), the
restore of its own copy, the transfer of copies to the ranks that lack theirs, and the
re-protection of the restored iteration. Mixed into ``Mirror`` (mirror.py), whose state it
reads: ``own``/``own_iter``, ``recv``/``recv_iter``, ``commits``, ``transport``."""

from __future__ import annotations

import logging
from typing import Optional, Sequence

from ..errors import MirrorCorruptError, MirrorError
from . import snapshot

log = logging.getLogger(__name__)


class HeldCopies:
    def holds_copy(self, owner: int, iteration: int) -> bool:
        its = self.recv_iter.get(owner)
        return its is not None and iteration >= 0 and its[iteration % 2] == iteration

    def restore_local(self, iteration: int) -> dict:
        """Verify the local copy of ``iteration`` and load it into the live tensors."""
        slot = self.own[iteration % 2]
        self.refresh_sources()
        layout = self.ensure_layout()
        meta = snapshot.verify(slot, self.rank, iteration, layout, self.job)
        snapshot.copy_tensors_out(slot, layout, self._tensors)
        self.refresh_sources()
        return meta

    def inventory(self) -> dict:
        """What this rank holds, for the restore decision (recovery/restore.py): only
        copies whose checksum holds."""
        self._check_held()
        return {"own": sorted(i for i in self.own_iter if i >= 0), "committed": self.committed,
                "copies": {str(o): sorted(i for i in its if i >= 0)
                           for o, its in self.recv_iter.items() if any(i >= 0 for i in its)}}

    def _check_held(self) -> None:
        """Each held copy's checksum, once per copy received. A copy is checked by its
        header when it arrives (mirror.py: every step, per holder, the checksum would read
        the whole slot again) and by its checksum when it is first needed, here: one damaged
        in transit or in memory since is dropped, and the restore decision picks an
        iteration that every rank holds intact."""
        for o, its in self.recv_iter.items():
            for idx, it in enumerate(its):
                if it < 0 or (o, idx) in self.crc_checked:
                    continue
                try:
                    snapshot.verify(self.recv[o][idx], o, it, job=self.job, load_meta=False)
                    self.crc_checked.add((o, idx))
                except MirrorCorruptError as exc:
                    log.warning("held copy dropped: %s", exc)
                    its[idx] = -1

    def transfer_for_restore(self, iteration: int, serve: Sequence[int], receive_from: Optional[int]
                             ) -> None:
        """Holders send their copy of ``iteration`` of each owner in ``serve`` (to the rank of
        the same id); a rank without its own copy receives it from ``receive_from`` into its
        own slot."""
        idx = iteration % 2
        sends = [(o, snapshot.sealed(self.recv[o][idx])) for o in serve]
        recvs = []
        if receive_from is not None:
            self.ensure_layout()
            recvs = [(receive_from, self.own[idx])]
        self.transport.exchange(sends, recvs)
        if receive_from is not None:
            self.own_iter[idx] = iteration

    def after_restore(self, iteration: int) -> None:
        """Everything newer than the restored iteration is dropped; the restored iteration's
        copies stay valid (a failure during re-protection can restore it again)."""
        self.own_iter = [i if i == iteration else -1 for i in self.own_iter]
        self.recv_iter = {o: [i if i <= iteration else -1 for i in its]
                          for o, its in self.recv_iter.items()}
        self.commits.reset(iteration)

    def reprotect(self, iteration: int, skip=frozenset()) -> None:
        """Send the restored snapshot to the (possibly new) buddies that do not hold it yet,
        and commit it."""
        self._exchange_and_commit(iteration, skip, collective=True)
        if self.committed != iteration:
            raise MirrorError(f"re-protection of iteration {iteration} did not commit")
