"""A real local Slurm cluster for tests (``scripts/slurm_local.sh``: munged, slurmctld and
one ``slurmd -N nX`` per emulated node, loopback only), and what a test does to it: submit a
batch script, find a job's processes on one node, kill them (a task kill) or kill the node
itself (its slurmd, its step daemons and every process of the job there), and read node
and job states. It only ever signals processes it can tie to this cluster (by SLURM_CONF in
their environment or by the PIDs ``slurm_local.sh`` recorded)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Dict, List, Optional

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "slurm_local.sh"
FINAL_STATES = ("COMPLETED", "FAILED", "CANCELLED", "NODE_FAIL", "TIMEOUT", "OUT_OF_MEMORY",
                "PREEMPTED", "BOOT_FAIL", "DEADLINE")


def installed() -> bool:
    return all(shutil.which(x) for x in ("slurmctld", "slurmd", "sbatch", "munged"))


def proc_env(pid: int) -> Dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(kv.split("=", 1) for kv in raw.decode(errors="replace").split("\0") if "=" in kv)


def proc_comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def proc_ppid(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return 0


class LocalSlurm:
    def __init__(self, base: Path, nodes: int = 5):
        self.base = Path(base)
        self.nodes = nodes
        self.env = dict(os.environ, SLURM_LC_BASE=str(self.base), SLURM_LC_NODES=str(nodes),
                        SLURM_CONF=str(self.base / "etc" / "slurm.conf"))

    # ------------------------------------------------------------------ cluster
    def _script(self, *args: str, timeout: float = 300) -> str:
        p = subprocess.run(["bash", str(SCRIPT), *args], env=self.env, capture_output=True,
                           text=True, timeout=timeout)
        if p.returncode != 0:
            raise RuntimeError(f"slurm_local.sh {' '.join(args)} failed:\n{p.stdout}{p.stderr}")
        return p.stdout + p.stderr

    def install(self) -> str:
        return self._script("install", timeout=900)

    def up(self) -> str:
        return self._script("up", timeout=120)

    def down(self) -> str:
        return self._script("down", timeout=180)

    def restart_node(self, node: str) -> str:
        return self._script("restart-node", node, timeout=120)

    def run(self, *cmd: str, check: bool = True) -> str:
        p = subprocess.run(list(cmd), env=self.env, capture_output=True, text=True, timeout=60)
        if check and p.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)}: {p.stdout}{p.stderr}")
        return p.stdout

    def slurmd_pid(self, node: str) -> int:
        return int((self.base / "run" / f"slurmd-{node}.pid").read_text())

    # ------------------------------------------------------------------ jobs
    def sbatch(self, script: Path, env: Dict[str, str], cwd: Path, *flags: str) -> int:
        p = subprocess.run(["sbatch", "--parsable", *flags, str(script)], cwd=cwd,
                           env=dict(self.env, **env), capture_output=True, text=True,
                           timeout=60)
        if p.returncode != 0:
            raise RuntimeError(f"sbatch failed: {p.stdout}{p.stderr}")
        return int(p.stdout.strip().split(";")[0])

    def job(self, job_id: int) -> Dict[str, str]:
        """``scontrol show job`` as a dict; once the job record is gone, its line in the job
        completion log (JobCompType=jobcomp/filetxt). Empty if neither knows it yet."""
        out = self.run("scontrol", "show", "job", "-o", str(job_id), check=False)
        if "JobState=" not in out:
            out = self.completion_record(job_id) or ""
        return dict(f.split("=", 1) for f in out.split() if "=" in f)

    def completion_record(self, job_id: int) -> Optional[str]:
        path = self.base / "log" / "jobcomp.txt"
        if not path.exists():
            return None
        lines = [x for x in path.read_text().splitlines() if x.startswith(f"JobId={job_id} ")]
        return lines[-1] if lines else None

    def sacct_state(self, job_id: int) -> str:
        """The job's final state as ``sacct`` reports it (from the job completion log: this
        cluster has no slurmdbd)."""
        out = self.run("sacct", "-c", "-n", "-P", "-j", str(job_id), "-o", "State", check=False)
        return out.strip().splitlines()[-1] if out.strip() else ""

    def wait_job(self, job_id: int, timeout: float) -> Dict[str, str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            info = self.job(job_id)
            if info.get("JobState") in FINAL_STATES:
                return info
            time.sleep(0.5)
        raise TimeoutError(f"job {job_id} did not finish in {timeout} s: {self.job(job_id)}")

    def node_state(self, node: str) -> str:
        return self.run("sinfo", "-h", "-n", node, "-o", "%T", check=False).strip()

    # ------------------------------------------------------------------ processes
    def job_pids(self, job_id: int, node: Optional[str] = None, workers_only: bool = False
                 ) -> List[int]:
        """Processes of this cluster's job ``job_id`` (optionally only on ``node``; only
        deadpool workers: processes whose environment has DEADPOOL_LID)."""
        out = []
        for d in Path("/proc").iterdir():
            if not d.name.isdigit() or int(d.name) == os.getpid():
                continue
            env = proc_env(int(d.name))
            if env.get("SLURM_CONF") != self.env["SLURM_CONF"]:
                continue
            if env.get("SLURM_JOB_ID") != str(job_id):
                continue
            if node is not None and env.get("SLURMD_NODENAME") != node:
                continue
            if workers_only and "DEADPOOL_LID" not in env:
                continue
            out.append(int(d.name))
        return out

    def kill_workers(self, job_id: int, node: str) -> List[int]:
        """Task kill: SIGKILL the deadpool workers of ``job_id`` on ``node``."""
        pids = self.job_pids(job_id, node, workers_only=True)
        if not pids:
            raise RuntimeError(f"job {job_id} has no workers on {node}")
        for p in pids:
            os.kill(p, signal.SIGKILL)
        return pids

    def kill_node(self, job_id: int, node: str) -> Dict[str, List[int]]:
        """Node loss: SIGKILL ``node``'s slurmd, the step daemons of ``job_id`` there and
        every process of the job on it, all at once."""
        tasks = self.job_pids(job_id, node)
        stepds = sorted({pp for p in tasks for pp in [proc_ppid(p)]
                         if proc_comm(pp) == "slurmstepd"})
        slurmd = self.slurmd_pid(node)
        if proc_comm(slurmd) != "slurmd":
            raise RuntimeError(f"pid {slurmd} is not {node}'s slurmd")
        if not tasks or not stepds:
            raise RuntimeError(f"job {job_id} has no processes on {node}")
        for p in [slurmd, *stepds, *tasks]:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return {"slurmd": [slurmd], "slurmstepd": stepds, "tasks": tasks}
