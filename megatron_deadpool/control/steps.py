"""The recovery's steps, one class each, and the two sequences built from them. Every step
takes and returns the ``Attempt`` (recovery/phases.py), as NVRx ``Compose`` chains its
steps; ``StepChain.run`` times each one as the phase it names (``base/vocabulary.py``'s
``RECOVERY_PHASES``, in this order), the one wrapper, so a step never starts or stops a timer
itself. ``SURVIVOR`` and ``SPARE`` below are the sequences; the restore is four steps
(``RESTORE``: agree, transfer, verify, load; recovery/restore.py), all in one phase.

A promoted spare walks its sequence in three calls, because its caller builds between
them: ``join``, ``initialize_model_parallel`` (Megatron's own arguments) and ``attach`` (its
model exists). Its walk pauses before each step that waits for its caller
(``Step.spare_waits``), whose phase is already timing: the caller's work belongs to it.

Adding a phase: its ``Phase`` member (base/vocabulary.py, in its place before
``first_step``), one class here and one line in a sequence. Adding a check before the
restore loads: one class here and one line in ``RESTORE``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence as Seq, Type

from ..adapters.quiet import CollectiveSuppressor
from ..base.config import Audit, DeadpoolConfig, DrainSource
from ..base.errors import DeadpoolError, TransportTimeout
from ..base.plan import Plan
from ..base.state import RankState
from ..base.vocabulary import Event, Phase
from ..recovery import restore
from ..recovery.abort import all_process_groups, drop_traceback
from ..membership.store import GenerationMoved
from ..mirror.rounds import READY_KEY
from ..recovery.classify import is_peer_failure
from ..recovery.formation import form_world
from ..recovery.phases import Attempt, EventSink
from ..recovery.rebind import weak_groups
from .attachment import Attachment
from .holders import GroupHolders
from .link import Links


@dataclass(frozen=True)
class Crew:
    """The worker process's parts that the recovery steps use. What the steps act on: the worker's
    parts (one of each per process), and the runtime's ``state()`` and ``adopt(plan)`` (take
    this process's rank in a plan: the runtime's ``RankState`` follows)."""

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
    quiet: CollectiveSuppressor       # turns collectives into no-ops while a promoted spare
    #                                   builds its model alone (adapters/quiet.py)


class Step:
    """One small part of a recovery, timed as its ``phase``: it takes the attempt and
    returns it."""

    phase: Phase
    # True: a promoted spare stops before this step and waits for what its caller hands it
    # next (Megatron's arguments, its model); the step's phase times the caller's work
    # meanwhile (StepChain.run)
    spare_waits: bool = False

    def __init__(self, crew: Crew):
        self.config, self.member, self.world = crew.config, crew.member, crew.world
        self.att, self.holders, self.links = crew.attachment, crew.holders, crew.links
        self.sink = crew.sink
        self.faults, self.state, self.adopt = crew.faults, crew.state, crew.adopt
        self.quiet = crew.quiet

    def __call__(self, attempt: Attempt) -> Attempt:
        raise NotImplementedError

    def fault_point(self, attempt: Attempt) -> None:
        """Test hook: a survivor dies in this step's phase (``--inject ...,phase=P``)."""
        if not attempt.spare:
            self.faults(attempt.iteration_at_failure + 1, self.phase)


class Abort(Step):
    """Every communicator of the failed generation aborted, the mirror thread stopped, the
    world retired (on gloo the unbroken groups stay for the replay: recovery/repair.py);
    the old groups die on the reaper thread (reaper.py)."""

    phase = Phase.ABORT

    def __call__(self, attempt: Attempt) -> Attempt:
        self.world.abort(f"{type(attempt.cause).__name__} in the training step", self.state().rank)
        self.links.abort()  # wakes a mirror thread blocked on a dead peer
        self.att.quiesce(self.config.rendezvous_timeout_s)
        self.links.retire()
        drop_traceback(attempt.cause)
        if self.config.audit is Audit.FULL:
            attempt.old_groups = weak_groups(all_process_groups())
        self.world.retire()
        self.holders.release(self.links.release())  # they die on the reaper thread
        return attempt


class Rendezvous(Step):
    """The next generation's plan (a spare was promoted with it), then its world forms."""

    phase = Phase.RENDEZVOUS

    def __call__(self, attempt: Attempt) -> Attempt:
        timeout_s, plan = self.config.rendezvous_timeout_s, self.state().plan
        if not attempt.startup:  # a spare starting up was promoted with its plan
            plan = self.member.wait_for_plan(plan.gen + 1, timeout_s, attempt.cause)
            self.adopt(plan)  # the victim of a fault point must know its rank in the plan
            self.fault_point(attempt)
        attempt.join(form_world(plan, self.adopt, self.member, self.world, timeout_s,
                          with_groups=False))  # its phases from here on are this plan's
        return attempt


class RebuildGroups(Step):
    """Megatron's groups (replayed; a spare's first build takes Megatron's arguments), the
    collective timeouts, and the generation's link; a survivor rebinds every holder."""

    phase = Phase.REBUILD_GROUPS
    spare_waits = True  # for Megatron's arguments (initialize_model_parallel)

    def __call__(self, attempt: Attempt) -> Attempt:
        if attempt.startup:
            self.first(attempt.group_kwargs)
            self.quiet.start()  # it builds its model without talking to anyone (quiet.py)
            return attempt
        self.fault_point(attempt)
        self.world.build_groups()
        self.holders.drop(self.world.take_dropped())  # not kept; the old default
        attempt.old_groups = still_old(attempt.old_groups, self.world.kept())
        self.world.set_collective_timeouts()  # before the mirror's group: it has its own
        audit = self.holders.rebind(self.config.audit, attempt.old_groups)
        self.att.use(self.links.connect(self.state().plan))
        if audit:
            self.sink.emit(Event.AUDIT, generation=self.state().generation,
                           rank=self.state().rank, **audit)
        return attempt

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


class Agree(Step):
    """Once every member is ready (a spare has built its model): the newest iteration held
    for every rank, and who sends which copy, agreed (recovery/restore.py). A drain's spare
    may first take its state straight from the draining rank (``--deadpool-drain-source
    direct``)."""

    phase = Phase.RESTORE_STATE
    spare_waits = True  # for its model (attach)

    def __call__(self, attempt: Attempt) -> Attempt:
        state = self.state()
        plan = state.plan
        self.fault_point(attempt)
        self.ready(state)
        if attempt.spare:  # the draining rank sends since the boundary: a short bound
            direct = plan.drain is not None and self.config.drain_source is DrainSource.DIRECT
            got = self.links.hand_off(self.att, state.generation, state.rank,
                                      self.config.gloo_op_timeout_s / 3) if direct else None
            attempt.state_from = "buddy" if got is None else "direct"
        attempt.restore = self.att.restoring(state.rank, self.links.current)
        restore.agree_on(attempt.restore)
        return attempt


    def ready(self, state: RankState) -> None:
        """Before the restore exchange, every member of the generation can take part in it:
        a promoted spare first builds its model and optimizer and allocates its slots (tens
        of seconds on a GPU node), longer than the operation deadline the restore runs
        under. A barrier on the node record stores (``Links.barrier``), bounded by
        --deadpool-spare-ready-timeout; a member that dies meanwhile leaves the others
        waiting until the next plan's abort, or the job's stop's."""
        try:
            self.links.barrier(state.plan, READY_KEY, self.config.spare_ready_timeout_s)
        except TransportTimeout as exc:
            if self.member.membership_moved(state.generation):
                raise GenerationMoved(f"a member of generation {state.generation} failed "
                                      "while the others waited for it to be ready") from None
            raise DeadpoolError(f"{exc}: a promoted spare did not build its model in time "
                                "(--deadpool-spare-ready-timeout)") from None


class Transfer(Step):
    """The copies this rank holds for ranks without their own sent; its own received from
    its holder if it has none."""

    phase = Phase.RESTORE_STATE

    def __call__(self, attempt: Attempt) -> Attempt:
        restore.transfer(attempt.restore)
        return attempt


class Verify(Step):
    """This rank's copy of the agreed iteration checked before anything is loaded (its
    header, layout and checksum)."""

    phase = Phase.RESTORE_STATE

    def __call__(self, attempt: Attempt) -> Attempt:
        restore.verify(attempt.restore)
        return attempt


class Load(Step):
    """The copy loaded into the optimizer's state and the model, its metadata applied, and
    the iteration protected again at the (possibly new) buddies."""

    phase = Phase.RESTORE_STATE

    def __call__(self, attempt: Attempt) -> Attempt:
        attempt.restored = restore.load(attempt.restore)
        return attempt


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


RESTORE: Seq[Type[Step]] = (Agree, Transfer, Verify, Load)
SURVIVOR: Seq[Type[Step]] = (Abort, Rendezvous, RebuildGroups, *RESTORE)
SPARE: Seq[Type[Step]] = (Rendezvous, RebuildGroups, *RESTORE)


class StepChain:
    """Steps run in order, each timed as its phase (the attempt's timer: each phase closes
    the one before it, and emits it)."""

    def __init__(self, crew: Crew, steps: Seq[Type[Step]]):
        self.steps = tuple(step(crew) for step in steps)

    def run(self, attempt: Attempt, pause: bool = False) -> Attempt:
        """The steps ``a`` has not done yet. ``pause`` (a promoted spare's walk): stop before
        the next step that waits for the caller (``Step.spare_waits``; not the first one run,
        which the call resumes), its phase timing the caller's work until then."""
        for i, step in enumerate(self.steps[attempt.done:]):
            attempt.phase(step.phase)
            if pause and step.spare_waits and i > 0:
                return attempt
            attempt = step(attempt)
            attempt.done += 1
        attempt.phase(None)
        return attempt
