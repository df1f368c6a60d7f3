"""Every shell script under scripts/ parses (`bash -n`) and is shellcheck-clean, and the
batch scripts carry the Slurm flags a DeadPool job needs to outlive a lost node."""

import os
import re
import shutil
import subprocess
import sys

import pytest

from conftest import REPO

SCRIPTS = sorted(p for p in (REPO / "scripts").iterdir()
                 if p.suffix in (".sh", ".sbatch"))
BATCH = [p for p in SCRIPTS if p.suffix == ".sbatch"]


def test_there_are_scripts():
    names = {p.name for p in SCRIPTS}
    assert {"perlmutter.sbatch", "vista.sbatch", "cpu-local.sbatch", "slurm_common.sh",
            "slurm_local.sh"} <= names


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.name)
def test_bash_parses(path):
    p = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.name)
def test_shellcheck_clean(path):
    if shutil.which("shellcheck") is None:
        if os.environ.get("CI") == "true":
            pytest.fail("shellcheck is required in CI (.ci/run installs it as root)")
        pytest.skip("shellcheck is not installed (apt-get install shellcheck; .ci/run does)")
    p = subprocess.run(["shellcheck", "-x", str(path)], capture_output=True, text=True,
                       cwd=REPO)
    assert p.returncode == 0, p.stdout + p.stderr


@pytest.mark.parametrize("path", BATCH, ids=lambda p: p.name)
def test_batch_scripts_survive_a_lost_node(path):
    text = path.read_text()
    sbatch = set(re.findall(r"^#SBATCH\s+(--[\w-]+)", text, re.M))
    assert {"--no-kill", "--no-requeue", "--ntasks-per-node"} <= sbatch
    assert re.search(r"^#SBATCH --ntasks-per-node=1\b", text, re.M)  # one agent per node
    assert "scripts/slurm_common.sh" in text and "deadpool_run" in text


def test_srun_step_survives_a_lost_node():
    text = (REPO / "scripts" / "slurm_common.sh").read_text()
    (srun,) = re.findall(r"local srun_flags=\(([^)]*)\)", text, re.S)
    assert "--no-kill" in srun and "--kill-on-bad-exit=0" in srun
    assert "--ntasks-per-node=1" in srun


def test_gpu_scripts_keep_nccl_errors_in_process():
    for name in ("perlmutter.sbatch", "vista.sbatch"):
        text = (REPO / "scripts" / name).read_text()
        assert re.search(r"^export TORCH_NCCL_ASYNC_ERROR_HANDLING=2$", text, re.M), name


def _bash(script: str, env: dict, cwd):
    return subprocess.run(["bash", "-c", script], env=dict(os.environ, **env), cwd=cwd,
                          capture_output=True, text=True, timeout=120)


def test_preset_flags_come_from_deadpool_plan(tmp_path):
    p = _bash('set -euo pipefail; source scripts/slurm_common.sh; deadpool_trainer_flags; '
              'printf "%s\\n" "${TRAIN_FLAGS[@]}"',
              {"OUT": str(tmp_path), "DEADPOOL_PYTHON": sys.executable, "PRESET": "gpt-7b",
               "DEADPOOL_SYSTEM": "perlmutter", "ACTIVE_NODES": "16",
               "EXTRA_FLAGS": "--train-iters 7", "DEADPOOL_REPLICAS": "2"}, REPO)
    assert p.returncode == 0, p.stderr
    flags = p.stdout.split()
    assert flags[flags.index("--tensor-model-parallel-size") + 1] == "4"
    assert flags[-7:] == ["--train-iters", "7", "--deadpool", "--deadpool-replicas", "2",
                          "--deadpool-events", str(tmp_path / "events.jsonl")]
    assert "K=2" in (tmp_path / "plan.txt").read_text()
    assert (tmp_path / "trainer_flags.txt").read_text().split()[-2:] == ["--train-iters", "7"]


def test_a_mirror_that_does_not_fit_stops_the_batch_script(tmp_path):
    p = _bash('set -euo pipefail; source scripts/slurm_common.sh; deadpool_trainer_flags; '
              'echo STARTED',
              {"OUT": str(tmp_path), "DEADPOOL_PYTHON": sys.executable, "PRESET": "gpt-65b",
               "DEADPOOL_SYSTEM": "vista", "ACTIVE_NODES": "16"}, REPO)
    assert p.returncode == 2 and "STARTED" not in p.stdout
    assert "120 GB" in p.stderr and "refused" in p.stderr


def test_agent_task_finds_its_node_rank_and_the_coordinator(tmp_path):
    stub = tmp_path / "python"
    stub.write_text('#!/bin/bash\necho "TOKEN=$DEADPOOL_TOKEN ARGS=$*"\n')
    stub.chmod(0o755)
    (tmp_path / "token").write_text("s3cret\n")
    env = {"DEADPOOL_PYTHON": str(stub), "NODE_ORDER": "n3 n0 n1 n2", "SLURMD_NODENAME": "n1",
           "SLURM_LAUNCH_NODE_IPADDR": "10.1.2.3", "DEADPOOL_TOKEN_FILE": str(tmp_path / "token"),
           "DEADPOOL_REPO": str(REPO), "ACTIVE_NODES": "3", "PROCS_PER_NODE": "4",
           "SPARE_NODES": "1", "MASTER_PORT": "4242", "OUT": str(tmp_path)}
    p = _bash(f'bash {REPO}/scripts/slurm_common.sh agent -- --num-layers 2', env, tmp_path)
    assert p.returncode == 0, p.stderr
    out = p.stdout
    assert "TOKEN=s3cret " in out and "--node-rank 2 " in out  # n3 (batch node) is rank 0
    assert "--master-addr 10.1.2.3 --master-port 4242" in out
    assert out.rstrip().endswith("-- --num-layers 2")
