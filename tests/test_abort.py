"""gloo abort: when the generation moves on, each rank shuts down its own gloo connections.
That unblocks a collective pending on a hung peer (``abort()`` would not), while the
coordinator store keeps working."""

import socket
import threading
import time
import traceback

import torch
import torch.multiprocessing as mp

from megatron_deadpool.recovery.abort import comm_socket_fds, shutdown_gloo_connections


def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, port, q):
    try:
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


def test_socket_shutdown_unblocks_pending_gloo_collectives():
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _port()
    procs = [ctx.Process(target=_worker, args=(r, port, q)) for r in range(3)]
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
