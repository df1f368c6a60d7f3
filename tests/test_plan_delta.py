"""Plan deltas (issue 57): a survivor that holds generation g - 1's plan reads only what
changed in g (O(changed ranks) bytes); a member without it, or a delta that is missing,
forged or does not rebuild the plan's digest, reads the full plan (O(W) bytes). Before,
every member read the full plan: O(W^2) bytes through the job's one store per recovery."""

import random

import pytest
from torch.distributed import HashStore

from megatron_deadpool.base import counts
from megatron_deadpool.base.plan import Drain, Plan, apply_delta, delta
from megatron_deadpool.membership import auth
from megatron_deadpool.membership.store import Coordinator, k

SECRET = "the-job-secret"


def _plans(world=4096, gpn=4, lost_node=3, spare_lid0=None):
    nodes = tuple(r // gpn for r in range(world))
    g0 = Plan(gen=0, world_size=world, rank_of={r: r for r in range(world)},
              node_of_rank=nodes, prev_node_of_rank=nodes, t=1.0)
    lost = range(lost_node * gpn, (lost_node + 1) * gpn)
    spare = world if spare_lid0 is None else spare_lid0
    rank_of = {lid: r for lid, r in g0.rank_of.items() if r not in lost}
    rank_of.update({spare + i: r for i, r in enumerate(lost)})
    g1 = Plan(gen=1, world_size=world, rank_of=rank_of,
              node_of_rank=tuple(world // gpn if r in lost else n for r, n in enumerate(nodes)),
              prev_node_of_rank=nodes, failed_ranks=tuple(lost),
              spare_of_rank={r: spare + i for i, r in enumerate(lost)}, t=2.0, t_failure=1.5)
    return g0, g1


def _random_plan(rng, gen, world, prev=None):
    lids = list(range(world + 8))
    rng.shuffle(lids)
    return Plan(gen=gen, world_size=world, rank_of={lids[r]: r for r in range(world)},
                node_of_rank=tuple(rng.choice([0, 1, 2, "n3"]) for _ in range(world)),
                prev_node_of_rank=prev.node_of_rank if prev and rng.random() < 0.7 else
                tuple(rng.randrange(4) for _ in range(rng.randrange(world + 1))),
                failed_ranks=tuple(sorted(rng.sample(range(world), min(world, rng.randrange(3))))),
                spare_of_rank={rng.randrange(world): rng.randrange(99) for _ in range(2)},
                t=rng.random(), t_failure=rng.choice([None, 0.5]),
                drain=rng.choice([None, Drain(node=1, reason="slurm", leaving=(3, 4))]))


def test_a_delta_rebuilds_the_plan_exactly():
    rng = random.Random(57)
    for trial in range(200):
        world = rng.randint(1, 12)
        prev = _random_plan(rng, trial, world)
        new = _random_plan(rng, trial + 1, world, prev)
        assert apply_delta(prev, delta(prev, new)) == new, trial
    g0, g1 = _plans()
    assert apply_delta(g0, delta(g0, g1)) == g1


def test_a_delta_is_a_few_hundred_bytes_where_the_plan_grows_with_the_world():
    for world in (1024, 4096):
        g0, g1 = _plans(world)
        full = len(auth.seal(SECRET, g1.to_json()))
        small = len(auth.seal(SECRET, delta(g0, g1)))
        assert small < 1200 < 20 * world < full, (world, small, full)


def test_a_delta_from_another_plan_or_altered_is_refused():
    g0, g1 = _plans(64)
    d = delta(g0, g1)
    with pytest.raises(ValueError, match="from generation"):
        apply_delta(g1, d)
    d["node_of_rank"]["set"]["0"] = 99
    with pytest.raises(ValueError, match="digest"):
        apply_delta(g0, d)
    with pytest.raises(ValueError, match="malformed"):
        apply_delta(g0, {"from": 0})


def _read(raw, gen, holds=None):
    reader = Coordinator(raw, SECRET)
    if holds is not None:
        reader._keep(holds)
    before = counts.snapshot()
    plan = reader.get_plan(gen)
    return plan, counts.delta(before, counts.snapshot()).get("bytes", 0)


def test_a_survivor_reads_the_delta_and_a_spare_the_whole_plan():
    raw = HashStore()
    writer = Coordinator(raw, SECRET)
    g0, g1 = _plans(2048)
    writer.publish_plan(g0)
    writer.publish_plan(g1)
    survivor, survivor_bytes = _read(raw, 1, holds=g0)
    spare, spare_bytes = _read(raw, 1)
    assert survivor == spare == g1
    assert survivor_bytes < 1200 < 20 * 2048 < spare_bytes, (survivor_bytes, spare_bytes)


@pytest.mark.parametrize("forgery", ["junk", "other-secret", "older-delta", "deleted"])
def test_a_forged_delta_falls_back_to_the_signed_plan(forgery):
    raw = HashStore()
    writer = Coordinator(raw, SECRET)
    g0, g1 = _plans(256)
    _, g2 = _plans(256, lost_node=5, spare_lid0=900)
    g2 = Plan(**{**g2.__dict__, "gen": 2})
    for p in (g0, g1, g2):
        writer.publish_plan(p)
    key = k("plan_delta", 2)
    if forgery == "junk":
        raw.set(key, b"\xff\xfejunk")
    elif forgery == "other-secret":
        raw.set(key, auth.seal("not-the-job-secret", {**delta(g1, g2), "node_of_rank": {
            "n": 256, "set": {"0": 77}}}))
    elif forgery == "older-delta":
        raw.set(key, raw.get(k("plan_delta", 1)))
    else:
        raw.delete_key(key)
    got, nbytes = _read(raw, 2, holds=g1)
    assert got == g2 and nbytes > 20 * 256
