"""``deadpool bench peers`` end to end at a small size (issue 36's slow test): DeadPool's hot
swap against a whole-job relaunch from ``--save``/``--load``, one round each, on the real
patched ``pretrain_gpt.py`` (TP2.PP2.DP2, 4 nodes x 2), with the benchmark's own injector
(every process of rank 2's node SIGKILLed as iteration K starts). The full comparison, with
NVRx, is a benchmark (docs/peers.md), not this test.

What is checked does not depend on the machine's load: both runs complete, the injector
killed the same node, DeadPool redoes at most one iteration and ends in its failure-free state, and the
relaunch restarts from the last checkpoint, redoing the iterations since it."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from mlm import REPO, patched_tree, python_for

pytestmark = [pytest.mark.slow]

TAG = "core_v0.19.0"
ITERS, KILL, INTERVAL = 8, 6, 3  # the kill fires on iteration 5's line; 3 is the last save


def _tree_python(tree, *args, timeout=1800):
    """Run on the tag's Python with the tree's megatron first: a checkpoint's pickled
    objects are that tag's classes."""
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(tree), str(REPO)]))
    p = subprocess.run([python_for(TAG), *args], env=env, capture_output=True, text=True,
                       timeout=timeout)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    return p.stdout


def test_deadpool_against_a_whole_job_relaunch(tmp_path_factory, tmp_path):
    tree = patched_tree(tmp_path_factory, TAG)
    out = tmp_path / "peers.json"
    _tree_python(tree, "-m", "megatron_deadpool.apps.cli", "bench", "peers", "--tree",
                 str(tree), "--work", str(tmp_path / "w"), "--systems", "deadpool,relaunch",
                 "--runs", "1", "--train-iters", str(ITERS), "--kill-iter", str(KILL),
                 "--save-interval", str(INTERVAL), "--timeout", "900", "--json", str(out))
    result = json.loads(out.read_text())
    by = {r["system"]: r for r in result["runs"]}
    assert set(by) == {"deadpool", "relaunch"}
    for r in by.values():
        assert r["free_outcome"] == "done" and r["outcome"] == "done", r
        assert r["kill_node"] is not None and r["killed_pids"], r
        assert r["free_fingerprint"], r  # the final checkpoint exists and was read
        assert r["recovery_s"] is not None and r["recovery_s"] > 0, r
    # the same node (each system tags its processes with its own variable: KEY=node)
    assert len({r["kill_node"].split("=")[-1] for r in by.values()}) == 1, by
    # the same job under two systems, failure-free: the same final state
    assert by["deadpool"]["free_fingerprint"] == by["relaunch"]["free_fingerprint"]
    dp, rl = by["deadpool"], by["relaunch"]
    # at most the iteration whose mirror had not committed when the kill came
    assert dp["bitwise"] and dp["redone"] <= 1, dp
    # killed as 6 starts, the relaunch resumes from 3 and redoes 4 and 5
    assert rl["redone"] == KILL - 1 - INTERVAL, rl
    assert rl["pieces"]["load_s"] > 0 and rl["pieces"]["init_s"] > 0, rl  # Megatron's timers
    assert set(result["summary"]) == {"deadpool", "relaunch"}


def test_a_resume_from_save_and_load_keeps_adams_step(tmp_path_factory, tmp_path):
    """The checkpoint systems' restart path on CPU: ``--load`` dropped torch Adam's step
    (the dp_reshardable load copied the template's 0 over the checkpoint's 3), so a resumed
    run's bias correction started again. Now a run resumed at 3 and saved at 6 holds step 6,
    as the uninterrupted run's checkpoint 6 does; with dropout off, the whole state equals."""
    from conftest import launch
    from megatron_deadpool.apps import bench_peers

    tree = patched_tree(tmp_path_factory, TAG)
    flags = bench_peers.MODEL_FLAGS + ["--hidden-dropout", "0", "--attention-dropout", "0",
                                       "--log-interval", "1", "--save-interval", "3"]
    extra = ["--device", "cpu", "--script", str(tree / "pretrain_gpt.py")]

    def run(name, iters, more=(), stops_at=None):
        ck = tmp_path / f"ck_{name}"
        p, s = launch(tmp_path, flags + ["--train-iters", str(iters), "--save", str(ck),
                                         *more], name=name, python=python_for(TAG),
                      extra_launch=extra)
        if stops_at is None:
            assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-2000:]
        else:  # stopped early on purpose: every rank ended well, the checkpoint is there
            assert set(s["exit_codes"].values()) == {0}, s
            assert (ck / f"iter_{stops_at:07d}").is_dir() and s["completed_iters"] == stops_at
        return ck

    whole = run("whole", 6)
    first = run("first", 6, ["--exit-interval", "3"], stops_at=3)  # same schedule, to 3
    resumed = run("resumed", 6, ["--load", str(first)])
    code = ("import json, sys\nfrom megatron_deadpool.apps.bench_peers import fingerprint, "
            "optimizer_steps\nprint(json.dumps([[s for _, _, s in optimizer_steps(d + "
            "'/iter_0000006')] for d in sys.argv[1:]] + [fingerprint(d, 6) for d in "
            "sys.argv[1:]]))")
    s_whole, s_resumed, f_whole, f_resumed = json.loads(
        _tree_python(tree, "-c", code, str(whole), str(resumed)))
    assert s_resumed and set(s_resumed) == {6.0}, s_resumed
    assert s_whole == s_resumed
    assert f_resumed == f_whole
