"""A promoted spare builds its model and optimizer before it can receive its state (tens of
seconds on a GPU node): the survivors wait for it at a barrier before the restore exchange
(``Member.wait_until_ready``), bounded by --deadpool-spare-ready-timeout, not by the
mirror's operation deadline; a member declared dead meanwhile ends the wait at once."""

import threading

import pytest

from conftest import assert_ok_and_bitwise, launch, layout_flags
from megatron_deadpool.base.config import DeadpoolConfig
from megatron_deadpool.base.errors import DeadpoolError, JobStopped
from megatron_deadpool.membership import store as st
from megatron_deadpool.membership.member import Member

SECRET = "s" * 32
FLAGS = layout_flags(2, 2, 12)
# rendezvous 20 s: take-plan fence 10 s, mirror operation deadline 5 s; the spare's build
# takes 12 s more than usual, longer than both
SHORT = ["--deadpool-rendezvous-timeout", "20"]
BUILD_DELAY_S = 12.0


@pytest.fixture
def store():
    server = st.connect("127.0.0.1", 0, 30.0, is_master=True)
    yield server, st.Coordinator(server, SECRET)


def _member(server, lid):
    return Member(lid, node=lid, host="127.0.0.1", port=server.port, secret=SECRET,
                  heartbeat_interval_s=0.1, rendezvous_timeout_s=10.0)


def _wait_in_thread(member, gen, world, timeout_s):
    out = {}

    def run():
        try:
            member.wait_until_ready(gen, world, timeout_s)
            out["ok"] = True
        except BaseException as exc:  # noqa: BLE001 - the test inspects it
            out["exc"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def test_the_restore_waits_until_every_member_is_ready(store):
    server, _ = store
    survivor, spare = _member(server, 0), _member(server, 1)
    t, out = _wait_in_thread(survivor, 1, 2, timeout_s=30.0)
    t.join(0.5)
    assert t.is_alive()  # the spare is still building its model
    spare.wait_until_ready(1, 2, timeout_s=30.0)  # built: the last one in
    t.join(10)
    assert out == {"ok": True}


def test_a_member_declared_dead_ends_the_wait(store):
    server, coord = store
    survivor = _member(server, 0)
    t, out = _wait_in_thread(survivor, 1, 2, timeout_s=60.0)
    t.join(0.3)
    coord.declare_failing(1)  # the spare's heartbeats stopped while it built its model
    t.join(10)
    assert not t.is_alive() and isinstance(out.get("exc"), st.GenerationMoved), out


def test_a_stop_ends_the_wait(store):
    server, coord = store
    survivor = _member(server, 0)
    survivor.stop_reason = None
    t, out = _wait_in_thread(survivor, 1, 2, timeout_s=60.0)
    t.join(0.3)
    survivor.stop_reason = "no spare left: 1 rank(s) failed; last committed iteration 4"
    t.join(10)
    assert isinstance(out.get("exc"), JobStopped), out


def test_a_spare_that_never_gets_ready_is_named_with_its_flag(store):
    server, _ = store
    with pytest.raises(DeadpoolError, match="only 1 of 2 members ready.*"
                                            "--deadpool-spare-ready-timeout"):
        _member(server, 0).wait_until_ready(1, 2, timeout_s=0.5)


@pytest.mark.slow
@pytest.mark.ci
def test_a_spare_slower_to_build_than_the_operation_deadline_recovers_bitwise(tmp_path,
                                                                              reference):
    cfg = DeadpoolConfig(enabled=True, rendezvous_timeout_s=20.0)
    assert BUILD_DELAY_S > cfg.gloo_op_timeout_s  # the survivors' old bound on the wait
    assert BUILD_DELAY_S > cfg.take_plan_timeout_s  # a fence that must not judge the spare
    p, s = launch(tmp_path, FLAGS + ["--deadpool", *SHORT, "--spare-build-delay",
                                     str(BUILD_DELAY_S)],
                  spares=1, inject=["kill:node=1@iter=6"])
    assert_ok_and_bitwise(p, s, reference(FLAGS))
    (rec,) = s["recoveries"]
    assert rec["failed_ranks"] == [2, 3] and rec["ranks_reported"] == 8
    assert rec["recomputed_iters"] <= 1 and "fencing" not in p.stdout
