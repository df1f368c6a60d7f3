"""Node agent: starts the node's worker processes (active or standby spare), forwards their
output with prefixes, reports every child exit at once, heartbeats the node, and carries out
the decider's commands (signals for fencing and fault injection).

One agent per node: under Slurm one ``srun`` task per node; locally the launcher runs one
agent object per simulated node.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, replace
from typing import Callable, Dict, List, Optional

from ..base.state import Role
from ..membership import store as st
from ..membership.store import CommandOp, EventKind
from ..base.worker_env import LAUNCHER_PID, WorkerEnv


GROUP_SIGNALS = (signal.SIGKILL, signal.SIGSTOP, signal.SIGCONT)
STOP_GRACE_S = 5.0  # between a worker's SIGTERM and its SIGKILL when its agent stops it


@dataclass
class WorkerSpec:
    lid: int
    node: int
    role: Role  # ACTIVE or SPARE
    rank: Optional[int]
    local_rank: int
    standby: bool = False  # a node's warm standby: it takes a crashed rank of its node


class NodeAgent:
    def __init__(self, node: int, workers: List[WorkerSpec], argv: List[str], base_env: dict,
                 job_env: WorkerEnv, coord: Optional[st.Coordinator], prefix_map: Dict[int, str],
                 out=sys.stdout, use_store: bool = True,
                 device_env: Callable[[WorkerSpec], dict] = lambda w: {}):
        self.node, self.workers, self.argv = node, workers, argv
        self.device_env = device_env  # a process's GPU placement (launch/gpus.py)
        self.base_env, self.job_env = base_env, job_env
        self.coord, self.prefix_map = coord, prefix_map
        self.rejected_commands = 0
        self.out = out
        self.use_store = use_store
        self.procs: Dict[int, subprocess.Popen] = {}
        self.exit_codes: Dict[int, int] = {}
        self._cmd_cursor = 0
        self._hb = 0
        self._last_hb = 0.0
        self._out_lock = threading.Lock()
        self._readers: List[threading.Thread] = []
        self._stopped: List[subprocess.Popen] = []  # workers asked to stop (ask_to_stop)
        # a simulated power loss (fault kind poweroff): the agent is gone with its workers,
        # so it reports nothing more, neither exits nor heartbeats, and takes no command
        self.powered_off = False
        self.record_store = None  # this node's record store's server (_serve_records)

    def start(self) -> None:
        if self.use_store and self.coord is not None:
            self._serve_records()
        for w in self.workers:
            self.spawn(w)

    def _serve_records(self) -> None:
        """This node's record store, published before any of its workers starts (issue 57):
        the round records its ranks read (mirror/rounds.py) are kept here, not on the job's
        one store, so each server carries O(its node's ranks) of every round."""
        self.record_store, host, port = st.serve_records(self.job_env.store_host)
        self.coord.publish_node_store(self.node, host, port)

    def spawn(self, w: WorkerSpec) -> None:
        """Start one worker process (also later: a replacement spare on this node)."""
        if w not in self.workers:
            self.workers.append(w)
        env = dict(self.base_env)
        env.update(replace(self.job_env, lid=w.lid, node=self.node, role=w.role,
                           local_rank=w.local_rank, rank=w.rank).to_env())
        env.update(self.device_env(w))
        env[LAUNCHER_PID] = str(os.getpid())  # a worker whose parent is not it: orphaned
        p = subprocess.Popen(self.argv, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                             start_new_session=True)
        self.procs[w.lid] = p
        t = threading.Thread(target=self._forward, args=(w.lid, p), daemon=True)
        t.start()
        self._readers.append(t)

    def _forward(self, lid: int, p: subprocess.Popen) -> None:
        for raw in iter(p.stdout.readline, b""):
            line = raw.decode(errors="replace").rstrip("\n")
            with self._out_lock:
                self.out.write(f"[{self.prefix_map.get(lid, f'lid{lid}')}] {line}\n")
                self.out.flush()

    def poll(self) -> List[tuple]:
        """Report exits; run commands; heartbeat. Returns newly exited (lid, code)."""
        if self.powered_off:
            return []
        exited = []
        for lid, p in self.procs.items():
            if lid in self.exit_codes:
                continue
            code = p.poll()
            if code is not None:
                self.exit_codes[lid] = code
                exited.append((lid, code))
                if code != 0:
                    self._reap_group(p)
                if self.use_store:
                    self.coord.push_event(EventKind.EXIT, lid=lid, code=code, node=self.node)
        if self.use_store:
            self._run_commands()
            now = time.monotonic()
            if now - self._last_hb > 0.25:
                self._hb += 1
                self.coord.agent_beat(self.node, self._hb)
                self._last_hb = now
        return exited

    def _run_commands(self) -> None:
        cmds, self._cmd_cursor, bad = self.coord.read_commands(self.node, self._cmd_cursor)
        if bad:
            self.rejected_commands += bad
            with self._out_lock:
                self.out.write(f"[agent n{self.node}] ignored {bad} command(s) not signed with "
                               "the job secret\n")
        for cmd in cmds:
            if cmd["op"] == CommandOp.SIGNAL:
                sig = getattr(signal, cmd["signal"])
                for lid in cmd["lids"]:
                    self.signal(lid, sig)
                if cmd.get("power_off"):
                    self.kill_all()
                    self.powered_off = True
                    self.record_store = None  # its record store goes down with it
                    with self._out_lock:
                        self.out.write(f"[agent n{self.node}] powered off: agent and "
                                       "processes gone, nothing more is reported\n")
                    return
            elif cmd["op"] == CommandOp.SPAWN:  # a crashed process restarted in its slot,
                # or a new warm standby in place of one that took a crashed rank
                old = next((w for w in self.workers if w.lid == cmd["replaces"]), None)
                standby = bool(cmd.get("standby"))
                self.prefix_map.setdefault(cmd["lid"], f"n{self.node} "
                                           f"{'standby' if standby else 'restart'}{cmd['lid']}")
                self.spawn(WorkerSpec(lid=cmd["lid"], node=self.node, role=Role.SPARE, rank=None,
                                      local_rank=old.local_rank if old else 0, standby=standby))

    def signal(self, lid: int, sig: int) -> None:
        """Signal a worker. A kill or a stop reaches its whole process group (each worker
        leads its own session): a dead or frozen machine takes the worker's children with
        it, e.g. Megatron's checkpoint writer processes, which would otherwise outlive it."""
        p = self.procs.get(lid)
        if p is not None and p.poll() is None:
            try:
                if sig in GROUP_SIGNALS:
                    os.killpg(p.pid, sig)
                else:
                    os.kill(p.pid, sig)
            except ProcessLookupError:
                pass

    @staticmethod
    def _reap_group(p: subprocess.Popen) -> None:
        """A worker that died (a crash, a kill it gave itself) leaves its children behind,
        e.g. Megatron's checkpoint writer processes, which wait for it forever (about 250 MB
        each on CPU; about 60 kill-during-save runs filled a machine's memory with them).
        The worker led its own session: end what is left."""
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def alive(self) -> List[int]:
        return [lid for lid, p in self.procs.items() if p.poll() is None]

    def kill_all(self) -> None:
        for lid in self.alive():
            self.signal(lid, signal.SIGKILL)

    def ask_to_stop(self) -> None:
        """SIGTERM (after SIGCONT) to every live worker; ``terminate_all`` finishes it."""
        for lid in self.alive():
            if self.procs[lid] not in self._stopped:
                self._stopped.append(self.procs[lid])
            self.signal(lid, signal.SIGCONT)
            self.signal(lid, signal.SIGTERM)

    def terminate_all(self, grace_s: Optional[float] = None) -> None:
        """SIGTERM to every live worker, SIGKILL after ``grace_s`` (None: STOP_GRACE_S);
        then what is left of the sessions of the workers ended here (their children) is
        killed too."""
        grace_s = STOP_GRACE_S if grace_s is None else grace_s
        self.ask_to_stop()
        deadline = time.monotonic() + grace_s
        while self.alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        self.kill_all()
        for p in self.procs.values():
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        for p in self._stopped:
            self._reap_group(p)

    def join_output(self) -> None:
        for t in self._readers:
            t.join(timeout=2)
