"""The restore agreed in store rounds (recovery/restore.py ``agree``, mirror/rounds.py): each
rank's part of ``choose_restore``'s decision, the same on every inventory, and a survivor's
store operations independent of the world size (issue 39)."""

import random

import pytest
import torch.distributed as dist
from conftest import on_every_rank

from megatron_deadpool.base.errors import NoCommittedStateError, TransportTimeout
from megatron_deadpool.mirror.rounds import StoreRounds
from megatron_deadpool.recovery.restore import Inventory, agree, choose_restore


class _Counted:
    """A store that counts each rank's operations, leaving out those that depend on who
    arrives at a barrier last (it opens the round; the others wait for it): every member's
    barrier counts as its one ``add``; and the looks of a wait (``check``, records.polled),
    as many as the wait lasts."""

    def __init__(self, inner):
        self.inner, self.ops = inner, 0

    def __getattr__(self, name):
        op = getattr(self.inner, name)

        def counted(*args):
            if name not in ("wait", "check") and not (name == "set"
                                                      and args[0].endswith("/open")):
                self.ops += 1
            return op(*args)
        return counted


def _agree_all(invs, timeout_s=20.0):
    store = dist.HashStore()
    stores = [_Counted(store) for _ in invs]
    out = on_every_rank(len(invs), lambda r: agree(
        StoreRounds(stores[r], r, len(invs), timeout_s), r, invs[r]))
    return out, [s.ops for s in stores]


def _random_inventories(rng, world):
    invs = []
    for r in range(world):
        own = frozenset(i for i in (5, 6, 7) if rng.random() < 0.6)
        copies = {o: frozenset(i for i in (5, 6, 7) if rng.random() < 0.5)
                  for o in range(world) if o != r and rng.random() < 0.4}
        invs.append(Inventory(own=own, copies=copies, committed=rng.choice([-1, 4, 5])))
    return invs


def test_each_rank_agrees_on_its_part_of_choose_restores_decision():
    rng = random.Random(39)
    decided = failed = 0
    for _ in range(150):
        invs = _random_inventories(rng, rng.randint(1, 6))
        got, _ = _agree_all(invs)
        try:
            want = choose_restore(invs)
        except NoCommittedStateError as exc:
            failed += 1
            assert all(isinstance(g, NoCommittedStateError) and str(g) == str(exc)
                       for g in got), (got, exc)
            continue
        decided += 1
        held = {(o, h) for h, inv in enumerate(invs) for o, its in inv.copies.items()
                if want.iteration in its}
        for r, g in enumerate(got):
            assert not isinstance(g, Exception), g
            decision, skip = g
            assert decision.iteration == want.iteration
            assert decision.sources.get(r) == want.sources.get(r)
            assert decision.serves(r) == want.serves(r)
            assert skip == {(o, h) for o, h in held if r in (o, h)}
    assert decided > 20 and failed > 20  # both paths were exercised


def _ring(world, lost):
    """Every rank holds iteration 7 of its own state and a copy of rank r - 1's (K = 1);
    ``lost`` is a promoted spare: nothing of its own."""
    return [Inventory(own=frozenset() if r == lost else frozenset({7}),
                      copies={} if r == lost else {(r - 1) % world: frozenset({7})},
                      committed=7) for r in range(world)]


def test_a_survivors_store_operations_do_not_grow_with_the_world_size():
    per_w = {}
    for world in (4, 8, 24, 32):
        got, ops = _agree_all(_ring(world, lost=1))
        assert all(g[0].iteration == 7 for g in got)
        assert got[2][0].serves(2) == [1] and got[1][0].sources[1] == 2
        per_w[world] = ops
    # the work depends on a rank's place in the rounds' tree (root, inner, leaf) and its
    # number of children, never on W: the busiest rank's is the same once an inner rank
    # has all FANOUT children (W = 24 and 32), and a leaf's at every W
    assert max(per_w[4]) <= max(per_w[8]) <= max(per_w[24]) == max(per_w[32]), per_w
    assert per_w[32][10] == per_w[8][5] == per_w[4][3]


class _PerKey:
    """One rank's store operations as ``--deadpool-count-work`` counts them (recovery/
    counting.py's CountingStore): every call, a ``multi_get`` or ``multi_set`` once per
    key, ``compare_set`` included; the looks of its waits (``check``: as many as a wait
    lasts, records.polled) apart, in ``looks``."""

    def __init__(self, inner):
        self.inner, self.ops, self.looks, self.waits = inner, 0, 0, 0

    def __getattr__(self, name):
        op = getattr(self.inner, name)

        def counted(*args):
            self.waits += name == "wait"
            if name == "check":
                self.looks += 1
            else:
                self.ops += len(args[0]) if name in ("multi_get", "multi_set") else 1
            return op(*args)
        return counted


def _busiest_per_round(world):
    """The most store operations one rank does per round, over a restore's three rounds,
    a commit vote and a slot-size gather, with the job secret (signed records)."""
    store = dist.HashStore()
    stores = [_PerKey(store) for _ in range(world)]
    invs = _ring(world, lost=1)
    def one(r):
        rounds = StoreRounds(stores[r], r, world, 60.0, secret="s", gen=2)
        decision, _ = agree(rounds, r, invs[r])
        return (decision.iteration, rounds.all_ok(True),
                rounds.gather_from(r, [(r - 1) % world]), rounds._round)

    out = on_every_rank(world, one, join_s=120)
    assert out == [(7, True, {(r - 1) % world: (r - 1) % world}, 5) for r in range(world)]
    assert all(s.looks >= 5 for s in stores)  # every rank waits for its result each round
    # one look per wait (the bound's), for its children's records and for its result
    return max(s.ops for s in stores) / 5 + 2, [s.ops for s in stores]


def test_the_busiest_ranks_store_operations_per_round_do_not_grow_with_w(monkeypatch):
    """Issue 57: in the signed rounds, no rank reads or verifies W records any more (rank
    0 did: 101 / 172 / 316 store operations in a restore at W = 8 / 16 / 32). Per round,
    the busiest rank does at most MAX_OPS_PER_ROUND = 2 FANOUT + 6 operations (one look
    for its children, a get_now of each of their FANOUT records, its own, one look and
    one get_now for its result, FANOUT results for its children, two deletes), at W = 8
    and at W = 32. The further looks of a wait, and its slices (a ``compare_set`` each),
    depend on timing: counted apart, and no slice here."""
    from megatron_deadpool.mirror import rounds as rounds_mod

    monkeypatch.setattr(rounds_mod, "SLICE_S", 60.0)
    bound = rounds_mod.MAX_OPS_PER_ROUND
    at8, ops8 = _busiest_per_round(8)
    at32, ops32 = _busiest_per_round(32)
    assert at8 <= bound and at32 <= bound, (at8, at32, ops8, ops32)
    assert at32 == bound  # ranks with FANOUT children: the bound is reached, not passed
    # every other rank does less: rank 0 (no parent) and the leaves
    assert ops32[0] < max(ops32) and ops32[31] < ops32[0], ops32


def test_a_member_that_never_arrives_ends_the_round_with_a_timeout():
    store = dist.HashStore()
    rounds = StoreRounds(store, 0, 2, timeout_s=0.5)
    with pytest.raises(TransportTimeout, match="not every member arrived"):
        rounds.all_ok(True)


def test_rounds_run_on_the_generation_store_that_counts_its_operations():
    """``--deadpool-count-work`` puts the generation's store behind a Python store under a
    prefix (recovery/world.py); every operation the rounds use must pass through it, or be
    counted where it cannot (a ``delete_key``: torch's trampoline has no override for it).
    Two members, so that rank 1 writes, waits, reads and deletes."""
    from megatron_deadpool.base import counts
    from megatron_deadpool.recovery.counting import counting_store

    counted = counting_store(dist.HashStore())  # kept alive, as generation_store keeps it
    store = dist.PrefixStore("gen3/", counted)
    before = counts.snapshot()
    def one(r):
        rounds = StoreRounds(store, r, 2, timeout_s=20)
        for _ in range(3):
            assert rounds.all_ok(True) and rounds.gather_from(7 + r, [1 - r]) == {1 - r: 8 - r}
        inv = Inventory(own=frozenset({4}), copies={1 - r: frozenset({4})})
        return agree(rounds, r, inv)[0].iteration

    out = on_every_rank(2, one)
    assert out == [4, 4], out
    assert counts.delta(before, counts.snapshot())["store_ops"] > 0


def test_a_round_that_outlasts_its_slices_never_lets_a_store_wait_time_out():
    """A member 1 s late, slices of 0.05 s: the waiting members look (``check``) instead of
    a store ``wait`` with a timeout, which torch's TCPStore client logs twice, with a
    reverse name lookup each (5 s where no name server answers: a W = 32 rendezvous took
    5.2 s so). Planted: a ``wait`` per slice, and the tally shows it."""
    import time

    from megatron_deadpool.mirror.rounds import barrier

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    clients = [_PerKey(dist.TCPStore("127.0.0.1", server.port, is_master=False))
               for _ in range(4)]

    def one(r):
        if r == 3:
            time.sleep(1.0)
        barrier(clients[r], r, 4, 20.0, "s" * 32, 1, "arrived/", slice_s=0.05)

    assert on_every_rank(4, one) == [None] * 4
    assert [c.waits for c in clients] == [0] * 4
    assert max(c.looks for c in clients) > 4  # the early ones looked while rank 3 slept
