"""The node agent's care of its workers' process trees (launch/agent.py)."""

import os
import signal
import sys
import textwrap
import time

from megatron_deadpool.base.state import Role
from megatron_deadpool.base.worker_env import WorkerEnv
from megatron_deadpool.launch.agent import NodeAgent, WorkerSpec

# a worker that starts a child (as Megatron's checkpoint writer processes are started), then
# dies of its own SIGKILL (a crash, or an injected fault delivered by the victim itself)
WORKER = textwrap.dedent("""
    import os, signal, subprocess, sys
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    with open(sys.argv[1], "w") as f:
        f.write(str(child.pid))
    {ending}
""")


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"  # a zombie: ended
    except (FileNotFoundError, ProcessLookupError):  # reaped between the open and the read
        return True


def _run_worker(tmp_path, ending: str):
    """Run WORKER under an agent until it exits; (its exit as the agent saw it, the child)."""
    pid_file = tmp_path / "child.pid"
    argv = [sys.executable, "-c", WORKER.format(ending=ending), str(pid_file)]
    agent = NodeAgent(0, [WorkerSpec(lid=0, node=0, role=Role.ACTIVE, rank=0, local_rank=0)],
                      argv, dict(os.environ), WorkerEnv(), None, {}, out=open(os.devnull, "w"),
                      use_store=False)
    agent.start()
    deadline = time.monotonic() + 60
    exited = []
    while not exited and time.monotonic() < deadline:
        exited = agent.poll()
        time.sleep(0.05)
    return exited, int(pid_file.read_text())


def test_a_dead_workers_children_do_not_outlive_it(tmp_path):
    """Megatron's checkpoint writer processes outlived a rank that was killed during a save
    (250 MB each on CPU); the agent ends what is left of a dead worker's process group."""
    exited, child = _run_worker(tmp_path, "os.kill(os.getpid(), signal.SIGKILL)")
    assert exited == [(0, -signal.SIGKILL)]
    deadline = time.monotonic() + 10
    while not _gone(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _gone(child)


def test_a_worker_that_ends_well_keeps_what_it_started(tmp_path):
    """Exit 0: the agent leaves the group alone (nothing crashed)."""
    exited, child = _run_worker(tmp_path, "pass")
    try:
        assert exited == [(0, 0)] and not _gone(child)
    finally:
        os.kill(child, signal.SIGKILL)
