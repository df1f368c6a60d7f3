"""The peer benchmark's one injector, the same for every system (docs/peers.md): it reads
the job's output as it arrives, stamps each line into the run's log (``peer_log``), and when
a line shows that iteration K has started (iteration K-1 finished) it SIGKILLs every
process of one node at once: all descendants of the job's launch processes whose
environment carries the node's tag (``DEADPOOL_NODE=1`` for a DeadPool job, the benchmark's
own ``PEERS_NODE=1`` for a per-node launcher and everything under it). No system's own
fault injection is used. Linux: processes are read from ``/proc``.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Callable, Dict, IO, Iterable, List, Optional, Set

from .peer_log import iteration_of, marker, stamp

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def _children_map() -> Dict[int, List[int]]:
    kids: Dict[int, List[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat.rpartition(")")[2].split()[1])
        kids.setdefault(ppid, []).append(int(name))
    return kids


def descendants(roots: Iterable[int]) -> Set[int]:
    """``roots`` and every process below them."""
    kids, seen = _children_map(), set()
    stack = list(roots)
    while stack:
        pid = stack.pop()
        if pid not in seen:
            seen.add(pid)
            stack.extend(kids.get(pid, []))
    return seen


def environ(pid: int) -> Dict[str, str]:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            raw = f.read()
    except OSError:
        return {}
    pairs = (x.decode(errors="replace").split("=", 1) for x in raw.split(b"\0") if b"=" in x)
    return dict(pairs)


def node_pids(roots: Iterable[int], key: str, value: str) -> List[int]:
    """The processes of one node: under ``roots``, those whose environment has key=value."""
    return sorted(p for p in descendants(roots) if environ(p).get(key) == value)


def tagged(tags: Dict[str, str]) -> List[int]:
    """Every process on this machine whose environment carries all of ``tags``: a run's
    leftovers, reparented or not."""
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit() and int(name) != os.getpid():
            env = environ(int(name))
            if env and all(env.get(k) == v for k, v in tags.items()):
                out.append(int(name))
    return sorted(out)


def cpu_seconds(pid: int) -> Optional[float]:
    """User plus system CPU seconds ``pid`` has used (None: it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def role_of(pid: int) -> str:
    """``worker`` (a training process: any system's, started with a RANK), ``spare`` (a
    DeadPool standby spare) or ``control`` (everything else: launchers, node agents, the
    store, NVRx's monitors, Megatron-LM's save helpers)."""
    env = environ(pid)
    if env.get("DEADPOOL_ROLE") == "spare":
        return "spare"
    return "worker" if env.get("RANK") and env.get("LOCAL_RANK") is not None else "control"


class CpuProbe:
    """Samples, when the job logs iterations ``at`` as finished, the CPU seconds every
    process of the job has used so far, summed by role (``role_of``): the difference
    between two samples is the whole job's CPU over those iterations, saves and mirror
    included, independent of how loaded the machine is."""

    ROLES = ("worker", "spare", "control")

    def __init__(self, at: Iterable[int], roots: Callable[[], List[int]] = list):
        self.at, self.roots, self.done = set(at), roots, set()

    def on_line(self, text: str) -> Optional[Dict[str, str]]:
        it = iteration_of(text)
        if it not in self.at or it in self.done:
            return None
        self.done.add(it)
        used = dict.fromkeys(self.ROLES, 0.0)
        for pid in descendants(self.roots()):
            sec = cpu_seconds(pid)
            if sec is not None:
                used[role_of(pid)] += sec
        return {"iter": str(it), **{k: f"{v:.3f}" for k, v in used.items()}}


def kill_all(pids: Iterable[int]) -> List[int]:
    killed = []
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
        except ProcessLookupError:
            pass
    return killed


class Injector:
    """Fires once: when iteration ``at_iter`` starts, SIGKILL the node whose tag ``key`` is
    ``value``, or (``rank``) the node of the process started with ``RANK=rank``: the same
    ranks' node for every system, wherever a dynamic rendezvous put them."""

    def __init__(self, at_iter: int, key: str, value: Optional[str] = None,
                 roots: Callable[[], List[int]] = list, rank: Optional[int] = None):
        if at_iter < 2:
            raise ValueError("the kill iteration K must be >= 2: it fires when K-1 is logged")
        if (value is None) == (rank is None):
            raise ValueError("name the node (value) or a rank on it (rank), not both")
        self.at_iter, self.key, self.value, self.roots = at_iter, key, value, roots
        self.rank = rank
        self.fired: Optional[dict] = None

    def victim(self) -> Optional[str]:
        if self.value is not None:
            return self.value
        for pid in sorted(descendants(self.roots())):
            env = environ(pid)
            if env.get("RANK") == str(self.rank) and self.key in env:
                return env[self.key]
        return None

    def on_line(self, text: str) -> Optional[List[int]]:
        """Called for every line of the job's output; returns the killed pids when it fires."""
        if self.fired is not None or iteration_of(text) != self.at_iter - 1:
            return None
        value = self.victim()
        killed = kill_all(node_pids(self.roots(), self.key, value)) if value else []
        self.fired = {"iter": self.at_iter, "node": f"{self.key}={value}", "pids": killed}
        return killed


class RunLogWriter:
    """Stamps lines from any number of pipes into one log file, in arrival order, and hands
    each to the injector (if any) as it arrives."""

    def __init__(self, path: str, injector: Optional[Injector] = None,
                 t0: Optional[float] = None, echo: Optional[Callable[[str], None]] = None,
                 probe: Optional[CpuProbe] = None):
        self.path, self.injector, self.echo, self.probe = path, injector, echo, probe
        self.t0 = time.monotonic() if t0 is None else t0
        self._lock = threading.Lock()
        self._f = open(path, "a", buffering=1)
        self._threads: List[threading.Thread] = []

    def now(self) -> float:
        return time.monotonic() - self.t0

    def mark(self, event: str, **fields) -> None:
        with self._lock:
            self._f.write(marker(self.now(), event, **fields) + "\n")

    def line(self, text: str) -> None:
        with self._lock:
            t = self.now()
            self._f.write(stamp(t, text) + "\n")
            if self.injector is not None:
                killed = self.injector.on_line(text)
                if killed is not None:
                    f = self.injector.fired
                    self._f.write(marker(self.now(), "kill", iter=f["iter"], node=f["node"],
                                         pids=",".join(map(str, killed))) + "\n")
            used = self.probe.on_line(text) if self.probe is not None else None
            if used is not None:
                self._f.write(marker(self.now(), "cpu", **used) + "\n")
        if self.echo is not None:
            self.echo(text)

    def follow(self, pipe: IO[str]) -> threading.Thread:
        def pump():
            for text in pipe:
                self.line(text)
            pipe.close()

        th = threading.Thread(target=pump, daemon=True)
        th.start()
        self._threads.append(th)
        return th

    def close(self, timeout: float = 5.0) -> None:
        for th in self._threads:
            th.join(timeout)
        with self._lock:
            self._f.close()
