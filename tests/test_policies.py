"""Pure policy logic: buddy placement, spare assignment, fault schedule."""


import pytest

from megatron_deadpool.errors import ConfigError, NoSpareError
from megatron_deadpool.launch import inject
from megatron_deadpool.membership.assign import assign_spares, remaining_spares
from megatron_deadpool.mirror import placement


def nodes_of(world, per_node):
    return [r // per_node for r in range(world)]


@pytest.mark.parametrize("world,per_node,k", [(8, 2, 1), (8, 2, 2), (16, 4, 3), (12, 3, 1)])
def test_buddies_on_other_distinct_nodes_and_balanced(world, per_node, k):
    r2n = nodes_of(world, per_node)
    b = placement.buddies(r2n, k)
    for r, bs in enumerate(b):
        assert len(bs) == k
        assert all(r2n[x] != r2n[r] for x in bs)
        assert len({r2n[x] for x in bs}) == k
    holders = placement.holders_of(b)
    assert all(len(h) == k for h in holders)
    recv = placement.received_bytes_per_node(r2n, b, [100] * world)
    assert set(recv.values()) == {100 * k * per_node}


def test_reference_layout_ring():
    # 4 nodes x 2: r0->r2, r2->r4, r4->r6, r6->r0
    b = placement.buddies(nodes_of(8, 2), 1)
    assert [x[0] for x in b] == [2, 3, 4, 5, 6, 7, 0, 1]


def test_buddies_after_node_replaced_by_spare():
    r2n = nodes_of(8, 2)
    r2n[2] = r2n[3] = 4  # node 1 died, spare node 4 took ranks 2 and 3
    b = placement.buddies(r2n, 1)
    assert all(r2n[x[0]] != r2n[r] for r, x in enumerate(b))
    recv = placement.received_bytes_per_node(r2n, b, [1] * 8)
    assert sorted(recv) == [0, 2, 3, 4] and set(recv.values()) == {2}


def test_buddies_errors():
    with pytest.raises(ConfigError, match="need at least 2 nodes"):
        placement.buddies([0, 0, 0], 1)
    with pytest.raises(ConfigError):
        placement.buddies(nodes_of(8, 2), 0)


def test_uneven_nodes_never_same_node():
    r2n = [0, 0, 0, 1, 2, 2]
    for k in (1, 2):
        b = placement.buddies(r2n, k)
        assert all(r2n[x] != r2n[r] for r, bs in enumerate(b) for x in bs)


def test_assign_whole_node_moves_together():
    r2n = nodes_of(8, 2)
    spares = [(8, 4), (9, 4), (10, 5), (11, 5)]
    assert assign_spares([3, 2], r2n, spares) == {2: 8, 3: 9}
    assert remaining_spares(spares, {2: 8, 3: 9}) == [(10, 5), (11, 5)]


def test_assign_prefers_a_spare_node_with_room():
    r2n = nodes_of(8, 2)
    spares = [(9, 4), (10, 5), (11, 5)]  # node 4 has one spare left
    assert assign_spares([2, 3], r2n, spares) == {2: 10, 3: 11}


def test_assign_spread_fill_and_partial():
    r2n = nodes_of(8, 2)
    assert assign_spares([2, 3], r2n, [(9, 4), (11, 5)]) == {2: 9, 3: 11}
    assert assign_spares([5], r2n, [(9, 4), (11, 5)]) == {5: 9}


def test_assign_not_enough_spares():
    with pytest.raises(NoSpareError, match="2 rank.*only 1 spare"):
        assign_spares([2, 3], nodes_of(8, 2), [(8, 4)])
    with pytest.raises(ValueError):
        assign_spares([99], nodes_of(8, 2), [(8, 4)])


def test_assign_16k_ranks_three_nodes():
    r2n = nodes_of(16384, 8)
    spares = [(16384 + i, 2048 + i // 8) for i in range(16 * 8)]
    failed = [r for r in range(16384) if r2n[r] in (3, 700, 2000)]
    m = assign_spares(failed, r2n, spares)
    assert sorted(m) == failed
    spare_node = dict(spares)
    for n in (3, 700, 2000):
        assert len({spare_node[m[r]] for r in failed if r2n[r] == n}) == 1


def test_fault_specs():
    f = inject.parse_fault("kill:node=1@iter=12")
    assert (f.kind, f.node, f.rank, f.iteration, f.phase) == ("kill", 1, None, 12,
                                                              "forward_backward")
    f = inject.parse_fault("kill:rank=5@iter=7,phase=optimizer", 3)
    assert (f.rank, f.phase, f.index) == (5, "optimizer", 3)
    assert inject.parse_fault("stop:rank=3@iter=9").kind == "stop"
    assert f.targets(rank=5, node=0) and not f.targets(rank=4, node=2)
    sched = inject.parse_schedule(["kill:node=1@iter=3", "stop:rank=2@iter=5"])
    assert inject.from_json(inject.to_json(sched)) == sched


@pytest.mark.parametrize("spec", ["kill:node=1", "boom:node=1@iter=2", "kill:rank=x@iter=2",
                                  "kill:rank=1@iter=2,phase=nope", ""])
def test_bad_fault_specs(spec):
    with pytest.raises(ConfigError):
        inject.parse_fault(spec)


def test_schedule_validation():
    sched = inject.parse_schedule(["kill:node=7@iter=3"])
    with pytest.raises(ConfigError, match="node 7"):
        inject.validate_schedule(sched, total_nodes=5, world_size=8, train_iters=10)
    with pytest.raises(ConfigError, match="iteration 30"):
        inject.validate_schedule(inject.parse_schedule(["kill:rank=1@iter=30"]), 5, 8, 10)


def test_single_rank_replacements_keep_one_copy_per_rank():
    r2n = nodes_of(8, 2)
    r2n[5] = 4  # rank 5 moved alone to spare node 4
    b = placement.buddies(r2n, 1)
    assert all(len(h) == 1 for h in placement.holders_of(b))
    r2n[7] = 4  # then rank 7 too: 5 -> 7 would now be on the same node
    b = placement.buddies(r2n, 1)
    assert all(r2n[x[0]] != r2n[r] for r, x in enumerate(b))
    assert max(len(h) for h in placement.holders_of(b)) <= 2
