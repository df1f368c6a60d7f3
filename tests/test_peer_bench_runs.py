"""``deadpool bench peers`` end to end at a small size (issue 36's slow test): DeadPool's hot
swap against a whole-job relaunch from ``--save``/``--load``, one round each, on the real
patched ``pretrain_gpt.py`` (TP2.PP2.DP2, 4 nodes x 2), with the benchmark's own injector
(every process of rank 2's node SIGKILLed as iteration K starts). The full comparison, with
NVRx, is a benchmark (docs/peers.md), not this test.

What is checked does not depend on the machine's load: both runs complete, the injector
killed the same node, DeadPool redoes at most one iteration and ends in its failure-free state, and the
relaunch restarts from the last checkpoint, redoing the iterations since it."""

from __future__ import annotations

import pytest

from megatron_deadpool.apps import bench_peers
from megatron_deadpool.apps.peer_systems import PeerJob
from mlm import patched_tree, python_for

pytestmark = [pytest.mark.slow]

TAG = "core_v0.19.0"
ITERS, KILL, INTERVAL = 8, 6, 3  # the kill fires on iteration 5's line; 3 is the last save


def test_deadpool_against_a_whole_job_relaunch(tmp_path_factory, tmp_path):
    tree = patched_tree(tmp_path_factory, TAG)
    job = PeerJob(tree=str(tree), python=python_for(TAG),
                  flags=bench_peers.MODEL_FLAGS + ["--train-iters", str(ITERS)],
                  train_iters=ITERS, save_interval=INTERVAL, timeout_s=900)
    said = []
    records = bench_peers.run_rounds(job, ["deadpool", "relaunch"], 1,
                                     {"iter": KILL, "rank": 2}, str(tmp_path), say=said.append)
    by = {r["system"]: r for r in records}
    assert set(by) == {"deadpool", "relaunch"} and len(said) == 2, said
    for r in records:
        assert r["free_outcome"] == "done" and r["outcome"] == "done", r
        assert r["kill_node"] is not None and r["killed_pids"], r
        assert r["free_fingerprint"], r  # the final checkpoint exists and was read
        assert r["recovery_s"] is not None and r["recovery_s"] > 0, r
    assert by["deadpool"]["kill_node"] == by["relaunch"]["kill_node"]
    # the same job under two systems, failure-free: the same final state
    assert by["deadpool"]["free_fingerprint"] == by["relaunch"]["free_fingerprint"]
    dp, rl = by["deadpool"], by["relaunch"]
    # at most the iteration whose mirror had not committed when the kill came
    assert dp["bitwise"] and dp["redone"] <= 1, dp
    # killed as 6 starts, the relaunch resumes from 3 and redoes 4 and 5
    assert rl["redone"] == KILL - 1 - INTERVAL, rl
    summary = bench_peers.summarize(records, ["deadpool", "relaunch"], None)
    table = bench_peers.markdown({"summary": summary, "config": {
        "runs": 1, "kill_iter": KILL, "train_iters": ITERS, "kill_rank": 2,
        "save_interval": INTERVAL, "mtbf_s": None}})
    assert "| deadpool |" in table and "| relaunch |" in table


def test_a_resume_from_save_and_load_keeps_adams_step(tmp_path_factory, tmp_path):
    """The checkpoint systems' restart path on CPU: ``--load`` dropped torch Adam's step
    (the dp_reshardable load copied the template's 0 over the checkpoint's 3), so a resumed
    run's bias correction started again. Now a run resumed at 3 and saved at 6 holds step 6,
    as the uninterrupted run's checkpoint 6 does; with dropout off, the whole state equals."""
    from conftest import launch

    tree = patched_tree(tmp_path_factory, TAG)
    flags = bench_peers.MODEL_FLAGS + ["--hidden-dropout", "0", "--attention-dropout", "0",
                                       "--log-interval", "1", "--save-interval", "3"]
    extra = ["--device", "cpu", "--script", str(tree / "pretrain_gpt.py")]

    def run(name, iters, more=()):
        ck = tmp_path / f"ck_{name}"
        p, s = launch(tmp_path, flags + ["--train-iters", str(iters), "--save", str(ck),
                                         *more], name=name, python=python_for(TAG),
                      extra_launch=extra)
        assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-2000:]
        return ck

    whole = run("whole", 6)
    first = run("first", 3)
    resumed = run("resumed", 6, ["--load", str(first)])
    steps = [s for _, _, s in bench_peers.optimizer_steps(str(resumed / "iter_0000006"))]
    assert steps and set(steps) == {6.0}, steps
    assert [s for _, _, s in bench_peers.optimizer_steps(str(whole / "iter_0000006"))] == steps
    assert bench_peers.fingerprint(str(resumed), 6) == bench_peers.fingerprint(str(whole), 6)
