"""A timer that yields a recovery's per-phase breakdown (``base/vocabulary.py``'s
``RECOVERY_PHASES``), the JSON-lines event sink (``--deadpool-events``, its ``Event`` names)
and what one recovery attempt carries from step to step.

Each rank's phases tile its recovery, from its abort to the end of its first step; ``detect``
is the decider's (the failure until the plan). The phases between are the steps' of
control/steps.py, each timed as its ``phase``: a survivor's ``SURVIVOR`` sequence, a promoted
spare's ``SPARE`` (no abort: it starts at its promotion, and its model build is timed in the
phase of the step that waits for it, ``Step.spare_waits``).
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Dict, Optional

from ..base import counts
from ..base.plan import Plan
from ..base.state import Role
from ..base.vocabulary import Event, Phase
from .restore import Restore


class EventSink:
    """Appends one JSON object per line. Safe to share between threads; each line is written
    with a single ``write`` on an O_APPEND file so several processes can share one file."""

    def __init__(self, path: Optional[str]):
        self.path = path
        self._lock = threading.Lock()

    def emit(self, event: Event, **fields) -> None:
        if not self.path:
            return
        rec = {"ts": round(time.time(), 6), "event": Event(event).value, **fields}
        line = (json.dumps(rec, sort_keys=True) + "\n").encode()
        with self._lock:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, line)
            finally:
                os.close(fd)


class PhaseTimer:
    """Times consecutive phases of one recovery: ``timer.start(Phase.ABORT, **label)`` closes
    the phase before it. Each closed phase is emitted as an event, with the label (the
    generation and rank) it was started with."""

    def __init__(self, sink: EventSink):
        self.sink = sink
        self.durations: Dict[str, float] = {}
        self.counts: Dict[str, Dict[str, int]] = {}  # per phase: base/counts.py's kinds
        self._cur: Optional[Phase] = None
        self._label: Dict[str, Any] = {}
        self._t0 = 0.0
        self._c0: Dict[str, int] = {}

    def start(self, phase: Phase, **label) -> None:
        if self._cur is phase:
            return  # already running (a spare's next step times its caller's work)
        self.stop()
        self._cur, self._label = phase, label
        self._t0, self._c0 = time.perf_counter(), counts.snapshot()

    def stop(self) -> None:
        if self._cur is None:
            return
        dt = time.perf_counter() - self._t0
        self.durations[self._cur.value] = self.durations.get(self._cur.value, 0.0) + dt
        counts.merge(self.counts.setdefault(self._cur.value, {}),
                     counts.delta(self._c0, counts.snapshot()))
        self.sink.emit(Event.PHASE, phase=self._cur.value, duration_s=round(dt, 6),
                       **self._label)
        self._cur = None


@dataclass
class Attempt:
    """What one recovery attempt carries from step to step (control/steps.py). Its phases
    are labelled with the generation and rank of the plan it runs (``plan``, this process
    ``lid``): a promoted spare's from the start; a survivor's is the one it recovers from
    until its rendezvous has the next (``joined``), and meanwhile the generation after it
    (the least one its rendezvous waits for)."""

    cause: BaseException
    iteration_at_failure: Optional[int]   # None: a promoted spare's (its startup, or after)
    plan: Plan
    lid: int
    timer: PhaseTimer
    joined: bool = False                  # ``plan`` is the one it recovers into
    role: Role = Role.ACTIVE              # the rank's role: PROMOTED, a spare's own restore
    startup: bool = False                 # a promoted spare's own walk: promoted with its
    group_kwargs: Optional[dict] = None   # plan; its first build takes Megatron's arguments
    old_groups: list = field(default_factory=list)
    restore: Optional[Restore] = None     # the restore in progress (its four steps)
    restored: int = -1
    state_from: Optional[str] = None      # a spare's: "direct" (the draining rank) or "buddy"
    done: int = 0                         # steps of its sequence done (a spare's walk pauses)

    @property
    def generation(self) -> int:
        return self.plan.gen if self.joined else self.plan.gen + 1

    @property
    def rank(self) -> Optional[int]:
        return self.plan.rank(self.lid)

    def join(self, plan: Plan) -> None:
        """Its rendezvous formed ``plan``'s world: its phases from here on are that plan's."""
        self.plan, self.joined = plan, True

    @property
    def spare(self) -> bool:
        """A promoted spare's recovery: it joins, it has nothing to abort or to redo."""
        return self.role is Role.PROMOTED

    def phase(self, phase: Optional[Phase]) -> None:
        """Begin timing ``phase`` (None: stop); the phase before it closes."""
        if phase is None:
            self.timer.stop()
        else:
            self.timer.start(phase, generation=self.generation, rank=self.rank)
