"""Forged records in the mirror's store rounds (issue 49, item 3): a commit vote, a slot size
or a restore count written by someone who reaches the store without the job secret. The
rounds either reject the record and go on (a vote: the iteration does not commit), or stop
with ForgedRecordError, whose message names the forgery. A forgery never makes a restore stop
with NoCommittedStateError (as if the state were gone) nor take a forged value.

Before the rounds were signed, one forged ``add`` to ``cover/{it}`` stopped a restore with
NoCommittedStateError, one to the commit vote's counter committed an iteration a holder had
rejected, and a slot size written over a genuine one was taken as it was."""

import json
import random
import threading
from datetime import timedelta

import pytest
import torch.distributed as dist
from conftest import on_every_rank

from megatron_deadpool.base.errors import (ForgedRecordError, NoCommittedStateError,
                                           TransportTimeout)

from megatron_deadpool.membership import auth
from megatron_deadpool.mirror import rounds as rounds_mod
from megatron_deadpool.mirror.rounds import PREFIX, StoreRounds
from megatron_deadpool.recovery.restore import Inventory, agree, choose_restore

SECRET, GEN = "the-job-secret", 3


@pytest.fixture(autouse=True)
def _short_waits(monkeypatch):
    for name, value in (("GRACE_S", 0.3), ("SLICE_S", 0.1)):
        if hasattr(rounds_mod, name):
            monkeypatch.setattr(rounds_mod, name, value)


class Hooked:
    """One rank's view of the store: after each of its writes, ``hook(raw, op, key,
    value)`` runs on the raw store (a forger acting at that moment); ``swap(op, key,
    value)``, before a write, returns the value the store gets instead (a forger that wrote
    over it before any reader could see the genuine one), or None to leave it."""

    def __init__(self, raw, hook=None, swap=None, after_wait=None):
        self.raw, self.hook, self.swap, self.after_wait = raw, hook, swap, after_wait

    def __getattr__(self, name):
        op = getattr(self.raw, name)

        def call(*args):
            if self.swap is not None and name == "set":
                forged = self.swap(name, args[0], args[1])
                args = args if forged is None else (args[0], forged)
            out = op(*args)
            # a wait's end: a look (``check``, records.polled) that found the keys
            if self.after_wait is not None and (name == "wait" or name == "check" and out):
                self.after_wait(self.raw, args[0])
            if self.hook is not None and name in ("set", "add", "multi_set"):
                self.hook(self.raw, name, args[0], args[1])
            return out
        return call


def _run_all(world, fn, hook=None, swap=None, after_wait=None):
    """``fn(rounds, rank)`` on every rank at once (threads), each on its own view of one
    store; the results or exceptions, by rank."""
    raw = dist.HashStore()
    raw.set_timeout(timedelta(seconds=10))  # a read of a key never written: no long hang
    return on_every_rank(world, lambda r: fn(
        StoreRounds(Hooked(raw, hook, swap, after_wait), r, world, 3.0, secret=SECRET,
                    gen=GEN), r))


def _ring(world, lost):
    return [Inventory(own=frozenset() if r == lost else frozenset({7}),
                      copies={} if r == lost else {(r - 1) % world: frozenset({7})},
                      committed=7) for r in range(world)]


def _planted_cover_counts(raw, rounds=range(1, 7), its=range(0, 12), amount=1):
    for r in rounds:
        for it in its:
            raw.add(f"{PREFIX}{r}/c/cover/{it}", amount)


@pytest.mark.parametrize("amount", [1, -1, 1000])
def test_a_forged_cover_count_is_not_taken_and_the_restore_goes_on(amount):
    """The issue's attack: forged adds to every ``cover/{it}`` counter a restore could read
    (before: NoCommittedStateError, 'no single iteration is held for every rank')."""
    world, invs = 4, _ring(4, lost=1)
    want = choose_restore(invs)

    planted = []

    def planting_first(raw, op, key, value):
        if op == "set" and not planted:
            planted.append(True)
            _planted_cover_counts(raw, amount=amount)

    got = _run_all(world, lambda rounds, r: agree(rounds, r, invs[r]), planting_first)
    for r, g in enumerate(got):
        assert not isinstance(g, Exception), f"rank {r}: {type(g).__name__}: {g}"
        assert g[0].iteration == want.iteration == 7
        assert g[0].sources.get(r) == want.sources.get(r) and g[0].serves(r) == want.serves(r)


@pytest.mark.parametrize("votes,amount", [((True, False, True), -1), ((True, True, True), 1)])
def test_a_forged_commit_vote_is_not_counted(votes, amount):
    """A forger moves the vote's counter: a rank's "no" is never cancelled (before: the
    iteration committed although a holder had rejected its copy), and a forged "no" does
    not count."""
    forged = []

    def forging(raw, op, key, value):  # once, as the first member writes its record
        if op == "set" and not forged:
            forged.append(True)
            raw.add(key.rsplit("/u/", 1)[0] + "/c/false", amount)

    got = _run_all(len(votes), lambda rounds, r: rounds.all_ok(votes[r]), forging)
    assert got == [all(votes)] * len(votes)


def test_a_forged_result_never_turns_a_no_into_a_commit():
    """Issue 57: each member's result comes from its parent in the rounds' tree, signed for
    it. A forger writes over every result with one signed without the job secret that says
    nobody voted no: no member takes it (the vote is a no, logged as forged), and the next
    round, without forgery, counts the genuine votes."""
    state = {"on": True}

    def forging(raw, op, keys, values):
        if state["on"] and op == "multi_set":
            for key in keys:
                r, x = int(key.split("/")[-3]), int(key.split("/")[-1])
                raw.set(key, auth.seal("not-the-job-secret", {
                    "k": "down", "g": GEN, "r": r, "w": "commit", "to": x, "posts": {},
                    "counts": {"false": 0}, "forged": {}}))

    votes = [True, True, False, True, True, True]

    def run(rounds, r):
        first = rounds.all_ok(votes[r])
        state["on"] = False
        return first, rounds.all_ok(True)

    got = _run_all(len(votes), run, forging)
    assert all(g[0] is False for g in got), got  # never a commit over rank 2's no
    assert [g[1] for g in got] == [True] * len(votes), got


def _overwrite_sizes(op, key, value, done):
    """As a rank posts its slot size, a forger writes over it, once: 666 bytes (a swap:
    no reader sees the genuine record before the forged one)."""
    if op != "set" or key in done or "/u/" not in key:
        return None
    done.add(key)
    body = json.loads(value)["body"]  # the signed rounds' record (a member's, its subtree's)
    body["posts"] = {t: 666 for t in body["posts"]}
    return auth.seal("not-the-job-secret", body)


def _no_heal_before_the_grace(monkeypatch, heals):
    """``heals``: a rank looks at its own record (and puts it back) every 0.1 s, before
    the 0.3 s grace ends; else not before the round has failed."""
    if not heals:
        monkeypatch.setattr(rounds_mod, "SLICE_S", 5.0)


@pytest.mark.parametrize("heals", [True, False])
def test_a_slot_size_written_over_is_never_taken(heals, caplog, monkeypatch):
    """Each rank's slot size is written over with 666 right after it posts it: the rank
    puts its record back and the genuine sizes are taken, or the gather stops with a
    message naming forgery (before: every holder took 666 bytes as its owner's size)."""
    _no_heal_before_the_grace(monkeypatch, heals)
    world = 3
    done = set()
    got = _run_all(world, lambda rounds, r: rounds.gather_from(1000 + r, [(r - 1) % world]),
                   swap=lambda *a: _overwrite_sizes(*a, done=done))

    if heals:
        assert got == [{(r - 1) % world: 1000 + (r - 1) % world} for r in range(world)], got
        assert "record was changed by someone without the job secret: put back" in caplog.text
    else:
        assert all(isinstance(g, ForgedRecordError) for g in got), got
        assert all("forged by someone without the job secret" in str(g) for g in got), got


@pytest.mark.parametrize("heals", [True, False])
def test_a_commit_vote_written_over_is_put_back_or_a_no_and_the_job_goes_on(
        heals, caplog, monkeypatch):
    """A rank's vote written over with junk: the rank puts its record back while it waits,
    and the vote is taken; if it could not in time, the vote is a no, logged as forged.
    Either way the next round, without forgery, commits."""
    _no_heal_before_the_grace(monkeypatch, heals)
    state = {"on": True}

    def once(op, key, value):  # a swap: no reader sees the genuine vote before the junk
        if state["on"] and op == "set" and key == f"{PREFIX}1/u/1":
            state["on"] = False
            return b"\xffforged"
        return None

    got = _run_all(3, lambda rounds, r: (rounds.all_ok(True), rounds.all_ok(True)),
                   swap=once)
    if heals:
        assert got == [(True, True)] * 3, got
        assert "record was changed by someone without the job secret: put back" in caplog.text
    else:
        assert got == [(False, True)] * 3, got
        assert "forged by someone without the job secret" in caplog.text


def test_a_record_deleted_after_its_readers_wait_is_put_back_not_waited_out():
    """Issue 58: a forger deletes rank 1's vote right after rank 0's wait for it returned.
    Before, rank 0's read (a multi_get) then waited for the key until the store's timeout
    and the round ended with the store's error on rank 0 and a timeout on the others; now
    the read finds it missing, rank 1 puts its record back while it waits, and the vote is
    taken on every rank."""
    state = {"on": True}

    def deleting(raw, keys):
        if state["on"] and f"{PREFIX}1/u/1" in keys:
            state["on"] = False
            raw.delete_key(f"{PREFIX}1/u/1")

    got = _run_all(3, lambda rounds, r: rounds.all_ok(True), after_wait=deleting)
    assert not state["on"]
    assert got == [True] * 3, got


# ---------------------------------------------------------------------------- the fuzzer
def _random_inventories(rng, world):
    invs = []
    for r in range(world):
        own = frozenset(i for i in (5, 6, 7) if rng.random() < 0.6)
        copies = {o: frozenset(i for i in (5, 6, 7) if rng.random() < 0.5)
                  for o in range(world) if o != r and rng.random() < 0.4}
        invs.append(Inventory(own=own, copies=copies, committed=rng.choice([-1, 4, 5])))
    return invs


class Fuzzer:
    """After a genuine write, now and then, one forgery: a counter moved (those of the
    rounds before issue 57 and of the unsigned rounds: cover, the vote, the posts), a
    record written over (or early) with junk, a forged seal, a claim in JSON or a genuine
    record of another slot, or a member's record deleted (a result deleted leaves its
    reader waiting until its timeout, as any deletion of a key waited for: not drawn)."""

    def __init__(self, rng, world, p=0.25):
        self.rng, self.world, self.p = rng, world, p
        self.seen = [b"x"]
        self.lock = threading.Lock()

    def _counter(self, r):
        rng = self.rng
        return rng.choice([f"{PREFIX}{r}/arrived", f"{PREFIX}{r}/c/cover/{rng.randrange(4, 9)}",
                           f"{PREFIX}{r}/c/false",
                           f"{PREFIX}{r}/p/holds/{rng.randrange(self.world)}/n"])

    def _record(self, r):
        rng = self.rng
        x = rng.randrange(self.world)
        return rng.choice([f"{PREFIX}{r}/u/{x}", f"{PREFIX}{r}/d/{x}",
                           f"{PREFIX}{r}/p/holds/{x}/1"])

    def _value(self, r):
        rng = self.rng
        return rng.choice([b"\xff\xfejunk", json.dumps([rng.randrange(self.world), [7]]),
                           auth.seal("not-the-secret", {"k": "up", "g": GEN, "r": r}),
                           rng.choice(self.seen)])

    def __call__(self, raw, op, key, value):
        with self.lock:
            if op == "set" and isinstance(value, (str, bytes)):
                self.seen.append(value)
            rng = self.rng
            if rng.random() > self.p:
                return
            r = rng.randrange(1, 5)
            what = rng.random()
            if what < 0.4:
                raw.add(self._counter(r), rng.choice([1, -1, 2, -3, 1000]))
            elif what < 0.9:
                raw.set(self._record(r), self._value(r))
            else:
                raw.delete_key(f"{PREFIX}{r}/u/{rng.randrange(self.world)}")


def test_fuzzed_rounds_finish_right_or_stop_naming_forgery():
    """Random inventories and random forgeries around every genuine write: each rank's part
    of the decision is choose_restore's, or the restore stops with ForgedRecordError. A
    NoCommittedStateError comes only where choose_restore itself finds the state lost,
    never for a forgery. Nothing else is raised, but a rank's timeout waiting for one that
    had already stopped naming the forgery (the job stops with that one's message)."""
    rng = random.Random(49)
    finished = stopped = 0
    # The forger's draws follow the threads' interleaving, so how many trials end in a stop
    # varies from run to run: trials go on (30 at least, 240 at most) until both outcomes
    # were seen often enough (the tree's rounds read fewer keys, so fewer forgeries land on
    # a read one: 120 trials once gave 5 stops). Every trial's outcome is checked either way.
    for trial in range(240):
        if trial >= 30 and finished > 20 and stopped > 5:
            break
        world = rng.randint(2, 5)
        invs = _random_inventories(rng, world)
        try:
            want, lost = choose_restore(invs), None
        except NoCommittedStateError as exc:
            want, lost = None, str(exc)
        got = _run_all(world, lambda rounds, r: agree(rounds, r, invs[r]),
                       Fuzzer(random.Random(trial), world))
        named = any(isinstance(g, ForgedRecordError) for g in got)
        for r, g in enumerate(got):
            if isinstance(g, TransportTimeout) and named:
                continue  # waited for a rank that had stopped naming the forgery
            elif isinstance(g, ForgedRecordError):
                assert "forged by someone without the job secret" in str(g)
                stopped += 1
            elif want is None:
                assert isinstance(g, NoCommittedStateError) and str(g) == lost, (trial, r, g)
            else:
                assert not isinstance(g, Exception), (trial, r, [repr(x)[:120] for x in got])
                assert g[0].iteration == want.iteration, (trial, r)
                assert g[0].sources.get(r) == want.sources.get(r), (trial, r)
                assert g[0].serves(r) == want.serves(r), (trial, r)
                finished += 1
    assert finished > 20 and stopped > 5, (finished, stopped)


def test_fuzzed_commit_votes_never_commit_over_a_no(caplog):
    """Random forgeries around commit votes: an iteration with a "no" never commits; one
    with every "yes" commits unless a forged record made the vote a no (logged). A rank's
    timeout comes only after another named the forgery."""
    rng = random.Random(4949)
    for trial in range(25):
        world = rng.randint(2, 5)
        votes = [rng.random() < 0.8 for _ in range(world)]
        caplog.clear()
        got = _run_all(world, lambda rounds, r: [rounds.all_ok(votes[r]) for _ in range(3)],
                       Fuzzer(random.Random(trial), world, p=0.15))
        for r, g in enumerate(got):
            if isinstance(g, TransportTimeout) and "forged by someone" in caplog.text:
                continue
            assert not isinstance(g, Exception), (trial, r, type(g).__name__, g)
            assert all(v is False for v in g) if not all(votes) else all(
                isinstance(v, bool) for v in g), (trial, votes, g)


# ------------------------------------------------------------- implicit commits' board
def test_a_forged_rejection_is_ignored_and_a_genuine_one_counts(caplog):
    """Implicit commits' rejection board: a post that does not verify (unsigned, another
    secret, or signed for another iteration or generation) cannot keep an iteration from
    committing, and is logged as forged; a genuine one is seen (before: any value posted)."""
    from megatron_deadpool.mirror.commit import REJECTED_KEY, RejectionBoard

    store = dist.HashStore()
    board = RejectionBoard(store, SECRET, GEN)
    store.set(f"{REJECTED_KEY}5", "1")
    store.set(f"{REJECTED_KEY}6", auth.seal("not-the-secret", {"k": "rejected", "g": GEN,
                                                                 "it": 6}))
    RejectionBoard(store, SECRET, GEN + 1).post(7)  # another generation's
    store.set(f"{REJECTED_KEY}8", store.get(f"{REJECTED_KEY}7"))  # moved to another iteration
    assert [board.posted(i) for i in (5, 6, 7, 8)] == [False] * 4
    assert caplog.text.count("rejection record forged by someone without the job secret") == 4
    board.post(9)
    assert board.posted(9) and not board.posted(10)


# ----------------------------------------------------------------- a job, end to end
class RoundForger(threading.Thread):
    """The attack on a running job's rounds where they are read (issue 58: the earlier
    forger planted the unsigned counters of before issue 49 on the job's store, which
    nothing read any more). It reads each node's record store address from the job's store
    (``dp/node_store/{n}``: signed, but readable by anyone) and the current generation
    (``dp/latest``), connects to every node's store and, for the next generation, writes
    records that do not verify under the first rounds' up and down records of both users
    of the rounds (the keep votes, the mirror's), before their writers: junk, and
    well-formed records sealed with another key that name a forged rank (taken, they would
    stop the restore). Each costs its reader polling until its writer writes over it."""

    NODES = 5  # 4 nodes and the spare node
    ROUNDS, RANKS = 8, 8

    def __init__(self, host: str, port: int, seed: int = 49):
        super().__init__(daemon=True)
        self.host, self.port = host, port
        self.rng, self.stop = random.Random(seed), threading.Event()
        self.written = 0
        self.error = None
        self.live = {}  # generation -> records written for it (before it began)
        self.stores = {}  # node -> a client of its record store

    def _connect(self, job) -> None:
        from megatron_deadpool.membership import store as st

        for n in range(self.NODES):
            if n not in self.stores and job.check([st.k("node_store", n)]):
                body = json.loads(job.get(st.k("node_store", n)))["body"]
                self.stores[n] = st.connect(body["host"], body["port"], 30.0)

    def _plant(self, g: int) -> None:
        from megatron_deadpool.mirror import round_records as rr

        for prefix, what in ((f"repair/{PREFIX}", "keep"), (PREFIX, "restore")):
            for r in range(1, self.ROUNDS + 1):
                for x in range(1, self.RANKS):
                    for way, kind, slot in (("u", "up", "from"), ("d", "down", "to")):
                        value = b"\xff\xfejunk" if self.rng.random() < 0.5 else rr.seal(
                            "not-the-job-secret", kind, g, r, what, **{slot: x}, posts={},
                            adds={}, reads=[], counts=[], forged={str(x): "planted"})
                        for store in self.stores.values():
                            store.set(f"gen{g}//{prefix}{r}/{way}/{x}", value)  # PrefixStore adds a /
                            self.written += 1
        self.live[g] = self.written

    def run(self) -> None:
        from megatron_deadpool.membership import store as st

        try:
            job = st.connect(self.host, self.port, 30.0)
            while not self.stop.is_set():
                self._connect(job)
                raw = job.get(st.k("latest")) if job.check([st.k("latest")]) else None
                gen = json.loads(raw)["body"]["gen"] if raw else 0
                if len(self.stores) == self.NODES and gen + 1 not in self.live:
                    self._plant(gen + 1)
                self.stop.wait(0.01)
        except Exception as exc:  # noqa: BLE001 - the job ended under the forger
            self.error = exc


@pytest.mark.slow
def test_a_job_whose_rounds_are_forged_recovers_bitwise(tmp_path, reference):
    """A forger writes records that do not verify into the rounds of the running job, on
    the node stores where they are read (RoundForger); the job loses node 1 (SIGKILLed from
    outside at iteration 5) and recovers while the forger writes into the recovery
    generation's rounds. The recovery takes none of them: the job ends bitwise with one
    recovery."""
    from conftest import assert_ok_and_bitwise, kill_node_from_outside, layout_flags

    flags, forgers = layout_flags(2, 2, 12), []

    def start_forger(line):
        if not forgers and "coordinator " in line:
            host, _, port = line.split("coordinator ", 1)[1].strip().rpartition(":")
            forgers.append(RoundForger(host, int(port)))
            forgers[0].start()

    try:
        proc, s, _ = kill_node_from_outside(tmp_path, flags, on_line=start_forger)
    finally:
        for f in forgers:
            f.stop.set()
            f.join(10)
    assert forgers and len(forgers[0].stores) == RoundForger.NODES, \
        (forgers and (forgers[0].stores, forgers[0].error))
    assert {1, 2} <= set(forgers[0].live), (forgers[0].live, forgers[0].error)
    assert "NoCommittedStateError" not in proc.stdout
    assert_ok_and_bitwise(proc, s, reference(flags))
    (rec,) = s["recoveries"]
    assert rec["failed_ranks"] == [2, 3], rec
