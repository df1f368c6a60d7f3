"""``--enable-ft-package`` (NVRx fault tolerance) with ``--deadpool``: the worker's side of
the division of work (``launch/nvrx.py`` is the launcher's).

NVRx's ``ft_launcher`` starts ``deadpool launch`` as its one worker on each node and gives
it a rank monitor. ``deadpool launch`` is that monitor's client: it sends NVRx's heartbeats
from its supervision loop, which goes on through every DeadPool recovery, so no NVRx
heartbeat or section timeout can fire while DeadPool swaps a spare in. The Megatron-LM ranks
under it are DeadPool's: its heartbeats and section timeouts (``--deadpool-section-timeouts``)
watch them, and a rank that fails is swapped, not restarted. When DeadPool stops (no spare
left, or a rank lost with every buddy) ``deadpool launch`` exits non-zero and ``ft_launcher``
restarts it: the restart resumes from ``--deadpool-fallback-save``, or from ``--load``.

So a rank does not open NVRx's per-rank client: Megatron-LM's ``ft_integration.setup``
would connect every rank of the node to the launcher's one rank monitor (which serves one
client at a time), and its sections would time out on a rank that DeadPool is restoring.
``hand_to_launcher`` makes ``setup`` and ``shutdown`` say so in one line instead; every
other ``ft_integration`` call is a no-op without a client, as upstream has it.
"""

from __future__ import annotations

import os
import sys

# Set by ``deadpool launch`` in its workers' environment when ft_launcher runs it.
ENV = "DEADPOOL_NVRX"
LAUNCHER = "launcher"


def launcher_is_client() -> bool:
    """This worker's ``deadpool launch`` is NVRx's rank-monitor client (it runs under
    ``ft_launcher``)."""
    return os.environ.get(ENV) == LAUNCHER


def hand_to_launcher() -> bool:
    """In a worker under ``deadpool launch`` run by ``ft_launcher``: Megatron-LM's
    ``ft_integration.setup``/``shutdown`` leave NVRx to the launcher. Returns whether it
    did (idempotent)."""
    if not launcher_is_client():
        return False
    from megatron.training import ft_integration as ft

    if getattr(ft.setup, "_deadpool", False):
        return True

    def setup() -> None:
        if os.environ.get("RANK") == "0" and "--enable-ft-package" in sys.argv:
            print("FT: --enable-ft-package with --deadpool: deadpool launch is NVRx's client "
                  "on each node (its heartbeats go on through recoveries); DeadPool watches "
                  "and swaps the ranks; ft_launcher restarts the job when DeadPool stops",
                  flush=True)

    def shutdown() -> None:
        return None

    setup._deadpool = shutdown._deadpool = True
    ft.setup, ft.shutdown = setup, shutdown
    return True
