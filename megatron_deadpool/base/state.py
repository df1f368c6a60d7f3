"""One worker's state, in one frozen object (after NVRx ``inprocess/state.py``): who it is
(``Role``), what it is doing (``WorkerState``, which its heartbeats report), its rank and
world in the current generation, and the iteration it has completed. The runtime replaces it
at each transition; everything below reads the copy it is handed.

    Role:         SPARE ──promote──► PROMOTED ──first step──► ACTIVE
                  (standby: no rank)  (took a dead rank's id: builds and restores alone)
                  ACTIVE from the start for the processes the job began with.
    WorkerState:  STANDBY ──attach──► ACTIVE ◄──restored── RECOVERING
                                      │    └──failure seen──►┘
                                      └──► DONE
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from .vocabulary import ValueEnum


class Role(ValueEnum):
    ACTIVE = "active"
    SPARE = "spare"
    PROMOTED = "promoted"


class WorkerState(ValueEnum):
    STANDBY = "STANDBY"
    ACTIVE = "ACTIVE"
    RECOVERING = "RECOVERING"
    DONE = "DONE"


@dataclasses.dataclass(frozen=True)
class RankState:
    lid: int                          # launcher process id (stable for the process's life)
    node: int
    role: Role
    mode: WorkerState = WorkerState.STANDBY
    rank: Optional[int] = None        # None: a standby spare
    world_size: int = 0
    generation: int = -1
    iteration: int = 0                # iterations completed (restored ones included)

    def promote(self, rank: int, world_size: int, generation: int) -> "RankState":
        """A standby spare takes a dead rank's id."""
        if self.role is not Role.SPARE:
            raise ValueError(f"only a spare is promoted, not a {self.role.value} process")
        return dataclasses.replace(self, role=Role.PROMOTED, rank=rank, world_size=world_size,
                                   generation=generation)

    def adopt(self, rank: int, world_size: int, generation: int) -> "RankState":
        """This process's rank in a generation's plan."""
        return dataclasses.replace(self, rank=rank, world_size=world_size,
                                   generation=generation)

    def enter(self, mode: WorkerState) -> "RankState":
        return dataclasses.replace(self, mode=mode)

    def at(self, iteration: int) -> "RankState":
        return dataclasses.replace(self, iteration=iteration)

    def first_step(self) -> "RankState":
        """A promoted spare's solitary startup is over: it trains as any rank."""
        return dataclasses.replace(self, role=Role.ACTIVE) if self.role is Role.PROMOTED \
            else self
