"""The Megatron-LM configuration people train with, through a hot swap, with the real
pretrain_gpt.py (patched, CPU, TP2.PP2.DP2, 4 nodes x 2 + 1 spare): overlapped grad-reduce
and param-gather, an interleaved pipeline, evaluation and Megatron's own ``--save``/``--load``
(the must-show of the production-flags issue), then sequence parallel and MoE with expert
parallelism. After a recovery a save writes the checkpoint the failure-free run writes
(tensors compared bit for bit), ``--load`` of it resumes bitwise, and every evaluation gives
the failure-free validation loss, also when the failure strikes during one."""

from __future__ import annotations

import re
import shutil

import pytest

from conftest import job_output, launch
from mlm import REPO, patched_tree, python_for
from test_megatron_lm_train import FLAGS, NEWEST, OLDER, in_ci_on

pytestmark = [pytest.mark.slow]

# the production flags of the must-show (P)
P = ["--overlap-grad-reduce", "--overlap-param-gather",
     "--num-layers-per-virtual-pipeline-stage", "1", "--eval-interval", "4", "--eval-iters", "2"]
SP = ["--sequence-parallel"]
MOE = ["--num-experts", "4", "--expert-model-parallel-size", "2", "--moe-router-topk", "2"]


# CI runs the evaluation kill and SP + MoE on the newest tag; the rest run on both tags
# outside CI (`make test-all`).
BOTH = [pytest.param(t, id=t) for t in (NEWEST, OLDER)]


@pytest.fixture
def tree(tmp_path_factory, tag):
    return patched_tree(tmp_path_factory, tag)


def _run(tree, d, name, flags, spares=0, inject=()):
    tag = _tag_of(tree)
    p, s = launch(d, flags, spares=spares, inject=inject, name=name, python=python_for(tag),
                  extra_launch=["--device", "cpu", "--script", str(tree / "pretrain_gpt.py")])
    assert p.returncode == 0, job_output(p)
    assert s["ok"] and s["final_state_sha256"], s
    return p, s


def _tag_of(tree) -> str:
    from megatron_deadpool.adapters.tags import patched_tag

    return patched_tag(str(tree)).name


def compare(tree, a, b) -> dict:
    """scripts/compare_checkpoints.py A B on the tree's Python, with the tree's megatron
    (a checkpoint's pickled objects are that tag's classes)."""
    import json
    import os
    import subprocess

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tree), str(REPO)]))
    p = subprocess.run([python_for(_tag_of(tree)), str(REPO / "scripts" /
                                                      "compare_checkpoints.py"), a, b],
                       env=env, capture_output=True, text=True, timeout=300)
    assert p.stdout.strip(), p.stderr[-3000:]
    return json.loads(p.stdout)


def _val_losses(out: str):
    """Megatron's validation lines, ``validation loss at iteration N ... lm loss value: X``,
    from rank outputs (prefixed by the launcher)."""
    return sorted(set(re.findall(r"(validation loss at iteration \d+[^|]*)\|.*?"
                                 r"lm loss value: (\S+)", out)))


BASE = FLAGS + ["--deadpool"] + P + ["--save-interval", "4"]


_REFERENCE = {}


@pytest.fixture
def reference(tree, tag, tmp_path_factory):
    """The failure-free run of ``tag``, shared by the tests: (summary, checkpoint dir,
    output)."""
    if tag not in _REFERENCE:
        d = tmp_path_factory.mktemp("ref")
        # one spare node, though nothing is planted: the open CPU heap corruption
        # (docs/megatron-lm.md) took rank 3 of this run at iteration 11 in CI (2026-11-29)
        # and, with no spare, stopped it; a crash is a failure like any other, swapped and
        # accounted for by its cause (_planted), and the run still ends bitwise
        p, s = _run(tree, d, "ref", BASE + ["--save", str(d / "ck")], spares=1)
        assert _planted(s, ()) == [], s["recoveries"]
        _REFERENCE[tag] = s, d / "ck", p.stdout + p.stderr
    return _REFERENCE[tag]


def _load_run(tree, d, ck, name, inject=(), at=None):
    """Resume from ``ck`` (copied; ``at``: from that saved iteration, not the newest) to
    iteration 16, on the checkpoint's LR schedule (``inject``: a failure after the load)."""
    more = list(BASE) + ["--use-checkpoint-opt_param-scheduler"]
    more[more.index("--train-iters") + 1] = "16"
    src = d / f"{name}-ck"
    shutil.copytree(ck, src)
    if at is not None:
        (src / "latest_checkpointed_iteration.txt").write_text(str(at))
    _, s = _run(tree, d, name, more + ["--load", str(src)], spares=1, inject=inject)
    assert len(s["recoveries"]) == len(inject), s
    return s


@pytest.mark.parametrize("tag", BOTH)
def test_production_flags_save_eval_and_load_through_a_swap(tree, reference, tmp_path):
    """The must-show: overlap, interleaved pipeline, eval and save; node 1 killed at 6.
    Not in CI, which runs the recipe (test_megatron_lm_recipe.py: the same flags in bf16
    on real data with sequence parallel, checkpoints compared) and the evaluation kill
    below on the same reference run; the --load pair runs in `make test-all`."""
    r, ck_r, out_r = reference
    pk, k = _run(tree, tmp_path, "kill", BASE + ["--save", str(tmp_path / "ck"),
                                                 "--deadpool-audit", "full"],
                 spares=1, inject=["kill:node=1@iter=6"])
    assert len(k["recoveries"]) == 1
    assert k["final_state_sha256"] == r["final_state_sha256"]
    assert k["losses"] == r["losses"]
    vk, vr = _val_losses(pk.stdout + pk.stderr), _val_losses(out_r)
    at = {re.search(r"iteration (\d+)", label).group(1) for label, _ in vr}
    assert at == {"4", "8", "12"}, vr
    assert vk == vr  # the evaluations at 8 and 12 ran after the recovery
    for it in ("iter_0000008", "iter_0000012"):
        c = compare(tree, str(tmp_path / "ck" / it), str(ck_r / it))
        assert c["equal"] and c["tensors"] > 0, (it, c)
    # --load of each resumes for 4 more iterations to the same state
    a = _load_run(tree, tmp_path, tmp_path / "ck", "load-k")
    b = _load_run(tree, tmp_path, ck_r, "load-r")
    assert a["final_state_sha256"] == b["final_state_sha256"]
    assert a["losses"] == b["losses"] and a["losses"]


@pytest.mark.parametrize("tag", in_ci_on(None))
def test_a_node_killed_during_an_evaluation(tree, reference, tmp_path):
    """Node 2 dies as the first evaluation, after iteration 4, begins. The restore lands
    before that evaluation (its snapshot is taken first), so every rank, the promoted
    spares included, runs it again: the same validation losses, consumed validation
    samples and state as the failure-free run. Before the first evaluation the restored
    ``consumed_valid_samples`` is 0, which Megatron's iterator build took for a checkpoint
    older than the counter and rewrote: the redone evaluation counted twice (a CI run
    restored iteration 4 after a kill at 6 and ended with 96 validation samples, not 80)."""
    r, _, out_r = reference
    # one spare node more than planned: the open CPU heap corruption (SIGABRT after the
    # iteration-4 save, rank 2, CI 2026-11-29) is a failure like any other; every recovery
    # is accounted for by its cause (_planted)
    pk, k = _run(tree, tmp_path, "kill-in-eval", BASE + ["--save", str(tmp_path / "ck")],
                 spares=2, inject=["kill:node=2@iter=4,phase=eval"])
    assert _planted(k, (4, 5)) == [[4, 5]], k["recoveries"]
    assert k["faults"][0]["at_iter"] == 4
    assert k["final_state_sha256"] == r["final_state_sha256"] and k["losses"] == r["losses"]
    assert _val_losses(pk.stdout + pk.stderr) == _val_losses(out_r)


@pytest.mark.parametrize("tag", in_ci_on(None))
def test_sequence_parallel_and_moe_through_a_swap(tree, tmp_path):
    """TP2 with sequence parallel (CPU: cpu_standins.sequence_parallel_norm) and MoE with
    expert parallelism 2 (expert tensor parallelism 1: the experts have biases), on top of
    the production flags: the expert groups are rebuilt, the expert optimizer shards
    mirrored and restored, the routers' buffers fingerprinted."""
    flags = FLAGS + ["--deadpool"] + P + SP + MOE + ["--expert-tensor-parallel-size", "1"]
    # one spare more than planned in each run: for the open CPU heap-corruption defect
    # (docs/megatron-lm.md), which took a rank of this test's runs in 3 of its last 4 on
    # core_v0.19.0, a crash is a failure like any other (swapped, and the run still ends
    # bitwise); every recovery is accounted for, by its cause
    _, ref = _run(tree, tmp_path, "ref-moe", flags, spares=1)
    _, k = _run(tree, tmp_path, "kill-moe", flags, spares=2, inject=["kill:node=1@iter=7"])
    assert _planted(ref, ()) == [] and _planted(k, (2, 3)) == [[2, 3]], k["recoveries"]
    assert k["final_state_sha256"] == ref["final_state_sha256"]
    assert k["losses"] == ref["losses"]


# the signals of the open CPU heap corruption (docs/megatron-lm.md): SIGABRT, SIGBUS, SIGSEGV
CRASH_CODES = (-6, -7, -11)


def _planted(s, ranks):
    """The failed ranks of each recovery ``s`` planted (those of ``ranks``); every other
    recovery must be the heap corruption's, one process that exited with its signal each."""
    planted = [sorted(r["failed_ranks"]) for r in s["recoveries"]
               if set(r["failed_ranks"]) <= set(ranks) and ranks]
    crashes = [c for c in s["exit_codes"].values() if c in CRASH_CODES]
    assert len(s["recoveries"]) - len(planted) <= len(crashes), (s["recoveries"],
                                                                 s["exit_codes"])
    return planted


@pytest.mark.parametrize("extra", [
    # TP1.PP2.DP4 with the interleaved pipeline needs >= 2 microbatches per iteration
    # (Megatron's own check): a global batch of 16, not 8
    pytest.param(["--tensor-model-parallel-size", "1"] + MOE + ["--global-batch-size", "16"],
                 id="moe-tp1-ep2"),
    pytest.param(SP, id="sequence-parallel")])
@pytest.mark.parametrize("tag", BOTH)
def test_must_show_pairs(tree, tmp_path, extra):
    """The must-show's other pairs, as shown (MoE on TP1.PP2.DP4; sequence parallel)."""
    flags = FLAGS + ["--deadpool"] + P + extra
    _, ref = _run(tree, tmp_path, "ref", flags)
    _, k = _run(tree, tmp_path, "kill", flags, spares=1, inject=["kill:node=1@iter=6"])
    assert len(k["recoveries"]) == 1
    assert k["final_state_sha256"] == ref["final_state_sha256"]


@pytest.mark.parametrize("tag", BOTH)
def test_a_node_killed_during_a_save(tree, reference, tmp_path):
    """Node 1 dies as the iteration-12 save begins (the last iteration: the restore ends
    the loop, and the redone evaluation runs after it): the job recovers and ends at the
    failure-free state. The interrupted save is not taken as complete: it is written
    again (the step redone after a restore to 11, or adapters/cadence.py after one to
    12), so the tracker names 12 and the directory holds the failure-free run's
    iterations, with equal tensors; ``--load`` of the rewritten 12 resumes exactly as
    from the failure-free run's 12."""
    r, ck_r, _ = reference
    _, k = _run(tree, tmp_path, "kill-in-save", BASE + ["--save", str(tmp_path / "ck")],
                spares=1, inject=["kill:node=1@iter=12,phase=save"])
    assert len(k["recoveries"]) == 1 and k["faults"][0]["at_iter"] == 12
    assert k["final_state_sha256"] == r["final_state_sha256"] and k["losses"] == r["losses"]
    tracker = tmp_path / "ck" / "latest_checkpointed_iteration.txt"
    assert tracker.read_text().strip() == "12"  # before the cadence was kept: 8
    (rec,) = k["recoveries"]
    assert rec["restored_iter"] in (11, 12), rec  # 12 once its snapshot committed
    names = sorted(p.name for p in (tmp_path / "ck").glob("iter_*"))
    assert names == sorted(p.name for p in ck_r.glob("iter_*")), names
    for it in ("iter_0000008", "iter_0000012"):
        c = compare(tree, str(tmp_path / "ck" / it), str(ck_r / it))
        assert c["equal"] and c["tensors"] > 0, (it, c)
    a = _load_run(tree, tmp_path, tmp_path / "ck", "resume-k")
    b = _load_run(tree, tmp_path, ck_r, "resume-r")
    assert a["final_state_sha256"] == b["final_state_sha256"] and a["losses"] == b["losses"]


@pytest.mark.parametrize("tag", BOTH)
def test_load_at_start_then_a_swap(tree, reference, tmp_path):
    """``--load`` of the failure-free checkpoint 12 (with the checkpoint's LR schedule), 4
    more iterations, node 2 killed at 14: bitwise equal to the same resume without the
    kill. Two defects were found here: the CPU path's load shared one torch Adam ``step``
    between all parameters (the spare refused the buddy's copy: "layout mismatch"), and
    the snapshot carried only the scheduler's step count, so a promoted spare, which never
    loads a checkpoint, ran the arguments' LR schedule instead of the checkpoint's."""
    _, ck_r, _ = reference
    a = _load_run(tree, tmp_path, ck_r, "load-kill", inject=["kill:node=2@iter=14"])
    b = _load_run(tree, tmp_path, ck_r, "load-plain")
    assert a["final_state_sha256"] == b["final_state_sha256"] and a["losses"] == b["losses"]
