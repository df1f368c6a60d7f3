"""Spare -> dead-rank assignment (megatron_deadpool.membership.assign): pure policy."""


import pytest

from megatron_deadpool.base.errors import DeadpoolError, NoSpareError
from megatron_deadpool.membership.assign import assign_spares


def remaining_spares(spares, assignment):
    """The pool minus the spares used by ``assignment``, pool order kept."""
    used = set(assignment.values())
    return [s for s in spares if s[0] not in used]


def nodes_of(world, per_node):
    return [r // per_node for r in range(world)]


def test_whole_node_moves_to_one_spare_node():
    r2n = nodes_of(8, 2)
    spares = [(8, 4), (9, 4), (10, 5), (11, 5)]
    m = assign_spares([3, 2], r2n, spares)
    assert m == {2: 8, 3: 9}
    assert remaining_spares(spares, m) == [(10, 5), (11, 5)]


def test_two_successive_failures_use_different_spare_nodes():
    r2n = nodes_of(8, 2)
    pool = [(8, 4), (9, 4), (10, 5), (11, 5)]
    spare_node = dict(pool)
    first = assign_spares([2, 3], r2n, pool)
    assert {spare_node[s] for s in first.values()} == {4}
    for rank, sid in first.items():
        r2n[rank] = spare_node[sid]
    pool = remaining_spares(pool, first)
    second = assign_spares([4, 5], r2n, pool)
    assert second == {4: 10, 5: 11}
    assert remaining_spares(pool, second) == []
    # a third failure finds the pool empty
    with pytest.raises(NoSpareError):
        assign_spares([0], r2n, remaining_spares(pool, second))


def test_prefers_a_spare_node_with_room_for_the_whole_group():
    r2n = nodes_of(8, 2)
    spares = [(9, 4), (10, 5), (11, 5)]  # node 4 has one spare left, node 5 two
    assert assign_spares([2, 3], r2n, spares) == {2: 10, 3: 11}


def test_partial_node_failure():
    r2n = nodes_of(8, 2)
    spares = [(8, 4), (9, 4), (10, 5), (11, 5)]
    m = assign_spares([5], r2n, spares)
    assert m == {5: 8}
    assert remaining_spares(spares, m) == [(9, 4), (10, 5), (11, 5)]


def test_groups_ordered_by_smallest_failed_rank():
    r2n = nodes_of(8, 2)
    spares = [(8, 4), (9, 4), (10, 5), (11, 5)]
    # node 2 (ranks 4, 5) and node 0 (ranks 0, 1) die: node 0's group goes first
    m = assign_spares([5, 4, 1, 0], r2n, spares)
    assert m == {0: 8, 1: 9, 4: 10, 5: 11}


def test_spread_fill_when_no_spare_node_fits():
    r2n = nodes_of(8, 2)
    assert assign_spares([2, 3], r2n, [(9, 4), (11, 5)]) == {2: 9, 3: 11}
    # a 4-rank node, spares scattered 2 + 1 + 1
    r2n = nodes_of(12, 4)
    pool = [(20, 7), (21, 8), (22, 8), (23, 9)]
    assert assign_spares([4, 5, 6, 7], r2n, pool) == {4: 20, 5: 21, 6: 22, 7: 23}


def test_fitting_node_is_not_taken_by_an_earlier_spread_group():
    r2n = nodes_of(12, 3)
    pool = [(30, 8), (31, 9), (32, 9), (33, 9)]
    # node 0 loses all 3 ranks -> spare node 9 fits; then rank 4 gets spare 30
    assert assign_spares([0, 1, 2, 4], r2n, pool) == {0: 31, 1: 32, 2: 33, 4: 30}


def test_not_enough_spares():
    with pytest.raises(NoSpareError, match=r"2 rank\(s\) failed.*only 1 spare"):
        assign_spares([2, 3], nodes_of(8, 2), [(8, 4)])
    with pytest.raises(NoSpareError, match=r"1 rank\(s\) failed.*only 0 spare"):
        assign_spares([2], nodes_of(8, 2), [])
    assert issubclass(NoSpareError, DeadpoolError)


def test_no_spare_message_stays_short_for_many_ranks():
    with pytest.raises(NoSpareError) as exc:
        assign_spares(range(1000), nodes_of(1000, 8), [(2000, 999)])
    msg = str(exc.value)
    assert "1000 rank(s) failed" in msg and "only 1 spare" in msg and len(msg) < 200


def test_duplicates_ignored_and_out_of_range():
    r2n = nodes_of(8, 2)
    assert assign_spares([3, 2, 3, 2], r2n, [(8, 4), (9, 4)]) == {2: 8, 3: 9}
    with pytest.raises(ValueError, match="99"):
        assign_spares([99], r2n, [(8, 4)])
    with pytest.raises(ValueError, match="-1"):
        assign_spares([-1], r2n, [(8, 4)])
    assert assign_spares([], r2n, [(8, 4)]) == {}


def test_does_not_mutate_inputs_and_is_deterministic():
    r2n = nodes_of(8, 2)
    pool = [(8, 4), (9, 4), (10, 5)]
    a = assign_spares([1, 0, 6], r2n, pool)
    assert pool == [(8, 4), (9, 4), (10, 5)] and r2n == nodes_of(8, 2)
    assert assign_spares([6, 0, 1], r2n, pool) == a == {0: 8, 1: 9, 6: 10}


def test_16k_ranks_three_nodes_fail():
    world, per_node = 16384, 8
    r2n = nodes_of(world, per_node)
    spares = [(world + i, 2048 + i // 8) for i in range(16 * 8)]  # 16 spare nodes
    spare_node = dict(spares)
    failed = [r for r in range(world) if r2n[r] in (700, 3, 2000)]

    class Counted(list):  # the world's map, counting what the assignment reads of it
        reads = 0

        def __getitem__(self, i):
            Counted.reads += 1
            return super().__getitem__(i)

    m = assign_spares(reversed(failed), Counted(r2n), spares)
    # the work follows the failed ranks and the pool, never the world (issue 58: counted,
    # not timed): one read of the map per failed rank
    assert Counted.reads == len(failed)
    assert sorted(m) == failed
    assert len(set(m.values())) == len(failed)
    used_nodes = []
    for n in (3, 700, 2000):
        on = {spare_node[m[r]] for r in failed if r2n[r] == n}
        assert len(on) == 1
        used_nodes.append(on.pop())
    assert used_nodes == [2048, 2049, 2050]  # whole spare nodes, in pool order
    assert len(remaining_spares(spares, m)) == 13 * 8
