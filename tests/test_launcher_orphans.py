"""Whatever ends the launcher, no worker outlives it (issue 38). The workers run a script
through ``deadpool launch --script`` (the child wrapper, as pretrain_gpt.py does; a stand-in
for Megatron-LM's training module beside it), each
stuck in a pure-Python loop like a long dataset build, and each with a child of its own
(as Megatron-LM's checkpoint writers are). The launcher leads its own process group, as
under ``timeout`` or a shell; the workers lead their own sessions, so a signal to the
launcher's group never reaches them by itself.

- SIGTERM, SIGHUP or SIGINT: the launcher winds down: SIGTERM to each worker, SIGKILL after
  its 5 s grace. Workers that ignore SIGTERM are gone within the grace plus 5 s.
- A second signal kills every worker's group at once.
- SIGKILL of the launcher (alone, or its whole process group): each worker sees its parent
  gone (``worker_env.exit_with_launcher``) and kills its own group.
- SIGKILL of the launcher right after it started its workers, before they could look at
  their parent (interpreter start and imports, about 0.4 s): each worker was told its
  launcher's pid at its start (``DEADPOOL_LAUNCHER_PID``), finds another parent, and kills
  its own group at once (it used to take the new parent for its launcher and watch it
  forever).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from test_agent import _gone

GRACE_S = 5.0  # agent.terminate_all's
# how long the workers may take to go: only a bound for a failing test (each wait returns
# as soon as they are gone), never a timing claim (issue 58: no wall-clock asserts)
GONE_S = 120.0
WORKERS = 4

SCRIPT = textwrap.dedent("""
    import os, signal, subprocess, sys, time
    if os.environ.get("STUBBORN"):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    out = os.path.join(os.environ["PIDS_DIR"], os.environ["DEADPOOL_LID"])
    with open(out + ".tmp", "w") as f:
        f.write(f"{os.getpid()} {child.pid}")
    os.rename(out + ".tmp", out)
    while True:  # a pure-Python section (a dataset build): no blocking call to interrupt
        sum(i * i for i in range(10000))
""")


def _spawn_launcher(tmp_path, stubborn: bool, grace_s: float = GRACE_S, **env_extra):
    script = tmp_path / "stuck.py"
    script.write_text(SCRIPT)
    # the child wrapper hooks Megatron-LM's training module: the script's folder has a stand-in
    (tmp_path / "megatron" / "training").mkdir(parents=True)
    (tmp_path / "megatron" / "training" / "__init__.py").write_text("")
    (tmp_path / "megatron" / "training" / "training.py").write_text(
        "def setup_model_and_optimizer(*a, **k):\n    raise NotImplementedError\n")
    pids = tmp_path / "pids"
    pids.mkdir()
    env = dict(os.environ, PIDS_DIR=str(pids), STUBBORN="1" if stubborn else "", **env_extra)
    # the launcher with its wind-down's grace set (agent.STOP_GRACE_S)
    entry = ("import sys; import megatron_deadpool.launch.agent as a; "
             "a.STOP_GRACE_S = float(sys.argv.pop(1)); "
             "from megatron_deadpool.apps.cli import main; sys.exit(main())")
    return subprocess.Popen(
        [sys.executable, "-c", entry, str(grace_s), "launch", "--nodes", "2",
         "--procs-per-node", "2", "--script", str(script)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)


def _start(tmp_path, stubborn: bool, grace_s: float = GRACE_S):
    launcher = _spawn_launcher(tmp_path, stubborn, grace_s)
    pids = tmp_path / "pids"
    deadline = time.monotonic() + 120
    while len(list(pids.iterdir())) < WORKERS:
        assert launcher.poll() is None, launcher.stdout.read().decode()
        assert time.monotonic() < deadline, "the workers did not start"
        time.sleep(0.1)
    procs = [int(x) for f in pids.iterdir() for x in f.read_text().split()]
    assert len(procs) == 2 * WORKERS and not any(_gone(p) for p in procs)
    return launcher, procs


def _seconds_until_gone(procs, limit_s: float) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit_s:
        if all(_gone(p) for p in procs):
            return time.monotonic() - t0
        time.sleep(0.05)
    left = [p for p in procs if not _gone(p)]
    for p in left:  # leave nothing behind for the next test, then fail
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    pytest.fail(f"{len(left)} of {len(procs)} worker processes outlived the launcher by "
                f"{limit_s} s: {left}")


def _end(launcher):
    try:
        launcher.wait(timeout=30)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
        launcher.stdout.close()


@pytest.mark.parametrize("sig,stubborn", [("SIGTERM", False), ("SIGTERM", True),
                                          ("SIGHUP", True), ("SIGINT", True)],
                         ids=["SIGTERM-worker-exits", "SIGTERM-worker-ignores",
                              "SIGHUP-worker-ignores", "SIGINT-worker-ignores"])
def test_a_signalled_launcher_winds_its_workers_down(tmp_path, sig, stubborn):
    launcher, procs = _start(tmp_path, stubborn)
    os.killpg(launcher.pid, getattr(signal, sig))
    _seconds_until_gone(procs, GONE_S)
    _end(launcher)
    assert launcher.returncode != 0  # an interrupted job is not a success


def test_a_second_signal_kills_the_workers_at_once(tmp_path):
    """With a wind-down grace of an hour, the stubborn workers go only if the second
    signal kills them (the first signal's wind-down would wait the hour out)."""
    launcher, procs = _start(tmp_path, stubborn=True, grace_s=3600.0)
    os.killpg(launcher.pid, signal.SIGTERM)
    time.sleep(0.5)
    os.killpg(launcher.pid, signal.SIGTERM)
    _seconds_until_gone(procs, GONE_S)
    _end(launcher)


@pytest.mark.parametrize("group", [False, True], ids=["launcher", "launcher-group"])
def test_a_launcher_killed_outright_leaves_no_orphans(tmp_path, group):
    launcher, procs = _start(tmp_path, stubborn=True)
    if group:
        os.killpg(launcher.pid, signal.SIGKILL)
    else:
        os.kill(launcher.pid, signal.SIGKILL)
    _seconds_until_gone(procs, GONE_S)
    _end(launcher)


MARK = "DEADPOOL_TEST_ORPHAN_MARK"


def _marked(mark: str, workers_only: bool = False):
    """The live processes whose environment carries ``MARK=mark`` (what the launcher
    started inherits it: its workers and their children; a zombie shows none)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            continue
        if f"{MARK}={mark}".encode() in env and (
                not workers_only or any(v.startswith(b"DEADPOOL_LID=") for v in env)):
            found.append(int(pid))
    return found


@pytest.mark.parametrize("after", ["launcher-start", "first-worker", "first-worker+0.1s"])
def test_a_launcher_killed_as_it_starts_leaves_no_process_behind(tmp_path, after):
    """SIGKILL 0.1 s after the launcher starts, the moment its first worker exists, and
    0.1 s after that (inside the worker's interpreter start and imports, before it could
    look at its parent): a few seconds later no process it started is left."""
    mark = f"{os.getpid()}-{time.monotonic_ns()}"
    launcher = _spawn_launcher(tmp_path, stubborn=True, **{MARK: mark})
    deadline = time.monotonic() + 120
    if after != "launcher-start":
        while not _marked(mark, workers_only=True):
            assert launcher.poll() is None, launcher.stdout.read().decode()
            assert time.monotonic() < deadline, "no worker started"
            time.sleep(0.005)
    time.sleep(0.1 if after != "first-worker" else 0.0)
    os.kill(launcher.pid, signal.SIGKILL)
    launcher.wait(timeout=30)
    launcher.stdout.close()
    t0 = time.monotonic()
    while (left := [p for p in _marked(mark) if p != launcher.pid]) and \
            time.monotonic() - t0 < GONE_S:
        time.sleep(0.1)
    for p in left:  # leave nothing behind for the next test, then fail
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert not left, f"{len(left)} process(es) outlived a launcher SIGKILLed at {after}: {left}"
