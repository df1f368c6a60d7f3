"""A worker whose join fails leaves no DeadPool thread behind (no SIGABRT at its exit).

The membership watcher is a daemon thread that spends its time in TCPStore calls (native
code, GIL released). A process that exits while such a thread is inside a call is ended by
the interpreter's finalization in ``std::terminate`` ("terminate called without an active
exception", exit -6): the thread is unwound through a ``noexcept`` frame when it tries to
take the GIL back. ``Deadpool.start`` used to let an exception of ``join`` (a promoted spare
whose world did not form, a stale generation, a rendezvous timeout) escape with the watcher
still running: 1 of 12 runs of this test's worker (on a loaded 2-core machine) then died
with SIGABRT after printing its own error, and the decider saw a promoted spare crash. The
assertion on the threads left fails on every run without the fix. Here the test is the
coordinator: it admits one process into a generation of two, whose second member never
arrives.
"""

import os
import subprocess
import sys
import textwrap
import threading

import pytest

from conftest import REPO

WORKER = textwrap.dedent("""
    import sys, threading
    from megatron_deadpool.api import Deadpool
    from megatron_deadpool.base.config import DeadpoolConfig
    from megatron_deadpool.base.worker_env import WorkerEnv

    cfg = DeadpoolConfig(enabled=True, heartbeat_interval_s=0.1, heartbeat_timeout_s=0.5,
                         rendezvous_timeout_s=1.0, collective_timeout_s=5.0)
    env = WorkerEnv(lid=0, node=0, role="active", store_port=int(sys.argv[1]))
    try:
        Deadpool.start(cfg, device="cpu", backend="gloo", env=env)
    except BaseException:
        left = [t.name for t in threading.enumerate() if t.name.startswith("deadpool")]
        print("threads left:", left, flush=True)
        raise
""")


def _coordinator(secret):
    from megatron_deadpool.membership import store as st
    from megatron_deadpool.base.plan import Plan

    server = st.connect("127.0.0.1", 0, 30.0, is_master=True)
    coord = st.Coordinator(server, secret)
    coord.publish_plan(Plan(gen=0, world_size=2, rank_of={0: 0, 1: 1}, node_of_rank=(0, 1)))
    stop = threading.Event()

    def admit():
        seen = 0
        while not stop.is_set():
            for ev in coord.read_events(seen):
                seen = ev["i"]
                if ev["kind"] == "join":
                    coord.answer_admission(ev["lid"], ev["nonce"], ok=True)
            stop.wait(0.05)

    t = threading.Thread(target=admit, daemon=True)
    t.start()
    return server, stop, t


@pytest.mark.slow
def test_failed_join_stops_the_watcher_and_exits_with_its_own_error():
    secret = "t" * 32
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", DEADPOOL_TOKEN=secret)
    for _ in range(4):
        server, stop, t = _coordinator(secret)  # a fresh store: nobody else ever arrives
        try:
            p = subprocess.run([sys.executable, "-c", WORKER, str(server.port)], env=env,
                               capture_output=True, text=True, timeout=120)
        finally:
            stop.set()
            t.join(5)
        out = p.stdout + p.stderr
        assert "threads left: []" in out, out[-3000:]
        assert p.returncode == 1 and "TimeoutError" in out, (p.returncode, out[-3000:])
        assert "terminate called" not in out, out[-3000:]
