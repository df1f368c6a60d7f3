"""gloo abort: when the generation moves on, each rank shuts down its own gloo connections.
That unblocks a collective pending on a hung peer (``abort()`` would not), while the
coordinator store and every socket that is not a communicator's keep working."""

import socket
import threading
import time
import traceback

import torch
import torch.multiprocessing as mp

from megatron_deadpool.recovery.abort import (comm_socket_fds, communicator_sockets,
                                              owned_socket_inodes, shutdown_gloo_connections)


def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _unrelated_sockets():
    """What the application opened itself: a listening socket and a connected pair over it
    (a metrics client, a remote data reader)."""
    listener = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(listener.getsockname())
    server, _ = listener.accept()
    return listener, client, server


def _still_work(listener, client, server) -> bool:
    client.sendall(b"ping")
    server.sendall(b"pong")
    late = socket.create_connection(listener.getsockname())  # the listener still accepts
    late.close()
    return server.recv(4) == b"ping" and client.recv(4) == b"pong"


def test_the_sweep_shuts_the_communicators_sockets_only():
    """One process, no torch.distributed: the pair opened inside ``communicator_sockets``
    is shut down, the pair and the listener opened outside it survive."""
    mine = _unrelated_sockets()
    with communicator_sockets():
        comm = _unrelated_sockets()
    try:
        assert shutdown_gloo_connections(store_port=0) == 2  # both ends of the comm pair
        assert _still_work(*mine)
        assert comm[1].recv(4) == b""  # shut down: reads end at once
        socket.create_connection(comm[0].getsockname()).close()  # listeners are spared
    finally:
        for s in (*mine, *comm):
            s.close()


def _worker(rank, port, q):
    try:
        store = torch.distributed.TCPStore("127.0.0.1", port, 3, rank == 0,
                                           wait_for_workers=False)
        unrelated = _unrelated_sockets()
        with communicator_sockets():  # as World.init_process_group does
            torch.distributed.init_process_group("gloo", store=store, rank=rank, world_size=3)
        torch.distributed.barrier()
        if rank == 2:  # alive but never joins the collective below (a hung peer)
            store.wait(["done0", "done1"])
            store.set("done2", "1")
            q.put((rank, "idle", 0.0, True))
            return
        assert comm_socket_fds([port], owned_socket_inodes()), "expected gloo connections"
        # what the runtime's watcher thread does when it sees a new generation
        threading.Timer(1.0 + rank, shutdown_gloo_connections, args=(port,)).start()
        t0 = time.monotonic()
        try:
            torch.distributed.all_reduce(torch.ones(4))  # blocks: rank 2 never joins
            outcome = "completed"
        except RuntimeError:
            outcome = "raised"
        dt = time.monotonic() - t0
        assert _still_work(*unrelated), "the abort shut a socket that is not a communicator's"
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


def test_the_abort_wakes_the_mirrors_own_connections(monkeypatch):
    """The sweep no longer reaches the socket transport's connections (not built inside
    ``communicator_sockets``): the generation's abort calls ``World.on_abort``, which the
    runtime points at the mirror transport's ``abort``; once per generation."""
    from megatron_deadpool.recovery import abort as ab
    from megatron_deadpool.recovery.world import World

    monkeypatch.setattr(ab, "abort_communicators", lambda backend, port, only=None: {})
    w = World("gloo", 1, 10.0, 10.0, emit=lambda *a, **k: None)
    woken = []
    w.on_abort = lambda: woken.append(1)
    w._live_gen = 3
    w.abort("generation 4 published", rank=0, newer_than=4)
    w.abort("again", rank=0)
    assert woken == [1] and w.aborted
    w.retire()  # as the recovery's abort step does: gloo operations may start again in this
    # process (the abort refused them: gloo_waits' fence), for the tests that run after it


def test_an_aborted_nccl_world_is_cleared_without_a_shutdown(monkeypatch):
    """On an H200 (NCCL 2.28.9, torch 2.11) every survivor hung in
    ``destroy_process_group`` after its communicators were aborted: the shutdown of an
    aborted NCCL communicator waited for the dead peer. After an abort, a world with an NCCL
    group is cleared by ``_abort_process_group``; a healthy end still shuts down cleanly."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    from megatron_deadpool.recovery import abort

    calls = []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(abort.groups, "destroy", lambda: calls.append("megatron"))
    monkeypatch.setattr(dist, "destroy_process_group", lambda *a: calls.append("shutdown"))
    monkeypatch.setattr(c10d, "_abort_process_group", lambda *a: calls.append("abort"))
    monkeypatch.setattr(abort, "has_nccl_group", lambda: True)
    abort.destroy_world(aborted=True)
    assert calls == ["megatron", "abort"]
    calls.clear()
    abort.destroy_world()  # the job's end: nothing was aborted
    assert calls == ["megatron", "shutdown"]
    calls.clear()
    monkeypatch.setattr(abort, "has_nccl_group", lambda: False)
    abort.destroy_world(aborted=True)  # gloo only: destroy as before
    assert calls == ["megatron", "shutdown"]
