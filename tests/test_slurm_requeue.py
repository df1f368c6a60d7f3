"""The last resort under Slurm (scripts/slurm_common.sh, DEADPOOL_REQUEUE): the job runs
with a fallback save; a run that stops is requeued (at most N times) and the requeued run
resumes from the fallback when it holds an iteration of every rank. The shell functions,
run with a stand-in `scontrol`; the real cluster's runs are tests/test_slurm.py."""

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO

COMMON = REPO / "scripts" / "slurm_common.sh"


def _bash(tmp_path, body, **env):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    fake = bin_dir / "scontrol"
    fake.write_text(f'#!/bin/sh\necho "$@" >> {tmp_path}/scontrol.calls\n')
    fake.chmod(0o755)
    e = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", OUT=str(tmp_path / "out"),
             DEADPOOL_PYTHON=sys.executable, SLURM_JOB_ID="77", TRAINER_FLAGS="--a 1",
             **{k: str(v) for k, v in env.items()})
    (tmp_path / "out").mkdir(exist_ok=True)
    return subprocess.run(["bash", "-c", f"source {COMMON}; {body}"], env=e, text=True,
                          capture_output=True, timeout=60)


def _summary(tmp_path, ok, iteration):
    (tmp_path / "out" / "summary.json").parent.mkdir(exist_ok=True)
    (tmp_path / "out" / "summary.json").write_text(json.dumps(
        {"ok": ok, "fallback_save": {"dir": "x", "iteration": iteration}}))


FLAGS = 'deadpool_trainer_flags; printf "%s\\n" "${TRAIN_FLAGS[@]}"'


def test_off_by_default(tmp_path):
    p = _bash(tmp_path, FLAGS)
    assert p.returncode == 0 and "--deadpool-fallback-save" not in p.stdout, p.stderr


def test_the_first_run_saves_and_a_requeued_one_resumes(tmp_path):
    out = tmp_path / "out"
    flags = _bash(tmp_path, FLAGS, DEADPOOL_REQUEUE=2).stdout.split("\n")
    assert flags[flags.index("--deadpool-fallback-save") + 1] == f"{out}/fallback"
    assert "--deadpool-resume" not in flags  # nothing saved yet
    _summary(tmp_path, ok=False, iteration=5)
    p = _bash(tmp_path, FLAGS, DEADPOOL_REQUEUE=2, SLURM_RESTART_COUNT=1)
    flags = p.stdout.split("\n")
    assert flags[flags.index("--deadpool-resume") + 1] == f"{out}/fallback"
    assert "resuming from iteration 5" in p.stdout
    _summary(tmp_path, ok=False, iteration=None)  # stopped with no complete iteration
    assert "--deadpool-resume" not in _bash(tmp_path, FLAGS, DEADPOOL_REQUEUE=2).stdout


@pytest.mark.parametrize("ok,restarts,requeue,called", [
    (False, 0, 1, True), (False, 1, 1, False), (False, 0, 0, False), (True, 0, 2, False)])
def test_a_stopped_run_is_requeued_while_restarts_last(tmp_path, ok, restarts, requeue, called):
    _summary(tmp_path, ok=ok, iteration=5)
    p = _bash(tmp_path, "deadpool_finish", DEADPOOL_REQUEUE=requeue,
              SLURM_RESTART_COUNT=restarts)
    assert p.returncode == (0 if ok else 1), p.stdout + p.stderr
    calls = tmp_path / "scontrol.calls"
    assert calls.exists() == called, p.stdout
    if called:
        assert calls.read_text().split() == ["requeue", "77"]
        assert "fallback save: iteration 5" in p.stdout
