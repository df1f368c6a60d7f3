"""The coordinator's last crash paths by a forged store record (issue 49), each planted on
its own: a JOIN whose nonce is a lone surrogate, a counter moved back over slots a forger
took, an owned record deleted, a record deleted between the reader's look and its read.
The decider keeps going and the genuine records around the forged ones are acted on; none
of them is an exception out of ``Decider.step()`` or out of a genuine writer.
``test_store_fuzz.py`` has the random records; this file has each one by name."""

import json
import secrets
from datetime import timedelta

import pytest
import torch.distributed as dist
from conftest import Counting

from megatron_deadpool.base.config import DeciderConfig
from megatron_deadpool.membership import auth, records
from megatron_deadpool.membership import store as st
from megatron_deadpool.membership.decider import Decider, Proc
from megatron_deadpool.membership.store import EventKind

SECRET = "the-job-secret"
SHORT_S = 1.0  # the stores' timeout here: a read that waits on a key fails in this long


class Clock:
    def __init__(self, t=0.0):
        self.t = t

    def __call__(self):
        return self.t


class NoWaits:
    """A store on which a read that would wait for a missing key (``get``, ``multi_get``,
    ``wait``) fails at once, naming it: "never blocks" checked by construction, not timed
    (issue 58)."""

    def __init__(self, store):
        self.store = store

    def _there(self, keys, what):
        missing = [k for k in keys if not self.store.check([k])]
        if missing:
            raise AssertionError(f"{what} would wait for missing {missing}")

    def get(self, key):
        self._there([key], "get")
        return self.store.get(key)

    def multi_get(self, keys):
        self._there(keys, "multi_get")
        return self.store.multi_get(keys)

    def wait(self, keys, *args):
        self._there(keys, "wait")
        return self.store.wait(keys, *args)

    def __getattr__(self, name):
        return getattr(self.store, name)


def _store(kind="hash"):
    if kind == "tcp":
        return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                             timeout=timedelta(seconds=SHORT_S))
    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=SHORT_S))
    return store


def _decider(store, clock=None, log=None):
    procs = {r: Proc(lid=r, node=r, role="active", rank=r) for r in range(2)}
    d = Decider(store=store, procs=procs, world_size=2, token=SECRET,
                send_command=lambda node, cmd: None,
                config=DeciderConfig(grace_s=0.0, heartbeat_interval_s=0.1),
                log=log if log is not None else (lambda m: None), clock=clock or Clock(1000.0))
    d.publish_initial_plan()
    return d


def _forge_event(store, body):
    """A record through the event counter, not signed with the job secret."""
    i = store.add(st.k("events", "n"), 1)
    store.set(st.k("events", i), json.dumps({"body": body, "mac": "0" * 64}))
    return i


def _admitted(store, lid, nonce):
    return auth.open_(SECRET, store.get(st.k("admit", lid, nonce)), lid=lid, nonce=nonce)["ok"]


# ------------------------------------------------------------------ A: a forged nonce

BAD_NONCES = ["\ud800", "a\udfffb", "../../latest", "a/b", "", "x" * 65, "é", "a b", 7, None]


def test_a_forged_join_with_a_surrogate_nonce_is_refused_and_the_decider_goes_on():
    """``"\\ud800"`` cannot be a store key (``raw.set`` raised TypeError out of
    ``Decider.step()``, and the launcher of node 0 died); a nonce with a ``/`` would name
    another key. Neither is answered; the genuine JOIN after them is."""
    store, logged = _store(), []
    d = _decider(store, log=logged.append)
    for nonce in BAD_NONCES:
        _forge_event(store, {"kind": "join", "lid": 0, "nonce": nonce})
    genuine = secrets.token_hex(8)
    st.Coordinator(store, SECRET).push_event(EventKind.JOIN, lid=1, nonce=genuine)
    d.step()
    assert d.forged == len(BAD_NONCES)
    assert d.procs[1].state == "alive" and _admitted(store, 1, genuine)
    assert not store.check([st.k("admit", 0, "..", "..", "latest")])
    assert not store.check([st.k("admit", 0, "a", "b")])
    assert st.Coordinator(store, SECRET).current_gen() == 0 and not d.finished


def test_a_signed_join_with_a_malformed_nonce_is_not_answered_and_never_a_crash():
    """A sender with the secret and a broken nonce (no genuine sender makes one): refused
    in the log, never a key written from it, never an exception out of the step."""
    store, logged = _store(), []
    d = _decider(store, log=logged.append)
    coord = st.Coordinator(store, SECRET)
    coord.push_event(EventKind.JOIN, lid=0, nonce="\ud800")
    coord.push_event(EventKind.SPARE_NODE, procs=1, nonce="a/b")
    coord.push_event(EventKind.JOIN, lid=1, nonce="n1")
    d.step()
    assert d.procs[0].state != "alive" and d.procs[1].state == "alive"
    assert _admitted(store, 1, "n1") and not store.check([st.k("spare_node", "a", "b")])
    assert any("nonce" in m for m in logged), logged


def test_an_event_whose_handling_raises_is_rejected_and_the_step_goes_on(monkeypatch):
    """Whatever else a record's handling raises stays inside the step: the record is
    counted and logged, and the events after it are handled."""
    store, logged = _store(), []
    d = _decider(store, log=logged.append)

    def broken(ev):
        raise KeyError("a field no sender leaves out")

    monkeypatch.setattr(d, "_on_done", broken)
    coord = st.Coordinator(store, SECRET)
    coord.push_event(EventKind.DONE, lid=0)
    coord.push_event(EventKind.JOIN, lid=1, nonce="n1")
    d.step()
    assert d.procs[1].state == "alive" and d.cursor == 2
    assert d.rejected and "KeyError" in d.rejected[-1]["why"]
    assert any("KeyError" in m for m in logged), logged


# ------------------------------------------------------------------ B: a counter moved back

@pytest.mark.parametrize("taken", [100, 5000])
def test_a_genuine_writer_moves_past_the_slots_a_forger_took(taken):
    """A forger writes ``taken`` records and moves the counter back over them: the next
    genuine event and command land past them (push_event raised RuntimeError after 64
    tries, and on node 0 the agent's EXIT push took the launcher down)."""
    store = _store()
    writer, reader = st.Coordinator(store, SECRET), st.Coordinator(store, SECRET)
    for q in (("events",), ("cmd", 0)):
        for _ in range(taken):
            i = store.add(st.k(*q, "n"), 1)
            store.set(st.k(*q, i), b"forged")
        store.add(st.k(*q, "n"), -taken)
    counted = Counting(store)
    writer = st.Coordinator(counted, SECRET)
    writer.push_event(EventKind.EXIT, lid=1, code=-9)
    writer.push_command(0, {"op": "signal", "signal": "SIGKILL", "lids": [1]})
    assert counted.n < 200, counted.n  # O(log taken) looks, not a walk over the taken slots
    events = reader.read_events(0)
    assert [ev["kind"] for ev in events] == [EventKind.FORGED] * taken + [EventKind.EXIT]
    cmds, cursor, bad = reader.read_commands(0, 0)
    assert [c["lids"] for c in cmds] == [[1]] and bad == taken
    assert cursor == events[-1]["i"] == taken + 1  # the first free slot past the taken ones


def test_the_decider_acts_on_a_genuine_exit_written_after_a_counter_moved_back():
    store = _store()
    d = _decider(store)
    for _ in range(100):
        _forge_event(store, {"kind": "exit", "lid": 0, "code": -9})
    store.add(st.k("events", "n"), -100)
    st.Coordinator(store, SECRET).push_event(EventKind.EXIT, lid=1, code=-9, node=1)
    d.step()
    assert d.forged == 100 and d.procs[1].state == "dead" and d.procs[0].state != "dead"


def test_a_record_written_after_a_move_back_onto_a_skipped_hole_is_not_lost():
    """The reader skipped a hole that had aged; a forger then moves the counter back onto
    it. The next genuine record used to land in that slot, behind the reader, and was never
    read. A skipped hole is now taken (closed), so the writer moves past it."""
    store, clock = _store(), Clock()
    q = records.CountedQueue(store, st.k("events", "n"), lambda i: st.k("events", i), clock)

    def write(value):
        return records.append(store, st.k("events", "n"), lambda i: st.k("events", i),
                              lambda i: value)

    write("first")
    store.add(st.k("events", "n"), 3)   # a hole: indices 2..4
    write("second")
    assert [raw for _, raw, _ in q.read(0)] == [b"first"]
    clock.t = records.HOLE_GRACE_S + 0.1
    got = q.read(1)
    assert [(i, raw) for i, raw, _ in got] == [(4, None), (5, b"second")]
    store.add(st.k("events", "n"), -3)  # back onto the skipped hole
    write("third")
    got = q.read(5)
    got += q.read(got[-1][0]) if got else []
    assert [raw for _, raw, _ in got if raw] == [b"third"], got


def test_a_writer_slower_than_the_grace_moves_past_its_closed_slot():
    """A genuine writer between its ``add`` and its ``set`` for longer than the grace: its
    slot was skipped (and closed); its record lands past it, and is read."""
    store, clock = _store(), Clock()
    q = records.CountedQueue(store, st.k("events", "n"), lambda i: st.k("events", i), clock)
    late = []

    class Slow:
        def __getattr__(self, name):
            return getattr(store, name)

        def compare_set(self, key, old, new):
            if not late:  # the reader skips the slot while this writer is away
                late.append(key)
                assert q.read(0) == []
                clock.t = records.HOLE_GRACE_S + 0.1
                assert [raw for _, raw, _ in q.read(0)] == [None]
            return store.compare_set(key, old, new)

    i = records.append(Slow(), st.k("events", "n"), lambda i: st.k("events", i), lambda i: "late")
    assert i == 2 and late == [st.k("events", 1)]
    assert q.read(1) == [(2, b"late", "")]


# ------------------------------------------------------------------ C: an owned key deleted

@pytest.mark.parametrize("kind", ["hash", "tcp"])
def test_an_owned_record_deleted_is_put_back_without_waiting(kind):
    """``heal`` read every owned key with ``multi_get``: one that a client deleted held it
    for the store's timeout, and the DistStoreError ended ``Decider.step()``. A missing key
    is a changed one: put back at once."""
    from megatron_deadpool.base.plan import Plan

    store = _store(kind)
    coord, reader = st.Coordinator(store, SECRET), st.Coordinator(store, SECRET)
    for g in (0, 1):
        coord.publish_plan(Plan(gen=g, world_size=2, rank_of={0: 0, 1: 1}, node_of_rank=(0, 1)))
    coord.declare_failing(1)
    gone = [st.k("latest"), st.k("plan", 1), st.k("failing", 1)]
    for key in gone:
        store.delete_key(key)
    coord.owned.raw = NoWaits(store)
    assert sorted(coord.owned.heal()) == sorted(gone)
    assert reader.current_gen() == 1 and reader.get_plan(1).gen == 1 and reader.is_failing(1)
    assert coord.owned.heal() == []


def test_the_decider_puts_back_a_deleted_generation_pointer_and_goes_on():
    raw, logged = _store(), []
    store = NoWaits(raw)
    d = _decider(store, log=logged.append)
    raw.delete_key(st.k("latest"))
    raw.delete_key(st.k("plan", 0))
    d.step()
    reader = st.Coordinator(store, SECRET)
    assert reader.get_plan(0).gen == 0 and store.check([st.k("latest")])
    assert any("put back" in m for m in logged), logged


class DeletesAfterLook:
    """A store whose records vanish between a reader's ``check`` and its read (a client
    deleting keys as fast as it can)."""

    def __init__(self, store, prefix):
        self.store, self.prefix = store, prefix

    def check(self, keys):
        there = self.store.check(keys)
        for key in keys:
            if key.startswith(self.prefix) and self.store.check([key]):
                self.store.delete_key(key)
        return there

    def __getattr__(self, name):
        return getattr(self.store, name)


def test_a_record_deleted_between_the_readers_look_and_its_read_never_blocks():
    """The event reader looked (``check``) and then read (``get``): a record deleted in
    between held the decider for the store's timeout and raised. Now it is a hole."""
    store = _store()
    st.Coordinator(store, SECRET).push_event(EventKind.DONE, lid=0)
    reader = st.Coordinator(NoWaits(DeletesAfterLook(store, st.k("events", ""))), SECRET)
    got = reader.read_events(0)  # a hole now (skipped), or read in one look
    assert got == [] or [ev["kind"] for ev in got] == [EventKind.DONE], got


def test_single_records_deleted_between_look_and_read_never_block_their_readers():
    from megatron_deadpool.base.plan import Plan

    store = _store()
    coord = st.Coordinator(store, SECRET)
    coord.publish_plan(Plan(gen=0, world_size=2, rank_of={0: 0, 1: 1}, node_of_rank=(0, 1)))
    coord.publish_plan(Plan(gen=1, world_size=2, rank_of={0: 0, 1: 1}, node_of_rank=(0, 1)))
    coord.declare_failing(1)
    coord.set_shutdown("done")
    coord.agent_beat(0, 1)
    coord.put_rank_record("report", 1, 0, {"x": 1})
    reader = st.Coordinator(NoWaits(DeletesAfterLook(store, "dp/")), SECRET)
    got = [reader.current_gen(), reader.is_failing(1), reader.shutdown_reason(),
           reader.agent_heartbeat(0), reader.rank_record("report", 1, 0)]
    # each one gone (what a deleted record reads as) or, read in one look, the genuine one
    assert got[0] in (0, 1) and got[1] in (False, True) and got[2] in (None, "done")
    assert got[3] in (None, 1) and got[4] in (None, {"x": 1, "gen": 1, "rank": 0})


# ------------------------------------------------------------------ all of them at once

def test_the_decider_keeps_going_under_every_planted_forgery_at_once(monkeypatch):
    """600 steps of the decider while a forger plants all of the above at random (joins
    with nonces no key can be made of, counters moved back over its records and holes,
    jumps, owned records deleted), and genuine processes join, report and exit through
    the same queue: no step raises or waits, every genuine event is acted on, and every
    owned record is there at the end."""
    import random
    from types import SimpleNamespace

    clock = Clock(1000.0)
    monkeypatch.setattr(records, "time", SimpleNamespace(monotonic=clock))
    store, rng = _store(), random.Random(49)
    d = _decider(store, clock)
    genuine = st.Coordinator(store, SECRET)
    nonces = {}
    for n in range(600):
        clock.t += 0.25  # holes age while the forger works
        which = rng.randrange(5)
        if which == 0:
            i = store.add(st.k("events", "n"), 1)
            store.compare_set(st.k("events", i), "", json.dumps({"body": {
                "kind": "join", "lid": rng.randrange(3),
                "nonce": rng.choice(BAD_NONCES[:7])}, "mac": "0" * 64}))
        elif which == 1:  # records, then the counter moved back over them
            for _ in range(taken := rng.choice([1, 5, 100])):
                _forge_event(store, {"kind": "exit", "lid": 0, "code": -9})
            store.add(st.k("events", "n"), -taken - rng.choice([0, 2]))
        elif which == 2:
            store.add(st.k("events", "n"), rng.choice([1, 3, 1000, 10 ** 6]))
        elif which == 3:
            store.delete_key(rng.choice([st.k("latest"), st.k("plan", 0)]))
        if n in (100, 300):  # the genuine processes join, once each
            lid = 0 if n == 100 else 1
            nonces[lid] = secrets.token_hex(8)
            genuine.push_event(EventKind.JOIN, lid=lid, nonce=nonces[lid])
        d.step()
    genuine.push_event(EventKind.EXIT, lid=1, code=-9, node=1)
    for _ in range(3):
        clock.t += records.HOLE_GRACE_S
        d.step()
    assert _admitted(store, 0, nonces[0]) and _admitted(store, 1, nonces[1])
    assert d.procs[0].state == "alive" and d.procs[1].state == "dead", d.procs
    assert d.forged > 100
    assert store.check([st.k("latest"), st.k("plan", 0)])


def test_a_record_written_between_the_readers_two_calls_is_read_not_lost():
    """get_now asks compare_set (missing: the placeholder comes back), then check; a writer
    whose set lands between the two made the placeholder pass for the record, and the
    decider dropped a genuine JOIN as forged (seen in the fault matrix under load)."""
    from megatron_deadpool.membership import records

    class Racy:
        def __init__(self):
            self.value = None

        def compare_set(self, key, expected, desired):
            if self.value is None:
                self.value = b"genuine"  # the writer's set lands right after this answer
                return expected.encode()
            return self.value

        def check(self, keys):
            return self.value is not None

    assert records.get_now(Racy(), "k") == b"genuine"


def test_a_process_joining_a_job_that_has_ended_stops_at_the_next_slice(monkeypatch):
    """A standby started to refill a node as the job completed asked to join after the
    decider had stopped: nobody answers, and it waited out the whole rendezvous timeout
    (120 s), the launcher with it, at the end of every job with a local restart. Now its
    wait looks for the shutdown every ADMIT_SLICE_S and ends with JobStopped."""
    from megatron_deadpool.base.errors import JobStopped

    monkeypatch.setattr(st, "ADMIT_SLICE_S", 0.05)
    store = _store()
    st.Coordinator(store, SECRET).set_shutdown("complete: all ranks finished")
    counted = Counting(store)
    with pytest.raises(JobStopped, match="before this process was admitted"):
        st.Coordinator(counted, SECRET).request_admission(14, timeout_s=120.0)
    assert counted.n < 10, counted.n  # one slice, not the timeout's worth of them
