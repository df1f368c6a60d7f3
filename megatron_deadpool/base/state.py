"""One worker's state, in one frozen object (after NVRx ``inprocess/state.py``): who it is
(``Role``), what it is doing (``WorkerState``, which its heartbeats report), its rank and
world in the current generation (read from the generation's ``Plan``, which it carries), and
the iteration it has completed. The runtime replaces it
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

from .plan import Plan
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
    """The plan is the rank's truth: its rank, world size and generation are read from the
    plan it took (none yet: a standby spare, or a process that has not joined)."""

    lid: int                          # launcher process id (stable for the process's life)
    node: int
    role: Role
    mode: WorkerState = WorkerState.STANDBY
    plan: Optional[Plan] = None       # the generation this process is a member of
    iteration: int = 0                # iterations completed (restored ones included)

    @property
    def rank(self) -> Optional[int]:
        """None: a standby spare (or not joined yet)."""
        return self.plan.rank(self.lid) if self.plan is not None else None

    @property
    def world_size(self) -> int:
        return self.plan.world_size if self.plan is not None else 0

    @property
    def generation(self) -> int:
        return self.plan.gen if self.plan is not None else -1

    def promote(self, plan: Plan) -> "RankState":
        """A standby spare takes a dead rank's id in ``plan``."""
        if self.role is not Role.SPARE:
            raise ValueError(f"only a spare is promoted, not a {self.role.value} process")
        return dataclasses.replace(self, role=Role.PROMOTED, plan=plan)

    def adopt(self, plan: Plan) -> "RankState":
        """This process's rank in a generation's plan."""
        return dataclasses.replace(self, plan=plan)

    def enter(self, mode: WorkerState) -> "RankState":
        return dataclasses.replace(self, mode=mode)

    def at(self, iteration: int) -> "RankState":
        return dataclasses.replace(self, iteration=iteration)

    def first_step(self) -> "RankState":
        """A promoted spare's solitary startup is over: it trains as any rank."""
        return dataclasses.replace(self, role=Role.ACTIVE) if self.role is Role.PROMOTED \
            else self
