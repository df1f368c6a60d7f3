"""Beyond the spare pool: a process that crashes on a healthy node is restarted in its slot
without spending the spare node; with --deadpool-on-no-spare wait, a failure with no spare
left waits for a spare node that joins the running job. Each run stays bitwise-equal."""

import json
import os
import secrets
import subprocess
import sys
import threading

import pytest

from conftest import REPO, assert_bitwise, assert_ok_and_bitwise, launch, layout_flags
from megatron_deadpool.launch.options import free_port

pytestmark = [pytest.mark.slow]
FLAGS = layout_flags(2, 2, 12)


@pytest.mark.ci
def test_crash_on_a_healthy_node_restarts_in_place(tmp_path, reference):
    events = tmp_path / "events.jsonl"
    p, s = launch(tmp_path, FLAGS + ["--deadpool", "--deadpool-max-local-restarts", "1",
                                     "--deadpool-events", str(events)],
                  spares=1, inject=["kill:rank=5@iter=6"])
    assert_ok_and_bitwise(p, s, reference(FLAGS))
    (rec,) = s["recoveries"]
    assert rec["failed_ranks"] == [5]
    new_lid = rec["spare_of_rank"]["5"]
    assert new_lid not in (8, 9)  # not a process of the spare node
    (local,) = s["local_restarts"]
    assert local["rank"] == 5 and local["node"] == 2 and local["exit_code"] == -9
    assert local["restored_iter"] == rec["restored_iter"] and local["total_s"] > 0
    # warm (issue 58): node 2's standby, started with the job, took the rank; a cold start
    # in place (no standby: --deadpool-local-standby 0, or none started) is warm False
    assert local["warm"] is True, local
    assert s["standby_spares_at_end"] == 2  # the spare node is still in standby
    ev = [json.loads(x) for x in events.read_text().splitlines()]
    (restart,) = [e for e in ev if e["event"] == "local_restart"]
    assert restart["rank"] == 5 and restart["lid"] == new_lid and restart["warm"] is True


def test_second_crash_of_the_same_rank_takes_the_spare(tmp_path, reference):
    """The limit is per rank: with N=1 the second crash of rank 5 spends the spare node."""
    p, s = launch(tmp_path, FLAGS + ["--deadpool", "--deadpool-max-local-restarts", "1"],
                  spares=1, inject=["kill:rank=5@iter=4", "kill:rank=5@iter=9"])
    assert_ok_and_bitwise(p, s, reference(FLAGS))
    first, second = s["recoveries"]
    assert first["spare_of_rank"]["5"] not in (8, 9)
    assert second["spare_of_rank"]["5"] in (8, 9)
    assert len(s["local_restarts"]) == 1


def test_node_kill_still_uses_the_spare_node(tmp_path, reference):
    p, s = launch(tmp_path, FLAGS + ["--deadpool", "--deadpool-max-local-restarts", "3"],
                  spares=1, inject=["kill:node=1@iter=6"])
    assert_ok_and_bitwise(p, s, reference(FLAGS))
    assert s["recoveries"][0]["spare_of_rank"] == {"2": 8, "3": 9}
    assert s["local_restarts"] == []


def _cli(args, env):
    return subprocess.Popen([sys.executable, "-m", "megatron_deadpool.apps.cli", *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_no_spare_waits_for_a_spare_node_that_joins(tmp_path, reference):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO),
               DEADPOOL_TOKEN=secrets.token_hex(16))
    port = free_port()
    events = tmp_path / "events.jsonl"
    flags = FLAGS + ["--deadpool", "--deadpool-on-no-spare", "wait", "--deadpool-events",
                     str(events)]
    summary = tmp_path / "s.json"
    job = _cli(["launch", "--nodes", "4", "--procs-per-node", "2", "--spare-nodes", "1",
                "--master-port", str(port), "--summary-json", str(summary),
                "--results-dir", str(tmp_path / "res"), "--inject", "kill:node=1@iter=4",
                "--inject", "kill:node=2@iter=8", "--", *flags], env)
    lines, waiting = [], threading.Event()

    def read():
        for line in job.stdout:
            lines.append(line)
            # the wait for a joining spare; under load an earlier recovery may first wait
            # for the spare node's processes that are still starting
            if "no spare left for the failed rank(s): waiting" in line and "joining" in line:
                waiting.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    assert waiting.wait(600), "".join(lines[-60:])
    joiner = _cli(["launch", "--join-as-spare", "--nodes", "4", "--procs-per-node", "2",
                   "--master-port", str(port), "--", *flags], env)
    out, _ = joiner.communicate(timeout=600)
    assert job.wait(timeout=600) == 0, "".join(lines[-80:])
    reader.join(timeout=10)
    assert joiner.returncode == 0, out[-3000:]
    s = json.loads(summary.read_text())
    assert_bitwise(s, reference(FLAGS))
    first, second = s["recoveries"]
    assert first["spare_of_rank"] == {"2": 8, "3": 9}
    assert set(second["spare_of_rank"].values()) == {10, 11}  # the joined node's processes
    assert s["waited_for_spare_s"] > 0
    ev = [json.loads(x) for x in events.read_text().splitlines()]
    waits = [e for e in ev if e["event"] == "spare_wait"]
    assert waits[-1]["generation"] == second["generation"]  # the wait the joined node ended
    assert sum(e["waited_s"] for e in waits) == pytest.approx(s["waited_for_spare_s"], abs=0.01)
