"""Each rank's state hashed per part after every step and every restore, so that a run that
ends not bitwise names the first iteration, rank and part that went wrong (not only the
final fingerprint). On with ``DEADPOOL_TRACE_DIGESTS=1`` in a launched job (``deadpool
soak`` turns it on); off, it costs nothing.

    <results>/digests_rank<r>.jsonl, one line per event, appended by whichever process
    holds rank r (a restarted or promoted one continues the file):
      {"what": "step" | "restored", "iteration": k, "pid": ..., "parts": {...}}

``parts`` are ``shard.digest_parts``: params, optimizer (main params, moments, step), each
RNG generator, the counters and the scheduler, hashed apart. ``first_divergence`` compares a
faulted run's trace with a failure-free run's.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Dict, List, Optional

ENV = "DEADPOOL_TRACE_DIGESTS"
PATTERN = "digests_rank*.jsonl"


class DigestTrace:
    """Records this process's events into its rank's trace file."""

    def __init__(self, results_dir: str, model, optimizer, scheduler, train_state,
                 with_cuda: bool):
        self.results_dir = results_dir
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.train_state, self._with_cuda = train_state, with_cuda

    @classmethod
    def from_env(cls, results_dir: Optional[str], model, optimizer, scheduler, train_state,
                 with_cuda: bool) -> Optional["DigestTrace"]:
        """A trace if the environment asks for one and the job has a results directory and
        a train state (the counters are part of what is compared); otherwise None."""
        if os.environ.get(ENV) != "1" or not results_dir or train_state is None:
            return None
        return cls(results_dir, model, optimizer, scheduler, train_state, with_cuda)

    def iteration(self) -> int:
        """The train state's iteration (after a restore: the restored one)."""
        return int(self.train_state.iteration)

    def record(self, what: str, rank: int, iteration: int) -> None:
        from . import shard
        from . import train_state as state_io

        resume = state_io.capture(iteration, self.train_state, self.scheduler, self.optimizer,
                                  with_cuda=self._with_cuda)
        line = {"what": what, "iteration": iteration, "pid": os.getpid(),
                "parts": shard.digest_parts(self.model, self.optimizer, resume)}
        path = os.path.join(self.results_dir, f"digests_rank{rank}.jsonl")
        with open(path, "a") as f:
            f.write(json.dumps(line) + "\n")


def _read(path: Path) -> List[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def first_divergence(faulted_dir, reference_dir) -> Optional[Dict]:
    """The earliest iteration at which a faulted run's traced state (after a step, or as
    restored) differs from the failure-free run's after the same step: that iteration, and
    for each rank that differs there, the event and the parts. None when every traced event
    matches. Raises FileNotFoundError when the reference has no trace."""
    ref_files = sorted(Path(reference_dir).glob(PATTERN))
    if not ref_files:
        raise FileNotFoundError(f"no digest trace in {reference_dir} ({ENV}=1?)")
    found: Dict[int, List[dict]] = {}
    for ref_file in ref_files:
        rank = int(ref_file.name[len("digests_rank"):-len(".jsonl")])
        ref = {x["iteration"]: x["parts"] for x in _read(ref_file) if x["what"] == "step"}
        mine = Path(faulted_dir) / ref_file.name
        for x in _read(mine) if mine.exists() else []:
            want = ref.get(x["iteration"])
            if want is None:
                continue
            parts = sorted(k for k in set(want) | set(x["parts"])
                           if want.get(k) != x["parts"].get(k))
            if parts:
                found.setdefault(x["iteration"], []).append(
                    {"rank": rank, "what": x["what"], "pid": x["pid"], "parts": parts})
    if not found:
        return None
    first = min(found)
    return {"iteration": first, "ranks": found[first]}
