"""After a communication error a survivor waits for the decider (``Member.wait_moved``):
with a watcher, on the generation the watcher reads anyway (no operation on the job's
store); without one, looking at the next plan's key (``records.polled``: no store wait that
times out, which torch logs with a reverse name lookup each), so the plan's publication ends
the wait at once, instead of three operations every 0.02 s (issue 57); a declaration
without a plan yet counts at the end; nothing within the timeout: False."""

import threading

import pytest

from megatron_deadpool.base.plan import Plan
from megatron_deadpool.membership import store as st
from megatron_deadpool.membership import member as member_mod
from megatron_deadpool.membership.member import Member

SECRET = "s" * 32


@pytest.fixture
def store():
    server = st.connect("127.0.0.1", 0, 30.0, is_master=True)
    coord = st.Coordinator(server, SECRET)
    coord.publish_plan(Plan(gen=0, world_size=2, rank_of={0: 0, 1: 1}, node_of_rank=(0, 1)))
    yield server, coord


def _member(server):
    return Member(0, node=0, host="127.0.0.1", port=server.port, secret=SECRET,
                  heartbeat_interval_s=0.1, rendezvous_timeout_s=10.0)


def test_the_next_plan_ends_the_wait_at_once(store, monkeypatch):
    """With slices of 60 s only the looks at the plan's key within the slice can end it
    within the join's bound (a check once per slice would look again after 60 s)."""
    server, coord = store
    monkeypatch.setattr(member_mod, "MOVED_SLICE_S", 60.0)
    m, out = _member(server), {}
    t = threading.Thread(target=lambda: out.setdefault("got", m.wait_moved(0, 120.0)),
                         daemon=True)
    t.start()
    t.join(0.5)
    assert t.is_alive()  # nothing yet: the wait goes on
    coord.publish_plan(Plan(gen=1, world_size=2, rank_of={0: 0, 2: 1}, node_of_rank=(0, 2)))
    t.join(10)
    assert out == {"got": True}


def test_nothing_within_the_timeout_is_false_and_a_declaration_is_true(store):
    server, coord = store
    m = _member(server)
    assert m.wait_moved(0, 0.3) is False
    coord.declare_failing(0)  # the decider waits for a spare: the plan comes later
    assert m.wait_moved(0, 0.3) is True


def test_a_plan_key_without_a_newer_generation_is_not_taken(store):
    """A forger writes the next plan's key: without a newer signed generation the wait
    does not end (it looks again every PLAN_POLL_S), and ends False at its timeout."""
    server, _ = store
    server.set(st.k("plan", 1), b"forged")
    assert _member(server).wait_moved(0, 0.5) is False


def test_a_member_with_a_watcher_waits_on_what_the_watcher_saw_with_no_store_operation(
        store):
    """The watcher's generation ends the wait; the member's own connection is not used
    (planted: the watcher's branch removed, the looks at the plan's key count)."""
    server, _ = store
    m = _member(server)
    ops = []

    class Counted:
        def __getattr__(self, name):
            ops.append(name)
            return getattr(server, name)

    m.store, m._watcher = Counted(), threading.current_thread()  # a watcher is running
    threading.Timer(0.3, lambda: setattr(m, "seen_gen", 1)).start()
    assert m.wait_moved(0, 10.0) is True
    assert ops == []
