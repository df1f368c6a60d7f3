"""The processes of a job as the decider tracks them."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional, Tuple

from .store import WorkerState


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
    hb_gen: int = -1  # the newest plan it took
    hb_state: str = ""  # its WorkerState
    progress_change: float = 0.0
    exit_code: Optional[int] = None


def observe(p: Proc, hb: dict, now: float) -> None:
    """Take a heartbeat record into ``p``: a new sequence number is a sign of life; a new
    iteration, or any state but ACTIVE (recovering, done), is progress."""
    if hb["seq"] != p.hb_seq:
        p.hb_seq, p.hb_change = hb["seq"], now
    if hb["iteration"] != p.hb_iteration or hb["state"] != WorkerState.ACTIVE:
        p.hb_iteration, p.progress_change = hb["iteration"], now
    p.hb_committed, p.hb_gen = hb["committed"], hb.get("gen", p.hb_gen)
    p.hb_state = hb["state"]


def hung(p: Proc, now: float, cfg, gen: int, plan_t: float) -> Optional[Tuple[str, float]]:
    """(why, since) if the live process ``p`` must be fenced, else None (pure):

    * its heartbeat is stale (SIGSTOP, a frozen node);
    * a member makes no progress (a hang inside a step);
    * a member of the newest generation (after a failure, published at ``plan_t``) that was
      training (attached: active or recovering) has not taken its plan in time: it is blocked
      where the abort did not reach it, and the others would wait for it at the rendezvous
      until their timeout. A member still starting up (imports, model build) is not judged
      by this: its startup may outlast the take-plan timeout on a loaded machine.
    """
    if now - p.hb_change > cfg.heartbeat_timeout_s:
        return f"heartbeat stale for {now - p.hb_change:.1f}s", p.hb_change
    if p.rank is None:
        return None
    if now - p.progress_change > cfg.progress_timeout_s:
        return f"no progress for {now - p.progress_change:.1f}s", p.progress_change
    training = p.hb_state in (WorkerState.ACTIVE, WorkerState.RECOVERING)
    if training and gen >= 1 and p.hb_gen < gen and now - plan_t > cfg.take_plan_timeout_s:
        return f"did not take generation {gen}'s plan in {now - plan_t:.1f}s", plan_t
    return None
