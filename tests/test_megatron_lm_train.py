"""Megatron-LM's own pretrain_gpt.py, patched, on CPU, for each supported tag (core_v0.19.0 on
its Python 3.12): 4 nodes x 2 processes, TP2.PP2.DP2, mock data, warmup + cosine LR. Every
run goes through `deadpool launch --device cpu --script` exactly as a user runs it; the runs
are shared between the tests of this module."""

from __future__ import annotations

import pytest

from conftest import job_output, launch
from megatron_deadpool.adapters.tags import NAMES
from megatron_deadpool.base.vocabulary import PHASE_ORDER
from mlm import patched_tree, pristine_tree, python_for

pytestmark = [pytest.mark.slow]

FLAGS = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
         "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "2",
         "--global-batch-size", "8", "--train-iters", "12", "--lr", "1e-3",
         "--lr-decay-style", "cosine", "--lr-warmup-iters", "2", "--mock-data",
         "--tokenizer-type", "NullTokenizer", "--vocab-size", "128",
         "--use-distributed-optimizer"]


# Every supported tag (tags.py), newest first. CI runs the whole set on the newest and one
# hot swap on the one before it (the budget); `make test-all` runs everything on all.
EVERY = tuple(reversed(NAMES))
NEWEST, OLDER = EVERY[0], EVERY[1]


def in_ci_on(ci_tag):
    """Every tag, the one CI runs marked ``ci`` (None: none in CI)."""
    return [pytest.param(t, marks=[pytest.mark.ci] if t == ci_tag else [], id=t) for t in EVERY]


ON_NEWEST_IN_CI = in_ci_on(NEWEST)

_TREES = {}


def _trees(tmp_path_factory, tag):
    if tag not in _TREES:
        unpatched = pristine_tree(tmp_path_factory.mktemp(f"mlm-unpatched-{tag}"), tag)
        _TREES[tag] = {"unpatched": unpatched, "patched": patched_tree(tmp_path_factory, tag)}
    return _TREES[tag]


_RUNS = {}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """run(tag, name, tree, flags, spares, inject) -> summary; each distinct run happens
    once, on the tag's Python."""

    def go(tag, name, which, flags, spares=0, inject=()):
        if (tag, name) not in _RUNS:
            trees = _trees(tmp_path_factory, tag)
            d = tmp_path_factory.mktemp(name)
            p, s = launch(d, flags, spares=spares, inject=inject, name=name,
                          python=python_for(tag),
                          extra_launch=["--device", "cpu", "--script",
                                        str(trees[which] / "pretrain_gpt.py")])
            assert p.returncode == 0, job_output(p)
            assert s["ok"] and s["final_state_sha256"], s
            if which == "patched":  # the unpatched script has no hook that logs losses
                assert s["completed_iters"] == 12, s
            _RUNS[(tag, name)] = (p, s)
        return _RUNS[(tag, name)][1]

    return go


@pytest.mark.parametrize("tag", EVERY)  # CI: the hot swap compares two runs too
def test_patched_script_is_deterministic(run, tag):
    a = run(tag, "deadpool-a", "patched", FLAGS + ["--deadpool"], spares=1)
    b = run(tag, "deadpool-b", "patched", FLAGS + ["--deadpool"], spares=1)
    assert a["final_state_sha256"] and a["final_state_sha256"] == b["final_state_sha256"]
    assert a["losses"] == b["losses"] and len(a["losses"]) == 12
    assert a["recoveries"] == [] and a["mirror"]["mirror_bytes_per_rank"] > 0


@pytest.mark.parametrize("tag", in_ci_on(OLDER))
def test_hot_swap_in_the_real_script(run, tag):
    """The must-show of both tags: node 1 killed at 7, bitwise with the failure-free run.
    CI runs it on the older tag; on the newest, CI's swap against the unpatched script
    (below) and the recipe test (test_megatron_lm_recipe.py) swap in the real script."""
    ref = run(tag, "deadpool-a", "patched", FLAGS + ["--deadpool"], spares=1)
    s = run(tag, "deadpool-kill", "patched", FLAGS + ["--deadpool"], spares=1,
            inject=["kill:node=1@iter=7"])
    (rec,) = s["recoveries"]
    assert rec["failed_ranks"] == [2, 3] and rec["spare_of_rank"] == {"2": 8, "3": 9}
    assert rec["restored_iter"] in (5, 6) and rec["recomputed_iters"] <= 1
    assert set(rec["phases_s"]) == set(PHASE_ORDER) and rec["ranks_reported"] == 8
    assert s["faults"][0]["ranks"] == [2, 3] and s["faults"][0]["at_iter"] == 7
    assert s["final_state_sha256"] == ref["final_state_sha256"]
    assert s["losses"] == ref["losses"]


@pytest.mark.parametrize("tag", EVERY)
def test_mirror_off_patched_matches_unpatched(run, tag):
    off = run(tag, "patched-off", "patched", FLAGS)
    unpatched = run(tag, "unpatched", "unpatched", FLAGS)
    assert off["final_state_sha256"] == unpatched["final_state_sha256"]
    on = run(tag, "deadpool-a", "patched", FLAGS + ["--deadpool"], spares=1)
    assert on["final_state_sha256"] == off["final_state_sha256"]  # the mirror is read-only


@pytest.mark.parametrize("tag", ON_NEWEST_IN_CI)
def test_a_swap_in_the_patched_script_ends_where_the_unpatched_script_does(run, tag):
    """Everything DeadPool adds at once, against upstream: the patched script with the
    mirror on and node 1 killed at 7 ends in the same state as the unmodified script
    without a failure (CI's one comparison with the unpatched tree; the steps in between,
    patched with the mirror off and on, are test_mirror_off_patched_matches_unpatched)."""
    unpatched = run(tag, "unpatched", "unpatched", FLAGS)
    s = run(tag, "deadpool-kill", "patched", FLAGS + ["--deadpool"], spares=1,
            inject=["kill:node=1@iter=7"])
    assert len(s["recoveries"]) == 1 and s["faults"][0]["ranks"] == [2, 3]
    assert s["final_state_sha256"] == unpatched["final_state_sha256"]


@pytest.mark.parametrize("tag", ON_NEWEST_IN_CI)
def test_last_resort_fallback_then_resume_is_bitwise(run, tag, tmp_path_factory):
    """No spare: node 1 killed at 6 stops the job, and first the survivors write the newest
    state memory holds (node 1's shards from their buddies' copies) to
    --deadpool-fallback-save; a new job with --deadpool-resume ends where the uninterrupted
    run does (CI compares with the unpatched script's, equal to the patched one's with the
    mirror on: test_mirror_off_patched_matches_unpatched), the iteration in flight redone."""
    ref = run(tag, "unpatched", "unpatched", FLAGS)
    trees = _trees(tmp_path_factory, tag)
    d = tmp_path_factory.mktemp("fallback")
    script = ["--device", "cpu", "--script", str(trees["patched"] / "pretrain_gpt.py")]
    p, stopped = launch(d, FLAGS + ["--deadpool", "--deadpool-fallback-save", str(d / "fb")],
                        spares=0, inject=["kill:node=1@iter=6"], name="stopped",
                        python=python_for(tag), extra_launch=script)
    assert p.returncode != 0 and "no spare left" in stopped["error"], stopped
    saved = stopped["fallback_save"]
    assert saved["iteration"] in (4, 5), saved  # the newest every rank's copy holds
    p, resumed = launch(d, FLAGS + ["--deadpool", "--deadpool-resume", str(d / "fb")],
                        spares=1, name="resumed", python=python_for(tag), extra_launch=script)
    assert p.returncode == 0, job_output(p)
    assert resumed["completed_iters"] == 12 - saved["iteration"]
    assert saved["iteration"] >= 6 - 2  # at most the iteration in flight and one more redone
    assert resumed["final_state_sha256"] == ref["final_state_sha256"]


@pytest.mark.parametrize("tag", in_ci_on(None))
def test_save_then_load_is_bitwise(run, tag, tmp_path_factory):
    """Megatron-LM's own checkpoints, dropout on (its default 0.1): a job with --deadpool
    --save's every 4 iterations (ending where the unpatched script does: the saves change
    nothing); a new job --load's its iteration 4 and goes on as if never stopped. Its
    checkpoint at 8 equals the first job's, and so do DeadPool's per-rank additions beside
    it (RNG states, each TP rank's own norms and biases: adapters/exact_resume.py); its
    fingerprint at 12 is the unpatched script's."""
    import os
    import subprocess

    from mlm import REPO

    ref = run(tag, "unpatched", "unpatched", FLAGS)
    tree = _trees(tmp_path_factory, tag)["patched"]
    d = tmp_path_factory.mktemp("save-load")
    done = {}
    for name, extra in (("saved", []), ("loaded", ["--load", str(d / "ck-saved"),
                                                  "--ckpt-step", "4"])):
        p, done[name] = launch(d, FLAGS + ["--deadpool", "--save", str(d / f"ck-{name}"),
                                           "--save-interval", "4", *extra],
                               name=name, python=python_for(tag),
                               extra_launch=["--device", "cpu", "--script",
                                             str(tree / "pretrain_gpt.py")])
        assert p.returncode == 0, job_output(p)
        assert done[name]["final_state_sha256"] == ref["final_state_sha256"], done[name]
    saved, loaded = done["saved"], done["loaded"]
    assert loaded["completed_iters"] == 8 and loaded["losses"] == saved["losses"][4:]
    assert "not exact" not in p.stdout + p.stderr
    for rank in range(8):  # DeadPool's additions at 8, byte for byte
        rel = f"deadpool_exact/iter_0000008/rank{rank}.bin"
        assert (d / "ck-saved" / rel).read_bytes() == (d / "ck-loaded" / rel).read_bytes()
    c = subprocess.run([python_for(tag), str(REPO / "scripts" / "compare_checkpoints.py"),
                        str(d / "ck-saved" / "iter_0000008"),
                        str(d / "ck-loaded" / "iter_0000008")], capture_output=True,
                       text=True, timeout=300,
                       env=dict(os.environ, PYTHONPATH=os.pathsep.join([str(tree), str(REPO)])))
    assert c.returncode == 0, c.stdout[-3000:] + c.stderr[-3000:]
