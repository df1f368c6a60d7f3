"""Stragglers (``--deadpool-straggler-swap FACTOR:WINDOW``): a node whose ranks' own compute
time per iteration stays above FACTOR x the median node's for WINDOW consecutive iterations
is drained (membership/drain.py, reason "straggler"), if a spare exists.

What is timed, after megatron-core's ``StragglerDetector`` and NVRx's straggler scores: each
rank's compute alone, not the step's wall time, which every rank of a synchronous job shares
(the fast ones wait in collectives for the slow one). A rank's heartbeat carries the median
of its main thread's CPU seconds per iteration less its mirror work (mirror/meter.py): a
wait in a collective blocks off the CPU, so a rank that only waits does not look slow. A node
counts as its slowest rank. Pure: a function of the processes as the decider tracks them.

A straggler is alive and makes progress: the hang detector (procs.hung) judges heartbeats
and progress, never speed, so it does not fence one.
"""

from __future__ import annotations

import statistics
from typing import Dict, List, Mapping, Optional, Tuple

from .procs import Proc, ProcState


class StragglerWatch:
    def __init__(self, swap: Optional[Tuple[float, int]]):
        self.factor, self.window = swap if swap is not None else (0.0, 0)
        self.over: Dict[object, int] = {}      # node -> consecutive iterations above
        self._seen: Dict[object, int] = {}     # node -> the iteration last counted
        self.flagged: List[dict] = []          # nodes asked to drain, with their numbers

    def observe(self, procs: Mapping[int, Proc]) -> List[object]:
        """The nodes that just became stragglers (each once)."""
        if not self.window:
            return []
        nodes: Dict[object, List[Proc]] = {}
        for p in procs.values():
            if p.rank is not None and p.state == ProcState.ALIVE and p.hb_compute_s:
                nodes.setdefault(p.node, []).append(p)
        if len(nodes) < 2:
            return []
        compute = {n: max(p.hb_compute_s for p in ps) for n, ps in nodes.items()}
        median = statistics.median(compute.values())
        out = []
        for node, ps in nodes.items():
            it = min(p.hb_iteration for p in ps)
            if it == self._seen.get(node):
                continue  # no new iteration since the last count
            self._seen[node] = it
            slow = compute[node] > self.factor * median
            self.over[node] = self.over.get(node, 0) + 1 if slow else 0
            if self.over[node] == self.window and node not in {f["node"] for f in self.flagged}:
                self.flagged.append({"node": node, "compute_s": round(compute[node], 4),
                                     "median_s": round(median, 4), "iteration": it})
                out.append(node)
        return out
