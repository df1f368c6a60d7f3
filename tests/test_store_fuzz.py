"""Nothing a forged byte can crash (issue 38): every key the coordinator and the ranks read
from the job's store, written with random and adversarial records by a client without the
job secret, is ignored (and counted), never acted on and never a crash.

The fast tests drive the readers directly on an in-memory store; the slow one runs a job
with a node killed while a fuzzer writes to its store, and the job must end bitwise."""

import json
import os
import random
import threading
from datetime import timedelta

import pytest
import torch.distributed as dist

from megatron_deadpool.membership import auth, records
from megatron_deadpool.membership import store as st

SECRET = "the-job-secret"


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def _queue(store, clock):
    return records.CountedQueue(store, st.k("events", "n"), lambda i: st.k("events", i), clock)


def _write(store, i=None, value=b"x"):
    i = store.add(st.k("events", "n"), 1) if i is None else i
    store.set(st.k("events", i), value)
    return i


def test_a_hole_holds_the_reader_until_it_ages_then_is_one_skip():
    store, clock = dist.HashStore(), Clock()
    q = _queue(store, clock)
    _write(store)
    store.add(st.k("events", "n"), 3)       # counted, never written: indices 2..4
    _write(store)                           # a genuine record after the hole: 5
    got = q.read(0)
    assert [(i, raw) for i, raw, _ in got] == [(1, b"x")]  # held at the young hole
    clock.t = records.HOLE_GRACE_S + 0.1
    got = q.read(1)
    assert [(i, raw) for i, raw, _ in got] == [(4, None), (5, b"x")]
    assert "2..4 counted but never written" in got[0][2]


def test_a_writer_between_its_add_and_its_set_is_waited_for_not_skipped():
    store, clock = dist.HashStore(), Clock()
    q = _queue(store, clock)
    i = store.add(st.k("events", "n"), 1)   # a genuine writer's add ...
    assert q.read(0) == []
    clock.t = 1.0                           # ... and its set, inside the grace
    _write(store, i, b"late")
    clock.t = 10.0
    assert q.read(0) == [(1, b"late", "")]


class Counting:
    """A store that counts the calls made to it."""

    def __init__(self, store):
        self.store, self.calls = store, 0

    def __getattr__(self, name):
        def call(*args):
            self.calls += 1
            return getattr(self.store, name)(*args)
        return call


def test_a_jump_far_ahead_is_skipped_without_visiting_every_index():
    """The store calls the reader makes for a jump do not grow with it (the same for 10^4,
    10^6 and 10^9 counted indices), and stay within the scan's own budget: each index of
    the JUMP_SCAN window looked at twice (timed on the first read, aged on the second), the
    FORWARD_SCAN reach once, the run at the counter's top found on each read and closed
    once (JUMP_RUN each), and a few for the records."""
    calls = {}
    for jump in (10 ** 4, 10 ** 6, 10 ** 9):
        store, clock = Counting(dist.HashStore()), Clock()
        q = _queue(store, clock)
        store.add(st.k("events", "n"), jump)
        a, b = _write(store), _write(store)
        store.calls = 0
        assert q.read(0) == []
        clock.t = records.HOLE_GRACE_S + 0.1
        got = q.read(0)
        assert [(i, raw) for i, raw, _ in got] == [(jump, None), (a, b"x"), (b, b"x")]
        calls[jump] = store.calls
    assert len(set(calls.values())) == 1, calls
    assert calls[10 ** 9] <= 2 * records.JUMP_SCAN + records.FORWARD_SCAN + \
        3 * records.JUMP_RUN + 32, calls


@pytest.mark.parametrize("jump", [1000, 10 ** 6])
def test_genuine_records_around_a_jump_are_never_skipped_with_it(jump):
    """A hole, a genuine record, a jump, a genuine record, a hole, a genuine record, then a
    genuine writer between its add and its set: every genuine record is read, the pending
    one too once it lands (the jump used to be ended at the highest missing index from the
    top, which skipped the genuine records below it: workers' JOIN events were lost and
    they timed out waiting for admission)."""
    store, clock = dist.HashStore(), Clock()
    q = _queue(store, clock)
    store.add(st.k("events", "n"), 1)
    first = _write(store, value=b"first")
    store.add(st.k("events", "n"), jump)
    second = _write(store, value=b"second")
    store.add(st.k("events", "n"), 1)
    third = _write(store, value=b"third")
    got = q.read(0)
    clock.t = records.HOLE_GRACE_S + 0.1
    got += q.read(got[-1][0] if got else 0)
    got += q.read(got[-1][0])
    assert [raw for _, raw, _ in got if raw] == [b"first", b"second", b"third"]
    assert got[-1][0] == third
    pending = store.add(st.k("events", "n"), 1)
    assert q.read(third) == []
    clock.t = 2 * records.HOLE_GRACE_S   # the pending writer is young: waited for
    _write(store, pending, b"late")
    assert q.read(third) == [(pending, b"late", "")]
    assert first == 2 and second == first + jump + 1


def test_a_counter_moved_back_is_put_forward_again():
    store, clock = dist.HashStore(), Clock()
    q = _queue(store, clock)
    for _ in range(5):
        _write(store)
    assert len(q.read(0)) == 5
    store.add(st.k("events", "n"), -4)       # later writers would reuse indices 2..5
    got = q.read(5)
    assert got[0][0] == 5 and got[0][1] is None and "moved back" in got[0][2]
    assert _write(store, value=b"new") == 6  # the next genuine record is past the cursor
    assert q.read(5) == [(6, b"new", "")]


def _forgeries(rng, genuine: bytes):
    """Random and adversarial values: bytes of any length, JSON of the wrong shapes, deep
    nesting, non-ASCII MACs, records sealed with a guessed secret, genuine records replayed."""
    body = {"kind": "exit", "lid": 1, "code": -9, "i": rng.randrange(1, 50), "gen": 1,
            "rank": 0, "node": 0, "op": "signal", "signal": "SIGKILL", "lids": [0]}
    return rng.choice([
        lambda: bytes(rng.randrange(256) for _ in range(rng.randrange(0, 300))),
        lambda: os.urandom(rng.choice([0, 1, 7, 4096, 1 << 16])),
        lambda: json.dumps(rng.choice([None, 1, "s", [], {}, {"body": 1, "mac": "x"},
                                       {"body": {}, "mac": 5}, {"body": [], "mac": "é"},
                                       {"body": body, "mac": "ß" * 64}])).encode(),
        lambda: ("[" * 100_000 + "]" * 100_000).encode(),
        lambda: ('{"body":' * 5000 + "1" + "}" * 5000).encode(),
        lambda: auth.seal("guessed", body).encode(),
        lambda: genuine,
        lambda: b"\xff\xfe" + "mac".encode("utf-16"),
        lambda: json.dumps({"body": {"kind": "join", "lid": rng.randrange(4),
                                     "nonce": rng.choice(["\ud800", "a/b", "", "é"])},
                            "mac": "0" * 64}).encode(),
    ])()


def _readers(coord, cursors):
    """Every read the coordinator and the ranks make of the store, as they make it (the
    decider and an agent each keep their cursor)."""
    def events():
        for ev in coord.read_events(cursors["events"]):
            cursors["events"] = ev["i"]

    return [
        events,
        lambda: cursors.__setitem__("cmd", coord.read_commands(0, cursors["cmd"])[1]),
        lambda: coord.current_gen(),
        lambda: coord.is_failing(1),
        lambda: coord.generation_done(coord.get_plan(0)),
        lambda: coord.heartbeats([0, 1, 2, 3]),
        lambda: coord.agent_heartbeat(0),
        lambda: coord.shutdown_reason(),
        lambda: coord.rank_records("report", 1, 2),
        lambda: coord.rank_records("boundary", 1, 2),
        lambda: coord.rank_record("report", 1, 0),
    ]


def test_random_records_on_every_key_read_are_ignored_never_a_crash(monkeypatch):
    """2,000 forged records over the keys the readers read (events and commands through
    their counters too: holes, jumps, moves back; owned records deleted), each followed by
    every reader: none raises or waits, and none acts on a forged record."""
    from types import SimpleNamespace

    from megatron_deadpool.base.plan import Plan

    clock = Clock()
    monkeypatch.setattr(records, "time", SimpleNamespace(monotonic=clock))
    rng = random.Random(38)
    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=1))  # a reader that waits on a key fails soon
    coord = st.Coordinator(store, SECRET)
    coord.publish_plan(Plan(gen=0, world_size=2, rank_of={0: 0, 1: 1}, node_of_rank=(0, 1)))
    coord.push_event("join", lid=0, nonce="a")
    genuine = store.get(st.k("events", 1))
    keys = [st.k("latest"), st.k("plan", 1), st.k("plan", 2), st.k("failing", 1),
            st.k("shutdown"), st.k("report", 1, 0), st.k("report", 1, 1),
            st.k("boundary", 1, 0), st.k("boundary", 1, 1), *[st.k("hb", x) for x in range(4)],
            st.k("agent_hb", 0), st.k("admit", 0, "a")]
    cursors = {"events": 0, "cmd": 0}
    # the owner puts a deleted record back first: a member's read of a plan waits for it
    # (a TCPStore get), which one thread cannot do here
    readers = [coord.owned.heal] + _readers(coord, cursors)
    for n in range(2000):
        clock.t += 0.5  # holes age while the forger writes
        which = rng.randrange(4)
        if which == 0:   # a forged event or command through its counter
            q = rng.choice([("events",), ("cmd", 0)])
            i = store.add(st.k(*q, "n"), 1)
            store.set(st.k(*q, i), _forgeries(rng, genuine))
        elif which == 1:  # the counter alone: a hole, a jump or a move back
            store.add(st.k(*rng.choice([("events",), ("cmd", 0)]), "n"),
                      rng.choice([1, 3, 10 ** 6, -2]))
        elif which == 2 and rng.random() < 0.2:  # a record deleted (owned ones put back)
            store.delete_key(rng.choice([st.k("latest"), st.k("plan", 0), *keys]))
        else:
            store.set(rng.choice(keys), _forgeries(rng, genuine))
        for read in readers:
            read()
    assert coord.current_gen() == 0 and not coord.is_failing(1)
    assert coord.shutdown_reason() is None
    assert coord.rank_records("report", 1, 2) is None
    assert coord.read_commands(0, 0)[0] == []
    assert cursors["events"] > 1000  # the reader got past every hole and jump


def test_the_decider_ignores_a_flood_of_forgeries_in_bounded_memory():
    """A forged event is counted and the last hundred are kept, each cut short."""
    from megatron_deadpool.base.config import DeciderConfig
    from megatron_deadpool.membership.decider import Decider, Proc

    store = dist.HashStore()
    procs = {r: Proc(lid=r, node=r, role="active", rank=r) for r in range(2)}
    d = Decider(store=store, procs=procs, world_size=2, token=SECRET,
                send_command=lambda node, cmd: None, config=DeciderConfig(grace_s=0.0),
                log=lambda m: None)
    d.publish_initial_plan()
    for _ in range(300):
        i = store.add(st.k("events", "n"), 1)
        store.set(st.k("events", i), json.dumps({"body": {"kind": "exit" * 10_000}, "mac": "0"}))
    d.step()
    assert d.forged == 300 and len(d.rejected) == 100
    assert all(len(r["claimed"]["kind"]) <= 40 for r in d.rejected)
    assert d.gen == 0 and all(p.state != "dead" for p in d.procs.values())


class Fuzzer(threading.Thread):
    """A client of the job's store without the secret, writing a forged record every few
    milliseconds to a key some reader reads: appended events and commands (through their
    counters, with holes, jumps and moves back), plans, the generation pointer, failure
    declarations, heartbeats, reports, boundaries, barriers and the shutdown flag."""

    # Counters moved back: a genuine writer then lands on slots that the reader has read or
    # skipped (and closed) and moves past them (records.append; before, a record that
    # landed on a skipped hole was lost). The fuzzer's own records through a counter go
    # only into empty slots: overwriting a record is a deletion, the denial of service
    # that docs/threat-model.md leaves open, and needs no counter to be moved.
    # Deletions here: the records the decider owns (put back on its heartbeat cadence).

    def __init__(self, host: str, port: int, lids: int, nodes: int, seed: int = 38):
        super().__init__(daemon=True)
        self.host, self.port, self.lids, self.nodes = host, port, lids, nodes
        self.rng, self.stop, self.written, self.error = random.Random(seed), threading.Event(), 0, None

    def _key(self, store) -> str:
        rng = self.rng
        g = rng.randrange(0, 4)
        which = rng.randrange(9)
        if which <= 1:
            q = ("events",) if which == 0 else ("cmd", rng.randrange(self.nodes))
            if rng.random() < 0.1:  # the counter alone: a hole, a jump or a move back
                store.add(st.k(*q, "n"), rng.choice([1, 2, 1000, -1, -3]))
                return ""
            return st.k(*q, store.add(st.k(*q, "n"), 1))
        if which == 2 and rng.random() < 0.05:  # an owned record deleted
            store.delete_key(rng.choice([st.k("latest"), st.k("plan", g), st.k("failing", g)]))
            return ""
        return rng.choice([
            st.k("latest"), st.k("plan", g + 1), st.k("failing", g + 1), st.k("shutdown"),
            st.k("hb", rng.randrange(self.lids + 2)), st.k("agent_hb", rng.randrange(self.nodes + 1)),
            st.k("report", g + 1, rng.randrange(8)), st.k("boundary", g + 1, rng.randrange(8)),
            st.k("admit", rng.randrange(self.lids), "0000"), st.k("arrived", g + 5)])

    def run(self) -> None:
        store = st.connect(self.host, self.port, 30.0)
        genuine = store.get(st.k("plan", 0))
        while not self.stop.is_set():
            try:
                key = self._key(store)
                if key.startswith((st.k("events", ""), st.k("cmd", ""))):
                    store.compare_set(key, "", _forgeries(self.rng, genuine))
                elif key:
                    store.set(key, _forgeries(self.rng, genuine))
                self.written += 1
            except Exception as exc:  # noqa: BLE001 - the job ended under the fuzzer
                self.error = exc
                return
            self.stop.wait(0.005)


@pytest.mark.slow
@pytest.mark.ci
def test_a_job_under_a_store_fuzzer_completes_bitwise(tmp_path, reference):
    """While the job trains, loses node 1 (SIGKILLed from outside at iteration 5) and
    recovers, a fuzzer writes thousands of forged records to the keys the coordinator and
    the ranks read. The job ends bitwise with one recovery, and the forged events were
    counted, not acted on."""
    from conftest import assert_ok_and_bitwise, kill_node_from_outside, layout_flags

    flags, fuzzers = layout_flags(2, 2, 12), []

    def start_fuzzer(line):
        if not fuzzers and "coordinator " in line:
            host, _, port = line.split("coordinator ", 1)[1].strip().rpartition(":")
            fuzzers.append(Fuzzer(host, int(port), lids=10, nodes=5))
            fuzzers[0].start()

    try:
        proc, s, _ = kill_node_from_outside(tmp_path, flags, on_line=start_fuzzer)
    finally:
        for f in fuzzers:
            f.stop.set()
            f.join(10)
    assert fuzzers and fuzzers[0].written > 500, (fuzzers and fuzzers[0].written)
    assert_ok_and_bitwise(proc, s, reference(flags))
    (rec,) = s["recoveries"]
    assert rec["failed_ranks"] == [2, 3], rec
    assert s["forged_events_ignored"] > 50, s["forged_events_ignored"]


def test_records_the_decider_owns_are_put_back_after_a_forger_overwrote_them():
    """A plan, the generation pointer, a failure declaration and the shutdown flag have one
    writer and many pollers: an overwrite would hide them from every later look. The
    writer puts them back; what it no longer owns (a superseded plan) it leaves alone."""
    from megatron_deadpool.base.plan import Plan

    store = dist.HashStore()
    coord = st.Coordinator(store, SECRET)
    reader = st.Coordinator(store, SECRET)
    for g in (0, 1):
        coord.publish_plan(Plan(gen=g, world_size=2, rank_of={0: 0, 1: 1}, node_of_rank=(0, 1)))
    coord.declare_failing(1)
    coord.set_shutdown("done")
    for key in (st.k("latest"), st.k("plan", 1), st.k("failing", 1), st.k("shutdown"),
                st.k("plan", 0)):
        store.set(key, b"\x00forged")
    assert reader.current_gen() == 0 and reader.shutdown_reason() is None
    assert sorted(coord.owned.heal()) == sorted(
        [st.k("latest"), st.k("plan", 1), st.k("failing", 1), st.k("shutdown")])
    assert reader.current_gen() == 1 and reader.get_plan(1).gen == 1
    assert reader.is_failing(1) and reader.shutdown_reason() == "done"
    assert coord.owned.heal() == []


def test_holes_between_records_age_together_not_one_after_another():
    """A hole every few records (a forger counting without writing) would hold the reader
    HOLE_GRACE_S per hole if each were first timed when the reader reached it."""
    store, clock = dist.HashStore(), Clock()
    q = _queue(store, clock)
    for _ in range(5):
        store.add(st.k("events", "n"), 1)   # a hole ...
        _write(store)                        # ... then a genuine record
    assert q.read(0) == []
    clock.t = records.HOLE_GRACE_S + 0.1
    got = q.read(0)
    assert [raw for _, raw, _ in got].count(b"x") == 5 and got[-1][0] == 10


def test_a_dead_agents_heartbeat_overwritten_by_a_forger_is_still_a_lost_node():
    """A forger overwriting a dead node agent's heartbeat must not keep the node alive:
    a record that does not verify is no sign of life, and the node is lost once its last
    genuine counter is older than the timeout (it hid node losses, which then waited for
    each rank's own heartbeat timeout, one plan per rank)."""
    from megatron_deadpool.membership.procs import AgentClock

    store = dist.HashStore()
    coord = st.Coordinator(store, SECRET)
    clock = AgentClock(timeout_s=3.0)
    assert clock.observe(1, coord.agent_heartbeat(1), 0.0) is None  # never seen: starting
    coord.agent_beat(1, 7)
    assert clock.observe(1, coord.agent_heartbeat(1), 1.0) is None
    store.set(st.k("agent_hb", 1), b'{"body": {"node": 1, "seq": 99}, "mac": "forged"}')
    assert coord.agent_heartbeat(1) is None
    assert clock.observe(1, coord.agent_heartbeat(1), 3.5) is None   # 2.5 s: not yet
    assert clock.observe(1, coord.agent_heartbeat(1), 4.5) == 1.0    # lost since the last beat
    coord.agent_beat(1, 8)                                           # a genuine beat again
    assert clock.observe(1, coord.agent_heartbeat(1), 5.0) is None
