"""The recovery sequencer (control/runtime.py, its steps in control/steps.py) in-process,
with fakes for membership, the communicators, the attachment and the generation's link: no subprocess, no torch.distributed. The decisions
are checked here in milliseconds: a local error fails fast, a communication error without a
new generation is re-raised after the heartbeat timeout, a cascade moves to the next
generation, and a lost buddy is terminal."""

import time
from types import SimpleNamespace

import pytest

from megatron_deadpool.base.config import DeadpoolConfig
from megatron_deadpool.base.errors import JobStopped, NoCommittedStateError, stopped
from megatron_deadpool.base.plan import Plan
from megatron_deadpool.base.state import Role, WorkerState
from megatron_deadpool.base.vocabulary import Phase
from megatron_deadpool.control.runtime import Runtime
from megatron_deadpool.control.steps import SPARE
from megatron_deadpool.recovery.phases import EventSink
from megatron_deadpool.base.worker_env import WorkerEnv

HB_TIMEOUT = 1.0


def plan(gen, lid=0, rank=0):
    return Plan(gen=gen, world_size=2, rank_of={lid: rank, 1: 1}, node_of_rank=(0, 1))


class FakeMember:
    def __init__(self):
        self.gen = 0
        self.plans = {0: plan(0)}
        self.stop_reason = None
        self.store = object()
        self.arrivals = []
        self.events = []
        self.fail_arrive_at = set()  # generations whose rendezvous sees a dead peer
        self.failing = set()  # generations with a member declared dead (plan not out yet)
        self.readies = []  # generations whose restore this member waited for
        self.fail_ready_at = set()  # generations whose spare dies while it builds its model

    def admit(self, status, on_generation, on_stop):
        pass

    def initial_plan(self):
        return self.plans[0]

    def current_gen(self):
        return self.gen

    def membership_moved(self, gen):
        return self.gen > gen or gen in self.failing

    def wait_moved(self, gen, timeout_s):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.raise_if_stopped()
            if self.membership_moved(gen):
                return True
            time.sleep(0.01)
        return False

    def publish(self, p):
        self.plans[p.gen] = p
        self.gen = p.gen

    def raise_if_stopped(self):
        if self.stop_reason:
            raise stopped(self.stop_reason)

    def wait_for_plan(self, min_gen, timeout_s, exc=None):
        self.raise_if_stopped()
        if self.gen >= min_gen:
            return self.plans[self.gen]
        raise exc or RuntimeError("no plan")

    def arrive(self, gen, world_size):
        self.arrivals.append(gen)
        if gen in self.fail_arrive_at:
            self.publish(plan(gen + 1))  # the decider replaced the dead peer meanwhile
            raise ConnectionError(f"peer died while generation {gen} formed")


    def push_event(self, kind, **fields):
        self.events.append((kind, fields))

    def report_recovery(self, gen, rank, report):
        pass

    def claim_fault(self, index):
        return True

    def step_done(self):
        pass

    def close(self):
        self.closed = True


class FakeWorld:
    def __init__(self, member):
        self.member = member
        self.aborted = False
        self.aborts = []
        self.formed = []
        self.mp_kwargs = None

    def meet(self, plan_, rank, store, moved):
        self.member.arrive(plan_.gen, plan_.world_size)  # the fake member's rendezvous

    def init_process_group(self, store, gen, rank, world_size, plan=None):
        self.formed.append(gen)
        self.aborted = False

    def take_dropped(self):
        return []

    def kept(self):
        return set()

    def retire(self):
        pass

    def build_groups(self, mp_kwargs=None):
        if mp_kwargs is not None:
            self.mp_kwargs = mp_kwargs

    def also_on_abort(self, wake):
        self.on_abort = wake

    def set_collective_timeouts(self):
        pass

    def bound_gloo_deadlines(self):
        pass

    def abort(self, reason, rank, newer_than=None):
        self.aborts.append(reason)
        self.aborted = True

    def destroy(self):
        pass

    def forget(self):
        pass


class FakeRestore:
    """recovery/restore.py's ``Restore``: the agreement (it may fail, as the store rounds
    do) chooses the iteration that the load returns."""

    def __init__(self, agree):
        self.agree = agree
        self.iteration = None


def use_fake_restore(monkeypatch) -> None:
    """The restore steps' functions on a ``FakeRestore`` (the real ones: test_restore*.py)."""
    from megatron_deadpool.control import steps

    def agree_on(r):
        r.iteration = r.agree()
        return r.iteration

    monkeypatch.setattr(steps, "restore", SimpleNamespace(
        agree_on=agree_on, transfer=lambda r: None, verify=lambda r: {},
        load=lambda r: r.iteration))


@pytest.fixture(autouse=True)
def fake_restore_steps(monkeypatch):
    use_fake_restore(monkeypatch)


class FakeAttachment:
    def __init__(self, restore=lambda rank: 5):
        self.restores = 0
        self._restore = restore
        self.restored_meta = None

    def status(self):
        return {"committed": -1, "compute_s": None}

    def quiesce(self, timeout_s):
        pass

    def use(self, link):
        pass

    def restoring(self, rank, link):
        self.restores += 1
        return FakeRestore(lambda: self._restore(rank))

    def before_step(self, iteration):
        pass

    def after_step(self, iteration, mirror_on=True):
        pass

    def close(self, abort=None):
        pass


class FakeLinks:
    def __init__(self, member):
        self.current = None
        self.released = 0
        self.member = member

    def barrier(self, plan_, name, timeout_s):
        """The ready barrier: a spare of ``fail_ready_at`` dies while it builds its model;
        the decider publishes the next plan, whose abort ends the wait."""
        m = self.member
        m.readies.append(plan_.gen)
        if plan_.gen in m.fail_ready_at:
            m.failing.add(plan_.gen)  # its heartbeats stopped: the decider declared it dead
            m.publish(plan(plan_.gen + 1))
            raise ConnectionError(f"generation {plan_.gen + 1} published: the barrier's "
                                  "store connections were shut")

    def connect(self, plan):
        self.current = object()
        return self.current

    def abort(self):
        pass

    def retire(self):
        self.current = None

    def release(self):
        self.released += 1
        return []


def runtime(attachment=None):
    cfg = DeadpoolConfig(enabled=True, heartbeat_interval_s=0.1, heartbeat_timeout_s=HB_TIMEOUT,
                         audit="none")
    member = FakeMember()
    world = FakeWorld(member)
    rt = Runtime(cfg, WorkerEnv(lid=0, node=0, store_port=1, rank=0, world_size=2), member,
                 world, attachment or FakeAttachment(), FakeLinks(member), EventSink(None))
    rt.join()
    rt.state = rt.state.enter(WorkerState.ACTIVE).at(6)  # attached, 6 iterations done
    return rt, member, world


def test_local_error_fails_fast_without_recovery():
    rt, member, world = runtime()
    err = ValueError("loss is NaN on this rank")
    t0 = time.monotonic()
    with pytest.raises(ValueError) as info:
        rt.recover(err)
    elapsed = time.monotonic() - t0
    assert info.value is err  # the original error, with its own traceback
    assert elapsed < HB_TIMEOUT / 10  # at once, not after waiting for a new generation
    assert world.aborts == [] and rt.att.restores == 0 and rt.recoveries == []
    assert rt.state.mode == WorkerState.ACTIVE and world.formed == [0]


def test_comm_error_without_new_generation_is_reraised_after_the_heartbeat_timeout():
    rt, member, world = runtime()
    err = ConnectionError("Connection reset by peer")
    t0 = time.monotonic()
    with pytest.raises(ConnectionError):
        rt.recover(err)
    assert time.monotonic() - t0 >= HB_TIMEOUT  # it waited for the decider, then gave up
    assert world.aborts == [] and rt.att.restores == 0


def test_declared_failure_recovers_even_if_the_plan_comes_later():
    """The decider declared a member dead and waits for a replacement that is still
    starting: the survivor does not give up after the heartbeat timeout."""
    rt, member, world = runtime()
    member.failing.add(0)
    wait_for_plan = member.wait_for_plan
    member.wait_for_plan = lambda *a: (member.publish(plan(1)), wait_for_plan(*a))[1]
    rt.recover(ConnectionError("Connection reset by peer"))
    assert rt.state.generation == 1 and rt.att.restores == 1


def test_aborted_generation_recovers_on_the_next_one():
    rt, member, world = runtime()
    member.publish(plan(1))
    world.aborted = True  # the watcher saw generation 1 and aborted the communicators
    rt.recover(RuntimeError("anything the blocked collective raised"))
    assert rt.state.generation == 1 and world.formed == [0, 1] and rt.att.restores == 1
    assert rt.state.mode == WorkerState.ACTIVE and rt.links.released == 1  # after the abort
    rt.step_done(6)
    assert rt.recoveries[0]["restored_iter"] == 5
    assert rt.recoveries[0]["iteration_at_failure"] == 6


def test_cascade_in_rendezvous_moves_to_the_next_generation():
    rt, member, world = runtime()
    member.publish(plan(1))
    member.fail_arrive_at = {1}  # a second peer dies while generation 1 forms
    world.aborted = True
    rt.recover(RuntimeError("first failure"))
    assert member.arrivals == [0, 1, 2] and world.formed == [0, 2] and rt.state.generation == 2
    assert rt.att.restores == 1


def test_cascade_in_restore_starts_a_new_attempt():
    calls = []

    def restore(rank):
        calls.append(rank)
        if len(calls) == 1:
            member.publish(plan(2))
            raise ConnectionError("Connection closed by peer")  # a holder died mid-restore
        return 5

    rt, member, world = runtime(FakeAttachment(restore))
    member.publish(plan(1))
    world.aborted = True
    rt.recover(RuntimeError("first failure"))
    assert len(calls) == 2 and rt.state.generation == 2 and world.formed == [0, 1, 2]


def test_restore_waits_for_every_member_and_a_spare_dying_meanwhile_moves_on():
    """The restore exchange starts only once every member of the generation is ready (a
    promoted spare builds its model first); a spare that dies while building: the next
    plan's abort ends the wait, and the recovery goes on with the next generation."""
    rt, member, world = runtime()
    member.publish(plan(1))
    member.fail_ready_at = {1}
    world.aborted = True
    rt.recover(RuntimeError("first failure"))
    assert member.readies == [1, 2] and rt.att.restores == 1  # never restored in gen 1
    assert rt.state.generation == 2 and world.formed == [0, 1, 2]
    assert rt.state.mode == WorkerState.ACTIVE


def test_primary_and_buddy_lost_is_terminal():
    def restore(rank):
        raise NoCommittedStateError("the state of rank(s) [1] is held by no living process; "
                                    "last committed iteration 5")

    rt, member, world = runtime(FakeAttachment(restore))
    member.publish(plan(1))
    world.aborted = True
    with pytest.raises(NoCommittedStateError, match="last committed iteration 5"):
        rt.recover(RuntimeError("node lost"))
    assert world.formed == [0, 1]  # one attempt: never retried


def test_job_stopped_during_recovery_is_terminal():
    rt, member, world = runtime()
    member.stop_reason = "no spare left: 2 rank(s) failed; last committed iteration 4"
    world.aborted = True
    with pytest.raises(JobStopped) as info:
        rt.recover(RuntimeError("peer gone"))
    assert info.value.reason.value == "no spare left"


def test_a_failed_join_closes_the_runtime(monkeypatch):
    """A promoted spare whose world does not form: ``Deadpool.start`` raises with the
    watcher stopped (a daemon thread left in a store call ends the exit in SIGABRT)."""
    from megatron_deadpool import api

    member = FakeMember()
    member.gen = 1
    member.plans[1] = plan(1, lid=8, rank=0)

    def arrive(gen, world_size):
        raise TimeoutError(f"generation {gen}: only 1 of 2 members arrived")

    member.arrive = arrive
    cfg = DeadpoolConfig(enabled=True, heartbeat_interval_s=0.1, heartbeat_timeout_s=HB_TIMEOUT)
    env = WorkerEnv(lid=8, node=4, role="spare", store_port=1)
    monkeypatch.setattr(api.Deadpool, "_make_runtime", lambda self, env: Runtime(
        cfg, env, member, FakeWorld(member), FakeAttachment(), FakeLinks(member), EventSink(None)))
    with pytest.raises(TimeoutError):
        api.Deadpool.start(cfg, env=env)
    assert getattr(member, "closed", False)


def spare_walk(events, build_s: float):
    """A promoted spare's startup, its model build taking ``build_s`` between
    ``initialize_model_parallel`` and ``attach``: (the calls seen, the attachment, its phase
    events as (phase, duration), its recovery report). The phases run on a virtual clock
    that only the model build moves (issue 58: durations exact, nothing timed), so every
    phase but the one the build falls in lasts 0 s exactly."""
    import json
    import types

    from megatron_deadpool.recovery import phases as phases_mod

    clock = {"t": 0.0}
    real = phases_mod.time
    phases_mod.time = types.SimpleNamespace(perf_counter=lambda: clock["t"], time=real.time)
    try:
        return _spare_walk(events, build_s, clock)
    finally:
        phases_mod.time = real


def _spare_walk(events, build_s, clock):
    import json

    calls = []

    class SpareAttachment(FakeAttachment):
        def attach(self, *args, **kwargs):
            calls.append("attach")

    class SpareLinks(FakeLinks):
        def connect(self, plan):
            calls.append("connect")
            return super().connect(plan)

    member = FakeMember()
    member.publish(plan(1, lid=8, rank=0))
    cfg = DeadpoolConfig(enabled=True, heartbeat_interval_s=0.1, heartbeat_timeout_s=HB_TIMEOUT,
                         audit="none", events_path=str(events))
    att = SpareAttachment()
    rt = Runtime(cfg, WorkerEnv(lid=8, node=4, role="spare", store_port=1), member,
                 FakeWorld(member), att, SpareLinks(member), EventSink(str(events)))
    rt.quiet.start = lambda: calls.append("quiet")  # its solitary model build
    rt.join()
    assert rt.state.role is Role.PROMOTED and rt.state.rank == 0
    rt.initialize_model_parallel({})
    clock["t"] += build_s  # the model build, on the phases' clock
    rt.attach(model=None, optimizer=None, scheduler=None, train_state=None)
    rt.before_step(5)
    assert rt.state.role is Role.ACTIVE  # its solitary startup is over
    rt.step_done(6)
    phases = [json.loads(line) for line in events.read_text().splitlines()]
    phases = [(e["phase"], e["duration_s"]) for e in phases if e["event"] == "phase"]
    return calls, att, phases, rt.recoveries[0]


def test_a_promoted_spares_phases_tile_its_recovery(tmp_path):
    """A spare has no abort: rendezvous until its world forms, rebuild_groups until its
    groups (megatron's and the mirror's) exist, restore_state over its model build and the
    restore, then its first step, each closed by the next (recovery/phases.py)."""
    calls, att, phases, report = spare_walk(tmp_path / "events.jsonl", build_s=0.05)
    assert calls == ["connect", "quiet", "attach"] and att.restores == 1
    assert report["spare"] and report["generation"] == 1
    # today's phases, from the one source: the spare's steps (control/steps.py SPARE), in
    # order, then the runtime's first step; the model build is timed in restore_state
    walk = [*dict.fromkeys(step.phase.value for step in SPARE), Phase.FIRST_STEP.value]
    assert "abort" not in walk and [p for p, _ in phases] == walk
    assert dict(phases) == {p: pytest.approx(0.05) if p == "restore_state" else 0.0
                            for p in walk}
    assert report["phases_s"] == pytest.approx(dict(phases), abs=1e-5)
