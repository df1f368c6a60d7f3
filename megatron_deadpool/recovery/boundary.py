"""The worker side of a planned swap (membership/drain.py): every rank stops at the same
iteration boundary, agreed without a collective and without guessing a time.

    watcher thread: sees the drain's plan (generation g+1) ─► posts completed + 1: the end
                    of the step its rank is in (or is about to start), the first boundary
                    it can surely still stop at
    main thread:    at every step boundary, once its watcher posted: waits until every rank
                    of generation g has posted; D = the maximum
                    completed < D: trains on (a rank already inside step D needs it)
                    completed == D: the planned swap (leave, or swap through the recovery
                    path with nothing redone)

No rank posts a boundary it has passed, and every rank checks at every boundary, so every
rank reaches D exactly; a step boundary costs nothing until a drain is seen. A newer unplanned generation (a failure
during the drain) aborts the wait: the failure's recovery carries the drain's moves.
"""

from __future__ import annotations

import enum
import threading
import time
from typing import Optional

from ..base.state import RankState, WorkerState
from ..base.plan import Plan
from ..membership.store import EventKind, GenerationMoved

POLL_S = 0.005


class PlannedSwap(Exception):
    """Raised at the agreed boundary by a rank that stays: the training loop's recovery
    boundary takes it to the drain's generation through the ordinary recovery path."""


class Action(str, enum.Enum):
    SWAP = "swap"    # this rank stays: abort, rendezvous on the drain's generation, restore D
    LEAVE = "leave"  # this rank is on the drained node: its processes leave


class Boundary:
    def __init__(self, member, lid: int):
        self.member, self.lid = member, lid
        self.drain_plan: Optional[Plan] = None  # the drain's plan (the next generation), once seen
        self.agreed: Optional[int] = None
        self._posted: Optional[int] = None
        self._peeked = -1  # the newest generation whose plan was read (not a drain's)
        self._lock = threading.Lock()

    @property
    def generation(self) -> Optional[int]:
        return self.drain_plan.gen if self.drain_plan is not None else None

    def planned(self, gen: int, state: RankState) -> bool:
        """The watcher: generation ``gen`` is a drain's plan following the live one (the
        rank's ``state.plan``), seen while training (no abort: the main thread stops at the
        agreed boundary)."""
        if self.drain_plan is not None:
            return self.drain_plan.gen == gen
        if state.plan is None or gen != state.generation + 1 \
                or state.mode is not WorkerState.ACTIVE or gen == self._peeked:
            return False
        self._peeked = gen
        plan = self.member.peek_plan(gen)
        if plan is None or plan.drain is None:
            return False
        self.notice(plan, state.rank, state.iteration)
        return True

    def notice(self, plan: Plan, rank: int, completed: int) -> None:
        """The watcher saw the drain's plan: post ``completed + 1`` unless posted."""
        with self._lock:
            self.drain_plan = self.drain_plan or plan
            self._post(rank, completed + 1)

    def check(self, rank: int, world_size: int, completed: int) -> Optional[Action]:
        """At the boundary after ``completed`` iterations (main thread): None to train on,
        else what this rank does now."""
        if self.drain_plan is None:
            return None
        while self.agreed is None:
            got = self.member.boundaries(self.drain_plan.gen, world_size)
            if got is not None:
                self.agreed = max(got)
            elif self.member.current_gen() > self.drain_plan.gen:
                return None  # a failure during the drain: its recovery takes over
            else:
                time.sleep(POLL_S)
        if completed < self.agreed:
            return None
        return Action.LEAVE if self.drain_plan.rank(self.lid) is None else Action.SWAP

    def _post(self, rank: int, iteration: int) -> None:
        if self._posted is None:
            self._posted = iteration
            self.member.post_boundary(self.drain_plan.gen, rank, iteration)

    def leave_after(self, timeout_s: float, plan: Optional[Plan] = None,
                    moved: type = GenerationMoved) -> None:
        """This process is not in ``plan`` (default: the drain's) and did not fail: drained,
        or a spare whose drain a failure undid. It stays until that generation has restored
        and re-protected (its copies may be needed until then), then leaves: SystemExit(0).
        A newer plan first (a failure undid the drain, membership/drain.py): ``moved`` is
        raised, and the recovery path takes the newer plan, which may name it again."""
        plan = plan or self.drain_plan
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not self.member.reports_done(plan.gen,
                                                                          plan.world_size):
            if self.member.current_gen() > plan.gen:
                raise moved(f"generation {self.member.current_gen()} replaced {plan.gen}")
            time.sleep(POLL_S * 10)
        self.member.push_event(EventKind.DONE)  # its exit is no failure, however long it takes
        raise SystemExit(0)

    def drained(self, live: Optional[Plan], plan: Plan) -> bool:
        """This process left in a drain published after ``live`` up to ``plan`` (a failure
        during the drain moved past it): not a failed member, so it leaves cleanly."""
        first = live.gen + 1 if live is not None else plan.gen
        drains = (self.member.peek_plan(g).drain for g in range(first, plan.gen + 1))
        return any(d is not None and self.lid in d.leaving for d in drains)

    def done(self) -> None:
        """The swap went through (or a failure's recovery replaced it)."""
        self.drain_plan, self.agreed, self._posted = None, None, None
