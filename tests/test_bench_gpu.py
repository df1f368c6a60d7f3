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
from mlm import find_archive


def test_dry_run_plans_both_trainers_on_the_shared_gpu(tmp_path):
    if find_archive("core_v0.19.0") is None and os.environ.get("CI") != "true":
        pytest.skip("no Megatron-LM archive beside the repository")
    p = subprocess.run(["bash", str(REPO / "scripts" / "gpu_swap_check.sh"), "--dry-run",
                        "--out", str(tmp_path / "o"), "--carry", str(tmp_path)],
                       env=dict(os.environ, PYTHON=sys.executable), capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    plan = json.loads((tmp_path / "o" / "gpu_swap.json").read_text())
    assert plan["dry_run"] and not plan["results"] and plan["megatron_lm_tree"]
    cases = {c["case"]: c["argv"] for c in plan["plan"]}
    assert {"ref-free", "ref-kill-fwdbwd", "ref-kill-optimizer", "mlm-free", "mlm-kill-fwdbwd",
            "mlm-kill-optimizer"} <= set(cases)
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


@pytest.mark.slow
def test_cpu_rehearsal_of_the_reference_cases(tmp_path):
    """The script's own runs, in CPU mode: a kill in forward/backward and one in the
    optimizer step recover bitwise against the failure-free run."""
    r = bench_gpu.run(str(tmp_path), None, budget_s=900, dry_run=False, device="cpu",
                      cases=["ref-free", "ref-kill-fwdbwd", "ref-kill-optimizer"])
    assert r["bitwise"] is True and r["bitwise_by_trainer"]["reference"] is True, \
        json.dumps(r["results"], indent=1)[-3000:]


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
