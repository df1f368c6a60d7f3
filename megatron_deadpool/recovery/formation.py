"""Forming a generation's world: adopt the plan's rank, meet every member (abortable), build
the communicators. If a member dies meanwhile, the next generation's plan is taken and the
world is formed again (bounded)::

    adopt(plan) ─► meet ──GenerationMoved──► wait for plan g+1 ─► adopt ...
                     └─► init_process_group [─► build_groups] ─► done
                              └─peer failure─► destroy ─► wait for plan g+1 ─► adopt ...
"""

from __future__ import annotations

import logging
from typing import Callable

from ..base.errors import DeadpoolError, StaleGenerationError
from ..base.plan import Plan
from ..membership.store import GenerationMoved
from .classify import is_peer_failure

log = logging.getLogger(__name__)

MAX_GENERATIONS = 8


def rank_in(plan: Plan, lid: int) -> int:
    """Process ``lid``'s rank in ``plan``; StaleGenerationError if it is not a member."""
    rank = plan.rank(lid)
    if rank is None:
        raise StaleGenerationError(f"process {lid} is not a member of generation {plan.gen} "
                                   "(it was declared failed); exiting")
    return rank


def form_world(plan: Plan, adopt: Callable[[Plan], int], member, world, timeout_s: float,
               with_groups: bool) -> Plan:
    """Returns the plan whose world was formed (``plan`` or a newer one). ``adopt(plan)``
    takes this process's rank in a plan (the runtime's state) and returns it."""
    for _ in range(MAX_GENERATIONS):
        try:
            rank = adopt(plan)  # GenerationMoved: it waits for a newer plan (drain.py)
            world.meet(plan, rank, member.store, lambda: member.moved_past(plan.gen))
        except GenerationMoved as moved:
            plan = member.wait_for_plan(plan.gen + 1, timeout_s, moved)
            continue
        try:
            world.init_process_group(member.store, plan.gen, rank, plan.world_size, plan=plan)
            if with_groups:
                world.build_groups()
            return plan
        except Exception as exc:  # noqa: BLE001 - classified right below
            if not is_peer_failure(exc, aborted=False):
                raise
            log.info("generation %s: the world did not form (%s); waiting for the next",
                     plan.gen, type(exc).__name__)
            world.destroy()
            plan = member.wait_for_plan(plan.gen + 1, timeout_s, exc)
    raise DeadpoolError(f"the world did not form in {MAX_GENERATIONS} generations")
