"""Planned swaps end to end (membership/drain.py): a node drained on request moves its ranks
to spares at an iteration boundary every rank agrees on, redoes nothing, and ends bitwise
equal to the failure-free run; a drain with no spare is refused and changes nothing; a
failure or a second drain during a drain ends in one consistent plan."""

import json
import os
import re
import subprocess
import sys
import threading

import pytest

from conftest import REPO, assert_ok_and_bitwise, launch, layout_flags
from megatron_deadpool.base.vocabulary import PHASE_ORDER

pytestmark = [pytest.mark.slow]
FLAGS = layout_flags(2, 2, 12)


def _one_drain(s, node, ranks):
    (d,) = s["drains"]
    assert (d["node"], d["ranks_moved"], d["iterations_redone"]) == (node, ranks, 0), d
    assert d["applied"] and d["ranks_reported"] == 8 and d["wall_s"] > 0
    assert set(d["phases_s"]) == set(PHASE_ORDER) - {"detect"}  # a drain detects nothing
    return d


def test_an_injected_drain_redoes_nothing(tmp_path, reference):
    p, s = launch(tmp_path, FLAGS + ["--deadpool"], spares=1, inject=["drain:node=2@iter=6"])
    assert_ok_and_bitwise(p, s, reference(FLAGS))
    d = _one_drain(s, 2, [4, 5])
    assert d["reason"] == "request" and d["spare_of_rank"] == {"4": 8, "5": 9}
    assert s["recoveries"] == [] and s["drains_refused"] == []
    assert d["restored_iter"] >= 6  # the boundary agreed after the request
    assert "draining node 2 (request)" in p.stdout
    assert d["state_from"] == {"4": "buddy", "5": "buddy"}  # the default source


def test_a_drained_ranks_state_comes_straight_from_the_draining_process(tmp_path, reference):
    """``--deadpool-drain-source direct`` (mirror/handoff.py): each spare takes iteration D
    from the process it replaces, verified, and no buddy sends it; bitwise as with buddies."""
    p, s = launch(tmp_path, FLAGS + ["--deadpool", "--deadpool-drain-source", "direct"],
                  spares=1, inject=["drain:node=2@iter=6"])
    assert_ok_and_bitwise(p, s, reference(FLAGS))
    d = _one_drain(s, 2, [4, 5])
    assert d["state_from"] == {"4": "direct", "5": "direct"}, p.stdout[-3000:]
    assert "drain handoff" not in p.stdout + p.stderr  # no fallback to the buddy's copy


def test_a_drain_with_no_spare_is_refused_and_the_job_goes_on(tmp_path, reference):
    p, s = launch(tmp_path, FLAGS + ["--deadpool"], spares=0, inject=["drain:node=1@iter=4"])
    assert_ok_and_bitwise(p, s, reference(FLAGS))
    assert s["drains"] == [] and s["recoveries"] == []
    (r,) = s["drains_refused"]
    assert r["node"] == 1 and "no spare left" in r["why"]


def test_a_node_killed_during_a_drain_ends_in_one_plan(tmp_path, reference):
    """Node 1 dies in the iteration the drain of node 2 is requested. Node 2 holds node 1's
    buddy copies, so the drain, if not yet applied, is undone and asked again after the
    failure's recovery: node 1's ranks end on spares, node 2's too if a spare is left (an
    undone drain's spares may have left the pool), and the run is bitwise."""
    p, s = launch(tmp_path, FLAGS + ["--deadpool"], spares=2,
                  inject=["drain:node=2@iter=6", "kill:node=1@iter=6"])
    assert_ok_and_bitwise(p, s, reference(FLAGS))
    applied = [d for d in s["drains"] if d["applied"]]
    moved = sorted([r for d in applied for r in d["ranks_moved"]]
                   + [r for x in s["recoveries"] for r in x["failed_ranks"]])
    assert moved in ([2, 3], [2, 3, 4, 5]), (s["drains"], s["recoveries"])
    assert all(d["iterations_redone"] == 0 for d in applied)


def test_a_second_drain_during_a_drain_waits_for_it(tmp_path, reference):
    flags = layout_flags(2, 2, 40)  # time for the second drain after the first, under load
    p, s = launch(tmp_path, flags + ["--deadpool"], spares=2,
                  inject=["drain:node=2@iter=5", "drain:node=1@iter=5"])
    assert_ok_and_bitwise(p, s, reference(flags))
    assert sorted(d["node"] for d in s["drains"]) == [1, 2]
    assert all(d["iterations_redone"] == 0 and d["applied"] for d in s["drains"])


# Not in CI (221 s there, the slowest of the subset): CI's injected drain takes the same
# path from the request on; `make test-all` runs this one.
def test_deadpool_drain_against_a_running_job(tmp_path, reference):
    """`deadpool drain --node 1 --wait` with the job's secret: the node's ranks move at the
    next boundary, nothing is redone, the command prints the time from the request to the
    first resumed step, and the drained slots stay on as standby spares."""
    flags = layout_flags(2, 2, 60)  # the job runs on while the command acts, under load
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO),
               DEADPOOL_TOKEN="a-test-job-secret")
    cli = [sys.executable, "-m", "megatron_deadpool.apps.cli"]
    job = subprocess.Popen(cli + ["launch", "--nodes", "4", "--procs-per-node", "2",
                                  "--spare-nodes", "1", "--summary-json",
                                  str(tmp_path / "s.json"), "--results-dir",
                                  str(tmp_path / "run"), "--", *flags, "--deadpool"],
                           cwd=tmp_path, env=env, stdout=subprocess.PIPE, text=True)
    out, found, started = [], {}, threading.Event()

    def read():  # the whole time: a full pipe would stall the job
        for line in job.stdout:
            out.append(line)
            m = re.search(r"coordinator (\S+:\d+)", line)
            if m:
                found["coordinator"] = m.group(1)
            if '"iteration": 3,' in line:
                started.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    assert started.wait(300), "".join(out)[-3000:]
    coordinator = found["coordinator"]
    drain = subprocess.run(cli + ["drain", "--coordinator", coordinator, "--node", "1",
                                  "--reason", "maintenance", "--to-standby", "--wait"],
                           env=env, capture_output=True, text=True, timeout=300)
    wrong = subprocess.run(cli + ["drain", "--coordinator", coordinator, "--node", "3",
                                  "--timeout", "20"], env=dict(env, DEADPOOL_TOKEN="guess"),
                           capture_output=True, text=True, timeout=120)
    job.wait(timeout=600)
    reader.join(60)
    stdout = "".join(out)
    assert wrong.returncode == 2 and "wrong DEADPOOL_TOKEN" in wrong.stderr
    assert drain.returncode == 0, drain.stdout + drain.stderr + stdout[-4000:]
    done = json.loads(drain.stdout.strip().splitlines()[-1])
    assert done["iterations_redone"] == 0 and done["request_to_first_step_s"] > 0
    s = json.loads((tmp_path / "s.json").read_text())
    assert job.returncode == 0, stdout[-4000:]
    assert_bitwise_run(s, reference(flags))
    d = _one_drain(s, 1, [2, 3])
    assert d["text"] == "maintenance" and d["to_standby"]
    assert s["standby_spares_at_end"] == 2  # the drained node's two slots


def assert_bitwise_run(s, ref):
    assert (s["final_state_sha256"], s["losses"]) == (ref["final_state_sha256"], ref["losses"])


def test_the_drain_command_refuses_bad_input(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO), DEADPOOL_TOKEN="x")
    p = subprocess.run([sys.executable, "-m", "megatron_deadpool.apps.cli", "drain",
                        "--coordinator", "nohost", "--node", "1"], env=env,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "--coordinator takes HOST:PORT" in p.stderr
    p = subprocess.run([sys.executable, "-m", "megatron_deadpool.apps.cli", "drain",
                        "--coordinator", "127.0.0.1:9", "--node", "1", "--timeout", "2"],
                       env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "no answer from the coordinator" in p.stderr


@pytest.mark.ci
def test_a_straggling_node_is_drained(tmp_path, reference):
    """Node 2 computes 3x slower from iteration 4; with --deadpool-straggler-swap 2:5 it is
    drained (reason straggler), nothing is redone, no process is fenced, and the run stays
    bitwise."""
    flags = layout_flags(2, 2, 30)
    p, s = launch(tmp_path, flags + ["--deadpool", "--deadpool-straggler-swap", "2:5"],
                  spares=1, inject=["slow:node=2@iter=4,factor=3"])
    assert_ok_and_bitwise(p, s, reference(flags))
    d = _one_drain(s, 2, [4, 5])
    assert d["reason"] == "straggler" and s["recoveries"] == []
    assert "node 2 straggles" in p.stdout and "fencing" not in p.stdout


def test_without_the_flag_a_slow_node_is_left_alone(tmp_path, reference):
    flags = layout_flags(2, 2, 16)
    p, s = launch(tmp_path, flags + ["--deadpool"], spares=1,
                  inject=["slow:node=2@iter=4,factor=3"])
    assert_ok_and_bitwise(p, s, reference(flags))
    assert s["drains"] == [] and s["recoveries"] == [] and "fencing" not in p.stdout
