"""What the launcher tells each worker process, in one place: :class:`WorkerEnv` with
``to_env()`` (written by the launcher and node agent) and ``from_env()`` (read once, by
``Deadpool.start``). The job secret is not in it: it travels out of band
(``membership/auth.py``).
"""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass, field
from typing import List, Mapping, Optional

from . import faults as fault_schedule
from .errors import ConfigError, DeadpoolError
from .state import Role

_NAMES = {"lid": "DEADPOOL_LID", "node": "DEADPOOL_NODE", "role": "DEADPOOL_ROLE",
          "store_host": "DEADPOOL_STORE_HOST", "store_port": "DEADPOOL_STORE_PORT",
          "results_dir": "DEADPOOL_RESULTS_DIR", "faults": "DEADPOOL_INJECT",
          "bench_block": "DEADPOOL_BENCH_BLOCK", "local_rank": "LOCAL_RANK", "rank": "RANK",
          "world_size": "WORLD_SIZE", "master_addr": "MASTER_ADDR",
          "master_port": "MASTER_PORT"}

# What a worker tells the launcher on stdout: one line per completed iteration, from the
# rank that logs the loss, ``PROGRESS_PREFIX`` + a JSON object (``api.Deadpool.after_step``;
# the launcher side is ``launch/progress.py``).
PROGRESS_PREFIX = "[deadpool progress] "

# The pid of the process that started a worker (its node's launcher), written into the
# worker's environment before the fork (``launch/agent.py``): ``exit_with_launcher``.
LAUNCHER_PID = "DEADPOOL_LAUNCHER_PID"


# LOCAL_RANK of a node's warm standby on a GPU node (not in the shared-GPU mode): it binds no
# GPU until it takes a crashed rank, and then takes the GPU that rank's process used.
UNBOUND = "-1"


def physical_id(local_rank: int, env=os.environ) -> str:
    """The GPU a process bound to ``local_rank`` uses, as this machine names it (its
    ``CUDA_VISIBLE_DEVICES`` entry, else the index): what its heartbeats report, so that a
    standby that takes a rank of the node knows which GPUs are in use."""
    listed = env.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        ids = [x.strip() for x in listed.split(",") if x.strip()]
        if 0 <= local_rank < len(ids):
            return ids[local_rank]
    return str(local_rank)


def promoted_gpu(visible: List[str], used: List[str], newcomers: List[int], me: int) -> int:
    """The index (into ``visible``, this process's devices) of the GPU a promoted standby
    binds: the GPUs its node's other members do not use (``used``, from their heartbeats),
    in order, shared out among the processes promoted on the node in the same plan
    (``newcomers``, by rank: two crashes on one node at once take two GPUs, not one).
    Raises ConfigError when none is free."""
    free = [i for i, g in enumerate(visible) if g not in set(used)]
    k = sorted(newcomers).index(me) if me in newcomers else 0
    if k >= len(free):
        raise ConfigError(f"no free GPU for a promoted standby on this node: visible "
                          f"{visible}, in use by its other ranks {sorted(set(used))}")
    return free[k]


@dataclass(frozen=True)
class WorkerEnv:
    lid: int = -1                 # launcher process id (stable for the process's life)
    node: int = -1
    role: Role = Role.ACTIVE      # ACTIVE, or SPARE (a standby spare)
    store_host: str = "127.0.0.1"
    store_port: int = 0
    results_dir: Optional[str] = None
    faults: List[fault_schedule.Fault] = field(default_factory=list)  # test schedule
    # Benchmark only (`deadpool bench overhead`): snapshot in alternating blocks of this many
    # iterations, so mirror-on and mirror-off steps are measured in one job. 0: always on.
    bench_block: int = 0
    local_rank: int = 0
    rank: Optional[int] = None    # None for a standby spare
    world_size: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "role", Role(self.role))  # "spare" from a test or a CLI

    def mirror_on(self, iteration: int) -> bool:
        """Whether step ``iteration`` (1-based) is snapshotted (``bench_block``)."""
        b = self.bench_block
        return not b or ((iteration - 1) // b) % 2 == 0

    def to_env(self) -> dict:
        out = {}
        for name, var in _NAMES.items():
            v = getattr(self, name)
            if name == "faults":
                v = fault_schedule.to_json(v)
            elif isinstance(v, enum.Enum):
                v = v.value
            if v is not None:
                out[var] = str(v)
        return out

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> "WorkerEnv":
        """Raises DeadpoolError when the process was not started by ``deadpool launch``."""
        missing = [_NAMES[n] for n in ("lid", "node", "store_port") if _NAMES[n] not in env]
        if missing:
            raise DeadpoolError(f"--deadpool needs {', '.join(missing)} in the environment: "
                                "start the job with `deadpool launch`")
        get = lambda n, d=None: env.get(_NAMES[n], d)  # noqa: E731
        return cls(lid=int(get("lid")), node=int(get("node")), role=Role(get("role", "active")),
                   store_host=get("store_host", "127.0.0.1"),
                   store_port=int(get("store_port")), results_dir=get("results_dir"),
                   faults=fault_schedule.from_json(get("faults", "")),
                   bench_block=int(get("bench_block", "0")),
                   local_rank=int(get("local_rank", "0")),
                   rank=int(get("rank")) if get("rank") is not None else None,
                   world_size=int(get("world_size", "1")),
                   master_addr=get("master_addr", "127.0.0.1"),
                   master_port=int(get("master_port", "0")))

    @staticmethod
    def variables() -> List[str]:
        """Every variable a worker's environment carries (the agent clears them first)."""
        return list(_NAMES.values())


def log_to_stdout(env: Mapping[str, str] = os.environ) -> None:
    """Worker entry points (the reference trainer, the child wrapper): the package's log
    messages go to stdout as ``[deadpool lidN] ...`` (the agent prefixes node and rank)."""
    import logging
    import sys

    logger = logging.getLogger("megatron_deadpool")
    if logger.handlers:
        return
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter(
        f"[deadpool lid{env.get(_NAMES['lid'], '?')}] %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


def dump_stacks_on_crash() -> None:
    """Worker entry points: on SIGABRT, SIGSEGV, SIGFPE, SIGBUS or SIGILL, write the Python
    stack of every thread to stderr (the agent forwards it with the worker's output), so a
    native crash (e.g. a C++ std::terminate) names the thread and the call it came from.
    ``kill -USR1 <pid>`` writes them too, without stopping the process (a hung worker)."""
    import faulthandler
    import signal

    if not faulthandler.is_enabled():
        faulthandler.enable(all_threads=True)
    faulthandler.register(signal.SIGUSR1, all_threads=True, chain=False)


def _gone(pid: int) -> bool:
    """``pid`` is no running process (a zombie is gone: it only waits to be reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True
    except (OSError, IndexError):  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            pass
        return False


def exit_with_launcher(poll_s: float = 0.25) -> None:
    """Worker entry points under ``deadpool launch`` (``DEADPOOL_LID`` set): a daemon
    thread that, once this process's parent (its node's launcher) is gone -- a SIGKILL, an
    OOM kill, a crash: anything that skipped the launcher's own wind-down -- kills this
    worker's process group, the worker and its children (e.g. Megatron-LM's checkpoint
    writers). The worker leads its own session (``launch/agent.py``), so nothing else is
    in that group. Orphans are noticed within ``poll_s``.

    This runs after the interpreter's start and the imports (about 0.4 s): a launcher
    killed before then left a worker that took its new parent (pid 1) for its launcher and
    watched it forever. So the launcher's pid also comes in the environment
    (``LAUNCHER_PID``, set by the agent before the fork): a parent that is not that pid,
    while that pid is no running process, means the launcher is gone already, and the
    group is killed at once. The variable is not passed on to the worker's children."""
    import signal
    import threading
    import time

    if os.environ.get(_NAMES["lid"]) is None:
        return
    told, parent = os.environ.pop(LAUNCHER_PID, ""), os.getppid()
    if told.isdigit() and int(told) != parent and _gone(int(told)):
        parent = -1  # no parent is: the watcher kills the group at its first look

    def watch():
        while os.getppid() == parent:
            time.sleep(poll_s)
        try:
            os.killpg(os.getpgrp(), signal.SIGKILL)
        except OSError:
            os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="deadpool-launcher-watch", daemon=True).start()
