"""A promoted spare builds its model and optimizer before it can receive its state (tens of
seconds on a GPU node): the survivors wait for it at a barrier before the restore exchange
(``Agree.ready``: a round of the store tree on the node record stores, mirror/rounds.py
``barrier``), bounded by --deadpool-spare-ready-timeout, not by the mirror's operation
deadline; a member that dies meanwhile leaves the others waiting until the next plan's
abort, and a timeout with the membership moved is a generation moved, not a stop."""

import threading
from types import SimpleNamespace

import pytest

from conftest import assert_ok_and_bitwise, launch, layout_flags
from megatron_deadpool.base.config import DeadpoolConfig
from megatron_deadpool.base.errors import DeadpoolError, TransportTimeout
from megatron_deadpool.control.steps import Agree
from megatron_deadpool.membership import store as st
from megatron_deadpool.mirror import rounds

SECRET = "s" * 32
FLAGS = layout_flags(2, 2, 12)
# rendezvous 20 s: take-plan fence 10 s, mirror operation deadline 5 s; the spare's build
# takes 12 s more than usual, longer than both
SHORT = ["--deadpool-rendezvous-timeout", "20"]
BUILD_DELAY_S = 12.0


@pytest.fixture
def store():
    server = st.connect("127.0.0.1", 0, 30.0, is_master=True)
    yield server


def _barrier_in_thread(server, rank, world=2, timeout_s=30.0, gen=1):
    out = {}

    def run():
        try:
            rounds.barrier(server, rank, world, timeout_s, SECRET, gen, rounds.READY_KEY)
            out["ok"] = True
        except BaseException as exc:  # noqa: BLE001 - the test inspects it
            out["exc"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def test_the_restore_waits_until_every_member_is_ready(store):
    t, out = _barrier_in_thread(store, 0)
    t.join(0.5)
    assert t.is_alive()  # the spare (rank 1) is still building its model
    spare, spare_out = _barrier_in_thread(store, 1)  # built: the last one in
    for th in (t, spare):
        th.join(10)
    assert out == {"ok": True} and spare_out == {"ok": True}


def test_a_wait_before_the_world_forms_ends_when_its_check_raises(store):
    """The rendezvous (recovery/world.py ``meet``) has no abort to end it: its check runs
    every slice a wait lasts, and a newer generation ends the wait within a slice."""
    moved = threading.Event()

    def check():
        if moved.is_set():
            raise st.GenerationMoved("generation 2 replaced 1")

    out = {}

    def run():
        try:
            rounds.barrier(store, 0, 2, 30.0, SECRET, 1, "arrived/", check=check, slice_s=0.1)
        except BaseException as exc:  # noqa: BLE001 - the test inspects it
            out["exc"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(0.5)
    assert t.is_alive()  # rank 1 never comes
    moved.set()
    t.join(2.0)
    assert not t.is_alive() and isinstance(out.get("exc"), st.GenerationMoved), out


class _Links:
    def barrier(self, plan, name, timeout_s):
        raise TransportTimeout(f"mirror {name}: not every member arrived in {timeout_s:g}s")


class _Member:
    def __init__(self, moved):
        self.moved = moved

    def membership_moved(self, gen):
        return self.moved


def _ready(moved):
    step = SimpleNamespace(links=_Links(), member=_Member(moved),
                           config=DeadpoolConfig(spare_ready_timeout_s=0.5))
    Agree.ready(step, SimpleNamespace(plan=None, generation=1))


def test_a_spare_that_never_gets_ready_is_named_with_its_flag():
    with pytest.raises(DeadpoolError, match="not every member arrived.*"
                                            "--deadpool-spare-ready-timeout"):
        _ready(moved=False)


def test_a_member_declared_dead_meanwhile_moves_the_generation():
    """A spare that died while building (declared dead, or a newer generation): the wait's
    end is no timeout to stop on but a generation to move on from."""
    with pytest.raises(st.GenerationMoved):
        _ready(moved=True)


@pytest.mark.slow
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
