"""The one-call GPU script (scripts/gpu_swap_check.sh -> ``deadpool bench gpu``) on CPU: its
``--dry-run`` plans what the GPU run does without a GPU, and its verdict (bitwise per
trainer, every phase bounded) can fail. The CPU rehearsal of the same cases
(``deadpool bench gpu --device cpu``) is a slow test."""

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO
from megatron_deadpool.apps import bench_gpu
from megatron_deadpool.launch import gpus
from megatron_deadpool.launch.options import LaunchOptions, validate


def test_dry_run_plans_both_trainers_on_the_shared_gpu_in_order(tmp_path):
    """From a clean clone (no carry yet) the dry run still plans every case, in the order
    the device runs them: the failure-free runs first (the second is the determinism
    control), then the kills, Megatron-LM's among the first."""
    p = subprocess.run(["bash", str(REPO / "scripts" / "gpu_swap_check.sh"), "--dry-run",
                        "--out", str(tmp_path / "o"), "--carry", str(tmp_path)],
                       env=dict(os.environ, PYTHON=sys.executable), capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    plan = json.loads((tmp_path / "o" / "gpu_swap.json").read_text())
    assert plan["dry_run"] and not plan["results"] and plan["megatron_lm_tree"]
    order = [c["case"] for c in plan["plan"]]
    assert order == [c.name for c in bench_gpu.CASES]
    assert order[:2] == ["ref-free", "ref-free-again"]
    free = [i for i, c in enumerate(bench_gpu.CASES) if c.phase is None]
    kills = [i for i, c in enumerate(bench_gpu.CASES) if c.phase is not None]
    assert max(free) < min(kills)
    assert bench_gpu.CASES[kills[1]].trainer == "pretrain_gpt"  # Megatron-LM's among the first
    printed = [line.split("would run ")[1].split()[0] for line in p.stdout.splitlines()
               if "would run" in line]
    assert printed == order
    cases = {c["case"]: c["argv"] for c in plan["plan"]}
    for name, argv in cases.items():
        launch = argv[argv.index("launch"):argv.index("--")]
        assert launch[launch.index("--nodes") + 1] == "4"
        assert launch[launch.index("--spare-nodes") + 1] == "1"
        assert "--share-gpu" in launch and launch[launch.index("--device") + 1] == "cuda"
        flags = argv[argv.index("--") + 1:]
        assert "--bf16" in flags and "--deadpool" in flags
        assert ("--script" in launch) == name.startswith("mlm")
    assert "kill:node=1@iter=6,phase=optimizer" in cases["ref-kill-optimizer"]
    assert plan["environment"]["share_gpu"]["nccl_env"] == gpus.SHARED_GPU_NCCL


@pytest.mark.parametrize("case", [c for c in bench_gpu.CASES if c.trainer == "reference"])
def test_every_planned_reference_run_passes_the_launchers_validation(case, monkeypatch):
    monkeypatch.setattr(gpus, "visible_gpus", lambda env=None: ["0"])
    argv = bench_gpu.command(case, "/tmp/x", None)
    rest = argv[argv.index("--") + 1:]
    validate(LaunchOptions(nodes=4, procs_per_node=2, spare_nodes=1, device="cuda",
                           share_gpu=True, inject=case.inject(), trainer_argv=rest))


def _result(name, trainer, phase, sha, phases=None, ok=True):
    recs = [] if phases is None else [{"phases_s": phases}]
    worst = max(phases.values()) if phases else None
    return {"case": name, "trainer": trainer, "kill_phase": phase, "ok": ok,
            "final_state_sha256": sha, "recoveries": recs, "max_phase_s": worst}


def test_verdict_fails_on_a_mismatch_a_slow_phase_or_no_recovery():
    ok = [_result("ref-free", "reference", None, "a"),
          _result("ref-kill", "reference", "optimizer", "a", {"detect": 0.1, "abort": 1.0})]
    assert bench_gpu.verdict(ok) == {"reference": True, "pretrain_gpt": None}
    for bad in ([_result("ref-kill", "reference", "optimizer", "b", {"detect": 0.1})],
                [_result("ref-kill", "reference", "optimizer", "a", {"detect": 31.0})],
                [_result("ref-kill", "reference", "optimizer", "a", None)],
                [_result("ref-kill", "reference", "optimizer", None, {"detect": 1.0}, ok=False)]):
        assert bench_gpu.verdict(ok[:1] + bad)["reference"] is False, bad


def test_determinism_needs_two_equal_failure_free_runs():
    a, b = _result("ref-free", "reference", None, "a"), _result("ref-free-again", "reference",
                                                                None, "a")
    assert bench_gpu.determinism([a, b]) == {"reference": True, "pretrain_gpt": None}
    assert bench_gpu.determinism([a, dict(b, final_state_sha256="b")])["reference"] is False
    assert bench_gpu.determinism([a])["reference"] is None


def test_the_outbox_rules_catch_what_would_not_come_back(tmp_path):
    sys.path.insert(0, str(REPO / "scripts"))
    import gpu_outbox

    ok = tmp_path / "ok"
    (ok / "a" / "b").mkdir(parents=True)
    (ok / "a" / "b" / "f.json").write_text("{}")
    assert gpu_outbox.problems(str(ok)) == []
    deep = tmp_path / "deep" / "a" / "b" / "c"
    deep.mkdir(parents=True)
    (deep / "f").write_text("x")
    assert any("folders down" in p for p in gpu_outbox.problems(str(tmp_path / "deep")))
    many = tmp_path / "many"
    many.mkdir()
    for i in range(9):
        (many / f"f{i}").write_text("x")
    assert any("more than 8" in p for p in gpu_outbox.problems(str(many)))
    odd = tmp_path / "odd"
    odd.mkdir()
    (odd / "a b").write_text("x")
    assert any("other characters" in p for p in gpu_outbox.problems(str(odd)))


@pytest.mark.slow
def test_the_cpu_rehearsal_of_the_one_call(tmp_path):
    """The whole device call on CPU under the device's rules (git and make off PATH, no
    package index), in its cheapest form: the smoke test, ref-free, ref-free-again and a
    kill in forward/backward, then ref-kill-optimizer cut by the scaled-down deadline. OUT
    comes back whole (3 files), the cut case is skipped, not failed, and the CPU cases are
    deterministic and bitwise."""
    out = tmp_path / "out"
    p = subprocess.run(["bash", str(REPO / "scripts" / "gpu_swap_check.sh"), "--rehearse",
                        "--out", str(out / "gpu_swap")],
                       env=dict(os.environ, PYTHON=sys.executable, OUT=str(out)),
                       capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-2000:]
    assert "comes back whole" in p.stdout and "git absent, make absent" in p.stdout
    assert "the last 60 lines of the log" in p.stdout
    assert sorted(os.listdir(out / "gpu_swap")) == ["gpu_swap.json", "gpu_swap.log.gz",
                                                   "gpu_swap_cases.tar.gz"]
    r = json.loads((out / "gpu_swap" / "gpu_swap.json").read_text())
    assert r["smoke"]["ok"] and r["machine"]["tools"]["git"] is False
    assert r["environment"]["commit"], "the commit is recorded before git leaves PATH"
    assert r["deterministic"] is True and r["bitwise"] is True, json.dumps(r["results"])[-3000:]
    assert r["kills"] == {"ref-kill-fwdbwd": True}
    assert [s["case"] for s in r["skipped"] if s.get("cut")] == ["ref-kill-optimizer"]
    assert set(r["case_seconds"]) == {"ref-free", "ref-free-again", "ref-kill-fwdbwd",
                                      "ref-kill-optimizer"}


def test_counts_dry_run_plans_the_repair_probe(tmp_path):
    """Issue 51's NCCL case (``--counts``): one call, nothing carried, W = 8, 16, 32."""
    p = subprocess.run(["bash", str(REPO / "scripts" / "gpu_swap_check.sh"), "--counts",
                        "--dry-run", "--out", str(tmp_path / "o"), "--carry", str(tmp_path)],
                       env=dict(os.environ, PYTHON=sys.executable), capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    for w in (8, 16, 32):
        assert f"W={w}: {w} ranks + 2 spares on one cuda device" in p.stdout
    assert "SHRINK_ABORT" in p.stdout and "deadpool bench gpu" not in p.stdout
    sys.path.insert(0, str(REPO / "scripts"))
    import gpu_repair_counts as probe

    groups = probe.layout(16)
    assert groups["tp0.1"] == [2, 3] and groups["dp0.0"] == [0, 2, 4, 6]
    assert groups["pp1.0"] == [2, 10] and len(groups["tpdp0"]) == 8
    assert sorted(r for m in groups.values() for r in m if len(m) == 2 and m[1] - m[0] == 1) \
        == list(range(16))  # every rank in one tensor-parallel pair
