"""Mirror failures are loud: a copy that a holder rejects, and a rank whose newest committed
iteration falls behind, are warnings in the worker's log, events in the ``--deadpool-events``
file, and counts in its result file (the launch summary adds them up, launch/summary.py).

    holder rejects a copy of k  ─► warning + event ``mirror_copy_rejected``; k commits nowhere
                                   (mirror/commit.py: RejectionBoard)
    after_step(k): k - committed > UNPROTECTED_LAG ─► warning ``UNPROTECTED`` every step,
                                   event ``unprotected`` when it begins, the progress line
"""

from __future__ import annotations

import logging
from typing import Callable

from ..base.vocabulary import Event

log = logging.getLogger(__name__)

# Measured at after_step(k), before snapshot k begins: a collective commit is then at k-1, an
# implicit one at k-2 (k-1 commits once job k starts, mirror/commit.py), so 2 is the healthy
# lag and anything more is a snapshot that did not commit.
UNPROTECTED_LAG = 2


def unprotected(iteration: int, committed: int) -> bool:
    """The newest committed iteration lags ``iteration`` by more than UNPROTECTED_LAG."""
    return iteration - committed > UNPROTECTED_LAG


class Alarms:
    """One worker's mirror alarms. ``emit``: the runtime's event sink (``EventSink.emit``)."""

    def __init__(self, emit: Callable[..., None] = lambda event, **fields: None):
        self.emit = emit
        self.unprotected_steps = 0  # after_step calls that found this rank UNPROTECTED

    def copy_rejected(self, holder: int, owner: int, iteration: int, why: str) -> None:
        """A copy that ``holder`` received from ``owner`` failed its check (mirror thread)."""
        log.warning("mirror: rank %s rejected the copy of rank %s, iteration %s: %s; that "
                    "iteration does not commit", holder, owner, iteration, why)
        self.emit(Event.COPY_REJECTED, rank=holder, owner=owner, iteration=iteration,
                  why=why)

    def step(self, rank: int, iteration: int, committed: int) -> None:
        """After step ``iteration`` (mirror on): a warning while UNPROTECTED, an event when it
        begins."""
        if not unprotected(iteration, committed):
            return
        log.warning("UNPROTECTED: rank %s trained iteration %s, its newest committed iteration "
                    "is %s (more than %s behind): a failure now loses more than one iteration",
                    rank, iteration, committed, UNPROTECTED_LAG)
        self.unprotected_steps += 1
        if not unprotected(iteration - 1, committed):
            self.emit(Event.UNPROTECTED, rank=rank, iteration=iteration, committed=committed)
