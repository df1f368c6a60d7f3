"""The restore agreed in store rounds (recovery/restore.py ``agree``, mirror/rounds.py): each
rank's part of ``choose_restore``'s decision, the same on every inventory, and a survivor's
store operations independent of the world size (issue 39)."""

import random
import threading

import pytest
import torch.distributed as dist

from megatron_deadpool.base.errors import NoCommittedStateError, TransportTimeout
from megatron_deadpool.mirror.rounds import StoreRounds
from megatron_deadpool.recovery.restore import Inventory, agree, choose_restore


class _Counted:
    """A store that counts each rank's operations, leaving out those that depend on who
    arrives at a barrier last (it opens the round; the others wait for it): every member's
    barrier counts as its one ``add``."""

    def __init__(self, inner):
        self.inner, self.ops = inner, 0

    def __getattr__(self, name):
        op = getattr(self.inner, name)

        def counted(*args):
            if name != "wait" and not (name == "set" and args[0].endswith("/open")):
                self.ops += 1
            return op(*args)
        return counted


def _agree_all(invs, timeout_s=20.0):
    store = dist.HashStore()
    stores = [_Counted(store) for _ in invs]
    out = [None] * len(invs)

    def one(r):
        try:
            out[r] = agree(StoreRounds(stores[r], r, len(invs), timeout_s), r, invs[r])
        except Exception as exc:  # noqa: BLE001 - compared by the test
            out[r] = exc

    threads = [threading.Thread(target=one, args=(r,)) for r in range(len(invs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
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
    for world in (4, 8, 32):
        got, ops = _agree_all(_ring(world, lost=1))
        assert all(g[0].iteration == 7 for g in got)
        assert got[2][0].serves(2) == [1] and got[1][0].sources[1] == 2
        per_w[world] = ops
    # the same role, the same work, at every W: the spare, its holder, a bystander
    for r in (1, 2, 3):
        assert per_w[4][r] == per_w[8][r] == per_w[32][r], (r, per_w)
    assert per_w[32][10] == per_w[8][5] == per_w[4][3]


def test_a_member_that_never_arrives_ends_the_round_with_a_timeout():
    store = dist.HashStore()
    rounds = StoreRounds(store, 0, 2, timeout_s=0.5)
    with pytest.raises(TransportTimeout, match="not every member arrived"):
        rounds.all_ok(True)


def test_rounds_run_on_the_generation_store_that_counts_its_operations():
    """``--deadpool-count-work`` puts the generation's store behind a Python store under a
    prefix (recovery/world.py); every operation the rounds use must pass through it (a
    ``delete_key`` did not: torch's trampoline has no override for it)."""
    from megatron_deadpool.base import counts
    from megatron_deadpool.recovery.counting import counting_store

    counted = counting_store(dist.HashStore())  # kept alive, as generation_store keeps it
    store = dist.PrefixStore("gen3/", counted)
    rounds = StoreRounds(store, 0, 1, timeout_s=5)
    before = counts.snapshot()
    for _ in range(3):
        assert rounds.all_ok(True) and rounds.gather_from(7, [0]) == {0: 7}
    decision, _ = agree(rounds, 0, Inventory(own=frozenset({4}), copies={}))
    assert decision.iteration == 4
    assert counts.delta(before, counts.snapshot())["store_ops"] > 0
