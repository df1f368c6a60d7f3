"""Megatron-LM's own checkpoints and evaluation through a hot swap, with the real
pretrain_gpt.py (patched, CPU, TP2.PP2.DP2, 4 nodes x 2 + 1 spare): ``--save`` after a
recovery writes the checkpoint the failure-free run writes (tensors compared bit for bit),
``--load`` of it resumes bitwise, and an evaluation after the recovery gives the same
validation loss. Before the fix the first save after a swap raised ``Process group ... is
not initialized in the world group map`` (a save strategy cached with the old groups)."""

from __future__ import annotations

import re
import shutil

import pytest

from conftest import launch
from megatron_deadpool.megatron.checkpoints import compare
from mlm import apply_patches, pristine_tree
from test_megatron_lm_train import FLAGS

pytestmark = [pytest.mark.slow]

EVAL = ["--eval-interval", "4", "--eval-iters", "2"]


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    t = pristine_tree(tmp_path_factory.mktemp("mlm-ckpt"))
    r = apply_patches(t)
    assert r.returncode == 0, r.stderr
    return t


def _run(tree, d, name, flags, spares=0, inject=()):
    p, s = launch(d, flags, spares=spares, inject=inject, name=name,
                  extra_launch=["--device", "cpu", "--script", str(tree / "pretrain_gpt.py")])
    assert p.returncode == 0, p.stdout[-6000:] + p.stderr[-3000:]
    assert s["ok"] and s["final_state_sha256"], s
    return p, s


def _val_losses(out: str):
    """Megatron's validation lines, ``validation loss at iteration N ... lm loss value: X``,
    from rank outputs (prefixed by the launcher)."""
    return sorted(set(re.findall(r"(validation loss at iteration \d+[^|]*)\|.*?"
                                 r"lm loss value: (\S+)", out)))


BASE = FLAGS + ["--deadpool"] + EVAL + ["--save-interval", "4"]


@pytest.fixture(scope="module")
def reference(tree, tmp_path_factory):
    """The failure-free run, shared by the tests: (summary, checkpoint dir, output)."""
    d = tmp_path_factory.mktemp("ref")
    p, s = _run(tree, d, "ref", BASE + ["--save", str(d / "ck")])
    assert s["recoveries"] == []
    return s, d / "ck", p.stdout + p.stderr


def _load_run(tree, d, ck, name):
    """Resume from ``ck`` (copied) to iteration 16, on the checkpoint's LR schedule."""
    more = list(BASE) + ["--use-checkpoint-opt_param-scheduler"]
    more[more.index("--train-iters") + 1] = "16"
    src = d / f"{name}-ck"
    shutil.copytree(ck, src)
    _, s = _run(tree, d, name, more + ["--load", str(src)], spares=1)
    assert s["recoveries"] == [], s
    return s


@pytest.mark.ci
def test_save_eval_and_load_through_a_swap(tree, reference, tmp_path):
    r, ck_r, out_r = reference
    pk, k = _run(tree, tmp_path, "kill", BASE + ["--save", str(tmp_path / "ck")],
                 spares=1, inject=["kill:node=1@iter=6"])
    assert len(k["recoveries"]) == 1
    assert k["final_state_sha256"] == r["final_state_sha256"]
    assert k["losses"] == r["losses"]
    vk, vr = _val_losses(pk.stdout + pk.stderr), _val_losses(out_r)
    at = {re.search(r"iteration (\d+)", label).group(1) for label, _ in vr}
    assert at == {"4", "8", "12"}, vr
    assert vk == vr  # the evaluations at 8 and 12 ran after the recovery
    for it in ("iter_0000008", "iter_0000012"):
        c = compare(str(tmp_path / "ck" / it), str(ck_r / it))
        assert c["equal"] and c["tensors"] > 0, (it, c)
    # --load of each resumes for 4 more iterations to the same state
    a = _load_run(tree, tmp_path, tmp_path / "ck", "load-k")
    b = _load_run(tree, tmp_path, ck_r, "load-r")
    assert a["final_state_sha256"] == b["final_state_sha256"]
    assert a["losses"] == b["losses"] and a["losses"]


def test_a_node_killed_during_a_save(tree, reference, tmp_path):
    """Node 1 dies as the iteration-12 save begins: the survivors' save fails, the job
    recovers and ends; the interrupted save is not taken as complete (Megatron's tracker
    still names iteration 8), and ``--load`` resumes from 8 to the failure-free state."""
    r, ck_r, _ = reference
    _, k = _run(tree, tmp_path, "kill-in-save", BASE + ["--save", str(tmp_path / "ck")],
                spares=1, inject=["kill:node=1@iter=12,phase=save"])
    assert len(k["recoveries"]) == 1 and k["faults"][0]["at_iter"] == 12
    assert k["final_state_sha256"] == r["final_state_sha256"] and k["losses"] == r["losses"]
    tracker = tmp_path / "ck" / "latest_checkpointed_iteration.txt"
    assert tracker.read_text().strip() == "8"
    src = tmp_path / "resume-ck"
    shutil.copytree(tmp_path / "ck", src)
    _, s = _run(tree, tmp_path, "resume-8", BASE + ["--load", str(src)], spares=1)
    assert s["final_state_sha256"] == r["final_state_sha256"]
