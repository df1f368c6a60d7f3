"""Megatron-LM's own pretrain_gpt.py, patched, on CPU: 4 nodes x 2 processes, TP2.PP2.DP2,
mock data, warmup + cosine LR. Every run goes through `deadpool launch --device cpu --script`
exactly as a user runs it; the runs are shared between the tests of this module."""

from __future__ import annotations

import shutil

import pytest

from conftest import launch
from megatron_deadpool.recovery.phases import PHASE_ORDER
from mlm import apply_patches, pristine_tree

pytestmark = [pytest.mark.slow]

FLAGS = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
         "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "2",
         "--global-batch-size", "8", "--train-iters", "12", "--lr", "1e-3",
         "--lr-decay-style", "cosine", "--lr-warmup-iters", "2", "--mock-data",
         "--tokenizer-type", "NullTokenizer", "--vocab-size", "128",
         "--use-distributed-optimizer"]


@pytest.fixture(scope="module")
def trees(tmp_path_factory):
    unpatched = pristine_tree(tmp_path_factory.mktemp("mlm-unpatched"))
    patched = tmp_path_factory.mktemp("mlm-patched") / "Megatron-LM"
    shutil.copytree(unpatched, patched)
    r = apply_patches(patched)
    assert r.returncode == 0, r.stderr
    return {"unpatched": unpatched, "patched": patched}


_RUNS = {}


@pytest.fixture(scope="module")
def run(trees, tmp_path_factory):
    """run(name, tree, flags, spares, inject) -> summary; each distinct run happens once."""

    def go(name, which, flags, spares=0, inject=()):
        if name not in _RUNS:
            d = tmp_path_factory.mktemp(name)
            p, s = launch(d, flags, spares=spares, inject=inject, name=name,
                          extra_launch=["--device", "cpu", "--script",
                                        str(trees[which] / "pretrain_gpt.py")])
            assert p.returncode == 0, p.stdout[-6000:] + p.stderr[-3000:]
            assert s["ok"] and s["final_state_sha256"], s
            if which == "patched":  # the unpatched script has no hook that logs losses
                assert s["completed_iters"] == 12, s
            _RUNS[name] = (p, s)
        return _RUNS[name][1]

    return go


@pytest.mark.ci
def test_patched_script_is_deterministic(run):
    a = run("deadpool-a", "patched", FLAGS + ["--deadpool"], spares=1)
    b = run("deadpool-b", "patched", FLAGS + ["--deadpool"], spares=1)
    assert a["final_state_sha256"] and a["final_state_sha256"] == b["final_state_sha256"]
    assert a["losses"] == b["losses"] and len(a["losses"]) == 12
    assert a["recoveries"] == [] and a["mirror"]["mirror_bytes_per_rank"] > 0


@pytest.mark.ci
def test_hot_swap_in_the_real_script(run, tmp_path):
    ref = run("deadpool-a", "patched", FLAGS + ["--deadpool"], spares=1)
    s = run("deadpool-kill", "patched", FLAGS + ["--deadpool"], spares=1,
            inject=["kill:node=1@iter=7"])
    (rec,) = s["recoveries"]
    assert rec["failed_ranks"] == [2, 3] and rec["spare_of_rank"] == {"2": 8, "3": 9}
    assert rec["restored_iter"] in (5, 6) and rec["recomputed_iters"] <= 1
    assert set(rec["phases_s"]) == set(PHASE_ORDER) and rec["ranks_reported"] == 8
    assert s["faults"][0]["ranks"] == [2, 3] and s["faults"][0]["at_iter"] == 7
    assert s["final_state_sha256"] == ref["final_state_sha256"]
    assert s["losses"] == ref["losses"]


@pytest.mark.ci
def test_mirror_off_patched_matches_unpatched(run):
    off = run("patched-off", "patched", FLAGS)
    unpatched = run("unpatched", "unpatched", FLAGS)
    assert off["final_state_sha256"] == unpatched["final_state_sha256"]
    on = run("deadpool-a", "patched", FLAGS + ["--deadpool"], spares=1)
    assert on["final_state_sha256"] == off["final_state_sha256"]  # the mirror is read-only
