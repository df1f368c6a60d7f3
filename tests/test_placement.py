"""Buddy placement (megatron_deadpool.mirror.placement): pure, no processes."""

import random

import pytest

from megatron_deadpool.base.errors import ConfigError
from megatron_deadpool.mirror import placement


def received_bytes_per_node(rank_to_node, buddy_lists, bytes_per_rank):
    """Bytes of mirror copies each node receives (every node hosting a rank appears, 0 if
    it receives nothing). ``bytes_per_rank[r]`` is the size of rank r's copy. (The tests'
    measure of a placement's balance; the runtime does not need it.)"""
    world = len(rank_to_node)
    if len(buddy_lists) != world or len(bytes_per_rank) != world:
        raise ValueError(f"rank_to_node has {world} ranks but buddy_lists has "
                         f"{len(buddy_lists)} and bytes_per_rank {len(bytes_per_rank)}")
    out = {node: 0 for node in rank_to_node}
    for owner, bs in enumerate(buddy_lists):
        for b in bs:
            out[rank_to_node[b]] += bytes_per_rank[owner]
    return out


def nodes_of(world, per_node):
    return [r // per_node for r in range(world)]


def check_valid(r2n, b, k):
    assert len(b) == len(r2n)
    for r, bs in enumerate(b):
        assert len(bs) == k, (r, bs)
        assert all(0 <= x < len(r2n) for x in bs)
        assert all(r2n[x] != r2n[r] for x in bs), f"rank {r} has a buddy on its own node: {bs}"
        assert len({r2n[x] for x in bs}) == k, f"rank {r}: buddies not on {k} distinct nodes"


EQUAL = [(8, 2, 1), (8, 2, 2), (8, 2, 3), (16, 4, 3), (12, 3, 1), (64, 8, 2), (10, 1, 4)]


@pytest.mark.parametrize("world,per_node,k", EQUAL)
def test_equal_nodes_valid_and_balanced(world, per_node, k):
    r2n = nodes_of(world, per_node)
    b = placement.buddies(r2n, k)
    check_valid(r2n, b, k)
    assert all(len(h) == k for h in placement.holders_of(b))
    recv = received_bytes_per_node(r2n, b, [100] * world)
    assert recv == {n: 100 * k * per_node for n in range(world // per_node)}


def test_reference_layout_is_the_node_ring():
    # 4 nodes x 2 ranks, K=1: node i's j-th rank -> node i+1's j-th rank
    assert placement.buddies(nodes_of(8, 2), 1) == [[2], [3], [4], [5], [6], [7], [0], [1]]
    assert placement.buddies(nodes_of(8, 2), 2) == [[2, 4], [3, 5], [4, 6], [5, 7],
                                                    [6, 0], [7, 1], [0, 2], [1, 3]]


def test_holders_is_the_inverse():
    r2n = nodes_of(24, 4)
    b = placement.buddies(r2n, 2)
    h = placement.holders_of(b)
    for owner in range(24):
        for holder in range(24):
            assert (owner in h[holder]) == (holder in b[owner])
    assert all(x == sorted(x) for x in h)
    assert placement.holders_of([[1], [0], [0]]) == [[1, 2], [0], []]
    with pytest.raises(ValueError):
        placement.holders_of([[5], [0]])


def test_deterministic_and_independent_of_node_labels():
    r2n = nodes_of(32, 4)
    a = placement.buddies(r2n, 2)
    assert placement.buddies(list(r2n), 2) == a
    assert placement.buddies(tuple(f"host-{9 - n}" for n in r2n), 2) == a


def test_whole_node_replaced_by_spare():
    r2n = nodes_of(8, 2)
    before = placement.buddies(r2n, 1)
    r2n[2] = r2n[3] = 4  # node 1 died, spare node 4 took ranks 2 and 3
    b = placement.buddies(r2n, 1)
    check_valid(r2n, b, 1)
    assert b == before  # ranks keep their ids: the placement does not move
    recv = received_bytes_per_node(r2n, b, [7] * 8)
    assert recv == {0: 14, 4: 14, 2: 14, 3: 14}
    assert all(len(h) == 1 for h in placement.holders_of(b))


def test_single_rank_moves_keep_one_copy_per_rank():
    r2n = nodes_of(8, 2)
    r2n[5] = 4  # rank 5 moved alone to spare node 4
    b = placement.buddies(r2n, 1)
    check_valid(r2n, b, 1)
    assert all(len(h) == 1 for h in placement.holders_of(b))
    r2n[7] = 4  # then rank 7 too: the plain shift 5 -> 7 would stay on node 4
    b = placement.buddies(r2n, 1)
    check_valid(r2n, b, 1)
    assert max(len(h) for h in placement.holders_of(b)) <= 2


def test_received_bytes_with_unequal_sizes():
    r2n = nodes_of(6, 2)  # nodes 0,1,2; K=1 ring 0 -> 1 -> 2 -> 0
    b = placement.buddies(r2n, 1)
    recv = received_bytes_per_node(r2n, b, [1, 2, 30, 40, 500, 600])
    assert recv == {1: 3, 2: 70, 0: 1100}
    with pytest.raises(ValueError):
        received_bytes_per_node(r2n, b, [1, 2, 3])


def test_node_that_receives_nothing_is_listed_with_zero():
    r2n = [0, 0, 0, 0, 1]  # node 1's single rank receives, node 0 gets one copy
    b = placement.buddies(r2n, 1)
    check_valid(r2n, b, 1)
    recv = received_bytes_per_node(r2n, b, [1] * 5)
    assert recv == {0: 1, 1: 4}


def test_too_few_nodes():
    with pytest.raises(ConfigError, match=r"1 replica\(s\) need at least 2 nodes.* has 1 node"):
        placement.buddies([0, 0, 0], 1)
    with pytest.raises(ConfigError, match=r"3 replica\(s\) need at least 4 nodes.* has 3 node"):
        placement.buddies(nodes_of(6, 2), 3)
    with pytest.raises(ConfigError):
        placement.buddies([], 1)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "1"])
def test_bad_replicas(bad):
    with pytest.raises(ConfigError, match="replicas"):
        placement.buddies(nodes_of(8, 2), bad)


UNEVEN = [[0, 0, 0, 1, 2, 2], [0, 1, 1, 1, 1, 2], [0, 0, 1, 0, 1, 2, 3, 3, 3],
          [5, 5, 5, 5, 5, 5, 5, 9, 7], [0, 1, 0, 1, 2, 2, 0]]


@pytest.mark.parametrize("r2n", UNEVEN)
@pytest.mark.parametrize("k", [1, 2])
def test_uneven_nodes_never_same_node(r2n, k):
    check_valid(r2n, placement.buddies(r2n, k), k)


def test_random_layouts_always_valid():
    rng = random.Random(7)
    for _ in range(300):
        nodes = rng.randint(2, 9)
        world = rng.randint(nodes, 40)
        r2n = [rng.randrange(nodes) for _ in range(world)]
        r2n[:nodes] = rng.sample(range(nodes), nodes)  # every node hosts a rank
        rng.shuffle(r2n)
        k = rng.randint(1, nodes - 1)
        check_valid(r2n, placement.buddies(r2n, k), k)


class Lookups(list):
    """A layout that counts how often the placement reads it: its work, without a clock."""

    reads = 0

    def __getitem__(self, i):
        self.reads += 1
        return super().__getitem__(i)


def test_degenerate_layout_is_fast():
    # one huge node next to tiny ones: the shift rarely leaves the big node; the work per
    # rank stays bounded (the shifts tried are capped; then the node ring)
    r2n = Lookups([0] * 16000 + list(range(1, 385)))
    b = placement.buddies(r2n, 2)
    assert r2n.reads <= (placement._MAX_SHIFTS + 1) * len(r2n)
    check_valid(list(r2n), b, 2)


@pytest.mark.parametrize("per_node", [4, 8])
@pytest.mark.parametrize("k", [1, 2])
def test_16k_ranks(per_node, k):
    world = 16384
    r2n = nodes_of(world, per_node)
    counted = Lookups(r2n)
    b = placement.buddies(counted, k)  # its work, not its wall-clock time (that flaked)
    assert counted.reads <= (placement._MAX_SHIFTS + 1) * world
    holders = placement.holders_of(b)
    recv = received_bytes_per_node(r2n, b, [12] * world)
    check_valid(r2n, b, k)
    assert all(len(h) == k for h in holders)
    assert recv == {n: 12 * k * per_node for n in range(world // per_node)}


def test_buddies_leave_their_owners_failure_domain():
    """Issue 59: 8 nodes of 2 ranks in 4 domains of 2 consecutive nodes (a rack each). The
    node ring puts node 0's copies on node 1, in its own rack: a rack lost at once takes a
    rank and its only copy. With the domains, every copy is in the next rack, and K = 2
    copies in two other racks."""
    r2n = nodes_of(16, 2)
    rack = {n: n // 2 for n in range(8)}
    ring = placement.buddies(r2n, 1)
    assert any(rack[r2n[b[0]]] == rack[r2n[r]] for r, b in enumerate(ring))
    for k in (1, 2, 3):
        got = placement.buddies(r2n, k, rack)
        for r, bs in enumerate(got):
            racks = [rack[r2n[b]] for b in bs]
            assert rack[r2n[r]] not in racks and len(set(racks)) == k, (k, r, bs)
        assert sorted(len(h) for h in placement.holders_of(got)) == [k] * 16
    assert placement.buddies(r2n, 1, rack)[0] == [4]  # node 0 -> node 2: the next rack
    with pytest.raises(ConfigError, match="4 replica\\(s\\) need at least 5 failure domains.*are in 4"):
        placement.buddies(r2n, 4, rack)


def test_without_domains_or_with_one_node_each_the_ring_is_unchanged():
    r2n = nodes_of(12, 3)
    assert placement.buddies(r2n, 2, None) == placement.buddies(r2n, 2) == \
        placement.buddies(r2n, 2, {n: f"d{n}" for n in range(4)})
    assert placement.buddies(r2n, 1, {0: "a"}) == placement.buddies(r2n, 1)
