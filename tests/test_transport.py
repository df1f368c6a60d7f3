"""Conformance: every mirror transport passes the same test (3 processes)."""

import socket
import time
import traceback

import pytest
import torch
import torch.multiprocessing as mp

from megatron_deadpool.mirror.transport import GlooTransport, StoreTransport
from megatron_deadpool.recovery.classify import is_comm_failure

WORLD = 3


def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _conformance(t, rank):
    # ring exchange of different sizes: rank r sends (r+1)*100 bytes valued r to r+1
    dst, src = (rank + 1) % WORLD, (rank - 1) % WORLD
    send = torch.full(((rank + 1) * 100,), rank, dtype=torch.uint8)
    recv = torch.empty(((src + 1) * 100,), dtype=torch.uint8)
    t.exchange([(dst, send)], [(src, recv)])
    assert torch.all(recv == src)
    # a receive buffer larger than what is sent: the bytes fill its prefix, the rest stays
    recv = torch.full((300,), 255, dtype=torch.uint8)
    t.exchange([(dst, torch.full((rank + 1,), rank, dtype=torch.uint8))], [(src, recv)])
    assert torch.all(recv[:src + 1] == src) and torch.all(recv[src + 1:] == 255)
    # many-to-one: everyone sends to 0
    bufs = {r: torch.empty(10, dtype=torch.uint8) for r in range(1, WORLD)}
    if rank == 0:
        t.exchange([], [(r, b) for r, b in bufs.items()])
        assert all(torch.all(b == r) for r, b in bufs.items())
    else:
        t.exchange([(0, torch.full((10,), rank, dtype=torch.uint8))], [])
    assert t.all_ok(True) is True
    assert t.all_ok(rank != 1) is False
    assert t.all_gather_json({"r": rank, "own": [rank, 5]}) == [
        {"r": r, "own": [r, 5]} for r in range(WORLD)]
    assert t.all_gather_int(rank + 7) == [7 + r for r in range(WORLD)]


def _peer_death(t, rank, store):
    """The last rank leaves without answering: every other member's call ends within its
    timeout, with an error that recovery takes for a peer failure (never a hang)."""
    store.add("conformed", 1)
    while store.add("conformed", 0) < WORLD:  # everyone passed the conformance part
        time.sleep(0.01)
    if rank == WORLD - 1:
        return  # gone: its process exits without joining the next call
    t0 = time.monotonic()
    try:
        t.all_ok(True, timeout_s=2.0)
    except Exception as exc:  # noqa: BLE001 - checked right below
        assert is_comm_failure(exc), f"{type(exc).__name__}: {exc}"
    else:
        raise AssertionError("all_ok returned although a member never called it")
    assert time.monotonic() - t0 < 15


def _worker(rank, kind, port, errq):
    try:
        store = torch.distributed.TCPStore("127.0.0.1", port, WORLD, rank == 0,
                                           wait_for_workers=False)
        if kind == "gloo":
            torch.distributed.init_process_group("gloo", store=store, rank=rank,
                                                 world_size=WORLD)
            t = GlooTransport(timeout_s=60)
        else:
            t = StoreTransport(store, rank, WORLD, tag="t", timeout_s=60)
        _conformance(t, rank)
        _peer_death(t, rank, store)
        errq.put(None)
    except BaseException:  # noqa: BLE001
        errq.put(traceback.format_exc())


@pytest.mark.parametrize("kind", ["gloo", "store"])
def test_transport_conformance(kind):
    ctx = mp.get_context("spawn")
    errq = ctx.Queue()
    port = _port()
    procs = [ctx.Process(target=_worker, args=(r, kind, port, errq)) for r in range(WORLD)]
    for p in procs:
        p.start()
    errors = [errq.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=30)
    assert errors == [None] * WORLD, "\n".join(e for e in errors if e)
