"""The steps of one recovery attempt, one home each, every step taking and returning the
``Attempt`` (recovery/phases.py) and timing itself (its phase in ``base/vocabulary.py``):

    survivor:  abort ─► rendezvous ─► rebuild_groups ─► restore_state
    spare:                                              restore_state   (a.spare: its world
               and groups were formed in join / initialize_model_parallel, control/runtime.py)

The runtime runs them in order (``SEQUENCE``) inside its one recovery boundary and starts a
new attempt on a newer generation when one fails. What they need of the runtime is given as
three callables: this process's ``rank()``, the current ``plan()``, and ``adopt(plan)``
(take this process's rank in a plan; the runtime's state follows).
"""

from __future__ import annotations

from typing import Callable

from ..base.config import DeadpoolConfig
from ..base.vocabulary import Event, Phase
from ..membership.plan import Plan
from ..recovery.abort import all_process_groups, drop_traceback
from ..recovery.boundary import PlannedSwap
from ..recovery.formation import form_world
from ..recovery.phases import Attempt, EventSink
from ..recovery.rebind import weak_groups
from .protected import Protected


class RecoverySteps:
    # the survivor's steps, each named by the phase it times
    SEQUENCE = (Phase.ABORT, Phase.RENDEZVOUS, Phase.REBUILD_GROUPS, Phase.RESTORE_STATE)

    def __init__(self, config: DeadpoolConfig, member, world, protected: Protected,
                 sink: EventSink, faults, rank: Callable[[], int], plan: Callable[[], Plan],
                 adopt: Callable[[Plan], int]):
        self.config, self.member, self.world, self.att = config, member, world, protected
        self.sink, self.faults = sink, faults
        self.rank, self.plan, self.adopt = rank, plan, adopt

    def run(self, a: Attempt) -> Attempt:
        for phase in self.SEQUENCE:
            a = getattr(self, phase.value)(a)
        return a

    def abort(self, a: Attempt) -> Attempt:
        a.phase(Phase.ABORT)
        self.world.abort(f"{type(a.cause).__name__} in the training step", self.rank())
        self.att.quiesce(self.config.rendezvous_timeout_s)
        drop_traceback(a.cause)
        if self.config.audit == "full":
            a.old_groups = weak_groups(all_process_groups())
        self.world.destroy()
        self.att.release_groups()  # the old groups die on the reaper thread (reaper.py)
        return a

    def rendezvous(self, a: Attempt) -> Attempt:
        a.phase(Phase.RENDEZVOUS)
        a.plan = self.member.wait_for_plan(self.plan().gen + 1,
                                           self.config.rendezvous_timeout_s, a.cause)
        if not a.spare:  # the victim of a fault point must know its rank in the plan
            self.adopt(a.plan)
        self._fault_point(a, Phase.RENDEZVOUS)
        a.plan = form_world(a.plan, self.adopt, self.member, self.world,
                            self.config.rendezvous_timeout_s, with_groups=False)
        return a

    def rebuild_groups(self, a: Attempt) -> Attempt:
        a.phase(Phase.REBUILD_GROUPS)
        self._fault_point(a, Phase.REBUILD_GROUPS)
        self.world.build_groups()
        self.world.set_collective_timeouts()  # before the mirror's group: it has its own
        plan = self.plan()
        audit = self.att.rebind(plan, self.config.audit, a.old_groups)
        if audit:
            self.sink.emit(Event.AUDIT, generation=plan.gen, rank=self.rank(), **audit)
        return a

    def restore_state(self, a: Attempt) -> Attempt:
        a.phase(Phase.RESTORE_STATE)
        self._fault_point(a, Phase.RESTORE_STATE)
        plan = self.plan()
        self.member.wait_until_ready(plan.gen, plan.world_size,  # a spare builds its model
                                     self.config.spare_ready_timeout_s)
        if a.spare:  # a drain's spare may take its state straight from the draining rank,
            # which sends since the boundary: a short bound, the survivors wait meanwhile
            got = self.att.hand_off(plan.gen, self.rank(), self.config.gloo_op_timeout_s / 3) \
                if plan.drain is not None and self.config.drain_source == "direct" else None
            a.state_from = "buddy" if got is None else "direct"
        a.restored = self.att.restore(self.rank())
        a.phase(None)
        return a

    def leave(self, boundary, gen: int, rank: int, iteration: int) -> None:
        """The drained node's process at the agreed boundary (snapshot ``iteration`` is at
        the buddies): with ``--deadpool-drain-source direct`` its own slot goes straight to
        the spare taking its rank (mirror/handoff.py, on a thread) while it waits until the
        swap is done (SystemExit(0)), or until a newer plan makes it a member again
        (PlannedSwap: the sending stops)."""
        sender = self.att.hand_off(gen, rank, self.config.spare_ready_timeout_s, iteration) \
            if self.config.drain_source == "direct" else None
        try:
            boundary.leave_after(self.config.spare_ready_timeout_s, moved=PlannedSwap)
        finally:
            if sender is not None:
                sender.abort()

    def _fault_point(self, a: Attempt, phase: Phase) -> None:
        if not a.spare:  # test hook: a survivor dies in ``phase``
            self.faults(a.iteration_at_failure + 1, phase)
