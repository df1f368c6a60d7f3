"""The recovery's steps, one class each, and the two sequences built from them. Every step
takes and returns the ``Attempt`` (recovery/phases.py), as NVRx ``Compose`` chains its
steps; ``Sequence.run`` times each one as the phase it names (``base/vocabulary.py``), the
one wrapper, so a step never starts or stops a timer itself.

    SURVIVOR:  Abort ─► Rendezvous ─► RebuildGroups ─► RestoreState
    SPARE:              Rendezvous ─► RebuildGroups ─► RestoreState

A promoted spare walks its sequence in three calls, because its caller builds between
them: ``join`` runs Rendezvous (its world forms), ``initialize_model_parallel`` runs
RebuildGroups with Megatron's own arguments (its first build), ``attach`` runs RestoreState
once its model exists. Between two calls the next step's phase is already timing: the
caller's work belongs to it (control/runtime.py).

Adding a phase: its ``Phase`` member (base/vocabulary.py, with ``RECOVERY_PHASES``), one
class here and one line in a sequence.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence as Seq, Type

from ..adapters.quiet import CollectiveSuppressor
from ..base.config import Audit, DeadpoolConfig, DrainSource
from ..base.plan import Plan
from ..base.state import RankState
from ..base.vocabulary import Event, Phase
from ..recovery.abort import all_process_groups, drop_traceback
from ..recovery.classify import is_peer_failure
from ..recovery.formation import form_world
from ..recovery.phases import Attempt, EventSink
from ..recovery.rebind import weak_groups
from .attachment import Attachment
from .holders import GroupHolders
from .link import Links


@dataclass(frozen=True)
class Crew:
    """What the steps act on: the worker's parts (one of each per process), and the
    runtime's ``state()`` and ``adopt(plan)`` (take this process's rank in a plan: the
    runtime's ``RankState`` follows)."""

    config: DeadpoolConfig
    member: object                    # membership.member.Member
    world: object                     # recovery.world.World
    attachment: Attachment
    holders: GroupHolders
    links: Links
    sink: EventSink
    faults: Callable                  # base.faults.FaultPoints
    state: Callable[[], RankState]
    adopt: Callable[[Plan], int]
    quiet: CollectiveSuppressor       # a promoted spare's solitary model build


class Step:
    phase: Phase

    def __init__(self, crew: Crew):
        self.config, self.member, self.world = crew.config, crew.member, crew.world
        self.att, self.holders, self.links = crew.attachment, crew.holders, crew.links
        self.sink = crew.sink
        self.faults, self.state, self.adopt = crew.faults, crew.state, crew.adopt
        self.quiet = crew.quiet

    def __call__(self, a: Attempt) -> Attempt:
        raise NotImplementedError

    def fault_point(self, a: Attempt) -> None:
        """Test hook: a survivor dies in this step's phase (``--inject ...,phase=P``)."""
        if not a.spare:
            self.faults(a.iteration_at_failure + 1, self.phase)


class Abort(Step):
    """Every communicator of the failed generation aborted, the mirror thread stopped, the
    world retired (on gloo the unbroken groups stay for the replay: recovery/repair.py);
    the old groups die on the reaper thread (reaper.py)."""

    phase = Phase.ABORT

    def __call__(self, a: Attempt) -> Attempt:
        self.world.abort(f"{type(a.cause).__name__} in the training step", self.state().rank)
        self.links.abort()  # wakes a mirror thread blocked on a dead peer
        self.att.quiesce(self.config.rendezvous_timeout_s)
        self.links.retire()
        drop_traceback(a.cause)
        if self.config.audit is Audit.FULL:
            a.old_groups = weak_groups(all_process_groups())
        self.world.retire()
        self.holders.release(self.links.release())  # they die on the reaper thread
        return a


class Rendezvous(Step):
    """The next generation's plan (a spare was promoted with it), then its world forms."""

    phase = Phase.RENDEZVOUS

    def __call__(self, a: Attempt) -> Attempt:
        timeout_s, plan = self.config.rendezvous_timeout_s, self.state().plan
        if not a.startup:  # a spare starting up was promoted with its plan
            plan = self.member.wait_for_plan(plan.gen + 1, timeout_s, a.cause)
            self.adopt(plan)  # the victim of a fault point must know its rank in the plan
            self.fault_point(a)
        plan = form_world(plan, self.adopt, self.member, self.world, timeout_s,
                          with_groups=False)
        if a.startup:  # its phases from here on are the formed generation's
            a.generation = plan.gen
        return a


class RebuildGroups(Step):
    """Megatron's groups (replayed; a spare's first build takes Megatron's arguments), the
    collective timeouts, and the generation's link; a survivor rebinds every holder."""

    phase = Phase.REBUILD_GROUPS

    def __call__(self, a: Attempt) -> Attempt:
        if a.startup:
            self.first(a.group_kwargs)
            self.quiet.start()  # it builds its model without talking to anyone (quiet.py)
            return a
        self.fault_point(a)
        self.world.build_groups()
        self.holders.drop(self.world.take_dropped())  # not kept; the old default
        a.old_groups = still_old(a.old_groups, self.world.kept())
        self.world.set_collective_timeouts()  # before the mirror's group: it has its own
        audit = self.holders.rebind(self.config.audit, a.old_groups)
        self.att.use(self.links.connect(self.state().plan))
        if audit:
            self.sink.emit(Event.AUDIT, generation=self.state().generation,
                           rank=self.state().rank, **audit)
        return a

    def first(self, kwargs: Optional[dict]) -> None:
        """The first build of Megatron's groups with its own arguments (recorded, replayed
        by every rebuild); a peer failing meanwhile moves the world to the next generation.
        Then the collective timeouts and the generation's link."""
        try:
            self.world.build_groups(kwargs)
        except Exception as exc:  # noqa: BLE001 - classified right below
            if not is_peer_failure(exc, aborted=False):
                raise
            self.world.destroy()
            timeout_s = self.config.rendezvous_timeout_s
            nxt = self.member.wait_for_plan(self.state().generation + 1, timeout_s, exc)
            form_world(nxt, self.adopt, self.member, self.world, timeout_s, with_groups=True)
        self.world.set_collective_timeouts()
        self.links.connect(self.state().plan)  # the mirror's group, with the others


class RestoreState(Step):
    """Once every member is ready (a spare has built its model): the newest iteration held
    for every rank, restored; a drain's spare may take its state straight from the draining
    rank (``--deadpool-drain-source direct``)."""

    phase = Phase.RESTORE_STATE

    def __call__(self, a: Attempt) -> Attempt:
        state = self.state()
        plan = state.plan
        self.fault_point(a)
        self.member.wait_until_ready(state.generation, state.world_size,
                                     self.config.spare_ready_timeout_s)
        if a.spare:  # the draining rank sends since the boundary: a short bound
            direct = plan.drain is not None and self.config.drain_source is DrainSource.DIRECT
            got = self.links.hand_off(self.att, state.generation, state.rank,
                                      self.config.gloo_op_timeout_s / 3) if direct else None
            a.state_from = "buddy" if got is None else "direct"
        a.restored = self.att.restore(state.rank, self.links.current)
        return a


def still_old(old_groups, kept: set):
    """Of the weak references taken at the abort (``--deadpool-audit full``), those of the
    groups that must die: all but the ones the replay kept (``kept``: their ids;
    recovery/repair.py), which stay alive and are no leak."""
    if not old_groups:
        return old_groups
    out = []
    for ref in old_groups:
        g = ref()
        if g is None or id(g) not in kept:
            out.append(ref)
        del g
    return out


SURVIVOR: Seq[Type[Step]] = (Abort, Rendezvous, RebuildGroups, RestoreState)
SPARE: Seq[Type[Step]] = (Rendezvous, RebuildGroups, RestoreState)


class Sequence:
    """Steps run in order, each timed as its phase (the attempt's timer: each phase closes
    the one before it, and emits it)."""

    def __init__(self, crew: Crew, steps: Seq[Type[Step]]):
        self.steps = tuple(step(crew) for step in steps)

    def run(self, a: Attempt, through: Optional[Phase] = None) -> Attempt:
        """The steps ``a`` has not done yet, up to ``through`` (default: all). Stopped
        early, the next step's phase times the caller's work until it resumes."""
        for step in self.steps[a.done:]:
            a.phase(step.phase)
            a = step(a)
            a.done += 1
            if step.phase is through and a.done < len(self.steps):
                a.phase(self.steps[a.done].phase)
                return a
        a.phase(None)
        return a
