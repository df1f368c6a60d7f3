"""A Slurm DRAIN of this node becomes a drain request (membership/drain.py, reason
``slurm``): an administrator's ``scontrol update nodename=X state=drain reason=...``, or a
health check that drains a node, moves its ranks to spares at the next iteration boundary
while the node still runs, instead of waiting for it to fail.

Under Slurm (``SLURMD_NODENAME`` set, ``scontrol`` on the PATH) each node's agent polls
``scontrol show node`` every ``POLL_S`` seconds and asks once; the decider refuses it (and
says why) when no spare is left. Nothing runs outside Slurm.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
from typing import Callable, Optional, Tuple

from ..membership.store import EventKind

POLL_S = 2.0


def node_state(name: str, run=subprocess.run) -> Tuple[str, str]:
    """(State, Reason) of Slurm node ``name`` from ``scontrol show node NAME -o``."""
    out = run(["scontrol", "show", "node", name, "-o"], capture_output=True, text=True,
              timeout=10).stdout
    fields = dict(x.split("=", 1) for x in out.split() if "=" in x)
    reason = out.split("Reason=", 1)[1].strip() if "Reason=" in out else ""
    return fields.get("State", ""), reason


class SlurmDrainWatch:
    def __init__(self, node: int, slurm_node: str, coord, say: Callable[[str], None],
                 poll_s: float = POLL_S, state=node_state):
        self.node, self.slurm_node, self.coord, self.say = node, slurm_node, coord, say
        self.poll_s, self._state = poll_s, state
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="deadpool-slurm-drain",
                                        daemon=True)

    def start(self) -> "SlurmDrainWatch":
        self._thread.start()
        return self

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                state, reason = self._state(self.slurm_node)
            except (OSError, subprocess.SubprocessError, ValueError):
                continue  # scontrol busy or gone: ask again
            if "DRAIN" in state.upper():
                self.say(f"Slurm drains {self.slurm_node} (node {self.node}): {reason or state}"
                         "; asking for a planned swap")
                try:
                    self.coord.push_event(EventKind.DRAIN_REQUEST, node=self.node,
                                          reason="slurm", text=reason[:200])
                except Exception:  # noqa: BLE001 - the job ended meanwhile
                    pass
                return

    def stop(self) -> None:
        self._stop.set()


def watch_this_node(node: int, coord, say, env=os.environ) -> Optional[SlurmDrainWatch]:
    """Under Slurm, the watch of this agent's node; None elsewhere."""
    name = env.get("SLURMD_NODENAME")
    if not name or coord is None or shutil.which("scontrol") is None:
        return None
    return SlurmDrainWatch(node, name, coord, say).start()
