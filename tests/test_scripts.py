"""Every shell script under scripts/ parses (`bash -n`) and is shellcheck-clean, and the
batch scripts carry the Slurm flags a DeadPool job needs to outlive a lost node."""

import os
import re
import shutil
import subprocess

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
