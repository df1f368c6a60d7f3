"""One worker's enabled runtime (used through ``api.Deadpool``): a sequencer over
membership, the communicators (``world.py``), what it protects (``attachment.py``, and the
group holders: ``holders.py``) and the current generation's link (``link.py``). It holds the
worker's one frozen ``RankState`` (base/state.py), which carries the plan, and replaces it
at each change.

    recovery = the SURVIVOR sequence (steps.py: its steps, each taking and returning the
               Attempt) ─► timed first step; a failure inside one starts the next on a newer
               generation (MAX_ATTEMPTS). A promoted spare walks the SPARE sequence in join /
               initialize_model_parallel / attach, each call resuming it where it paused
               (the steps declare where: Step.spare_waits). A drain's plan is applied at an
               agreed step boundary (recovery/boundary.py), on the same path.
A failure is a membership fact, not an exception type (``_membership_changed``). """

from __future__ import annotations

import contextlib
import logging
import time
from typing import Iterator, List, Optional

from ..adapters.quiet import CollectiveSuppressor
from ..base.config import DeadpoolConfig, DrainSource
from ..base.errors import DeadpoolError, ForgedRecordError, JobStopped, NoCommittedStateError
from ..base.plan import Plan
from ..base.state import RankState, Role, WorkerState
from ..base.vocabulary import SECTION_PHASES, Event, Phase
from ..base.worker_env import WorkerEnv, physical_id, promoted_gpu
from ..membership.member import Member
from ..membership.store import EventKind
from ..recovery.boundary import Action, Boundary, PlannedSwap
from ..recovery.classify import failed_again, is_comm_failure, is_peer_failure
from ..recovery.fault_points import worker_fault_points
from ..recovery.formation import form_world, rank_in
from ..recovery.phases import Attempt, EventSink, PhaseTimer
from ..recovery.stall import StallWatch
from ..recovery.world import World
from .attachment import Attachment
from .holders import GroupHolders
from .link import Links
from .steps import SPARE, SURVIVOR, Crew, RebuildGroups, StepChain

log = logging.getLogger(__name__)

MAX_ATTEMPTS = 8  # recovery attempts per failure (each on a newer generation)


class Runtime:
    def __init__(self, config: DeadpoolConfig, env: WorkerEnv, member: Member, world: World,
                 attachment: Attachment, links: Links, sink: EventSink,
                 with_cuda: bool = False):
        self.config, self.env, self.with_cuda = config, env, with_cuda
        # the GPU this process uses, as its machine names it (heartbeats report it); None on
        # CPU and for a node's standby until it takes a rank (its GPU is bound then)
        self.gpu: Optional[str] = physical_id(env.local_rank) \
            if with_cuda and env.local_rank >= 0 else None
        self.local_rank = env.local_rank  # a standby's: UNBOUND until it takes a rank
        self.member, self.world, self.att, self.sink = member, world, attachment, sink
        self.links, self.holders = links, GroupHolders()
        self.state = RankState(lid=env.lid, node=env.node, role=env.role)
        self.faults = worker_fault_points(env, member, lambda: self.state.rank, attachment,
                                          links)
        world.also_on_abort(links.abort)  # the mirror's sockets are not abort.py's
        self.recoveries: List[dict] = []
        self._first_step: Optional[tuple] = None
        self._startup: Optional[Attempt] = None  # a promoted spare's walk, between calls
        self._closed = False
        self.stall = StallWatch(config.take_plan_timeout_s * 0.75)  # before the decider fences
        self.boundary = Boundary(member, env.lid)  # planned swaps (membership/drain.py)
        crew = Crew(config, member, world, attachment, self.holders, links, sink, self.faults,
                    lambda: self.state, self._adopt, CollectiveSuppressor())
        self.survivor, self.spare = StepChain(crew, SURVIVOR), StepChain(crew, SPARE)
        self.quiet, self.first_groups = crew.quiet, RebuildGroups(crew).first

    @property
    def promoted(self) -> bool:
        return self.state.role is Role.PROMOTED

    @property
    def restored_meta(self) -> Optional[dict]:
        return self.att.restored_meta

    # ================================================================ membership
    def join(self) -> None:
        try:
            self.member.admit(self._status, self._on_generation, self._on_stop)
        except JobStopped as exc:
            if self.state.role is not Role.SPARE:
                raise
            log.info("spare released: %s", exc)  # the job ended before it was needed
            self.close(destroy=False)
            raise SystemExit(0) from None
        if self.state.role is Role.SPARE:
            self._startup = self.spare.run(self._standby(), pause=True)  # its world forms
        else:
            form_world(self.member.initial_plan(), self._adopt, self.member, self.world,
                       self.config.rendezvous_timeout_s, with_groups=False)

    def _standby(self) -> Attempt:
        log.info("standby spare on node %s: waiting for an assignment", self.env.node)
        try:
            plan = self.member.wait_for_plan(min_gen=1, timeout_s=None)
        except JobStopped as exc:
            log.info("spare released: %s", exc)
            self.close(destroy=False)
            raise SystemExit(0) from None
        self.state = self.state.promote(plan)
        if self.with_cuda and self.gpu is None:
            self._bind_gpu(plan)  # before its world forms: NCCL binds the current device
        self.sink.emit(Event.PROMOTED, lid=self.env.lid, rank=self.state.rank,
                       generation=plan.gen, gpu=self.gpu)
        return Attempt(cause=DeadpoolError("promoted"), iteration_at_failure=None, plan=plan,
                       lid=self.env.lid, timer=PhaseTimer(self.sink), joined=True,
                       role=self.state.role, startup=True)

    def _bind_gpu(self, plan: Plan) -> None:
        """A node's standby took a rank: it binds the GPU its node's other members do not
        use (their heartbeats name theirs), shared out by rank among the processes promoted
        on the node in the same plan (base/worker_env.py ``promoted_gpu``)."""
        import torch

        mine, fresh = plan.lids_beside(self.state.rank), plan.newcomers()
        beats = self.member.heartbeats([lid for lid in mine if lid not in fresh])
        visible = [physical_id(i) for i in range(torch.cuda.device_count())]
        idx = promoted_gpu(visible, [b.get("gpu") for b in beats.values()],
                                [plan.rank(lid) for lid in mine if lid in fresh],
                                self.state.rank)
        torch.cuda.set_device(idx)
        self.gpu, self.local_rank = visible[idx], idx
        log.info("standby took rank %s on GPU %s (device %d)", self.state.rank, self.gpu, idx)

    def _status(self) -> dict:
        gpu = {} if self.gpu is None else {"gpu": self.gpu}
        return {"iteration": self.state.iteration, "state": self.state.mode,  # heartbeats
                "gen": self.state.generation, **gpu, **self.att.status()}

    def _on_generation(self, gen: int) -> None:
        if self.boundary.planned(gen, self.state):
            return  # a drain: every rank stops at the boundary they agree on
        self.world.abort(f"generation {gen} published", self.state.rank, newer_than=gen)
        self.stall.observe(gen, self.state.generation if self.state.plan is not None else None)

    def _on_stop(self, reason: str) -> None:
        if self.state.mode not in (WorkerState.DONE, WorkerState.STANDBY):
            self.world.abort("job stopped: " + reason, self.state.rank)

    def _adopt(self, plan: Plan) -> int:
        """This process's rank in ``plan``: the state carries the plan from here on."""
        if plan.rank(self.env.lid) is None and (self.promoted or self.boundary.drained(
                self.state.plan, plan)):  # drained, or a spare whose drain a failure undid
            self.boundary.leave_after(self.config.spare_ready_timeout_s, plan)
        rank = rank_in(plan, self.env.lid)
        self.state = self.state.adopt(plan)
        return rank

    def initialize_model_parallel(self, kwargs: dict) -> None:
        """First build of the model-parallel groups (recorded, replayed on every rebuild),
        and the generation's link. A promoted spare's is its rebuild_groups step."""
        if self._startup is None:
            self.first_groups(kwargs)
            return
        self._startup.group_kwargs = kwargs
        self._startup = self.spare.run(self._startup, pause=True)

    # ================================================================ attach and loop
    def attach(self, model, optimizer, scheduler, train_state) -> None:
        self.quiet.stop()  # a promoted spare's model is built
        link = self.links.current or self.links.connect(self.state.plan)  # built outside us
        self.att.attach(model, optimizer, scheduler, train_state, self.state.rank,
                        self.state.world_size, self.with_cuda, link, fault_points=self.faults)
        self.holders.attach(model, optimizer)
        self.state = self.state.enter(WorkerState.ACTIVE)
        if self.config.resume_dir and not self.promoted:
            it = self.att.resume(self.config.resume_dir, self.state.world_size)
            self.state = self.state.at(it)
            self.sink.emit(Event.RESUMED, rank=self.state.rank, iteration=it,
                           dir=self.config.resume_dir)
            return
        if self._startup is None:
            return
        startup, self._startup = self._startup, None
        try:
            self._begin_first_step(self.spare.run(startup))  # its restore_state step
        except Exception as exc:  # noqa: BLE001 - a peer failed while this spare restored
            if not failed_again(exc, self.world.aborted):
                raise
            self._recover_until_done(exc, iteration_at_failure=None)

    def protect_groups_of(self, holders) -> None:
        self.holders.add(holders)

    def before_step(self, iteration: int) -> None:
        self.state = self.state.first_step()  # a promoted spare's solitary startup is over
        action = self.boundary.check(self.state.rank, self.state.world_size, iteration)
        if action is not None:
            self._planned_swap(action, iteration)
        self.world.bound_gloo_deadlines()
        self.att.before_step(iteration)
        self.faults(iteration + 1, Phase.FORWARD_BACKWARD)

    def _planned_swap(self, action: Action, iteration: int) -> None:
        """At the agreed boundary, once snapshot ``iteration`` is at the buddies: leave (the
        drained node) or take the recovery path with nothing to redo."""
        self.att.settle_snapshot()
        gen = self.boundary.generation
        self.sink.emit(Event.DRAIN_BOUNDARY, generation=gen, rank=self.state.rank,
                       iteration=iteration, action=action.value)
        if action is Action.LEAVE:  # exits once the swap is done, or rejoins a newer plan
            self._leave(gen, iteration)
        raise PlannedSwap(f"planned swap to generation {gen} at iteration {iteration}")

    def _leave(self, gen: int, iteration: int) -> None:
        """The drained node's process at the agreed boundary (snapshot ``iteration`` is at
        the buddies): with ``--deadpool-drain-source direct`` its own slot goes straight to
        the spare taking its rank (mirror/handoff.py, on a thread) while it waits until the
        swap is done (SystemExit(0)), or until a newer plan makes it a member again
        (PlannedSwap: the sending stops)."""
        timeout_s = self.config.spare_ready_timeout_s
        sender = self.links.hand_off(self.att, gen, self.state.rank, timeout_s, iteration) \
            if self.config.drain_source is DrainSource.DIRECT else None
        try:
            self.boundary.leave_after(timeout_s, moved=PlannedSwap)
        finally:
            if sender is not None:
                sender.abort()

    def step_done(self, iteration: int) -> Optional[dict]:
        """After ``iteration``: its snapshot begins; the report of a recovery it completed."""
        self.member.step_done()
        self.state = self.state.at(iteration)
        self.att.after_step(iteration, mirror_on=self.env.mirror_on(iteration))
        report = self._report_recovery()
        self.sink.emit(Event.STEP, rank=self.state.rank, iteration=iteration)  # for report
        return report

    def progress(self, iteration: int) -> dict:
        """The mirror's part of ``iteration``'s progress line, and the generation."""
        return {**self.att.progress(iteration), "generation": self.state.generation}

    @contextlib.contextmanager
    def section(self, name: str) -> Iterator[None]:
        """``api.Deadpool.section``: the section's timeout judges this rank (and bounds its
        gloo waits in a save, world.py); a scheduled save or eval fault strikes on entry."""
        with self.member.section(name):
            self.world.enter_section(name, self.config.section_timeouts_s)
            if name in SECTION_PHASES and self.faults.due(self.state.iteration, name):
                self.member.wait_beat_of_section()  # the decider knows the section first
                self.faults(self.state.iteration, name)
            yield

    def _report_recovery(self) -> Optional[dict]:
        """The recovery's report, once its first step is done (or the job ended first)."""
        if self._first_step is None:
            return None
        (timer, report), self._first_step = self._first_step, None
        timer.stop()  # the first step
        report.update(phases_s=timer.durations, counts=timer.counts,
                      t_done=time.time())  # wall clock
        self.member.report_recovery(self.state.generation, self.state.rank, report)
        self.recoveries.append(report)
        return report

    # ================================================================ recovery
    def recover(self, exc: BaseException) -> None:
        """The recovery boundary. Returns with every rank restored to the same committed
        iteration on a rebuilt world; re-raises ``exc`` if no membership change backs it."""
        if self.state.mode != WorkerState.ACTIVE:
            raise exc
        try:
            if not self._membership_changed(exc):
                raise exc
            log.info("%s at iteration %s: %s: %.160s", "planned swap" if isinstance(
                exc, PlannedSwap) else "failure seen", self.state.iteration,
                type(exc).__name__, str(exc).partition("\n")[0])
            self._recover_until_done(exc, self.state.iteration)
        except (JobStopped, NoCommittedStateError, ForgedRecordError):
            if self.config.fallback_save_dir:  # write the copies held here, then stop
                self.world.abort("the job stops: fallback save", self.state.rank)
                self.att.save_fallback(self.config.heartbeat_timeout_s, self.state.rank)
            raise

    def _membership_changed(self, exc: BaseException) -> bool:
        """Aborted: a newer generation exists. A communication error: wait for the decider
        to declare a member dead, as long as it may need to see a lost node (heartbeat
        timeout plus two polls and a second). Anything else is local: False at once."""
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            return False
        if self.world.aborted or isinstance(exc, PlannedSwap):
            return True
        if not is_comm_failure(exc):
            return False
        cfg = self.config
        return self.member.wait_moved(self.state.generation, cfg.heartbeat_timeout_s
                                      + 2 * cfg.heartbeat_interval_s + 1)

    def _recover_until_done(self, exc: BaseException, iteration_at_failure: Optional[int]
                            ) -> None:
        for attempt in range(1, MAX_ATTEMPTS + 1):
            a = Attempt(cause=exc, iteration_at_failure=iteration_at_failure,
                        plan=self.state.plan, lid=self.env.lid, timer=PhaseTimer(self.sink),
                        role=self.state.role)
            try:
                self.state = self.state.enter(WorkerState.RECOVERING)
                self._begin_first_step(self.survivor.run(a))
                self.state = self.state.enter(WorkerState.ACTIVE)
                self.boundary.done()
                return
            except Exception as again:  # noqa: BLE001 - classified right below
                if not failed_again(again, self.world.aborted):
                    raise
                self.member.raise_if_stopped()
                log.info("failure during recovery attempt %s (%s: %.200s); starting over on "
                         "the next generation", attempt, type(again).__name__, again)
                exc = again
        raise DeadpoolError(f"recovery did not succeed in {MAX_ATTEMPTS} attempts; last "
                            f"failure: {type(exc).__name__}: {exc}")

    def _begin_first_step(self, a: Attempt) -> None:
        self.state = self.state.at(a.restored)
        gen = self.state.generation
        report = {"generation": gen, "rank": self.state.rank, "lid": self.env.lid,
                  "spare": a.spare, "restored_iter": a.restored, "state_from": a.state_from,
                  "iteration_at_failure": a.iteration_at_failure,
                  "failed_ranks": list(self.state.plan.failed_ranks)}
        log.info("generation %s: restored iteration %s", gen, a.restored)
        self.sink.emit(Event.RESTORED, generation=gen, rank=self.state.rank,
                       iteration=a.restored)
        a.phase(Phase.FIRST_STEP)
        self._first_step = (a.timer, report)

    # ================================================================ end
    def finish(self) -> dict:
        self._report_recovery()
        info = self.att.finish_info()
        if info:
            info.update(self.links.summary())
        self.state = self.state.enter(WorkerState.DONE)
        self.member.push_event(EventKind.DONE, rank=self.state.rank)
        self.close(destroy=False)
        return {"recoveries": self.recoveries, "generation": self.state.generation, **info}

    def report_fatal(self, exc: BaseException) -> None:
        """An error recovery must not handle: the decider stops the job with it (no spare)."""
        if self.state.mode == WorkerState.DONE or self._closed or isinstance(exc, JobStopped):
            return
        attached = (self.state.mode != WorkerState.STANDBY
                    or is_peer_failure(exc, self.world.aborted))
        self.member.report_fatal(self.state.rank, exc, attached)

    def close(self, destroy: bool = True) -> None:
        """Stop the threads and free every communicator (``destroy``: an error exit; abort a
        snapshot job blocked on a dead peer first): live ones end in std::terminate at exit."""
        if self._closed:
            return
        self._closed = True
        self.member.close()
        self.holders.wait()  # the old groups die first
        self.att.close(abort=destroy and self._abort_all)
        self.world.destroy() if destroy else self.world.forget()

    def _abort_all(self) -> None:
        """At an error exit: the world's communicators and the link's sockets (e.g. a
        snapshot job waiting for a dead owner's connection)."""
        self.world.abort("exit", self.state.rank)
        self.links.abort()
