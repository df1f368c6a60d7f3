"""Hot-swap must-shows: each run ends with the failure-free run's fingerprint."""

import json
from pathlib import Path

import pytest

from conftest import assert_ok_and_bitwise, deadpool, launch, layout_flags
from test_readme_tables import DEMO_SHOWN, demo_block, pattern, shown_in
from megatron_deadpool.base.vocabulary import PHASE_ORDER

pytestmark = [pytest.mark.slow]
FLAGS = layout_flags(2, 2, 12)


def _check_ok(p, s, ref):
    assert_ok_and_bitwise(p, s, ref)
    for rec in s["recoveries"]:
        assert set(rec["phases_s"]) == set(PHASE_ORDER), rec
        assert rec["recomputed_iters"] <= 1
        assert rec["ranks_reported"] == 8


def test_node_killed(tmp_path, reference):
    events = tmp_path / "ev.jsonl"
    p, s = launch(tmp_path, FLAGS + ["--deadpool", "--deadpool-audit", "full",
                                     "--deadpool-events", str(events)],
                  spares=1, inject=["kill:node=1@iter=6"])
    _check_ok(p, s, reference(FLAGS))
    assert s["faults"][0]["kind"] == "kill" and s["faults"][0]["ranks"] == [2, 3]
    assert s["faults"][0]["at_iter"] == 6
    (rec,) = s["recoveries"]
    assert rec["failed_ranks"] == [2, 3] and rec["spare_of_rank"] == {"2": 8, "3": 9}
    ev = [json.loads(x) for x in events.read_text().splitlines()]
    assert {e["phase"] for e in ev if e["event"] == "phase"} >= set(PHASE_ORDER) - {"detect"}
    audits = [e for e in ev if e["event"] == "audit"]
    assert len(audits) == 6 and all(a["leaked"] == 0 and a["old_groups"] > 0 for a in audits)


@pytest.mark.ci
def test_rank_hung_by_sigstop_is_fenced(tmp_path, reference):
    p, s = launch(tmp_path, FLAGS + ["--deadpool", "--deadpool-heartbeat-interval", "0.25",
                                     "--deadpool-heartbeat-timeout", "3"],
                  spares=1, inject=["stop:rank=3@iter=6"])
    _check_ok(p, s, reference(FLAGS))
    assert "fencing process 3" in p.stdout
    (rec,) = s["recoveries"]
    assert rec["failed_ranks"] == [3] and rec["phases_s"]["detect"] >= 2.0


def test_two_successive_failures_with_two_spare_nodes(tmp_path, reference):
    p, s = launch(tmp_path, FLAGS + ["--deadpool"], spares=2,
                  inject=["kill:node=1@iter=4", "kill:node=3@iter=9"])
    _check_ok(p, s, reference(FLAGS))
    r1, r2 = s["recoveries"]
    assert r1["failed_ranks"] == [2, 3] and r2["failed_ranks"] == [6, 7]
    assert set(r1["spare_of_rank"].values()) == {8, 9}
    assert set(r2["spare_of_rank"].values()) == {10, 11}


def test_failure_of_rank_whose_buddy_node_failed_earlier(tmp_path, reference):
    """Node ring: rank 0 mirrors to rank 2 (node 1). Node 1 dies first; rank 0 must be
    re-protected on the spare node, or its later death would be unrecoverable."""
    p, s = launch(tmp_path, FLAGS + ["--deadpool"], spares=2,
                  inject=["kill:node=1@iter=4", "kill:rank=0@iter=9"])
    _check_ok(p, s, reference(FLAGS))
    r1, r2 = s["recoveries"]
    assert r1["failed_ranks"] == [2, 3] and r2["failed_ranks"] == [0]


def test_no_spare_left_stops_cleanly(tmp_path):
    """Not in CI: the last-resort CI tests stop the same way ("no spare left")
    (test_megatron_lm_train.py, test_fallback.py)."""
    p, s = launch(tmp_path, FLAGS + ["--deadpool"], spares=0, inject=["kill:node=1@iter=6"],
                  timeout=300)
    assert p.returncode == 1
    assert "no spare left" in p.stderr and "last committed iteration" in p.stderr
    assert s["ok"] is False and s["final_state_sha256"] is None


@pytest.mark.ci
def test_demo(tmp_path):
    out = tmp_path / "d.json"
    p = deadpool(["demo", "--summary-json", str(out)], cwd=tmp_path)
    assert p.returncode == 0, p.stdout[-5000:] + p.stderr[-3000:]
    d = json.loads(out.read_text())
    assert d["bitwise_equal"] is True
    assert d["final_state_sha256"] == d["reference_state_sha256"]
    (rec,) = d["recoveries"]
    assert set(rec["phases_s"]) == set(PHASE_ORDER)
    assert d["completed_iters"] == 30 and d["faults"][0]["at_iter"] == 12
    assert "recovery timeline" in p.stdout
    repo = Path(__file__).resolve().parents[1]
    for doc in DEMO_SHOWN:  # the output the docs show is this run's, numbers that vary aside
        missing = shown_in(p.stdout, [pattern(line) for line in demo_block(repo / doc)])
        assert not missing, f"{doc}'s demo output is not what the demo prints: {missing}"


def test_rank_killed_during_mirror_exchange(tmp_path, reference):
    """The victim dies inside its mirror job (snapshot taken, exchange in flight): that
    iteration never commits and everyone restores the previous one."""
    p, s = launch(tmp_path, FLAGS + ["--deadpool"], spares=1,
                  inject=["kill:rank=2@iter=5,phase=mirror"])
    _check_ok(p, s, reference(FLAGS))
    (rec,) = s["recoveries"]
    assert rec["failed_ranks"] == [2] and rec["restored_iter"] == 4


def test_a_node_killed_from_outside_is_one_recovery(tmp_path, reference):
    """A real node loss, imitated with no fault driver and no fault point: once iteration 5
    is reported, every process of node 1 is SIGKILLed from outside the job, one after the
    other as a test can (issue 38: injected and real failures take the same detection
    path, so both give one recovery). CI runs the same kill under a store fuzzer
    (test_store_fuzz.py)."""
    from conftest import kill_node_from_outside

    proc, s, _ = kill_node_from_outside(tmp_path, FLAGS)
    _check_ok(proc, s, reference(FLAGS))
    (rec,) = s["recoveries"]  # one node, one recovery
    assert rec["failed_ranks"] == [2, 3], rec
