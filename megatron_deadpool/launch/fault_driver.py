"""Delivers the test fault schedule from the launcher's side (``base/faults.py`` is the
schedule, and ``KINDS`` says what each kind sends):

* a staged fault (``@iter=N``) is fired by the first victim process that reaches its point;
  the victim reports it (event ``fault_request``). A rank fault of one signal: the victim
  signals itself. Otherwise (``Fault.by_agent``) the victim waits: the driver has the agents
  send the kind's signal sequence, each node's processes in one pass, as a real node loss
  takes them all at once, so the decider sees an injected node loss exactly as it sees a real
  one (no window of its own). A wait in the sequence is kept here: its next signal goes at
  its time, from ``poll``.
* an unstaged fault (``@t=S``) is delivered from outside, S seconds after the first rank
  reported a completed iteration, wherever the victims are (no fault point, no cooperation),
  through the same agent pass.

Every delivered fault is recorded for the summary.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Tuple

from ..base.faults import KINDS, Fault
from ..membership.decider import Decider, ProcState
from ..membership.store import CommandOp


class FaultDriver:
    def __init__(self, faults: List[Fault], decider: Decider,
                 send_command: Callable[[int, dict], None], log: Callable[[str], None],
                 claim: Callable[[int], bool]):
        self.faults: Dict[int, Fault] = {f.index: f for f in faults}
        self.decider, self.send_command, self.log, self.claim = decider, send_command, log, claim
        self.records: List[dict] = []
        self.pending: List[Tuple[float, int, dict]] = []  # (when, node, command) to send
        self._train_t0: Optional[float] = None
        decider.on_fault = self.on_request

    def on_request(self, ev: dict) -> None:
        """A victim fired staged fault ``ev['index']`` on itself."""
        f = self.faults[ev["index"]]
        self._deliver(f, ev["t"], at_iter=f.iteration, phase=f.phase)

    def poll(self, now: float) -> None:
        """Send the signals that are due, and fire the unstaged faults that are due."""
        self._send_due(now)
        timed = [f for f in self.faults.values() if f.at_s is not None]
        if not timed:
            return
        if self._train_t0 is None:
            if self.decider.max_iteration() >= 1:
                self._train_t0 = now
            return
        for f in timed:
            if now - self._train_t0 >= f.at_s and self.claim(f.index):
                self.decider.note_fault(now)
                self._deliver(f, now, at_iter=self.decider.max_iteration(), phase="unstaged")

    def _deliver(self, f: Fault, t: float, at_iter: int, phase: str) -> None:
        procs = self.decider.procs.values()
        victims = [p for p in procs if p.state not in (ProcState.DEAD, ProcState.DONE)
                   and (p.node in f.nodes if f.domain is not None else
                        p.node == f.node if f.node is not None else p.rank == f.rank)]
        if f.by_agent:
            self._queue(f, t, victims)
        rec = {"kind": f.kind, "node": f.node, "rank": f.rank,
               **({"domain": f.domain, "nodes": list(f.nodes)} if f.domain is not None else {}),
               "ranks": sorted(p.rank for p in victims if p.rank is not None),
               "at_iter": at_iter, "phase": phase, "t": t}
        if f.at_s is not None:
            rec["at_s"] = f.at_s
        self.records.append(rec)
        when = (f"at iteration {f.iteration} ({f.phase})" if f.at_s is None else
                f"{f.at_s:g}s after training began (unstaged, at iteration {at_iter})")
        self.log(f"injected {f.kind} on {f.where()} {when}")

    def _queue(self, f: Fault, t: float, victims) -> None:
        """Each signal of the fault's sequence at its time (``t`` plus its offset) to each
        victim node's agent, that node's processes in one command; the first goes now."""
        times = f.signal_times()
        for i, (offset, sig) in enumerate(times):
            last = i == len(times) - 1
            for node in sorted({p.node for p in victims}):  # each node's processes at once
                lids = [p.lid for p in victims if p.node == node]
                self.pending.append((t + offset, node, {
                    "op": CommandOp.SIGNAL, "signal": sig, "lids": lids,
                    **({"power_off": True} if last and KINDS[f.kind].power_off else {})}))
        self._send_due(t)

    def _send_due(self, now: float) -> None:
        due = [c for c in self.pending if c[0] <= now]
        self.pending = [c for c in self.pending if c[0] > now]
        for _, node, cmd in sorted(due, key=lambda c: c[0]):
            self.send_command(node, cmd)
