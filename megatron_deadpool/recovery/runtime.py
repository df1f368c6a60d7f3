"""The enabled DeadPool runtime of one worker process (used through ``api.Deadpool``): a
sequencer over membership (``membership/member.py``), the communicators (``world.py``), the
mirror and the restore decision (``restore.py``).

    WorkerState:  STANDBY ──promoted──► ACTIVE ──failure──► RECOVERING ──restored──► ACTIVE
                  (a spare)             └──────────────finish──────────────► DONE

    recovery = abort ─► rendezvous ─► rebuild_groups ─► restore_state ─► (timed) first step,
               each a method taking and returning the Attempt; a failure inside one starts
               the next on a newer generation (MAX_ATTEMPTS, waits bounded by the rendezvous
               timeout). A member that does not take a newer plan dumps its stacks (stall.py).
A failure is a membership fact, not an exception type (``_membership_changed``). """

from __future__ import annotations

import logging
import time
from typing import List, Optional

from ..config import DeadpoolConfig
from ..errors import DeadpoolError, JobStopped, MirrorError, NoCommittedStateError
from ..faults import Phase as FaultPhase
from ..membership.member import Member
from ..membership.plan import Plan
from ..membership.store import EventKind, GenerationMoved, WorkerState
from ..worker_env import WorkerEnv
from .abort import all_process_groups, drop_traceback
from .classify import is_comm_failure, is_peer_failure
from .fault_points import worker_fault_points
from .formation import adopt, form_world
from .phases import Attempt, EventSink, Phase, PhaseTimer
from .rebind import audit_rebind, weak_groups
from .stall import StallWatch
from .world import World

log = logging.getLogger(__name__)

MAX_ATTEMPTS = 8  # recovery attempts per failure (each on a newer generation)
NEW_GEN_POLL_S = 0.02


class Runtime:
    def __init__(self, handle, config: DeadpoolConfig, env: WorkerEnv, member: Member,
                 world: World, attachment):
        self.h, self.config, self.env = handle, config, env
        self.member, self.world, self.att = member, world, attachment
        self.sink = EventSink(config.events_path)
        self.faults = worker_fault_points(env, member, lambda: self.h.rank, attachment)
        attachment.alarms.emit = self.sink.emit  # mirror failures are events (alarms.py)
        world.on_abort = attachment.abort_transport  # the mirror's sockets (abort.py)
        self.state = WorkerState.STANDBY
        self.plan: Optional[Plan] = None
        self.promoted = False
        self.recoveries: List[dict] = []
        self._first_step: Optional[tuple] = None
        self._spare_timer: Optional[PhaseTimer] = None  # a promoted spare's own phases
        self._closed = False
        self.stall = StallWatch(config.take_plan_timeout_s * 0.75)  # before the decider fences

    # ================================================================ membership
    def join(self) -> None:
        self.member.admit(self._status, self._on_generation, self._on_stop)
        plan = self._standby() if self.env.role == "spare" else self.member.initial_plan()
        self._form_world(plan, with_groups=False)
        if self.promoted:  # a spare's world formed (maybe on a newer generation than its plan)
            self._spare_timer.start(Phase.REBUILD_GROUPS, generation=self.plan.gen)

    def _standby(self) -> Plan:
        log.info("standby spare on node %s: waiting for an assignment", self.env.node)
        try:
            plan = self.member.wait_for_plan(min_gen=1, timeout_s=None)
        except JobStopped as exc:
            log.info("spare released: %s", exc)
            self.close(destroy=False)
            raise SystemExit(0) from None
        self.promoted = True
        self._spare_timer = PhaseTimer(self.sink, plan.gen, plan.rank(self.env.lid))
        self._spare_timer.start(Phase.RENDEZVOUS)  # until its world forms (join)
        self.sink.emit("promoted", lid=self.env.lid, rank=plan.rank(self.env.lid),
                       generation=plan.gen)
        return plan

    def _status(self) -> dict:
        m = self.att.mirror
        return {"iteration": self.att.iteration, "state": self.state.value,
                "committed": m.committed if m is not None else -1, "gen": self.member.taken_gen}

    def _on_generation(self, gen: int) -> None:
        self.world.abort(f"generation {gen} published", self.h.rank, newer_than=gen)
        self.stall.observe(gen, self.plan.gen if self.plan is not None else None)

    def _on_stop(self, reason: str) -> None:
        if self.state not in (WorkerState.DONE, WorkerState.STANDBY):
            self.world.abort("job stopped: " + reason, self.h.rank)

    def _form_world(self, plan: Plan, with_groups: bool) -> None:
        self.plan = form_world(plan, self.env.lid, self.h, self.member, self.world,
                               self.config.rendezvous_timeout_s, with_groups)

    def _wait_for_plan(self, cause: BaseException) -> Plan:
        return self.member.wait_for_plan(self.plan.gen + 1, self.config.rendezvous_timeout_s, cause)

    def initialize_model_parallel(self, kwargs: dict) -> None:
        """First build of the model-parallel groups (recorded, replayed on every rebuild)."""
        self.world.mp_kwargs = dict(kwargs)
        try:
            self.world.build_groups()
        except Exception as exc:  # noqa: BLE001 - classified right below
            if not is_peer_failure(exc, aborted=False):
                raise
            self.world.destroy()
            self._form_world(self._wait_for_plan(exc), with_groups=True)
        self.world.set_collective_timeouts()
        self.att.connect(self.plan)  # the mirror's group, with the others
        if self.promoted:
            self._spare_timer.start(Phase.RESTORE_STATE)  # its model build and restore
            self.att.quiet_startup()

    # ================================================================ attach and loop
    def attach(self, model, optimizer, scheduler, train_state) -> None:
        self.att.attach(model, optimizer, scheduler, train_state, self.h, self.plan,
                        fault_points=self.faults)
        self.state = WorkerState.ACTIVE
        if self.config.resume_dir and not self.promoted:
            it = self.att.resume(self.config.resume_dir, self.h.world_size)
            self.sink.emit("resumed", rank=self.h.rank, iteration=it, dir=self.config.resume_dir)
            return
        if not self.promoted:
            return
        attempt = Attempt(cause=DeadpoolError("promoted"), iteration_at_failure=None,
                          timer=self._spare_timer, plan=self.plan)
        try:
            self._begin_first_step(self._restore_state(attempt))
        except Exception as exc:  # noqa: BLE001 - a peer failed while this spare restored
            if not self._failed_again(exc):
                raise
            self._recover_until_done(exc, iteration_at_failure=None)

    def before_step(self, iteration: int) -> None:
        self.world.bound_gloo_deadlines()
        self.att.before_step(iteration)
        self.faults(iteration + 1, FaultPhase.FORWARD_BACKWARD)

    def after_step(self, iteration: int) -> None:
        self.att.after_step(iteration, mirror_on=self.env.mirror_on(iteration))
        self._report_recovery()

    def _report_recovery(self) -> None:
        """Once the first step after a restore is done (or the job ends before one: a
        restore to the last iteration), the recovery's report goes out."""
        if self._first_step is not None:
            (timer, report), self._first_step = self._first_step, None
            timer.stop()  # the first step
            report.update(phases_s=timer.durations, t_done=time.time())  # wall clock
            self.member.report_recovery(self.plan.gen, self.h.rank, report)
            self.recoveries.append(report)

    # ================================================================ recovery
    def recover(self, exc: BaseException) -> None:
        """The recovery boundary. Returns with every rank restored to the same committed
        iteration on a rebuilt world; re-raises ``exc`` if no membership change backs it."""
        if self.state != WorkerState.ACTIVE:
            raise exc
        try:
            if not self._membership_changed(exc):
                raise exc
            first = str(exc).splitlines()[0][:160] if str(exc) else ""
            log.info("failure seen at iteration %s: %s: %s", self.att.iteration,
                     type(exc).__name__, first)
            self._recover_until_done(exc, self.att.iteration)
        except (JobStopped, NoCommittedStateError):
            self._save_fallback()
            raise

    def _save_fallback(self) -> None:
        """With ``--deadpool-fallback-save``: write the copies this process holds, then stop."""
        if not self.config.fallback_save_dir:
            return
        self.world.abort("the job stops: fallback save", self.h.rank)
        saved = self.att.fallback.save(self.att.mirror, self.config.heartbeat_timeout_s)
        self.sink.emit("fallback_save", rank=self.h.rank, dir=self.config.fallback_save_dir,
                       copies=[{"rank": r, "iteration": it, "bytes": b} for r, it, b in saved])

    def _membership_changed(self, exc: BaseException) -> bool:
        """Aborted: a newer generation exists. A communication error: wait for the decider
        to declare a member dead, as long as it may need to see a lost node (heartbeat
        timeout plus two polls and a second). Anything else is local: False at once."""
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            return False
        if self.world.aborted:
            return True
        if not is_comm_failure(exc):
            return False
        cfg = self.config
        deadline = time.monotonic() + cfg.heartbeat_timeout_s + 2 * cfg.heartbeat_interval_s + 1
        while time.monotonic() < deadline:
            self.member.raise_if_stopped()
            if self.member.membership_moved(self.plan.gen):
                return True
            time.sleep(NEW_GEN_POLL_S)
        return False

    def _failed_again(self, exc: BaseException) -> bool:
        if isinstance(exc, DeadpoolError) and not isinstance(exc, MirrorError):
            return False  # a stop, a stale generation, no committed state: terminal
        return self.world.aborted or is_comm_failure(exc) or isinstance(exc, GenerationMoved)

    def _recover_until_done(self, exc: BaseException, iteration_at_failure: Optional[int]
                            ) -> None:
        for attempt in range(1, MAX_ATTEMPTS + 1):
            a = Attempt(cause=exc, iteration_at_failure=iteration_at_failure,
                        timer=PhaseTimer(self.sink, self.plan.gen + 1, self.h.rank))
            try:
                self.state = WorkerState.RECOVERING
                for step in (self._abort, self._rendezvous, self._rebuild_groups,
                             self._restore_state):
                    a = step(a)
                self._begin_first_step(a)
                self.state = WorkerState.ACTIVE
                return
            except Exception as again:  # noqa: BLE001 - classified right below
                if not self._failed_again(again):
                    raise
                self.member.raise_if_stopped()
                log.info("failure during recovery attempt %s (%s: %.200s); starting over on "
                         "the next generation", attempt, type(again).__name__, again)
                exc = again
        raise DeadpoolError(f"recovery did not succeed in {MAX_ATTEMPTS} attempts; last "
                            f"failure: {type(exc).__name__}: {exc}")

    def _abort(self, a: Attempt) -> Attempt:
        a.timer.start(Phase.ABORT)
        self.world.abort(f"{type(a.cause).__name__} in the training step", self.h.rank)
        self.att.quiesce(self.config.rendezvous_timeout_s)
        drop_traceback(a.cause)
        if self.config.audit == "full":
            a.old_groups = weak_groups(all_process_groups())
        self.world.destroy()
        self.att.release_groups()  # the old groups die on the reaper thread (reaper.py)
        return a

    def _rendezvous(self, a: Attempt) -> Attempt:
        a.timer.start(Phase.RENDEZVOUS)
        a.plan = self._wait_for_plan(a.cause)
        if a.iteration_at_failure is not None:  # the victim must know its rank in the plan
            self.plan = adopt(a.plan, self.env.lid, self.h)
        self._fault_point(a, FaultPhase.RENDEZVOUS)
        self._form_world(a.plan, with_groups=False)
        a.plan = self.plan
        return a

    def _rebuild_groups(self, a: Attempt) -> Attempt:
        a.timer.start(Phase.REBUILD_GROUPS)
        self._fault_point(a, FaultPhase.REBUILD_GROUPS)
        self.world.build_groups()
        self.world.set_collective_timeouts()  # before the mirror's group: it has its own
        self.att.rebind(self.h, self.plan)
        audit = audit_rebind(self.config.audit, self.att.slots, a.old_groups,
                             self.att.settle_groups)
        if audit:
            self.sink.emit("audit", generation=self.plan.gen, rank=self.h.rank, **audit)
        return a

    def _restore_state(self, a: Attempt) -> Attempt:
        a.timer.start(Phase.RESTORE_STATE)
        self._fault_point(a, FaultPhase.RESTORE_STATE)
        self.member.wait_until_ready(self.plan.gen, self.plan.world_size,  # a spare builds
                                     self.config.spare_ready_timeout_s)
        a.restored = self.att.restore(self.h.rank)
        a.timer.stop()
        return a

    def _fault_point(self, a: Attempt, phase: str) -> None:
        if a.iteration_at_failure is not None:  # test hook: a survivor dies in ``phase``
            self.faults(a.iteration_at_failure + 1, phase)

    def _begin_first_step(self, a: Attempt) -> None:
        report = {"generation": self.plan.gen, "rank": self.h.rank, "lid": self.env.lid,
                  "spare": self.promoted and a.iteration_at_failure is None,
                  "restored_iter": a.restored, "iteration_at_failure": a.iteration_at_failure,
                  "failed_ranks": list(self.plan.failed_ranks)}
        log.info("generation %s: restored iteration %s", self.plan.gen, a.restored)
        self.sink.emit("restored", generation=self.plan.gen, rank=self.h.rank, iteration=a.restored)
        a.timer.start(Phase.FIRST_STEP)
        self._first_step = (a.timer, report)

    # ================================================================ end
    def finish(self) -> dict:
        self._report_recovery()
        info = self.att.finish_info()
        self.state = WorkerState.DONE
        self.member.push_event(EventKind.DONE, rank=self.h.rank)
        self.close(destroy=False)
        return {"recoveries": self.recoveries, "generation": self.plan.gen, **info}

    def report_fatal(self, exc: BaseException) -> None:
        """This process stops on an error that recovery cannot or must not handle: tell the
        decider, which stops the job with this reason instead of spending a spare."""
        if self.state == WorkerState.DONE or self._closed or isinstance(exc, JobStopped):
            return
        attached = self.state != WorkerState.STANDBY or is_peer_failure(exc, self.world.aborted)
        self.member.report_fatal(self.h.rank, exc, attached)

    def close(self, destroy: bool = True) -> None:
        """Stop the threads and free every communicator (``destroy``: an error exit; abort a
        snapshot job blocked on a dead peer first): live ones end in std::terminate at exit."""
        if self._closed:
            return
        self._closed = True
        self.member.close()
        self.att.close(abort=destroy and (lambda: self.world.abort("exit", self.h.rank)))
        self.world.destroy() if destroy else self.world.forget()
