"""Issue 57: a recovery does not build the world again. On a gloo world that keeps its
groups, the default group of a generation after the first (recovery/world.py
``lazy_default``) opens no connection when it is made: gloo connects a pair on first use.
The first generation's stays eager (a full mesh: W - 1 pairs per rank), and the lazy one
still works when it is used (a barrier)."""

import socket
import time

import torch.multiprocessing as mp

from megatron_deadpool.recovery import abort as ab
from megatron_deadpool.recovery.world import World

WORLD = 4


def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, port, gen, q):
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False)
    w = World("gloo", port, 30.0, 30.0, emit=lambda *a, **k: None)
    w.keep = True
    before = set(ab.socket_inodes())
    w.init_process_group(store, gen, rank, WORLD)
    store.add(f"made{gen}", 1)  # every rank has made the group, and a peer's connect to
    while int(store.add(f"made{gen}", 0)) < WORLD:  # this one was accepted (gloo accepts
        time.sleep(0.05)                              # on its own thread): then count
    time.sleep(1.0)
    opened = len(set(ab.socket_inodes()) - before)
    store.add(f"counted{gen}", 1)  # no peer's barrier connects to this one before it counted
    while int(store.add(f"counted{gen}", 0)) < WORLD:
        time.sleep(0.05)
    dist.barrier()  # the lazy pairs connect now
    used = len(set(ab.socket_inodes()) - before)
    q.put((rank, opened, used))
    dist.barrier()
    dist.destroy_process_group()


def _run(gen):
    import torch.distributed as dist

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)  # noqa: F841
    ps = [ctx.Process(target=_worker, args=(r, port, gen, q)) for r in range(WORLD)]
    for p in ps:
        p.start()
    out = sorted(q.get(timeout=120) for _ in ps)
    for p in ps:
        p.join(60)
        assert p.exitcode == 0
    return out


def test_a_recoverys_default_group_connects_nothing_until_used():
    eager, lazy = _run(0), _run(1)
    # each opens its generation's own store connection and a listener, and the first
    # generation its full mesh
    assert all(opened >= WORLD - 1 + 1 for _, opened, _ in eager), eager
    assert all(opened <= 2 for _, opened, _ in lazy), lazy  # the store's and a listener
    assert all(used > opened for _, opened, used in lazy), lazy  # the barrier connected
