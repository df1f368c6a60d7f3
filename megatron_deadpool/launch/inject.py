"""Declarative fault schedule: ``kind:target@iter=N[,phase=P]``.

    kill:node=1@iter=12                  SIGKILL every process of node 1 at iteration 12
    kill:rank=5@iter=7,phase=optimizer   SIGKILL rank 5 during its optimizer step
    stop:rank=3@iter=9                   SIGSTOP rank 3 (a hang)

Every worker gets the same schedule (as JSON in an env var) so all ranks agree on it.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from typing import List, Optional, Sequence

from ..errors import ConfigError

KINDS = ("kill", "stop")
PHASES = ("forward_backward", "optimizer", "mirror")
_FORM = "kill|stop:node=N|rank=N@iter=N[,phase=forward_backward|optimizer|mirror]"
_RE = re.compile(r"^(?P<kind>\w+):(?P<tk>node|rank)=(?P<tv>\d+)@iter=(?P<it>\d+)"
                 r"(?:,phase=(?P<phase>\w+))?$")


@dataclass(frozen=True)
class Fault:
    kind: str
    iteration: int
    node: Optional[int] = None
    rank: Optional[int] = None
    phase: str = "forward_backward"
    index: int = 0

    def targets(self, rank: int, node: int) -> bool:
        return self.node == node if self.node is not None else self.rank == rank


def parse_fault(spec: str, index: int = 0) -> Fault:
    m = _RE.match(spec.strip())
    if not m:
        raise ConfigError(f"bad --inject spec {spec!r}; expected {_FORM}")
    kind, phase = m["kind"], m["phase"] or "forward_backward"
    if kind not in KINDS:
        raise ConfigError(f"bad --inject spec {spec!r}: kind must be one of {KINDS}")
    if phase not in PHASES:
        raise ConfigError(f"bad --inject spec {spec!r}: phase must be one of {PHASES}")
    tv = int(m["tv"])
    return Fault(kind=kind, iteration=int(m["it"]), node=tv if m["tk"] == "node" else None,
                 rank=tv if m["tk"] == "rank" else None, phase=phase, index=index)


def parse_schedule(specs: Sequence[str]) -> List[Fault]:
    return [parse_fault(s, i) for i, s in enumerate(specs)]


def to_json(faults: Sequence[Fault]) -> str:
    return json.dumps([asdict(f) for f in faults])


def from_json(s: str) -> List[Fault]:
    return [Fault(**d) for d in json.loads(s or "[]")]


def validate_schedule(faults: Sequence[Fault], total_nodes: int, world_size: int,
                      train_iters: int) -> None:
    for f in faults:
        if f.node is not None and not 0 <= f.node < total_nodes:
            raise ConfigError(f"--inject: node {f.node} does not exist (0..{total_nodes - 1})")
        if f.rank is not None and not 0 <= f.rank < world_size:
            raise ConfigError(f"--inject: rank {f.rank} does not exist (0..{world_size - 1})")
        if not 1 <= f.iteration <= train_iters:
            raise ConfigError(f"--inject: iteration {f.iteration} is outside 1..{train_iters}")
