"""The decider against an in-memory store: admission by token, plans on failure, fencing,
lost nodes, and the no-spare stop. No processes are started."""

import torch.distributed as dist

from megatron_deadpool.membership import store as st
from megatron_deadpool.base.config import DeciderConfig
from megatron_deadpool.membership.decider import Decider, Proc


class Clock:
    """The decider's injected clock: tests advance it instead of sleeping."""

    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t

    def advance(self, dt):
        self.t += dt


def _decider(spares=2, hb_timeout=0.5):
    return _decider_on(dist.HashStore(), spares, hb_timeout)


def _decider_on(store, spares=2, hb_timeout=0.5):
    procs = {r: Proc(lid=r, node=r // 2, role="active", rank=r) for r in range(8)}
    for i in range(spares):
        procs[8 + i] = Proc(lid=8 + i, node=4 + i // 2, role="spare")
    cmds = []
    clock = Clock()
    d = Decider(store=store, procs=procs, world_size=8, token="secret",
                send_command=lambda node, cmd: cmds.append((node, cmd)),
                config=DeciderConfig(heartbeat_timeout_s=hb_timeout, heartbeat_interval_s=0.1,
                                     grace_s=0.0), log=lambda m: None, clock=clock)
    d.clock_ = clock
    d.publish_initial_plan()
    return d, store, cmds


def _c(store, token="secret"):
    return st.Coordinator(store, token)


def _join(store, lid, token="secret"):
    _c(store, token).push_event("join", lid=lid, nonce=f"n{lid}")


def _beat(store, lid, seq, iteration=1, gen=0, state="ACTIVE"):
    _c(store).beat(lid, seq=seq, iteration=iteration, state=state,
                   committed=iteration - 1, gen=gen)


def test_wrong_token_is_refused():
    d, store, _ = _decider()
    _join(store, 0)
    _join(store, 1, token="guess")
    d.step()
    assert _c(store).get_plan(0).gen == 0
    from megatron_deadpool.membership import auth

    ok = auth.open_("secret", store.get(st.k("admit", 0, "n0")), lid=0, nonce="n0")
    assert ok["ok"] is True
    refused = auth.open_("secret", store.get(st.k("admit", 1, "n1")), lid=1, nonce="n1")
    assert refused["ok"] is False and "secret" in refused["why"]
    assert d.procs[1].state != "alive"


def test_exit_produces_next_generation_plan():
    d, store, _ = _decider()
    for lid in range(10):
        _join(store, lid)
    d.step()
    _c(store).push_event("exit", lid=2, code=-9, node=1)
    _c(store).push_event("exit", lid=3, code=-9, node=1)
    d.step()
    d.step()
    assert _c(store).current_gen() == 1
    plan = _c(store).get_plan(1)
    assert plan.failed_ranks == (2, 3) and plan.spare_of_rank == {2: 8, 3: 9}
    assert plan.rank_of[8] == 2 and 2 not in plan.rank_of
    assert plan.node_of_rank[2] == 4 and plan.prev_node_of_rank[2] == 1


def test_a_plan_carries_its_nodes_record_stores_and_a_delta_only_a_new_nodes():
    """Issue 57: the record store addresses are signed with the plan, each read once from
    the job's store, so a recovery's members read none there; the delta of a recovery
    carries the spare node's address alone."""
    from megatron_deadpool.base.plan import delta

    store = dist.HashStore()
    for node in range(6):  # each node's agent publishes its own before its workers start
        _c(store).publish_node_store(node, "10.0.0.%d" % node, 7000 + node)
    d, _, _ = _decider_on(store)
    g0 = _c(store).get_plan(0)
    assert g0.node_stores == {str(n): ("10.0.0.%d" % n, 7000 + n) for n in range(4)}
    for lid in range(10):
        _join(store, lid)
    d.step()
    read, orig = [], d.coord.node_store
    d.coord.node_store = lambda node: read.append(node) or orig(node)  # recorded from now
    _c(store).push_event("exit", lid=2, code=-9, node=1)
    _c(store).push_event("exit", lid=3, code=-9, node=1)
    d.step()
    d.step()
    g1 = _c(store).get_plan(1)
    assert read == [4]  # the spares' node, new in this plan; the others' were kept
    assert g1.node_store(4) == ("10.0.0.4", 7004) and g1.node_store(0) == ("10.0.0.0", 7000)
    # the delta: the new node in, the lost one out
    assert delta(g0, g1)["node_stores"] == {"set": {"4": ["10.0.0.4", 7004]}, "gone": ["1"]}


def test_stale_heartbeat_is_fenced_then_replaced():
    d, store, cmds = _decider(hb_timeout=1.0)
    for lid in range(10):
        _join(store, lid)
        _beat(store, lid, 1)
    d.step()
    for seq in range(2, 60):  # everyone but lid 5 keeps beating
        for lid in range(10):
            if lid != 5:
                _beat(store, lid, seq)
        d.clock_.advance(0.05)
        d.step()
        if _c(store).current_gen() == 1:
            break
    assert any(c == {"op": "signal", "signal": "SIGKILL", "lids": [5]} for _, c in cmds)
    plan = _c(store).get_plan(1)
    assert plan.failed_ranks == (5,)


def test_no_spare_left_stops_with_committed_iteration():
    d, store, _ = _decider(spares=0)
    for lid in range(8):
        _join(store, lid)
        _beat(store, lid, 1, iteration=7)
    d.step()
    d.clock_.advance(0.06)
    d.step()
    _c(store).push_event("exit", lid=6, code=-9, node=3)
    d.step()
    d.step()
    reason = _c(store).shutdown_reason()
    assert "no spare left" in reason and "last committed iteration 6" in reason
    assert d.finished and _c(store).current_gen() == 0


def test_no_spare_left_names_the_committed_iteration_when_no_rank_is_alive():
    """Every ranked process dead (survivors fenced after the nodes died): the message still
    names the newest iteration they reported committed, not -1."""
    d, store, _ = _decider(spares=0)
    for lid in range(8):
        _join(store, lid)
        _beat(store, lid, 1, iteration=7)
    d.step()
    d.clock_.advance(0.06)
    d.step()
    for lid in range(8):
        _c(store).push_event("exit", lid=lid, code=-9, node=lid // 2)
    d.step()
    d.step()
    reason = _c(store).shutdown_reason()
    assert "no spare left" in reason and reason.endswith("last committed iteration 6"), reason


def test_failure_waits_for_a_starting_spare_then_plans():
    d, store, _ = _decider(spares=2)
    for lid in range(8):  # the spares (8, 9) have not joined yet: still starting
        _join(store, lid)
    d.step()
    _c(store).push_event("exit", lid=2, code=-9, node=1)
    d.step()
    d.step()
    assert _c(store).current_gen() == 0 and not d.finished  # waiting, not stopped
    _join(store, 8)
    d.step()
    d.step()
    assert _c(store).current_gen() == 1 and _c(store).get_plan(1).spare_of_rank == {2: 8}


def _decider_with_grace(grace_s):
    d, store, cmds = _decider()
    d.config = DeciderConfig(heartbeat_timeout_s=60.0, heartbeat_interval_s=0.1, grace_s=grace_s)
    for lid in range(10):
        _join(store, lid)
    d.step()
    return d, store


def test_whole_node_dead_ends_the_grace_window_at_once():
    d, store = _decider_with_grace(5.0)
    _c(store).push_event("exit", lid=2, code=-9, node=1)
    d.step()
    assert d.gen == 0  # node 1 still has a live process: the window collects it
    _c(store).push_event("exit", lid=3, code=-9, node=1)
    d.step()  # no clock advance: the node is accounted for
    assert d.gen == 1
    assert sorted(d.plans[-1].failed_ranks) == [2, 3]


def test_one_crash_on_a_live_node_waits_out_the_grace_window():
    d, store = _decider_with_grace(5.0)
    _c(store).push_event("exit", lid=2, code=-9, node=1)
    d.step()
    d.clock_.advance(4.9)
    d.step()
    assert d.gen == 0
    d.clock_.advance(0.2)
    d.step()
    assert d.gen == 1 and list(d.plans[-1].failed_ranks) == [2]


def test_a_fenced_process_needs_no_grace_window():
    """A stale heartbeat is found by a scan of every process at once: the plan follows the
    fence without waiting out the window (a hang's detection is the timeout, not more)."""
    d, store, cmds = _decider(hb_timeout=1.0)
    d.config = DeciderConfig(heartbeat_timeout_s=1.0, heartbeat_interval_s=0.1, grace_s=5.0)
    for lid in range(10):
        _join(store, lid)
        _beat(store, lid, 1)
    d.step()
    for seq in range(2, 40):  # everyone but lid 5 keeps beating; 1.9 s < the window
        for lid in range(10):
            if lid != 5:
                _beat(store, lid, seq)
        d.clock_.advance(0.05)
        d.step()
    assert any(c == {"op": "signal", "signal": "SIGKILL", "lids": [5]} for _, c in cmds)
    assert d.gen == 1 and d.plans[-1].failed_ranks == (5,)


def _after_node_2_killed():
    """8 ranks on 4 nodes, 2 spare nodes, take-plan timeout 3 s; node 2 (lids 4, 5) has just
    exited, so generation 1 is published. Returns (decider, store, commands, clock)."""
    store = dist.HashStore()
    procs = {r: Proc(lid=r, node=r // 2, role="active", rank=r) for r in range(8)}
    procs.update({lid: Proc(lid=lid, node=4 + (lid - 8) // 2, role="spare")
                  for lid in range(8, 12)})
    cmds, clock = [], Clock()
    d = Decider(store=store, procs=procs, world_size=8, token="secret",
                send_command=lambda node, cmd: cmds.append((node, cmd)),
                config=DeciderConfig(heartbeat_timeout_s=1.0, heartbeat_interval_s=0.1,
                                     grace_s=0.0, take_plan_timeout_s=3.0),
                log=lambda m: None, clock=clock)
    d.publish_initial_plan()
    for lid in range(12):
        _join(store, lid)
    d.step()
    _c(store).push_event("exit", lid=4, code=-9, node=2)
    _c(store).push_event("exit", lid=5, code=-9, node=2)
    d.step()
    return d, store, cmds, clock


def test_a_member_that_never_takes_the_new_plan_is_fenced():
    """After a kill, every member of generation 1 takes its plan but lid 3, whose heartbeat
    stays fresh (its watcher runs) while its main thread is blocked where the abort did not
    reach: it is fenced after take_plan_timeout_s, and generation 2 replaces it."""
    d, store, cmds, clock = _after_node_2_killed()
    assert _c(store).current_gen() == 1
    fenced_at = None
    for seq in range(1, 80):
        for lid in [0, 1, 2, 3, 6, 7, 8, 9, 10, 11]:
            took = 0 if lid == 3 else 1
            _beat(store, lid, seq, gen=took if lid < 10 else -1, state="RECOVERING")
        clock.advance(0.1)
        d.step()
        if fenced_at is None and any(c.get("lids") == [3] for _, c in cmds):
            fenced_at = seq * 0.1
        if _c(store).current_gen() == 2:
            break
    assert fenced_at is not None and 2.95 < fenced_at < 3.5, fenced_at
    assert [c["lids"] for _, c in cmds] == [[3]]  # nobody else: they all took the plan
    assert _c(store).current_gen() == 2
    assert _c(store).get_plan(2).failed_ranks == (3,)


def test_a_member_still_starting_up_is_not_fenced_for_the_plan():
    """The take-plan fence judges only members that were training: one still in startup
    (STANDBY: imports, model build on a loaded machine) is left to the rendezvous timeout."""
    d, store, cmds, clock = _after_node_2_killed()
    for seq in range(1, 80):
        for lid in [0, 1, 2, 3, 6, 7, 8, 9, 10, 11]:
            state = "STANDBY" if lid == 3 else "RECOVERING"
            _beat(store, lid, seq, gen=0 if lid == 3 else 1, state=state)
        clock.advance(0.1)
        d.step()
    assert cmds == [] and _c(store).current_gen() == 1


def test_a_standby_spare_fault_does_not_time_the_next_failure():
    """An injected fault that kills only idle spares publishes no plan; a node kill much
    later must be timed from its own fault, not from the spare's (the matrix once reported
    `detected in 25.4 s` for a 0.1 s detection)."""
    d, store, _ = _decider(spares=4, hb_timeout=100.0)  # no heartbeat goes stale here
    for lid in range(12):
        _join(store, lid)
    d.step()
    d.note_fault(d.clock_.t)                       # the standby node 4 is killed
    _c(store).push_event("exit", lid=8, code=-9, node=4)
    _c(store).push_event("exit", lid=9, code=-9, node=4)
    d.step()
    assert _c(store).current_gen() == 0
    d.clock_.advance(25.0)
    d.note_fault(d.clock_.t)                       # node 1 is killed 25 s later
    _c(store).push_event("exit", lid=2, code=-9, node=1)
    _c(store).push_event("exit", lid=3, code=-9, node=1)
    d.clock_.advance(0.1)
    d.step()
    d.step()
    plan = _c(store).get_plan(1)
    assert plan.spare_of_rank == {2: 10, 3: 11}
    assert plan.detect_s < 1.0, plan.detect_s


def _startup_error(store, lid, error="ModuleNotFoundError: No module named 'six'"):
    _c(store).push_event("startup_error", lid=lid, rank=None, error=error, traceback="...")


def test_a_startup_error_stops_the_job_naming_it_and_promotes_no_spare():
    """Every process fails on the same import before it attached (membership/startup.py):
    the job stops with the first rank's error; the exits that follow plan nothing."""
    d, store, cmds = _decider()
    _startup_error(store, 8)  # a standby spare: its error alone does not stop the job
    for lid in (3, 0, 9, 1, 2, 4, 5, 6, 7):
        _startup_error(store, lid)
    for lid in range(10):
        _c(store).push_event("exit", lid=lid, code=1, node=lid // 2)
    for _ in range(3):
        d.clock_.advance(1.0)
        d.step()
    line = "ModuleNotFoundError: No module named 'six' (first raised by rank 3)"
    assert d.startup_error == line and d.failed_reason == "startup error: " + line
    assert _c(store).shutdown_reason() == "startup error: " + line
    assert _c(store).current_gen() == 0 and len(d.plans) == 1 and cmds == []


def test_a_standby_spares_startup_error_only_takes_it_out_of_the_pool():
    d, store, _ = _decider()
    for lid in (0, 1, 2, 3, 4, 5, 6, 7, 9):
        _join(store, lid)
    _startup_error(store, 8)
    _c(store).push_event("exit", lid=8, code=1, node=4)
    d.step()
    assert not d.finished and d.startup_error is None and d.procs[8].state == "dead"
    _c(store).push_event("exit", lid=2, code=-9, node=1)  # a node failure later: spare 9
    d.clock_.advance(0.1)
    d.step()
    assert _c(store).get_plan(1).spare_of_rank == {2: 9}


def test_a_process_killed_during_startup_is_still_a_node_failure():
    d, store, _ = _decider()
    for lid in (0, 1, 2, 3, 4, 6, 7, 8, 9):
        _join(store, lid)
    _c(store).push_event("exit", lid=5, code=-9, node=2)  # no startup error reported
    d.clock_.advance(0.1)
    d.step()
    assert not d.finished and _c(store).get_plan(1).failed_ranks == (5,)


def test_one_window_for_every_failure():
    """No injected case: the window closes at once when every process of each node with an
    exit is dead, else after the grace window, whoever delivered the failure."""
    from megatron_deadpool.membership.procs import ProcState, window_over

    procs = {lid: Proc(lid=lid, node=lid // 2, role="active", rank=lid, state="alive")
             for lid in range(4)}
    procs[3].state = ProcState.DEAD
    cfg = DeciderConfig(heartbeat_timeout_s=6.0, heartbeat_interval_s=0.5, grace_s=0.3)
    assert not window_over(procs, {3}, {3}, 0.2, cfg)  # node 1: 2 lives, in grace
    assert window_over(procs, {3}, {3}, 0.31, cfg)  # one crash: the window ends
    procs[2].state = ProcState.DEAD
    assert window_over(procs, {2, 3}, {2, 3}, 0.0, cfg)  # the node is accounted for
    assert window_over(procs, {0}, set(), 0.0, cfg)  # fenced: the scan saw them all


def test_an_injected_node_fault_signals_the_whole_node_in_one_pass():
    """The victim does not signal itself: its agent signals every process of the node, the
    victim included, in one command, as a real node loss takes them all at once."""
    from megatron_deadpool.base.faults import parse_fault
    from megatron_deadpool.launch.fault_driver import FaultDriver

    d, store = _decider_with_grace(0.3)
    sent = []
    drv = FaultDriver([parse_fault("kill:node=1@iter=6")], d, lambda n, c: sent.append((n, c)),
                      log=lambda m: None, claim=lambda i: True)
    drv.on_request({"index": 0, "t": 0.0, "lid": 3})
    assert sent == [(1, {"op": "signal", "signal": "SIGKILL", "lids": [2, 3]})]
    assert not hasattr(d, "signalled") and not hasattr(d, "await_exits")


def test_a_node_faults_victim_waits_for_its_agent_and_a_rank_fault_signals_itself(monkeypatch):
    from megatron_deadpool.base import faults

    monkeypatch.setattr(faults, "NODE_SIGNAL_WAIT_S", 0.05)
    for spec, node, expect_wait in (("kill:node=1@iter=6", 1, True),
                                    ("kill:rank=3@iter=6", 1, False)):
        killed, slept = [], []
        points = faults.FaultPoints([faults.parse_fault(spec)], rank=lambda: 3, node=node,
                                    claim=lambda i: True, report=lambda *a: None,
                                    kill=killed.append)
        t0 = faults.time.monotonic()
        points(6, "forward_backward")
        slept.append(faults.time.monotonic() - t0)
        assert killed == [faults._signal.SIGKILL]  # the fallback, after the wait
        assert (slept[0] >= 0.05) == expect_wait
