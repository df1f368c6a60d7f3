"""``--enable-ft-package`` with ``--deadpool`` (issue 50 item 3): NVRx's ``ft_launcher``
runs ``deadpool launch``; DeadPool swaps spares in while they last, NVRx restarts the job
when DeadPool stops, and the restart resumes from the fallback save (or ``--load``).

The pure parts run everywhere; the end-to-end test needs NVRx 0.7.0
(``scripts/install_peers.sh``: ``.venv-peers``) and the core_v0.19.0 archive, else it skips."""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from megatron_deadpool.adapters import ft_package, lm_rules
from megatron_deadpool.launch import nvrx
from megatron_deadpool.mirror import persist, snapshot
from megatron_deadpool.mirror.held import HeldCopies, OwnSlots
from mlm import REPO, patched_tree
from test_megatron_lm_train import FLAGS as TRAIN_FLAGS

PEERS_PY = REPO / ".venv-peers" / "bin" / "python"
FT_LAUNCHER = REPO / ".venv-peers" / "bin" / "ft_launcher"


# ------------------------------------------------------------------ pure parts
def test_enable_ft_package_needs_ft_launcher_above_deadpool_launch():
    args = SimpleNamespace(use_distributed_optimizer=True, enable_ft_package=True)
    (why,) = lm_rules.unsupported_args(args)
    assert "--enable-ft-package" in why and "ft_launcher" in why
    assert lm_rules.unsupported_args(args, ft_launcher=True) == []
    assert lm_rules.unsupported_argv(["--use-distributed-optimizer", "--enable-ft-package"],
                                     ft_launcher=True) == []


def test_workers_never_get_nvrx_sockets():
    base = {"PATH": "/bin", "FT_RANK_MONITOR_IPC_SOCKET": "/tmp/a",
            "FT_LAUNCHER_IPC_SOCKET": "/tmp/b"}
    under = nvrx.worker_env(base, environ=base)
    assert under == {"PATH": "/bin", ft_package.ENV: ft_package.LAUNCHER}
    assert nvrx.worker_env({"PATH": "/bin"}, environ={}) == {"PATH": "/bin"}


def _save(root: Path, iteration: int, world: int = 2) -> None:
    """A complete fallback iteration of ``world`` ranks (TP1.PP1)."""
    man = persist.Manifest(7, "0123456789abcdef", world, 1, 1, world)
    for rank in range(world):
        t = torch.arange(8, dtype=torch.float32) + rank
        layout = snapshot.Layout([("w", t)], 256)
        own = OwnSlots(rank)
        own.allocate(layout.total_bytes, False)
        own.rewrite(iteration)
        slot = own.slot(iteration)
        snapshot.copy_tensors_in(slot, layout, [t])
        snapshot.seal(slot, layout, rank, iteration, {"iteration": iteration}, 7)
        own.hold(iteration)
        m = SimpleNamespace(rank=rank, job=7, layout=layout,
                            holdings=SimpleNamespace(ensure_layout=lambda l=layout: l),
                            own=own, held=HeldCopies(7))
        persist.save_held(m, str(root), man)


def test_a_restart_resumes_from_the_fallback_or_from_load(tmp_path):
    fb, ck = tmp_path / "fb", tmp_path / "ck"
    argv = ["--load", str(ck), "--deadpool-fallback-save", str(fb),
            "--deadpool-resume", str(fb)]
    said = []
    assert nvrx.resume_or_load(argv, 2, said.append) == argv[:4]  # nothing saved yet
    assert "holds no iteration" in said[-1] and f"--load {ck}" in said[-1]
    _save(fb, 5)
    assert nvrx.resume_or_load(argv, 2, said.append) == argv  # the fallback
    assert "iteration 5" in said[-1]
    assert nvrx.resume_or_load(argv, 4, said.append) == argv[:4]  # another layout
    ck.mkdir()
    (ck / "latest_checkpointed_iteration.txt").write_text("8")
    assert nvrx.resume_or_load(argv, 2, said.append) == argv[:4]  # --load is newer
    assert "older than --load's 8" in said[-1]
    other = ["--deadpool-resume", str(fb)]  # not the restartable form: left to the user
    assert nvrx.resume_or_load(other, 4, said.append) == other


# ------------------------------------------------------------------ end to end
TAG = "core_v0.19.0"
FLAGS = TRAIN_FLAGS + ["--log-interval", "1", "--deadpool"]  # test_megatron_lm_train's job
HANG_AT, KILL_AT = 3, 7  # node 2 stopped (SIGSTOP) at 3: the spare; node 1 killed at 7
NVRX_HB_TIMEOUT = 2.5    # NVRx's heartbeat timeout, shorter than DeadPool's hang detection


def _launch_cmd(d: Path, tree: Path, spares: int, extra=()):
    return [str(PEERS_PY), "-m", "megatron_deadpool.apps.cli", "launch", "--nodes", "4",
            "--procs-per-node", "2", "--spare-nodes", str(spares), "--device", "cpu",
            "--summary-json", str(d / "summary.json"), "--results-dir", str(d / "results"),
            "--script", str(tree / "pretrain_gpt.py"), "--", *FLAGS, *extra]


def _ft_cmd(port: int, launch):
    return [str(FT_LAUNCHER), "--nnodes=1", "--nproc-per-node=1", "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=deadpool", "--max-restarts=2",
            f"--ft-rank-heartbeat-timeout={NVRX_HB_TIMEOUT}",
            "--ft-initial-rank-heartbeat-timeout=60", "--ft-workload_check_interval=0.5",
            "--no-python", *launch]


class _Faults:
    """Watches the job's output: SIGSTOPs node 2's processes once iteration HANG_AT is
    logged, SIGKILLs node 1's once KILL_AT is (the first run only)."""

    def __init__(self, root_pid: int):
        self.root, self.done = root_pid, []

    def see(self, line: str) -> None:
        import signal

        from megatron_deadpool.apps.peer_inject import node_pids

        m = re.search(r" iteration\s+(\d+)/", line)
        if m is None:
            return
        it = int(m.group(1))
        for at, node, sig in ((HANG_AT, "2", signal.SIGSTOP), (KILL_AT, "1", signal.SIGKILL)):
            if it >= at and (node, sig) not in [x[:2] for x in self.done]:
                pids = node_pids([self.root], "DEADPOOL_NODE", node)
                for pid in pids:
                    os.kill(pid, sig)
                self.done.append((node, sig, pids, time.monotonic()))


def _run(cmd, cwd: Path, faults=None, timeout=900):
    from megatron_deadpool.apps.peer_inject import kill_all, node_pids

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    p = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, start_new_session=True)
    out, deadline, watch = [], time.monotonic() + timeout, faults(p.pid) if faults else None
    try:
        for line in p.stdout:
            out.append(line)
            if watch is not None:
                watch.see(line)
            assert time.monotonic() < deadline, "".join(out[-60:])
        p.wait(timeout=60)
    finally:
        if p.poll() is None:
            kill_all(node_pids([p.pid], "PYTHONPATH", str(REPO)) + [p.pid])
    return p.returncode, "".join(out), watch


@pytest.mark.slow
def test_ft_launcher_restarts_deadpool_after_the_spares_run_out(tmp_path_factory):
    """ft_launcher runs deadpool launch (1 spare node). Node 2 hangs at 3: DeadPool finds
    it (its heartbeats, 5 s) and swaps the spare in, and NVRx, whose heartbeat timeout is
    2.5 s, does not fire. Node 1 killed at 7: no spare left, the survivors write the
    fallback save and DeadPool stops; ft_launcher restarts the same command, which resumes
    from the fallback, the iteration in flight redone, and ends with the uninterrupted
    run's fingerprint."""
    if not FT_LAUNCHER.is_file():
        pytest.skip("NVRx is not installed: bash scripts/install_peers.sh (.venv-peers)")
    tree = patched_tree(tmp_path_factory, TAG)
    ref_dir, d = tmp_path_factory.mktemp("ref"), tmp_path_factory.mktemp("ft")
    rc, out, _ = _run(_launch_cmd(ref_dir, tree, spares=0), ref_dir)
    ref = json.loads((ref_dir / "summary.json").read_text())
    assert rc == 0 and ref["ok"], out[-4000:]
    fb, ck = d / "fb", d / "ck"
    extra = ["--enable-ft-package", "--save", str(ck), "--load", str(ck), "--save-interval",
             "4", "--deadpool-fallback-save", str(fb), "--deadpool-resume", str(fb)]
    from megatron_deadpool.launch.options import free_port

    t0 = time.monotonic()
    rc, out, faults = _run(_ft_cmd(free_port(), _launch_cmd(d, tree, 1, extra)), d, _Faults)
    wall = time.monotonic() - t0
    (d / "ft.log").write_text(out)
    assert rc == 0, out[-6000:]
    assert [x[:2] for x in faults.done] == [("2", 19), ("1", 9)], faults.done
    assert out.count("world size 8") == 2, out[-6000:]  # one restart, by DeadPool's stop
    assert "did not get subsequent heartbeat" not in out.lower(), out[-6000:]
    swaps = re.findall(r"generation \d+: ranks \[([\d, ]+)\] -> spares \[([\d, ]+)\] "
                       r"\(detected in ([\d.]+)s\)", out)
    assert sorted(r for rs, _, _ in swaps for r in rs.split(", ")) == ["4", "5"], swaps
    assert all(float(t) > NVRX_HB_TIMEOUT for _, _, t in swaps), swaps  # NVRx's would fire
    assert "no spare left" in out, out[-6000:]
    resumed = re.search(r"--deadpool-resume: iteration (\d+) of the fallback save", out)
    assert resumed, out[-6000:]
    saved = int(resumed.group(1))
    assert saved >= KILL_AT - 1, saved  # the iteration in flight redone, at most one more
    s = json.loads((d / "summary.json").read_text())  # the restarted run's
    assert s["ok"] and s["final_state_sha256"] == ref["final_state_sha256"], (s, wall)
    # each iteration's loss as last logged (the stopped run's up to the fallback, the
    # restarted run's after it: one results folder) is the uninterrupted run's
    assert s["losses"] == ref["losses"], (s["losses"], ref["losses"])


# ------------------------------------------------------------------ one ft_launcher per node
class _PerNode:
    """One NVRx ft_launcher per simulated node (issue 59), as users deploy them under srun:
    each runs ``deadpool launch --node-rank $GROUP_RANK`` (the node rank ft_launcher's
    rendezvous gave it), all in one rendezvous. On one machine each launcher is its own
    host through ``--local-addr`` (NVRx refuses two launchers of one host in a rendezvous).
    The first launcher hosts the rendezvous store, as the batch node does on a cluster: a
    node loss takes another node's launcher with its processes (SIGKILL of its session)."""

    def __init__(self, d: Path, tree: Path, nodes: int, spares: int, extra=()):
        from megatron_deadpool.launch.options import free_port, free_port_pair

        self.d, self.n, self.procs = d, nodes + spares, []
        self.rdzv, master = free_port(), free_port_pair()
        self.env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO),
                        DEADPOOL_TOKEN="f" * 32)
        self.launch = " ".join(
            [str(PEERS_PY), "-m", "megatron_deadpool.apps.cli", "launch", "--nodes",
             str(nodes), "--procs-per-node", "2", "--spare-nodes", str(spares),
             "--node-rank", "$GROUP_RANK", "--master-addr", "127.0.0.1", "--master-port",
             str(master), "--device", "cpu", "--summary-json", str(d / "summary.json"),
             "--results-dir", str(d / "results"), "--script", str(tree / "pretrain_gpt.py"),
             "--", *FLAGS, *extra])

    def start(self, addr: int) -> None:
        cmd = [str(FT_LAUNCHER), f"--nnodes={self.n}", "--nproc-per-node=1",
               "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{self.rdzv}",
               "--rdzv-id=deadpool", f"--local-addr=127.0.0.{addr}", "--max-restarts=2",
               "--ft-rank-heartbeat-timeout=30", "--ft-initial-rank-heartbeat-timeout=120",
               "--no-python", "bash", "-c", "exec " + self.launch]
        log = open(self.d / f"ft{len(self.procs)}.log", "w")
        self.procs.append(subprocess.Popen(cmd, env=self.env, stdout=log,
                                           stderr=subprocess.STDOUT, cwd=self.d,
                                           start_new_session=True))
        log.close()

    def text(self) -> str:
        return "".join(f.read_text(errors="replace") for f in sorted(self.d.glob("ft*.log")))

    def run(self, kill_at: int, replace: bool, whole: bool = True, timeout: float = 900):
        """Start every launcher, kill one node (not the rendezvous host's, not a spare) at
        iteration ``kill_at`` (``whole``: its launchers with it; else only its training
        processes, as a GPU fault that kills them does), start a replacement node's
        launcher if ``replace``; returns (exit codes, the killed node's DeadPool node id)."""
        import signal

        from megatron_deadpool.apps.peer_inject import descendants, environ

        self.start(1)
        deadline = time.monotonic() + timeout
        while "hosts the TCP store" not in (self.d / "ft0.log").read_text(errors="replace"):
            assert time.monotonic() < deadline and self.procs[0].poll() is None, self.text()
            time.sleep(0.1)
        for i in range(1, self.n):
            self.start(i + 1)
        killed = None
        try:
            while any(p.poll() is None for p in self.procs):
                assert time.monotonic() < deadline, self.text()[-8000:]
                its = [int(x) for x in re.findall(r" iteration\s+(\d+)/", self.text())]
                if killed is None and its and max(its) >= kill_at:
                    for p in self.procs[1:]:
                        nodes = {environ(q).get("DEADPOOL_NODE")
                                 for q in descendants([p.pid])} - {None}
                        if len(nodes) == 1 and int(min(nodes)) in (1, 2, 3):
                            killed = int(min(nodes))
                            if whole:
                                os.killpg(p.pid, signal.SIGKILL)
                            for q in descendants([p.pid]):
                                if environ(q).get("DEADPOOL_NODE") == str(killed):
                                    os.kill(q, signal.SIGKILL)
                            break
                    if replace and killed is not None:
                        self.start(9)  # the repaired node, back under its own launcher
                time.sleep(0.2)
        finally:
            for p in self.procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
        return [p.returncode for p in self.procs], killed


@pytest.mark.slow
@pytest.mark.parametrize("case", ["spare", "no_spare", "processes"])
def test_one_ft_launcher_per_node(tmp_path_factory, case):
    """Issue 59: one ft_launcher per node, in one rendezvous. A node lost (its launcher
    with it) with a spare node: DeadPool swaps, and no launcher restarts anything. With
    none: DeadPool stops with its fallback save, ft_launcher restarts the job on the nodes
    that are left and the repaired one, and the restart resumes from the fallback. A node
    whose training processes all die while it lives (``processes``): DeadPool swaps, and
    its ``deadpool launch`` stays up until the job ends (it left early with a failure
    before, and its ft_launcher would have restarted every node). All end with the
    uninterrupted run's fingerprint and losses."""
    if not FT_LAUNCHER.is_file():
        pytest.skip("NVRx is not installed: bash scripts/install_peers.sh (.venv-peers)")
    tree = patched_tree(tmp_path_factory, TAG)
    ref_dir, d = tmp_path_factory.mktemp("ref"), tmp_path_factory.mktemp(case)
    rc, out, _ = _run(_launch_cmd(ref_dir, tree, spares=0), ref_dir)
    ref = json.loads((ref_dir / "summary.json").read_text())
    assert rc == 0 and ref["ok"], out[-4000:]
    fb, ck = d / "fb", d / "ck"
    extra = [] if case == "spare" else [
        "--enable-ft-package", "--save", str(ck), "--load", str(ck), "--save-interval", "4",
        "--deadpool-fallback-save", str(fb), "--deadpool-resume", str(fb)]
    job = _PerNode(d, tree, nodes=4, spares=0 if case == "no_spare" else 1, extra=extra)
    codes, killed = job.run(kill_at=KILL_AT if case == "no_spare" else 5,
                            replace=case == "no_spare", whole=case != "processes")
    out = job.text()
    assert killed is not None, out[-6000:]
    survivors = [c for c in codes if c != -9]
    assert all(c == 0 for c in survivors), (codes, out[-6000:])
    assert len(survivors) == len(codes) - (case != "processes"), codes
    s = json.loads((d / "summary.json").read_text())
    assert s["ok"] and s["final_state_sha256"] == ref["final_state_sha256"], out[-6000:]
    assert s["losses"] == ref["losses"], (s["losses"], ref["losses"])
    restarts = set(re.findall(r"Cycle: (\d+) Event: rendezvous_completed", out)) - {"0"}
    if case != "no_spare":
        (rec,) = s["recoveries"]
        assert rec["failed_ranks"] == [2 * killed, 2 * killed + 1], rec
        assert not restarts, restarts  # no launcher restarted anything
    else:
        assert "no spare left" in out and restarts == {"1"}, (restarts, out[-6000:])
        resumed = re.search(r"--deadpool-resume: iteration (\d+) of the fallback save", out)
        assert resumed and int(resumed.group(1)) >= KILL_AT - 1, out[-6000:]
