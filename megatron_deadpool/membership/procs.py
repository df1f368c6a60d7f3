"""The processes of a job as the decider tracks them."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional


class ProcState(str, enum.Enum):
    STARTING = "starting"  # started, not admitted yet
    ALIVE = "alive"
    DEAD = "dead"
    DONE = "done"


class Role(str, enum.Enum):
    ACTIVE = "active"
    SPARE = "spare"


@dataclass
class Proc:
    lid: int
    node: int
    role: str  # Role
    rank: Optional[int] = None
    state: str = ProcState.STARTING
    hb_seq: int = -1
    hb_change: float = 0.0
    hb_iteration: int = 0
    hb_committed: int = -1
    progress_change: float = 0.0
    exit_code: Optional[int] = None
