"""The restore decision as pure logic."""

import pytest

from megatron_deadpool.base.errors import NoCommittedStateError
from megatron_deadpool.recovery.restore import Inventory, choose_restore


def inv(own=(), copies=None, committed=-1):
    return Inventory(own=frozenset(own), copies={o: frozenset(i) for o, i in
                                                 (copies or {}).items()}, committed=committed)


def test_docstring_example():
    p = choose_restore([inv({6, 7}, {2: {6}}), inv({6, 7}, {3: {6}}), inv(), inv({6}, {0: {6}})])
    assert p.iteration == 6 and p.sources == {2: 0} and p.serves(0) == [2]


def test_newest_iteration_held_by_everyone_wins():
    p = choose_restore([inv({6, 7}, {1: {6, 7}}), inv(), inv({6, 7}, {3: {6, 7}}), inv({6, 7})])
    assert p.iteration == 7 and p.sources == {1: 0}


def test_no_rollback_needed_without_a_spare():
    assert choose_restore([inv({3, 4}), inv({3, 4})]).iteration == 4


def test_initial_commit_iteration_zero():
    p = choose_restore([inv({0}, {1: {0}}), inv()])
    assert p.iteration == 0 and p.sources == {1: 0}


def test_old_placement_copy_survives_a_cascade():
    # rank 1's copy is still with rank 3 from the previous placement; its newer buddy died.
    p = choose_restore([inv({5}), inv(), inv({5}), inv({5}, {1: {5}})])
    assert p.sources == {1: 3}


def test_survivor_whose_own_slot_was_overwritten_gets_a_copy():
    p = choose_restore([inv({8, 9}, {1: {8}}), inv({9, 10})])
    assert p.iteration == 9 and p.sources == {}
    p = choose_restore([inv({8}, {1: {8}}), inv({9, 10}, {0: {9}})])
    assert p.iteration == 9 and p.sources == {0: 1}


def test_lost_rank_is_named_with_the_last_committed_iteration():
    with pytest.raises(NoCommittedStateError, match=r"rank\(s\) \[1\].*last committed "
                                                     r"iteration 7"):
        choose_restore([inv({7, 8}, committed=7), inv(), inv({7, 8}, committed=7)])


def test_json_round_trip():
    a = inv({1, 2}, {3: {1}}, committed=1)
    assert Inventory.from_json(a.to_json()) == a


def test_16k_ranks_is_linear_enough():
    world = 16384
    invs = [inv({10, 11}, {(r - 1) % world: {10, 11}}) for r in range(world)]
    invs[77] = inv()
    p = choose_restore(invs)
    assert p.iteration == 11 and p.sources == {77: 78}
