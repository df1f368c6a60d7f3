"""How each system of the peer benchmark launches the same Megatron-LM ``pretrain_gpt.py``
job (docs/peers.md), and one run of it under the shared injector (``peer_inject``).

* ``deadpool``: ``deadpool launch --device cpu --script`` with ``--deadpool``, N nodes x P
  and one spare node; ``--save`` only at the last iteration (the fingerprint reads it).
* ``nvrx``: one ``ft_launcher`` per simulated node (NVRx, ``--enable-ft-package``, Megatron's
  own integration), N active + spare launchers (``--nnodes=N:N+S``: the first N to arrive
  are active, the rest hot spares), in-job restart from ``--save``/``--load`` every
  ``save_interval`` iterations.
* ``nvrx-local``: the same launchers, with local checkpoints replicated to the next node
  (``--non-persistent-ckpt-type local --replication``) every ``save_interval``.
* ``deadpool-nvrx``: NVRx's ``ft_launcher`` runs ``deadpool launch`` with no spare node
  (the spares exhausted), ``--enable-ft-package`` and a fallback save: the kill stops
  DeadPool, which writes what memory holds, and ``ft_launcher`` restarts the same command,
  which resumes from it (``launch/nvrx.py``).
* ``deadpool-slurm``: ``scripts/cpu-local.sbatch`` on the local Slurm cluster
  (``scripts/slurm_local.sh``), submitted with ``sbatch --requeue --wait``, one agent per
  node, no spare node and ``DEADPOOL_REQUEUE=1``: the kill stops DeadPool, which writes what
  memory holds, and the batch script requeues the job, which resumes from it. The kill takes
  the node's processes of the job (agent and workers; its ``slurmd`` lives on).
* ``relaunch``: one ``torchrun`` per node; when any node's launcher fails, the whole job is
  killed and started again with ``--load`` (what ``sbatch --requeue`` or a relaunch loop
  does, with failure detection taken as immediate).

The non-DeadPool workers run through the package's CPU mode exactly as DeadPool's do
(``python -m megatron_deadpool.launch.child --device cpu``, the same CPU-only flags and
environment), so every system runs the same code on the same tensors.
"""

from __future__ import annotations

import os
import subprocess
import time
import uuid
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from ..adapters import lm_rules
from ..launch.options import free_port
from ..megatron import tree as mlm_tree
from .peer_inject import CpuProbe, Injector, RunLogWriter, kill_all, tagged

SYSTEMS = ("deadpool", "nvrx", "nvrx-local", "relaunch", "deadpool-nvrx", "deadpool-slurm")
DEADPOOL_SYSTEMS = ("deadpool", "deadpool-nvrx")  # their workers carry DEADPOOL_NODE
NODE_TAG = "PEERS_NODE"
SLURM_NODE_TAG = "SLURMD_NODENAME"  # under Slurm every process of a node's task carries it
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def node_tag(system: str) -> str:
    """The environment key whose value names a process's node, per system."""
    if system == "deadpool-slurm":
        return SLURM_NODE_TAG
    return "DEADPOOL_NODE" if system in DEADPOOL_SYSTEMS else NODE_TAG


@dataclass
class PeerJob:
    tree: str                       # a patched Megatron-LM tree (scripts/apply_patches.sh)
    python: str                     # with torch, megatron-deadpool and (for NVRx) NVRx
    flags: List[str]                # the model/data flags, --train-iters included
    train_iters: int
    save_interval: int
    nodes: int = 4
    procs_per_node: int = 2
    spares: int = 1
    timeout_s: float = 1200.0
    max_relaunches: int = 4
    env: Dict[str, str] = field(default_factory=dict)

    @property
    def script(self) -> str:
        return os.path.join(self.tree, "pretrain_gpt.py")


def system_flags(system: str, job: PeerJob, ck: str, local: str) -> List[str]:
    """The Megatron-LM flags each system adds to the shared ones."""
    last = ["--save", ck, "--save-interval", str(job.train_iters)]
    every = ["--save", ck, "--load", ck, "--save-interval", str(job.save_interval)]
    if system == "deadpool":
        return ["--log-interval", "1", "--deadpool", *last]
    if system == "deadpool-nvrx":  # the restartable form: the same flags at every restart
        return ["--log-interval", "1", "--deadpool", "--enable-ft-package", *last,
                "--load", ck, "--deadpool-fallback-save", local, "--deadpool-resume", local]
    if system == "deadpool-slurm":  # the batch script adds --deadpool and the fallback flags
        return ["--log-interval", "1", *last, "--load", ck]
    if system == "nvrx":
        return ["--log-interval", "1", "--enable-ft-package", *every]
    if system == "nvrx-local":
        return ["--log-interval", "1", "--enable-ft-package", "--load", ck, *last,
                "--non-persistent-ckpt-type", "local", "--non-persistent-local-ckpt-dir",
                local, "--non-persistent-save-interval", str(job.save_interval),
                "--replication", "--replication-jump", str(job.procs_per_node),
                "--replication-factor", "2"]
    if system == "relaunch":
        return ["--log-interval", "1", *every]
    raise ValueError(f"unknown system {system!r}; one of {', '.join(SYSTEMS)}")


def worker(job: PeerJob, argv: List[str]) -> List[str]:
    return [job.python, "-m", "megatron_deadpool.launch.child", "--device", "cpu",
            job.script, *lm_rules.cpu_flags(argv)]


def node_commands(system: str, job: PeerJob, argv: List[str], port: int
                  ) -> List[Tuple[List[str], Dict[str, str]]]:
    """(command, extra environment) of each process the system starts, one per node
    (DeadPool: one launcher that simulates every node)."""
    n, p = job.nodes, job.procs_per_node
    if system in DEADPOOL_SYSTEMS:
        spares = job.spares if system == "deadpool" else 0
        head = [job.python, "-m", "megatron_deadpool.apps.cli", "launch", "--nodes", str(n),
                "--procs-per-node", str(p), "--spare-nodes", str(spares), "--device", "cpu"]
        tail = ["--script", job.script, "--", *argv]
        if system == "deadpool":
            return [([*head, "--master-port", str(port), *tail], {})]
        launch = [*head, *tail]  # a restart picks its own ports
        ft = os.path.join(os.path.dirname(job.python), "ft_launcher")
        return [([ft, "--nnodes=1", "--nproc-per-node=1", "--rdzv-backend=c10d",
                  f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=peers", "--max-restarts=3",
                  "--no-python", *launch], {})]
    if system in ("nvrx", "nvrx-local"):
        ft = os.path.join(os.path.dirname(job.python), "ft_launcher")
        base = [ft, f"--nnodes={n}:{n + job.spares}", f"--nproc-per-node={p}",
                "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
                "--rdzv-id=peers", "--max-restarts=3", "--no-python"]
        return [([*base, *worker(job, argv)],
                 {NODE_TAG: str(i), "NVRX_ENABLE_MULTI_LAUNCHERS_PER_NODE": "1"})
                for i in range(n + job.spares)]
    if system == "relaunch":
        base = [job.python, "-m", "torch.distributed.run", f"--nnodes={n}",
                f"--nproc-per-node={p}", "--master-addr=127.0.0.1", f"--master-port={port}",
                "--no-python"]
        return [([*base[:4], f"--node-rank={i}", *base[4:], *worker(job, argv)],
                 {NODE_TAG: str(i)}) for i in range(n)]
    raise ValueError(f"unknown system {system!r}")


def base_env(job: PeerJob) -> Dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **job.env)
    env.update(mlm_tree.prepare(job.tree, cpu=True))  # dataset helper, CPU-mode variables
    return env


def _start(cmds, env, writer: RunLogWriter, delay_s: float = 1.0):
    procs = []
    for i, (cmd, extra) in enumerate(cmds):
        p = subprocess.Popen(cmd, env=dict(env, **extra), stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, errors="replace",
                             start_new_session=True)
        writer.follow(p.stdout)
        procs.append(p)
        if i == 0 and len(cmds) > 1:
            time.sleep(delay_s)  # node 0 first: it hosts the rendezvous store
    return procs


def _wait(procs, whole_job: bool, deadline: float, grace_s: float = 30.0) -> str:
    """'done', 'failed' (whole_job: a node's launcher failed) or 'timeout'."""
    done_at = None
    while time.monotonic() < deadline:
        codes = [p.poll() for p in procs]
        if whole_job and any(c not in (None, 0) for c in codes):
            return "failed"
        if all(c is not None for c in codes):
            return "done" if any(c == 0 for c in codes) else "failed"
        if any(c == 0 for c in codes):  # finished: spares and stragglers get a grace period
            done_at = done_at or time.monotonic()
            if time.monotonic() - done_at > grace_s:
                return "done"
        time.sleep(0.1)
    return "timeout"


def slurm_job(job: PeerJob, argv: List[str], work: str, name: str
              ) -> Tuple[List[str], Dict[str, str], str]:
    """``deadpool-slurm``: the sbatch command, its environment and the batch output file,
    which a requeued run appends to (``--open-mode=append``)."""
    log = os.path.join(work, "slurm.out")
    env = {"ACTIVE_NODES": str(job.nodes), "PROCS_PER_NODE": str(job.procs_per_node),
           "MEGATRON_LM_DIR": job.tree, "DEADPOOL_PYTHON": job.python,
           "DEADPOOL_REPO": REPO, "OUT": os.path.join(work, "slurm"),
           "TRAINER_FLAGS": " ".join(argv), "DEADPOOL_REQUEUE": "1", "PYTHONPATH": REPO}
    cmd = ["sbatch", "--wait", "--requeue", "--open-mode=append", f"--nodes={job.nodes}",
           f"--job-name={name}", f"--output={log}",
           os.path.join(REPO, "scripts", "cpu-local.sbatch")]
    return cmd, env, log


def slurm_check(nodes: int) -> None:
    """The local Slurm cluster is up with ``nodes`` nodes free (``SLURM_CONF`` from
    ``scripts/slurm_local.sh env`` when unset), or SystemExit naming how to start it."""
    if "SLURM_CONF" not in os.environ:
        out = subprocess.run(["bash", os.path.join(REPO, "scripts", "slurm_local.sh"), "env"],
                             capture_output=True, text=True).stdout
        os.environ["SLURM_CONF"] = out.strip().split("=", 1)[-1]
    r = subprocess.run(["sinfo", "-h", "-o", "%T %D"], capture_output=True, text=True)
    idle = sum(int(n) for state, n in (ln.split() for ln in r.stdout.splitlines())
               if state == "idle")
    if r.returncode != 0 or idle < nodes:
        raise SystemExit(f"deadpool-slurm needs a local Slurm cluster with {nodes} idle "
                         f"nodes (have {idle}): scripts/slurm_local.sh install && "
                         "scripts/slurm_local.sh up, as root")


def _run_slurm(job: PeerJob, argv: List[str], work: str, env: Dict[str, str],
               writer: RunLogWriter, deadline: float) -> str:
    """One sbatch job, its output file followed as it grows; 'done', 'failed' or
    'timeout'. The job is cancelled whatever the outcome."""
    name = f"peers-{env['PEERS_RUN'][:12]}"
    cmd, extra, log = slurm_job(job, argv, work, name)
    open(log, "a").close()
    tail = subprocess.Popen(["tail", "-n", "+1", "-F", log], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, errors="replace")
    writer.follow(tail.stdout)
    writer.mark("start", attempt=1)
    sb = subprocess.Popen(cmd, env=dict(env, **extra), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, errors="replace")
    writer.follow(sb.stdout)
    try:
        outcome = _wait([sb], False, deadline)
        time.sleep(1.0)  # the file's last lines reach the tail
    finally:
        subprocess.run(["scancel", f"--name={name}"], capture_output=True)
        sb.kill()
        tail.kill()
    return outcome


def _run_launchers(system: str, job: PeerJob, argv: List[str], env: Dict[str, str],
                   writer: RunLogWriter, deadline: float) -> Tuple[str, int]:
    """The launchers of every system but ``deadpool-slurm``; the relaunch starts the whole
    job again after a failure. (outcome, attempts)"""
    outcome, attempt = "failed", 0
    while attempt <= job.max_relaunches:
        attempt += 1
        writer.mark("start", attempt=attempt)
        procs = _start(node_commands(system, job, argv, free_port()), env, writer)
        outcome = _wait(procs, system == "relaunch", deadline)
        kill_all(tagged({"PEERS_RUN": env["PEERS_RUN"]}))  # leftovers, orphans included
        for p in procs:
            p.wait()
        if outcome != "failed" or system != "relaunch":
            break
    return outcome, attempt


def run_system(system: str, job: PeerJob, work: str, injector: Optional[Injector],
               echo=None, probe: Optional[CpuProbe] = None) -> dict:
    """One run; its log is ``work/run.log``, its checkpoints ``work/ck``. Every process of
    the run carries its tag in its environment, which is how the injector, the CPU probe
    and the clean-up find them (under Slurm too, where they descend from slurmstepd)."""
    os.makedirs(work, exist_ok=True)
    ck, local = os.path.join(work, "ck"), os.path.join(work, "local")
    argv = [*job.flags, *system_flags(system, job, ck, local)]
    run_tag = {"PEERS_RUN": uuid.uuid4().hex}
    env = dict(base_env(job), **run_tag)
    for watcher in (injector, probe):
        if watcher is not None:
            watcher.roots = lambda: tagged(run_tag)
    writer = RunLogWriter(os.path.join(work, "run.log"), injector=injector, echo=echo,
                          probe=probe)
    deadline = time.monotonic() + job.timeout_s
    outcome, attempt = "failed", 0
    try:
        if system == "deadpool-slurm":
            outcome, attempt = _run_slurm(job, argv, work, env, writer, deadline), 1
        else:
            outcome, attempt = _run_launchers(system, job, argv, env, writer, deadline)
    finally:  # the benchmark interrupted (Ctrl-C, SIGTERM): no run outlives it
        kill_all(tagged(run_tag))
    writer.mark("exit", outcome=outcome, attempts=attempt)
    writer.close()
    return {"outcome": outcome, "attempts": attempt, "log": os.path.join(work, "run.log"),
            "checkpoints": ck}
