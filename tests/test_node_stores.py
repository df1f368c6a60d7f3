"""Issue 57: the round records on each node's record store, not the job's one store. A
node's agent serves the records its ranks read (launch/agent.py, published signed as
``dp/node_store/{node}``); a child's records are kept on its parent's node, so a rank
touches its own node's store and its parent's, and no one server carries every rank's
rounds."""

from collections import Counter

import torch.distributed as dist

from conftest import on_every_rank

from megatron_deadpool.membership import store as st
from megatron_deadpool.mirror.rounds import PREFIX, StoreRounds, children_of, parent_of

SECRET = "node-stores-secret"


class Tally:
    """One rank's connection to a store, counting its operations in ``by`` (by rank; one
    Counter per store, shared by every rank's connection to it)."""

    def __init__(self, port, rank, by):
        self.raw, self.rank, self.by = dist.TCPStore("127.0.0.1", port, is_master=False), \
            rank, by

    def __getattr__(self, name):
        op = getattr(self.raw, name)

        def counted(*a, **kw):
            self.by[self.rank] += 1
            return op(*a, **kw)
        return counted


def test_a_rounds_records_stay_on_the_stores_of_the_nodes_that_read_them():
    world, per_node = 12, 3
    node_of = [r // per_node for r in range(world)]
    job = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    servers = [st.serve_records("127.0.0.1") for _ in range(world // per_node)]
    by_node, on_job = [Counter() for _ in servers], Counter()

    def rank(r):
        mine = [Tally(port, r, by) for (_, _, port), by in zip(servers, by_node)]
        rounds = StoreRounds(Tally(job.port, r, on_job), r, world, 20.0, SECRET, gen=1,
                             at=lambda x: mine[node_of[x]])
        ok = rounds.all_ok(r != 5)
        sizes = rounds.gather_from(100 + r, [0, 7, 11])
        return ok, sizes

    got = on_every_rank(world, rank)
    assert got == [(False, {0: 100, 7: 107, 11: 111})] * world, got
    assert sum(on_job.values()) == 0  # nothing on the job's store
    for node, by in enumerate(by_node):
        users = set(by)
        # this node's ranks that have children (they read their records here) and the
        # ranks whose parent is here (they write their own records here)
        expected = {r for r in range(world) if node_of[r] == node and children_of(r, world)}
        expected |= {r for r in range(1, world) if node_of[parent_of(r)] == node}
        assert users == expected, (node, users, expected)
    assert set().union(*by_node) == set(range(world))
    for _, host, port in servers:  # every record read is deleted by its reader's writer
        left = dist.TCPStore(host, port, is_master=False)
        assert not any(left.check([f"{PREFIX}{n}/{w}/{r}"]) for n in (1, 2)
                       for w in "ud" for r in range(1, world))


def test_a_node_store_address_is_signed_for_its_node():
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    coord = st.Coordinator(dist.TCPStore("127.0.0.1", server.port, is_master=False), SECRET)
    assert coord.node_store(3) is None  # none published: the generation's store is used
    coord.publish_node_store(3, "10.0.0.7", 4242)
    assert coord.node_store(3) == ("10.0.0.7", 4242)
    raw = server.get(st.k("node_store", 3))
    server.set(st.k("node_store", 4), raw)  # node 3's, copied to node 4's slot
    assert coord.node_store(4) is None
    forger = st.Coordinator(dist.TCPStore("127.0.0.1", server.port, is_master=False), "x")
    forger.publish_node_store(3, "evil.example", 1)  # a client without the secret
    assert coord.node_store(3) is None


def test_a_listener_is_published_on_its_nodes_store_and_found_there():
    """The socket transport publishes each rank's listener on its node's record store
    (``at``), and a peer finds it there: nothing on the job's store."""
    import threading

    import torch

    from megatron_deadpool.mirror.socket_transport import KEY, SocketTransport

    job, nodes = dist.HashStore(), [dist.HashStore(), dist.HashStore()]
    t = [SocketTransport(job, r, 2, None, "127.0.0.1", SECRET, 3, timeout_s=30,
                         at=lambda x: nodes[x]) for r in (0, 1)]
    assert nodes[1].check([f"{KEY}1"]) and not nodes[0].check([f"{KEY}1"])
    assert not job.check([f"{KEY}0"]) and not job.check([f"{KEY}1"])
    got = torch.zeros(4, dtype=torch.uint8)
    sender = threading.Thread(target=t[0].exchange, args=([(1, torch.ones(4, dtype=torch.uint8))],
                                                          []))
    sender.start()
    t[1].exchange([], [(0, got)])
    sender.join(30)
    assert torch.all(got == 1)
    for x in t:
        x.release()
