"""``deadpool launch`` run by NVRx's ``ft_launcher`` (``--enable-ft-package`` with
``--deadpool``): the launcher's side of the division of work (the worker's side, and the
division itself: ``adapters/ft_package.py``).

* DeadPool owns node loss and crashes while spares last: the ranks are its workers.
* ``ft_launcher`` watches ``deadpool launch``: this process is its rank monitor's client and
  sends a heartbeat from the supervision loop (``Nvrx.beat``), which runs through every
  recovery; a hung launcher stops beating and NVRx restarts it.
* When DeadPool stops, ``deadpool launch`` exits non-zero and ``ft_launcher`` runs the same
  command again. With ``--deadpool-fallback-save DIR --deadpool-resume DIR`` (the same DIR),
  ``resume_or_load`` picks where that run starts: the newest iteration DIR holds for every
  rank of this layout, or ``--load`` when DIR holds none or ``--load``'s checkpoint is newer.
"""

from __future__ import annotations

import os
import time
from typing import Callable, Dict, List, Optional

from ..adapters.ft_package import ENV, LAUNCHER

# What ft_launcher gives its worker for NVRx's IPC (fault_tolerance/data.py); DeadPool's
# ranks never get them (one client per rank monitor: this launcher).
SOCKETS = ("FT_RANK_MONITOR_IPC_SOCKET", "FT_LAUNCHER_IPC_SOCKET")


def flag_value(argv: List[str], flag: str) -> Optional[str]:
    """The value of ``flag V`` or ``flag=V`` (the last one, as argparse takes it)."""
    value = None
    for i, x in enumerate(argv):
        if x == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif x.startswith(flag + "="):
            value = x[len(flag) + 1:]
    return value


def under_ft_launcher(environ=os.environ) -> bool:
    return bool(environ.get(SOCKETS[0]))


def worker_env(base: Dict[str, str], environ=os.environ) -> Dict[str, str]:
    """The workers' environment: without NVRx's sockets; under ft_launcher, marked so that
    Megatron-LM's ``ft_integration`` leaves NVRx to this launcher."""
    out = {k: v for k, v in base.items() if k not in SOCKETS}
    if under_ft_launcher(environ):
        out[ENV] = LAUNCHER
    return out


class Nvrx:
    """NVRx's rank-monitor client in ``deadpool launch`` (one per ft_launcher worker)."""

    def __init__(self, client, interval_s: float) -> None:
        self.client, self.interval_s, self.last = client, interval_s, 0.0
        self.beats = 0

    @classmethod
    def connect(cls, say, interval_s: float = 0.5) -> Optional["Nvrx"]:
        """None unless ft_launcher runs this launcher."""
        if not under_ft_launcher():
            return None
        from nvidia_resiliency_ext.fault_tolerance import RankMonitorClient

        client = RankMonitorClient()
        client.init_workload_monitoring()
        say("NVRx: ft_launcher's rank monitor watches this launcher (heartbeat every "
            f"{interval_s} s, through recoveries); DeadPool watches and swaps the ranks")
        self = cls(client, interval_s)
        self.beat()
        return self

    def beat(self) -> None:
        now = time.monotonic()
        if now - self.last >= self.interval_s:
            self.client.send_heartbeat()
            self.last, self.beats = now, self.beats + 1

    def close(self) -> None:
        try:
            self.client.shutdown_workload_monitoring()
        except OSError:
            pass


def _without(argv: List[str], flag: str) -> List[str]:
    out, skip = [], False
    for x in argv:
        if skip:
            skip = False
        elif x == flag:
            skip = True
        elif not x.startswith(flag + "="):
            out.append(x)
    return out


def loaded_iteration(load: Optional[str]) -> Optional[int]:
    """The iteration of ``--load``'s tracker file (Megatron-LM's
    ``latest_checkpointed_iteration.txt``), or None."""
    try:
        with open(os.path.join(load, "latest_checkpointed_iteration.txt")) as f:
            return int(f.read().strip())
    except (TypeError, OSError, ValueError):
        return None


def resume_or_load(argv: List[str], world: int, say: Callable[[str], None]) -> List[str]:
    """The Megatron-LM flags of a restartable run (``--deadpool-resume`` naming the
    ``--deadpool-fallback-save`` directory): kept when that directory holds a complete
    iteration of this layout at least as new as ``--load``'s, else ``--deadpool-resume``
    dropped (the run starts from ``--load``, or from scratch), said in one line. Other
    command lines are returned as they are."""
    from ..mirror import persist

    root = flag_value(argv, "--deadpool-resume")
    if root is None or root != flag_value(argv, "--deadpool-fallback-save"):
        return argv
    tp = int(flag_value(argv, "--tensor-model-parallel-size") or 1)
    pp = int(flag_value(argv, "--pipeline-model-parallel-size") or 1)
    done = persist.scan(root).complete(layout=(world, tp, pp, world // (tp * pp)))
    load = flag_value(argv, "--load")
    loaded = loaded_iteration(load)
    if done and (loaded is None or done[0][0] >= loaded):
        say(f"--deadpool-resume: iteration {done[0][0]} of the fallback save in {root}")
        return argv
    why = (f"holds no iteration of every rank of TP{tp}.PP{pp}" if not done else
           f"holds iteration {done[0][0]}, older than --load's {loaded}")
    say(f"--deadpool-resume {root} {why}: starting from " +
        (f"--load {load}" + (f" (iteration {loaded})" if loaded is not None else "")
         if load else "scratch"))
    return _without(argv, "--deadpool-resume")
