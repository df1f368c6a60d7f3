"""Issue 51: a recovery keeps every group whose members are all alive and settled, and
rebuilds only the others (recovery/repair.py).

The layouts run megatron-core's own ``initialize_model_parallel`` for one rank of a
``fake``-backend world (torch's test backend: groups without communication), through
``World`` as a recovery drives it: first build, abort, retire, a new default group, the
replay. The votes' store round is replaced by "every member gave the same account" (its
own test, with a real store and threads, is below)."""

import random
import threading

import pytest
import torch.distributed as dist

from megatron_deadpool.adapters import groups
from megatron_deadpool.apps import sim_scale
from megatron_deadpool.base import counts
from megatron_deadpool.base.plan import Plan
from megatron_deadpool.recovery import group_ops, repair
from megatron_deadpool.recovery.world import World


def _plan(gen, world, failed=(), moved=0):
    """Ranks 0..W-1 held by processes 0..W-1, the failed ranks' taken by new lids."""
    rank_of = {r: r for r in range(world) if r not in failed}
    rank_of.update({world + moved + i: r for i, r in enumerate(sorted(failed))})
    return Plan(gen=gen, world_size=world, rank_of=rank_of,
                node_of_rank=tuple(r // 2 for r in range(world)), failed_ranks=tuple(failed))


def _roles():
    """role -> (group, its global ranks in group-rank order) for every group megatron
    holds now (non-members' slots are not groups)."""
    out = {}
    for gid, role in groups.roles(dist.ProcessGroup).items():
        g = groups.group_of(role)
        out[role] = (g, tuple(dist.get_process_group_ranks(g)))
    return out


def _fresh(kwargs, rank, world):
    """What a first build gives this rank, in a world of its own."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    groups.destroy()
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    groups.initialize(**kwargs)
    out = {role: ranks for role, (_, ranks) in _roles().items()}
    groups.destroy()
    dist.destroy_process_group()
    return out


def _layouts(n, seed):
    rng = random.Random(seed)
    out = []
    while len(out) < n:
        tp, pp, dp = rng.choice([1, 2, 4]), rng.choice([1, 2, 4]), rng.choice([1, 2, 4, 8])
        if tp * pp * dp > 64 or tp * pp * dp < 4:
            continue
        kw = {"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp,
              "create_gloo_process_groups": False}  # a gloo group needs a real store
        if pp > 1 and rng.random() < 0.5:
            kw["virtual_pipeline_model_parallel_size"] = 2
        if dp % 2 == 0 and rng.random() < 0.4:
            kw["expert_model_parallel_size"] = 2
        world = tp * pp * dp
        dead = rng.sample(range(world), rng.choice([1, 2, min(4, world // 2)]))
        out.append((kw, world, sorted(dead), rng.randrange(world)))
    return out


@pytest.fixture
def fake_world(monkeypatch):
    from torch.testing._internal.distributed.fake_pg import FakeStore

    def settle(replay):  # every member gave the same account: keep iff a "keep:" one
        for key, old in replay.old.groups.items():
            if not set(key[0]) & replay.failed and key[1] in ("", "gloo"):
                replay.verdicts[key] = repair.group_ops.digest(
                    old.group_name, replay.me, key[0]).startswith("keep")
    monkeypatch.setattr(repair.Replay, "settle", settle)

    def make(rank, world, kwargs, plan0):
        w = World("fake", 1, 30.0, 30.0, emit=lambda *a, **k: None)
        w.keep = True
        w.init_process_group(FakeStore(), 0, rank, world, plan=plan0)
        w.build_groups(kwargs)
        return w
    yield make, FakeStore
    groups.destroy()
    if dist.is_initialized():
        dist.destroy_process_group()


def _recover(w, store_cls, rank, world, plan1):
    w.abort("test", rank)
    w.retire()
    w.init_process_group(store_cls(), plan1.gen, rank, world, plan=plan1)
    before = counts.snapshot()
    w.build_groups()
    return counts.delta(before, counts.snapshot())


@pytest.mark.parametrize("kw,world,dead,rank", _layouts(24, seed=51))
def test_kept_groups_hold_no_dead_rank_and_rebuilt_ones_equal_a_fresh_build(
        fake_world, kw, world, dead, rank):
    make, store_cls = fake_world
    if rank in dead:
        rank = next(r for r in range(world) if r not in dead)  # a survivor
    fresh = _fresh(kw, rank, world)
    w = make(rank, world, kw, _plan(0, world))
    before = _roles()
    did = _recover(w, store_cls, rank, world, _plan(1, world, dead))
    after = _roles()
    assert set(after) == set(fresh), "every role megatron asks for is served"
    kept = rebuilt = 0
    for role, (g, ranks) in after.items():
        assert ranks == fresh[role], (role, ranks, fresh[role])  # members and their order
        old = before[role][0]
        if set(ranks) & set(dead):
            assert g is not old, f"{role} holds a dead rank and was kept"
            rebuilt += 1
        else:
            assert g is old, f"{role}: no member died, its group was not kept"
            kept += 1
    dropped = w.take_dropped()
    for g in dropped:  # out of torch's registry, none of them still megatron's
        assert g not in dist.distributed_c10d._world.pg_map
        assert all(g is not h for h, _ in after.values())
    assert did.get("groups_kept", 0) >= (1 if kept else 0)
    assert did.get("groups_rebuilt", 0) >= 1  # the default group at least
    # the dead ranks' own groups, counted apart (issue 57): each rebuilt group that holds
    # a dead rank, once, with its size and its connections
    mine = {id(g): ranks for g, ranks in after.values() if set(ranks) & set(dead)}
    assert did.get("dead_groups", 0) == len(mine), (did, mine)
    assert did.get("dead_group_members", 0) == sum(len(r) for r in mine.values())
    assert did.get("dead_group_connections", 0) == sum(len(r) - 1 for r in mine.values())


def test_a_group_with_an_operation_in_flight_is_rebuilt(fake_world):
    """Its members live, but one of them has an operation on it not waited on: the
    account is "open", the vote says rebuild."""
    make, store_cls = fake_world
    kw = {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2,
          "create_gloo_process_groups": False}
    w = make(0, 8, kw, _plan(0, 8))
    tp = groups.group_of("_TENSOR_MODEL_PARALLEL_GROUP")
    group_ops.issued(tp)  # never finished
    _recover(w, store_cls, 0, 8, _plan(1, 8, [6, 7]))  # no member of {0, 1} died
    assert groups.group_of("_TENSOR_MODEL_PARALLEL_GROUP") is not tp
    pp = groups.group_of("_PIPELINE_MODEL_PARALLEL_GROUP")  # {0, 4}: kept
    assert dist.get_process_group_ranks(pp) == [0, 4]


def test_accounts():
    name = "acct-test"
    assert group_ops.digest(name, 0, (0, 1)) == f"keep:{name}:c0"
    group = type("G", (), {"group_name": name})()
    a = group_ops.issued(group, peer=1, send=True)
    assert group_ops.digest(name, 0, (0, 1)).startswith("open")
    a.done()
    # rank 0 sent one message to 1; rank 1 took it: both give the same account
    assert group_ops.digest(name, 0, (0, 1)) == f"keep:{name}:c0:p1,0"
    group_ops.forget(name)
    group_ops.issued(group, peer=0, send=False).done()
    assert group_ops.digest(name, 1, (0, 1)) == f"keep:{name}:c0:p1,0"
    assert group_ops.digest(name, 1, (0, 1, 2)) == "p2p"  # larger groups: rebuilt
    group_ops.forget(name)


KEY = ((0, 1, 2), "gloo", 0)


class _Swapped:
    """A rank's store on which ``swap(key, value)`` replaces what it writes (a forger who
    wrote over it before any reader saw it); None leaves the value."""

    def __init__(self, raw, swap):
        self.raw, self.swap = raw, swap

    def __getattr__(self, name):
        op = getattr(self.raw, name)
        if name != "set":
            return op
        return lambda key, value: op(key, self.swap(key, value) or value)


def _settle(accounts, monkeypatch, swap=None, secret="job-secret"):
    """Each member's verdict on one group of three, from one signed round among threads
    (each its own store connection, as each process has); ``swap`` on rank 1's writes."""
    from megatron_deadpool.mirror import rounds as rounds_mod

    monkeypatch.setattr(rounds_mod, "GRACE_S", 0.3)
    monkeypatch.setattr(rounds_mod, "SLICE_S", 0.1)
    monkeypatch.setattr(repair.group_ops, "digest", lambda name, me, members: accounts[me])
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    group = type("G", (), {"group_name": "7"})()
    got, lids = {}, {r: 10 + r for r in range(3)}

    def member(i):
        client = dist.PrefixStore("repair/", dist.TCPStore("127.0.0.1", store.port,
                                                           is_master=False))
        if swap is not None and i == 1:
            client = _Swapped(client, swap)
        rounds = rounds_mod.StoreRounds(client, i, 3, 10.0, secret, gen=1)
        replay = repair.Replay(gen=1, me=i, lids=lids, failed=set(), rounds=rounds,
                               old=repair.Book(groups={KEY: group}, lids=dict(lids)))
        replay.settle()
        got[i] = replay.verdicts.get(KEY, False)
    threads = [threading.Thread(target=member, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return got


@pytest.mark.parametrize("accounts,keep", [
    (["keep:7:c3"] * 3, True),
    (["keep:7:c3", "keep:7:c3", "keep:7:c4"], False),
    (["keep:7:c3", "open", "keep:7:c3"], False),
    (["new"] * 3, False),
])
def test_the_vote(accounts, keep, monkeypatch):
    """One signed round decides the group; every member gets the same verdict."""
    assert _settle(accounts, monkeypatch) == {i: keep for i in range(3)}


def test_a_forged_keep_vote_is_refused_named_and_the_group_rebuilt(monkeypatch, caplog):
    """Issue 58: rank 1 had an operation in flight (its account differs), and a store client
    without the secret writes over rank 1's vote, as it is written, a well-formed vote that
    agrees with the others (sealed with another key). The forged record fails its MAC and is
    named; every member rebuilds the group (with the check gone, all three kept it)."""
    from megatron_deadpool.mirror import round_records as rr
    from megatron_deadpool.mirror.rounds import PREFIX

    t, h = repair.topic(KEY), repair.account_hash("keep:7:c3")
    adds = {f"{t}/n": 1, f"{t}/s": h}
    forged = rr.seal("not-the-job-secret", "up", 1, 1, "keep", **{"from": 1}, posts={},
                     adds=adds, reads=[], counts=sorted(adds), forged={})
    caplog.set_level("WARNING")
    got = _settle(["keep:7:c3", "keep:7:c4", "keep:7:c3"], monkeypatch,
                  swap=lambda key, value: forged if key == f"{PREFIX}1/u/1" else None)
    assert got == {0: False, 1: False, 2: False}
    assert "every group is rebuilt" in caplog.text
    assert "forged by someone without the job secret (rank 1" in caplog.text


def test_groups_made_outside_the_build_leave_the_registry(fake_world):
    """A group made after megatron's build (the gloo mirror transport's) is not kept: the
    retire takes it out of torch's registry (its owner destroys it), or the full audit
    finds it alive, held by torch's tables."""
    make, store_cls = fake_world
    kw = {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2,
          "create_gloo_process_groups": False}
    w = make(0, 8, kw, _plan(0, 8))
    stray = dist.new_group(list(range(8)))
    _recover(w, store_cls, 0, 8, _plan(1, 8, [2, 3]))
    assert stray not in dist.distributed_c10d._world.pg_map
    current = {id(g) for g, _ in _roles().values()} | {id(dist.group.WORLD)}
    assert {id(g) for g in dist.distributed_c10d._world.pg_map} <= current


@pytest.mark.parametrize("world", [16, 64])
def test_a_survivors_replay_calls_torch_only_for_the_groups_it_rebuilds(fake_world,
                                                                       monkeypatch, world):
    """Issue 57: rebuilding megatron-core's groups does not make a rank call torch's
    ``new_group`` for groups it is not in. A survivor far from the dead node (TP2 x PP2, node
    1 = ranks 2 and 3 lost) makes the same number of torch calls at W = 16 and W = 64."""
    make, store_cls = fake_world
    kw = {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2,
          "create_gloo_process_groups": False}
    rank = world - 1
    w = make(rank, world, kw, _plan(0, world))
    calls = []
    torch_new_group = dist.new_group

    def counted(*a, **k):
        calls.append(k.get("ranks", a[0] if a else None))
        return torch_new_group(*a, **k)
    monkeypatch.setattr(dist, "new_group", counted)
    did = _recover(w, store_cls, rank, world, _plan(1, world, [2, 3]))
    mine = [r for r in calls if r is None or rank in r]
    assert len(calls) == len(mine), f"torch called for {len(calls) - len(mine)} foreign groups"
    assert len(calls) == did.get("groups_rebuilt", 0)  # (the default group is made before)
    assert len(calls) <= 4, calls  # the dead ranks' data-parallel side only: not O(W)


KINDS_CAUGHT = ("coalesced", "all_reduce", "never_waited")


def _caught_worker(rank: int, port: int, out) -> None:
    """One of three members of three gloo groups. On each, ranks 0 and 1 are caught by the
    abort in a collective that rank 2 never issued (as a data-parallel reduce-scatter the
    dead ranks' pipeline partners never joined), one kind per group (KINDS_CAUGHT); then
    the three settle the groups with real signed rounds over the store, and each kept group
    must still compute."""
    import threading
    import time
    from datetime import timedelta

    import torch

    from megatron_deadpool.mirror import rounds as rounds_mod
    from megatron_deadpool.recovery import gloo_waits

    client = dist.TCPStore("127.0.0.1", port, is_master=False)
    dist.init_process_group("gloo", store=dist.PrefixStore("pg/", client), rank=rank,
                            world_size=3, timeout=timedelta(seconds=20))
    gloo_waits.install()
    groups = {k: dist.new_group([0, 1, 2], backend="gloo", timeout=timedelta(seconds=20))
              for k in KINDS_CAUGHT}
    held = []

    def caught(kind, g):
        try:
            if kind == "coalesced":  # as megatron's bucketed gradient reduce-scatter
                with dist._coalescing_manager(group=g):
                    dist.reduce_scatter_tensor(torch.zeros(2), torch.ones(6), group=g)
            elif kind == "never_waited":  # issued asynchronously (--overlap-grad-reduce),
                # and the failure came before its wait
                held.append(dist.all_gather_into_tensor(  # the handle kept, as megatron's
                    torch.zeros(6), torch.ones(2), group=g, async_op=True))  # bucket does
            else:
                dist.all_reduce(torch.ones(5), group=g)
        except RuntimeError:  # abandoned at the abort
            pass
    for kind, g in groups.items():
        dist.all_reduce(torch.ones(6), group=g)  # settled: one collective each
        if rank < 2:
            threading.Thread(target=caught, args=(kind, g), daemon=True).start()
    time.sleep(1.0)
    gloo_waits.abandon_all()  # the abort
    gloo_waits.reopen()       # the next generation live
    keys = {((0, 1, 2), "gloo", n): k for n, k in enumerate(KINDS_CAUGHT)}
    lids = {r: 10 + r for r in range(3)}
    rounds = rounds_mod.StoreRounds(dist.PrefixStore("keep/", client), rank, 3, 20.0,
                                    "job-secret", gen=1)
    replay = repair.Replay(gen=1, me=rank, lids=lids, failed=set(), rounds=rounds,
                           old=repair.Book(groups={key: groups[k] for key, k in keys.items()},
                                           lids=dict(lids)))
    before = counts.snapshot()
    replay.settle()
    got = {}
    for key, kind in keys.items():
        y = torch.full((3,), rank + 1.0)
        if replay.verdicts.get(key, False):
            dist.all_reduce(y, group=groups[kind])
        got[kind] = y.tolist()
    out.put((rank, got, counts.delta(before, counts.snapshot()).get("groups_completed", 0),
             rounds._round))
    client.set(f"done{rank}", "1")
    client.wait([f"done{r}" for r in range(3)], timedelta(seconds=30))


def test_groups_caught_with_a_collective_in_flight_are_completed_and_kept():
    """Issue 57: a group none of whose members died, caught by the failure in a collective
    some members issued and the others never did, was rebuilt by every member (W / (TP x
    PP) - 1 connections each, the last recovery work outside the dead ranks' groups that
    grew with W). The members that never issued it now issue the same one (its description
    comes through a signed round), it finishes everywhere, every account agrees, and the
    group is kept; an all-reduce on it afterwards sums 1 + 2 + 3. Three groups at once, one
    per kind: a blocking coalesced reduce-scatter, a blocking all-reduce, an asynchronous
    all-gather never waited on."""
    import multiprocessing as mp

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_caught_worker, args=(r, server.port, out)) for r in range(3)]
    for p in procs:
        p.start()
    try:
        got = sorted(out.get(timeout=120) for _ in range(3))
    finally:
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
    six = dict.fromkeys(KINDS_CAUGHT, [6.0, 6.0, 6.0])
    # the signed rounds it took: what deadpool sim's keep votes term counts
    rounds_taken = next(u.value for u in sim_scale.units() if u.name == "keep_rounds")
    assert got == [(r, six, len(KINDS_CAUGHT), rounds_taken) for r in range(3)], got
