"""The membership plan (base/plan.py) and its rule (membership/plan.py): pure next_plan,
JSON round trip, 16k ranks."""

import pytest

from megatron_deadpool.base.errors import NoSpareError
from megatron_deadpool.base.plan import Plan
from megatron_deadpool.membership.plan import initial_plan, next_plan


def job(world=8, per_node=2, spare_nodes=1):
    node_of_lid = {lid: lid // per_node for lid in range(world + spare_nodes * per_node)}
    p0 = initial_plan({r: r for r in range(world)}, node_of_lid, world, t=1.0)
    pool = [(lid, node_of_lid[lid]) for lid in range(world, world + spare_nodes * per_node)]
    return p0, pool, node_of_lid


def test_docstring_example():
    p0, pool, nodes = job(world=4, per_node=2, spare_nodes=1)
    p1 = next_plan(p0, dead={2}, pool=pool, node_of_lid=nodes, t=2.0, t_failure=1.5)
    assert p1.gen == 1 and p1.failed_ranks == (2,) and p1.spare_of_rank == {2: 4}
    assert p1.rank_of == {0: 0, 1: 1, 3: 3, 4: 2}
    assert p1.node_of_rank == (0, 0, 2, 1) and p1.prev_node_of_rank == (0, 0, 1, 1)
    assert p1.detect_s == pytest.approx(0.5)
    assert p0.rank_of == {0: 0, 1: 1, 2: 2, 3: 3}  # frozen: the old plan is untouched


def test_whole_node_moves_and_json_round_trip():
    p0, pool, nodes = job()
    p1 = next_plan(p0, dead={2, 3}, pool=pool, node_of_lid=nodes, t=2.0)
    assert p1.spare_of_rank == {2: 8, 3: 9} and p1.node_of_rank[2:4] == (4, 4)
    assert Plan.from_json(p1.to_json()) == p1
    assert p1.rank(2) is None and p1.rank(8) == 2


def test_no_spare_assigns_nothing():
    p0, pool, nodes = job(spare_nodes=0)
    with pytest.raises(NoSpareError, match="only 0 spare"):
        next_plan(p0, dead={5}, pool=pool, node_of_lid=nodes, t=2.0)


def test_dead_idle_spare_only_leaves_the_pool():
    p0, pool, nodes = job()
    p1 = next_plan(p0, dead={9}, pool=pool[:1], node_of_lid=nodes, t=2.0)
    assert p1.failed_ranks == () and p1.rank_of == p0.rank_of


def test_16k_ranks_a_node_fails():
    p0, pool, nodes = job(world=16384, per_node=4, spare_nodes=2)
    p1 = next_plan(p0, dead={4096, 4097, 4098, 4099}, pool=pool, node_of_lid=nodes, t=2.0)
    assert p1.failed_ranks == (4096, 4097, 4098, 4099)
    assert {nodes[lid] for lid in p1.spare_of_rank.values()} == {4096}  # one spare node
    assert len(p1.rank_of) == 16384


def test_reserved_local_replacement_takes_its_rank_and_spares_stay_idle():
    p0, pool, nodes = job()
    nodes = {**nodes, 10: 2}  # lid 10: rank 5 restarted in place on its node (2)
    p1 = next_plan(p0, dead={5}, pool=pool, node_of_lid=nodes, t=2.0, reserved={5: 10})
    assert p1.spare_of_rank == {5: 10} and p1.node_of_rank == p0.node_of_rank
    assert {8, 9}.isdisjoint(p1.rank_of)  # the spare node was not spent
    # a rank without a reservation still takes a spare, in the same plan
    p2 = next_plan(p1, dead={2, 10}, pool=pool, node_of_lid={**nodes, 11: 2}, t=3.0,
                   reserved={5: 11})
    assert p2.spare_of_rank == {2: 8, 5: 11}
