"""Every holder of a process group in one worker, for the job's whole life: the model's and
the optimizer's (found at attach), and those the caller adds (``protect_groups_of``). At
each generation change their old groups are taken away and die on the reaper thread, and
they are pointed at the new generation's groups; ``--deadpool-audit`` checks that none was
missed.

    attach(model, optimizer) ─► add(...) ─► failure: release(old) ─► rebind(audit) ─► ...
"""

from __future__ import annotations

import logging
from typing import Optional

from ..adapters import ddp
from ..base.errors import DeadpoolError
from ..recovery.reaper import Reaper
from ..recovery.rebind import GroupSlots, audit_rebind

log = logging.getLogger(__name__)
REAPER_WAIT_S = 30.0  # for the old groups to die (the heap audit, the exit)


class GroupHolders:
    def __init__(self) -> None:
        self.slots: Optional[GroupSlots] = None
        self.reaper = Reaper()
        self._model = None

    def attach(self, model, optimizer) -> None:
        """The model's and the optimizer's holders (``rebind.GroupSlots``)."""
        self._model, self.slots = model, GroupSlots([model, optimizer])
        if self.slots.unknown:
            log.warning("%s group slot(s) of unknown role: %s", len(self.slots.unknown),
                        ", ".join(self.slots.unknown[:5]))

    def add(self, holders) -> None:
        """More holders of process groups, rebound like the model's."""
        self.slots.add(holders)

    def release(self, old: list) -> None:
        """Once the world is destroyed: the old groups still held, and ``old`` (the retired
        link's), die on the reaper thread."""
        held = self.slots.release() if self.slots is not None else []
        ddp.drop_pending(self._model or ())  # bucket handles on the dead groups: never waited
        self.reaper.drop(held + list(old))

    def drop(self, old: list) -> None:
        """Groups no holder uses any more (a recovery's replay did not keep them): they die
        on the reaper thread."""
        self.reaper.drop(list(old))

    def rebind(self, audit, old_groups) -> Optional[dict]:
        """Point every holder at the new generation's groups; then audit the rebind
        (``--deadpool-audit``): its event's fields, or None (nothing attached yet: none)."""
        if self.slots is None:
            return None
        self.slots.rebind()
        return audit_rebind(audit, self.slots, old_groups, self._settle)

    def _settle(self) -> None:
        if not self.reaper.wait(REAPER_WAIT_S):
            raise DeadpoolError(f"old process groups not destroyed in {REAPER_WAIT_S:g}s")

    def wait(self, timeout_s: float = REAPER_WAIT_S) -> bool:
        """The old groups have died (the exit waits for them)."""
        return self.reaper.wait(timeout_s)
