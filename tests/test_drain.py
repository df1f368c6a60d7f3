"""Planned swaps, in-process: the drain's plan (pure), the decider's queue and answers
against an in-memory store, and the boundary every rank agrees on. The end-to-end runs
are in test_planned_swaps.py."""

import threading

import pytest

from megatron_deadpool.base import faults
from megatron_deadpool.base.errors import ConfigError
from megatron_deadpool.base.plan import Drain, Plan
from megatron_deadpool.base.state import RankState, Role, WorkerState
from megatron_deadpool.membership import plan as plans
from megatron_deadpool.membership import store as st
from megatron_deadpool.membership.drain import DrainQueue, DrainRequest, drain_plan
from megatron_deadpool.recovery.boundary import Action, Boundary

from test_decider import _c, _decider, _join

NODE_OF_LID = {lid: lid // 2 for lid in range(8)} | {8: 4, 9: 4, 10: 5, 11: 5}


def _gen0():
    return plans.initial_plan({lid: lid for lid in range(8)}, NODE_OF_LID, 8, t=0.0)


def test_a_drain_moves_the_nodes_ranks_to_spares_on_another_node():
    pool = [(8, 4), (9, 4), (10, 5), (11, 5)]
    plan, why = drain_plan(_gen0(), DrainRequest(node=2, t=5.0), pool, NODE_OF_LID, t=6.0)
    assert why == "" and plan.gen == 1 and plan.failed_ranks == (4, 5)
    assert plan.spare_of_rank == {4: 8, 5: 9} and plan.rank(4) is None
    assert plan.drain == Drain(node=2, reason="request", to_standby=False, text="",
                               leaving=(4, 5))
    assert plan.detect_s == 1.0  # the request until the plan
    assert Plan.from_json(plan.to_json()) == plan  # the drain travels with the plan
    assert plan.to_json()["drain"] == {"node": 2, "reason": "request", "to_standby": False,
                                       "text": "", "leaving": [4, 5]}  # the signed format


@pytest.mark.parametrize("node,pool,why", [
    (7, [(8, 4), (9, 4)], "node 7 is not part of this job"),
    (4, [(10, 5), (11, 5)], "node 4 holds no rank"),
    (2, [(8, 4)], "no spare left for its 2 rank(s)"),
    (2, [(4, 2), (5, 2)], "no spare left"),  # the node's own processes are no spares
])
def test_a_drain_that_cannot_be_done_is_refused_with_the_reason(node, pool, why):
    plan, got = drain_plan(_gen0(), DrainRequest(node=node), pool, NODE_OF_LID, t=0.0)
    assert plan is None and why in got


def test_the_queue_answers_a_second_request_for_the_same_node_at_once():
    answers = []
    q = DrainQueue(answer=lambda nonce, body: answers.append((nonce, body)))
    q.add(DrainRequest(node=2, nonce="a"))
    q.add(DrainRequest(node=2, nonce="b"))
    assert len(q.waiting) == 1 and answers == [("b", {"ok": False, "t_request": 0.0,
                                                       "why": "node 2 is being drained already"})]


def test_the_decider_publishes_a_drain_answers_and_takes_the_leaving_exit_as_done():
    d, store, cmds = _decider(spares=2)
    for lid in range(10):
        _join(store, lid)
    d.step()
    _c(store).push_event("drain_request", node=1, reason="request", nonce="n1",
                         to_standby=True)
    _c(store).push_event("drain_request", node=3, reason="request", nonce="n2")  # waits
    d.step()
    plan = _c(store).get_plan(1)
    assert plan.drain.node == 1 and plan.spare_of_rank == {2: 8, 3: 9}
    from megatron_deadpool.membership import auth

    body = auth.open_("secret", store.get(st.k("drain", "n1")), nonce="n1")
    assert body["ok"] and body["generation"] == 1
    assert not store.check([st.k("drain", "n2")])  # one drain at a time
    # the job ends before the boundary: the previous plan's members complete it
    assert {p.lid for p in d.drains.finishing(d.procs, d.plans)} == set(range(8))
    for lid in (2, 3):  # the drained processes leave cleanly at the boundary
        _c(store).push_event("exit", lid=lid, code=0, node=1)
    d.step()
    assert not store.check([st.k("drain", "n2")])  # generation 1 has not restored yet
    for rank in range(8):  # every rank's first step after the swap
        _c(store).put_rank_record("report", 1, rank, {})
    d.step()
    assert d.procs[2].state == "done" and not d.pending_dead  # no failure
    assert [c["replaces"] for _, c in cmds if c["op"] == "spawn"] == [2, 3]  # to standby
    refused = auth.open_("secret", store.get(st.k("drain", "n2")), nonce="n2")
    assert not refused["ok"] and "no spare left" in refused["why"]  # node 3: none left
    assert _c(store).current_gen() == 1 and d.drains.refused[0]["node"] == 3


def test_the_new_plans_ranks_complete_the_job_however_late_the_drained_exits_come():
    """The drained processes say `done` before they exit, and their exits may be seen
    seconds later. Once the drain's generation has stepped, the job is complete only when
    the spares that took their ranks are done too (the CI failure at 2b18601: the job was
    stopped as complete while the spares were still in their last barrier)."""
    d, store, _ = _decider(spares=2)
    for lid in range(10):
        _join(store, lid)
    d.step()
    _c(store).push_event("drain_request", node=1, reason="request")
    d.step()
    assert d.drains.active is not None
    for rank in range(8):  # generation 1 restored and stepped
        _c(store).put_rank_record("report", 1, rank, {})
    d.step()
    assert d.drains.active is None  # applied: a failure from now on is planned from it
    for lid in range(8):  # the drained (2, 3) and the staying processes are done; no exits
        _c(store).push_event("done", lid=lid)
    d.step()
    assert not d.finished  # spares 8 and 9 hold ranks 2 and 3 and are still training
    for lid in (8, 9):
        _c(store).push_event("done", lid=lid)
    d.step()
    assert d.finished and not d.pending_dead
    _c(store).push_event("exit", lid=2, code=0, node=1)  # late: still a clean leave
    d.step()
    assert d.procs[2].state == "done" and not d.pending_dead


class _Member:
    """The store side of the boundary: posts and the current generation."""

    def __init__(self, world=4):
        self.posted, self.world, self.gen = {}, world, 1

    def post_boundary(self, gen, rank, iteration):
        self.posted[rank] = iteration

    def boundaries(self, gen, world_size):
        return list(self.posted.values()) if len(self.posted) == world_size else None

    def current_gen(self):
        return self.gen

    def peek_plan(self, gen):
        return self.plan


def _drain_gen1():
    pool = [(8, 4), (9, 4)]
    plan, _ = drain_plan(_gen0(), DrainRequest(node=1), pool, NODE_OF_LID, t=0.0)
    return plan


def test_every_rank_stops_at_the_highest_boundary_posted():
    """Each rank's watcher posts one more than the iterations its rank completed when it saw
    the drain: rank 0 was inside step 8 (posts 8), the others inside step 7 (post 7). D = 8:
    the others train on through step 8, and all stop there; ranks 2 and 3 (the drained
    node) leave, the rest swap."""
    m = _Member(world=4)
    m.plan = _drain_gen1()
    live = _gen0()
    bounds = [Boundary(m, lid) for lid in range(4)]
    for r, done in ((0, 7), (1, 6), (2, 6), (3, 6)):
        state = RankState(lid=r, node=r // 2, role=Role.ACTIVE, mode=WorkerState.ACTIVE,
                          plan=live, iteration=done)
        assert bounds[r].planned(1, state)  # a drain: the watcher does not abort
    assert m.posted == {0: 8, 1: 7, 2: 7, 3: 7}
    assert [bounds[r].check(r, 4, 7) for r in (1, 2, 3)] == [None, None, None]
    assert [bounds[r].check(r, 4, 8) for r in range(4)] == [Action.SWAP, Action.SWAP,
                                                             Action.LEAVE, Action.LEAVE]


def test_the_boundary_waits_for_every_rank_to_post():
    m = _Member(world=2)
    m.plan = _drain_gen1()
    a, b = Boundary(m, 0), Boundary(m, 1)
    a.notice(m.plan, rank=0, completed=4)
    got = []
    t = threading.Thread(target=lambda: got.append(a.check(0, 2, 5)))
    t.start()
    t.join(0.2)
    assert t.is_alive() and not got  # rank 1 has not posted yet
    b.notice(m.plan, rank=1, completed=4)
    t.join(5)
    assert got == [Action.SWAP]


def test_a_failure_during_the_wait_hands_over_to_the_recovery():
    m = _Member(world=2)
    m.plan = _drain_gen1()
    b = Boundary(m, 0)
    b.notice(m.plan, rank=0, completed=3)
    m.gen = 2  # a node died: an unplanned generation 2 replaces the drain's
    assert b.check(0, 2, 4) is None  # rank 1 never posts; the failure's abort takes over


def test_a_failures_plan_is_not_a_drain_for_the_watcher():
    m = _Member()
    m.plan = plans.next_plan(_gen0(), [2, 3], [(8, 4), (9, 4)], NODE_OF_LID, t=0.0)
    live = _gen0()
    state = RankState(lid=0, node=0, role=Role.ACTIVE, mode=WorkerState.ACTIVE, plan=live)
    assert not Boundary(m, 0).planned(1, state)  # the watcher aborts as before


def test_drain_and_slow_fault_specs():
    f = faults.parse_fault("drain:node=2@iter=8")
    assert (f.kind, f.node, f.iteration, f.params) == ("drain", 2, 8, ())
    s = faults.parse_fault("slow:node=2@iter=4,factor=3")
    assert s.param("factor") == 3.0 and faults.parse_fault(s.describe()) == s
    for bad in ("slow:node=2@iter=4", "slow:node=2@iter=4,factor=0.5",
                "kill:node=1@iter=3,factor=2", "drain:node=1@t=5"):
        with pytest.raises(ConfigError):
            faults.parse_fault(bad)


def test_a_slow_fault_burns_at_every_later_iteration_start_and_only_there():
    """A kind that is not a signal is one table entry and one action: ``slow``'s action
    returns a lasting effect, which the fault points run at each later FORWARD_BACKWARD."""
    from megatron_deadpool.base.vocabulary import Phase
    from megatron_deadpool.recovery.fault_points import straggle

    burns = []
    sched = [faults.parse_fault("slow:rank=0@iter=3,factor=3")]
    fp = faults.FaultPoints(sched, rank=lambda: 0, node=0, claim=lambda i: True,
                            report=lambda *a: None,
                            actions={"slow": lambda f, it: lambda: burns.append(it)})
    for it in range(1, 6):
        fp(it, Phase.FORWARD_BACKWARD)
        fp(it, Phase.OPTIMIZER)
    assert burns == [3, 3]  # fired at 3: iterations 4 and 5 burn, once each
    t = iter([0.0, 0.0, 0.5, 1.0, 2.0, 9.0])
    burn = straggle(3.0, 1.0, clock=lambda: next(t))  # (3 - 1) x 1.0 s per step
    burn()
    assert next(t) == 9.0  # read the clock until 2.0 s had passed, not after
    straggle(3.0, None)()  # no compute measured yet: burns nothing


def test_a_slow_fault_burns_cpu_seconds_even_when_the_cpu_is_shared():
    """The straggler check counts a rank's CPU seconds, so the slow fault burns CPU
    seconds: with another thread taking half the time (the GIL, like a loaded machine), a
    burn of 0.2 s still costs the burning thread 0.2 s of CPU (a wall-clock burn: ~0.1)."""
    import threading

    from megatron_deadpool.mirror.meter import cpu_clock
    from megatron_deadpool.recovery.fault_points import straggle

    stop = threading.Event()

    def hog():
        while not stop.is_set():
            pass
    t = threading.Thread(target=hog)
    t.start()
    try:
        c0 = cpu_clock()
        straggle(2.0, 0.2)()
        burned = cpu_clock() - c0
    finally:
        stop.set()
        t.join()
    assert burned >= 0.2


def _procs(compute, iteration):
    from megatron_deadpool.membership.procs import Proc

    out = {}
    for lid, c in enumerate(compute):
        p = Proc(lid=lid, node=lid // 2, role=Role.ACTIVE, rank=lid, state="alive")
        p.hb_compute_s, p.hb_iteration = c, iteration
        out[lid] = p
    return out


def test_a_node_slower_than_factor_times_the_median_for_window_iterations_straggles():
    from megatron_deadpool.membership.straggler import StragglerWatch

    w = StragglerWatch((2.0, 3))
    normal = [0.10, 0.11, 0.10, 0.12, 0.10, 0.10, 0.11, 0.10]
    slow = normal[:4] + [0.35, 0.31] + normal[6:]  # node 2 (ranks 4, 5)
    assert w.observe(_procs(slow, 5)) == []
    assert w.observe(_procs(slow, 5)) == []  # the same iteration is not counted twice
    assert w.observe(_procs(normal, 6)) == []  # back to normal: the count restarts
    assert [w.observe(_procs(slow, it)) for it in (7, 8, 9, 10)] == [[], [], [2], []]
    assert w.flagged == [{"node": 2, "compute_s": 0.35, "median_s": 0.115, "iteration": 9}]
    assert StragglerWatch(None).observe(_procs(slow, 11)) == []  # the flag is off


def test_a_slurm_drain_state_asks_once_for_a_drain_of_the_node():
    from megatron_deadpool.launch.slurm_drain import SlurmDrainWatch, node_state

    out = ("NodeName=node2 Arch=x86_64 CoresTotal=2 State=MIXED+DRAIN ThreadsPerCore=1 "
           "Reason=disk failing [root@2026-11-26T04:00:00]")
    run = lambda cmd, **kw: type("P", (), {"stdout": out})()  # noqa: E731
    assert node_state("node2", run) == ("MIXED+DRAIN", "disk failing [root@2026-11-26T04:00:00]")
    states = iter([("ALLOCATED", ""), ("MIXED+DRAIN", "disk failing"), ("MIXED+DRAIN", "")])
    events, said = [], []
    coord = type("C", (), {"push_event": lambda self, kind, **f: events.append((kind, f))})()
    w = SlurmDrainWatch(2, "node2", coord, said.append, poll_s=0.01,
                        state=lambda name: next(states))
    w.start()
    w._thread.join(5)
    assert events == [("drain_request", {"node": 2, "reason": "slurm", "text": "disk failing"})]
    assert "Slurm drains node2 (node 2)" in said[0]
