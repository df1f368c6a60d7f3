"""gloo abort: when the generation moves on, each rank shuts down its own gloo connections.
That unblocks a collective pending on a hung peer (``abort()`` would not), while the
coordinator store keeps working."""

import os
import socket
import threading
import time
import traceback

import pytest
import torch
import torch.multiprocessing as mp

from megatron_deadpool.recovery.abort import comm_socket_fds, shutdown_gloo_connections


def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, port, q, lazy=False):
    try:
        if lazy:  # what World.init_process_group sets: pairs connect on first use
            from megatron_deadpool.recovery.world import lazy_gloo_env

            lazy_gloo_env(os.environ)
        store = torch.distributed.TCPStore("127.0.0.1", port, 3, rank == 0,
                                           wait_for_workers=False)
        torch.distributed.init_process_group("gloo", store=store, rank=rank, world_size=3)
        torch.distributed.barrier()
        if rank == 2:  # alive but never joins the collective below (a hung peer)
            store.wait(["done0", "done1"])
            store.set("done2", "1")
            q.put((rank, "idle", 0.0, True))
            return
        assert comm_socket_fds([port]), "expected gloo connections"
        # what the runtime's watcher thread does when it sees a new generation
        threading.Timer(1.0 + rank, shutdown_gloo_connections, args=(port,)).start()
        t0 = time.monotonic()
        try:
            torch.distributed.all_reduce(torch.ones(4))  # blocks: rank 2 never joins
            outcome = "completed"
        except RuntimeError:
            outcome = "raised"
        dt = time.monotonic() - t0
        store.set(f"done{rank}", "1")  # the store still works after the abort
        if rank == 0:
            store.wait(["done2"])  # rank 0 hosts the store: leave last
        q.put((rank, outcome, dt, True))
    except BaseException:  # noqa: BLE001
        q.put((rank, traceback.format_exc(), 0.0, False))


@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
def test_socket_shutdown_unblocks_pending_gloo_collectives(lazy):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _port()
    procs = [ctx.Process(target=_worker, args=(r, port, q, lazy)) for r in range(3)]
    for p in procs:
        p.start()
    res = {r: (o, dt, ok) for r, o, dt, ok in (q.get(timeout=120) for _ in procs)}
    for p in procs:
        p.join(timeout=30)
    assert all(ok for _, _, ok in res.values()), res
    assert res[0][0] == "raised" and res[1][0] == "raised", res
    assert res[0][1] < 30 and res[1][1] < 30, res


def test_nccl_error_handling_never_tears_a_survivor_down():
    """CleanUpOnly (2): a dead peer's error aborts the communicator and raises; TearDown (1)
    and SkipCleanUp (3, torch's default) would kill the survivor before the plan arrives."""
    from megatron_deadpool.recovery.world import nccl_error_handling_env

    env = {}
    assert nccl_error_handling_env(env) == []
    assert env == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2", "NCCL_ASYNC_ERROR_HANDLING": "2"}
    env = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3", "NCCL_ASYNC_ERROR_HANDLING": "1"}
    assert nccl_error_handling_env(env) == [("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3"),
                                            ("NCCL_ASYNC_ERROR_HANDLING", "1")]
    assert set(env.values()) == {"2"}
    env = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}
    assert nccl_error_handling_env(env) == [] and env["NCCL_ASYNC_ERROR_HANDLING"] == "2"


def _ring_worker(rank, world, port, q):
    try:
        from megatron_deadpool.recovery.world import World

        w = World("gloo", port, rendezvous_timeout_s=60, collective_timeout_s=60,
                  emit=lambda *a, **k: None)
        store = torch.distributed.TCPStore("127.0.0.1", port, world, rank == 0,
                                           wait_for_workers=False)
        w.init_process_group(store, gen=0, rank=rank, world_size=world)
        group = torch.distributed.new_group(backend="gloo")  # like the mirror's group
        built = len(comm_socket_fds([port]))
        store.set(f"built{rank}", "1")  # nobody connects before everyone counted
        store.wait([f"built{r}" for r in range(world)])
        works = [torch.distributed.isend(torch.ones(2), (rank + 1) % world, group=group),
                 torch.distributed.irecv(torch.empty(2), (rank - 1) % world, group=group)]
        for work in works:
            work.wait()
        used = len(comm_socket_fds([port]))
        torch.distributed.barrier(group=group)
        q.put((rank, built, used, None))
        store.set(f"left{rank}", "1")
        if rank == 0:
            store.wait([f"left{r}" for r in range(world)])
        w.destroy()
    except BaseException:  # noqa: BLE001
        q.put((rank, 0, 0, traceback.format_exc()))


def test_world_connects_gloo_pairs_on_first_use_only():
    """A generation's world and a world-wide group cost no connections when built; a ring
    exchange then connects each rank to its two neighbours only (not a full mesh)."""
    os.environ.pop("TORCH_GLOO_LAZY_INIT", None)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    world, port = 5, _port()
    procs = [ctx.Process(target=_ring_worker, args=(r, world, port, q)) for r in range(world)]
    for p in procs:
        p.start()
    res = {r: (b, u, err) for r, b, u, err in (q.get(timeout=120) for _ in procs)}
    for p in procs:
        p.join(timeout=30)
    assert all(err is None for _, _, err in res.values()), res
    assert all(b == 0 for b, _, _ in res.values()), res
    assert all(u == 2 for _, u, _ in res.values()), res
