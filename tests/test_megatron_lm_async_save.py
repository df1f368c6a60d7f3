"""Megatron-LM's ``--async-save`` and the checkpoint cadence through a hot swap, with the
real pretrain_gpt.py (patched, CPU, TP2.PP2.DP2, 4 nodes x 2 + 1 spare, a save every 4
iterations of 12).

An asynchronous save that a failure cuts off is abandoned (never finalized, the tracker
not advanced, its writers killed: adapters/async_saves.py), and the save due at the
restored iteration is written again (adapters/cadence.py). Each run with a kill is
compared with the same run without it: the same final state, bit for bit, and the same
checkpoint iterations on disk, with the same tensors."""

from __future__ import annotations

import re

import pytest

from test_megatron_lm_production import BASE, BOTH, _run, _tag_of, compare
from test_megatron_lm_production import reference  # noqa: F401 (a fixture: its run is shared)
from test_megatron_lm_train import FLAGS, NEWEST, OLDER

pytestmark = [pytest.mark.slow]

# core_v0.19.0 defaults to NVRx's writer (not installed here, and refused with --deadpool)
ASYNC = {OLDER: ["--async-save", "--use-persistent-ckpt-worker"],
         NEWEST: ["--async-save", "--use-persistent-ckpt-worker", "--async-strategy", "mcore"]}


def _flags(tag):
    return FLAGS + ["--deadpool", "--save-interval", "4"] + ASYNC[tag]


@pytest.fixture
def tree(tmp_path_factory, tag):
    from mlm import patched_tree

    return patched_tree(tmp_path_factory, tag)


_REF = {}


@pytest.fixture
def async_reference(tree, tag, tmp_path_factory):
    """The failure-free run with --async-save: (summary, checkpoint dir)."""
    if tag not in _REF:
        d = tmp_path_factory.mktemp("async-ref")
        _, s = _run(tree, d, "ref", _flags(tag) + ["--save", str(d / "ck")])
        assert s["recoveries"] == []
        _REF[tag] = s, d / "ck"
    return _REF[tag]


def iterations(ck) -> list:
    return sorted(p.name for p in ck.iterdir() if p.name.startswith("iter_"))


def tracker(ck) -> str:
    return (ck / "latest_checkpointed_iteration.txt").read_text().strip()


def same_checkpoints(tree, ck, ck_ref, later=("iter_0000008", "iter_0000012")) -> None:
    """The same iterations on disk, the same tracker, the same tensors at ``later``."""
    assert iterations(ck) == iterations(ck_ref) == ["iter_0000004", "iter_0000008",
                                                    "iter_0000012"], iterations(ck)
    assert tracker(ck) == tracker(ck_ref) == "12"
    for it in later:
        c = compare(tree, str(ck / it), str(ck_ref / it))
        assert c["equal"] and c["tensors"] > 0, (it, c)


def _abandoned(out: str) -> list:
    return re.findall(r"abandoned (\d+) unfinalized async save", out)


def _resaved(out: str) -> set:
    """The iterations whose save the cadence wrote again (cadence.py), on any rank."""
    return {int(x) for x in re.findall(r"the save at iteration (\d+) written again", out)}


@pytest.mark.parametrize("tag", [pytest.param(NEWEST, id=NEWEST), pytest.param(OLDER, id=OLDER)])
@pytest.mark.parametrize("inject", [
    pytest.param("kill:node=1@iter=8,phase=save", id="during-a-save"),
    pytest.param("kill:node=2@iter=9", id="after-a-save")])
def test_async_save_through_a_swap(tree, async_reference, tmp_path, inject):
    """Node 1 dies as the iteration-8 save begins, or node 2 in iteration 9, while the
    iteration-8 save's writes are usually still unfinalized (the log says whether one was
    abandoned). Either way the restore lands on 7 or 8 and the job saves 8 again (its own
    step redone, or cadence.py), finalizes 8 and 12 with every rank's writer, the
    promoted spares' included, and ends bitwise with the failure-free async run."""
    r, ck_r = async_reference
    ck = tmp_path / "ck"
    p, k = _run(tree, tmp_path, "kill", _flags(_tag_of(tree)) + ["--save", str(ck)], spares=1,
                inject=[inject])
    (rec,) = k["recoveries"]
    assert rec["restored_iter"] in (7, 8, 9), rec
    assert k["final_state_sha256"] == r["final_state_sha256"] and k["losses"] == r["losses"]
    same_checkpoints(tree, ck, ck_r)
    out = p.stdout + p.stderr
    if rec["restored_iter"] == 8 and _abandoned(out):  # 8 cut off, restored onto: redone
        assert _resaved(out) == {8}, out[-3000:]
    print("restored", rec["restored_iter"], "abandoned", _abandoned(p.stdout + p.stderr))


@pytest.mark.parametrize("tag", BOTH)
def test_the_cadence_is_kept_after_a_restore_to_a_save(tree, reference, tmp_path):
    """Synchronous saves, the production flags: node 1 dies as the iteration-8 save
    begins, after the evaluation at 8, so the restore lands on 8 once its snapshot
    committed. The failure-free run saved at 8: the job writes that save again before
    iteration 9, so its checkpoint directory holds 4, 8 and 12 as the failure-free run's
    does, with equal tensors (before, the save at 8 was never written)."""
    r, ck_r, _ = reference
    p, k = _run(tree, tmp_path, "kill", BASE + ["--save", str(tmp_path / "ck")], spares=1,
                inject=["kill:node=1@iter=8,phase=save"])
    (rec,) = k["recoveries"]
    assert rec["restored_iter"] in (7, 8), rec
    assert k["final_state_sha256"] == r["final_state_sha256"] and k["losses"] == r["losses"]
    same_checkpoints(tree, tmp_path / "ck", ck_r)
    # restored onto 8, whose save the failure cut off: the cadence wrote it (from 7 the
    # redone iteration 8 saves by itself)
    assert _resaved(p.stdout + p.stderr) == ({8} if rec["restored_iter"] == 8 else set())
    print("restored", rec["restored_iter"])
