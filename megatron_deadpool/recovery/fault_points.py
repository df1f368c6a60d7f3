"""The worker's fault points, wired to what each fault kind acts on. A kind with a signal
sequence needs nothing here (``base/faults.py`` delivers it); a kind without one is an action,
bound here by the ``name`` of its ``KINDS`` entry, on what this rank protects
(``attachment``: control/attachment.py), on the current generation's link (``links``:
control/link.py) or on the decider (``member``). An action may return a lasting effect
(``straggle``: every later step burns more compute). Every delivery is reported to the
decider first (a ``fault_request`` event: it times detection from there)."""

from __future__ import annotations

import logging
from typing import Callable, Optional

from ..base.faults import FaultPoints, Kind
from ..membership.store import EventKind
from ..mirror import impostor
from ..mirror.meter import cpu_clock

log = logging.getLogger(__name__)


def worker_fault_points(env, member, rank: Callable[[], int], attachment, links
                        ) -> FaultPoints:
    def report(fault, iteration: int, phase: str) -> None:
        member.push_event(EventKind.FAULT_REQUEST, index=fault.index, rank=rank(),
                          node=env.node, iteration=iteration, phase=phase)
        log.info("fault %s delivered at iteration %s (%s)", fault.kind, iteration, phase)

    def drain(fault, iteration: int) -> None:  # the path of `deadpool drain --node N`
        member.push_event(EventKind.DRAIN_REQUEST, node=env.node, reason="request",
                          text=f"--inject {fault.describe()}")

    def slow(fault, iteration: int) -> Callable[[], None]:
        return straggle(fault.param("factor"), attachment.status()["compute_s"])

    def knock(fault, iteration: int) -> None:  # its thread is no lasting effect
        impostor.start(links.current.transport)

    actions = {Kind.DROP: lambda fault, it: attachment.rejections.drop_arrivals(it),  # holder
               Kind.IMPOSTOR: knock,  # a thread knocks on the listeners (mirror/impostor.py)
               Kind.DRAIN: drain,
               Kind.SLOW: slow}
    return FaultPoints(env.faults, rank=rank, node=env.node, claim=member.claim_fault,
                       report=report, actions=actions)


def straggle(factor: float, compute_s: Optional[float],
             clock: Callable[[], float] = cpu_clock) -> Callable[[], None]:
    """The ``slow`` kind's lasting effect: each call burns (factor - 1) x ``compute_s``
    (this rank's compute per step as measured so far; none yet: nothing) CPU seconds of
    the calling thread. The straggler check counts CPU seconds too; a wall-clock burn would
    get less CPU on a loaded machine and could stay under the check's factor."""
    burn_s = (factor - 1) * (compute_s or 0.0)
    log.info("slow fault: each step burns %.3f s more (compute %.3f s)", burn_s,
             compute_s or 0.0)

    def burn() -> None:
        end = clock() + burn_s
        while clock() < end:
            pass
    return burn
