"""Declarative fault schedule (``kind:target=N@iter=N[,phase=P]``) and its delivery.

    kill:node=1@iter=12                  SIGKILL every process of node 1 at iteration 12
    kill:rank=5@iter=7,phase=optimizer   SIGKILL rank 5 during its optimizer step
    poweroff:node=2@iter=6               node 2's agent and processes die together (no exit
                                         is reported: its heartbeat finds the loss)
    stop:rank=3@iter=9                   SIGSTOP rank 3 (a hang)
    stop:node=2@iter=4                   SIGSTOP every process of node 2
    stop:rank=3@iter=6,phase=save        SIGSTOP rank 3 in the save after iteration 6
    kill:node=1@iter=6,phase=eval        SIGKILL node 1 as the evaluation after 6 begins
    drop:rank=3@iter=2                   rank 3 rejects every mirror copy it receives from
                                         then on (no failure: the run goes on unprotected)
    impostor:rank=2@iter=3               rank 2 starts a client without the job secret that
                                         knocks on every mirror listener (mirror/impostor.py)
    drain:node=2@iter=8                  a drain of node 2 is requested at iteration 8 (the
                                         path of `deadpool drain`: membership/drain.py)
    slow:node=2@iter=4,factor=3          node 2's processes compute 3x slower from iteration 4
                                         (a straggler: --deadpool-straggler-swap)

    iteration:  ... | forward_backward | optimizer | mirror | ... next iteration
                          ^ default        ^              ^  (phase= picks the point)

    recovery from a failure seen while running iteration N: abort | rendezvous | rebuild
    | restore_state | ...       (rendezvous/restore_state at iter=N: a failure during a
                                 recovery, to test cascades)

The launcher parses and validates the ``--inject`` specs once and passes the schedule to every
worker (``base/worker_env.py``). ``Fault.index`` (its position) is the fault's unique id.

Delivery (:class:`FaultPoints`, in the worker): the first process at a fault's point claims
and reports it. A rank fault's victim signals itself at once (in the optimizer step after a
seeded sub-millisecond delay: a torn step). A node fault's victim waits while its agent
signals the whole node in one pass, as a real node loss takes it (``launch/``, which also
delivers ``@t=S`` faults); detection has no injected case (``procs.py: window_over``).
"""

from __future__ import annotations

import json
import os
import random
import signal as _signal
import threading
import time
from dataclasses import asdict, dataclass
from typing import Callable, Dict, List, Optional, Sequence

from .errors import ConfigError
from .vocabulary import FAULT_PHASES, Phase, ValueEnum

NODE_SIGNAL_WAIT_S = 10.0  # a node fault's victim, then it signals itself (no agent pass)


class Kind(ValueEnum):
    """A fault kind's name (``kind:...`` in a spec); what it does is in ``KINDS``."""

    KILL = "kill"
    STOP = "stop"
    TERM = "term"
    SEGV = "segv"
    POWEROFF = "poweroff"
    RAISE = "raise"
    DROP = "drop"
    IMPOSTOR = "impostor"
    DRAIN = "drain"
    SLOW = "slow"


@dataclass(frozen=True)
class FaultKind:
    """One kind of fault, the only place a kind is described. A signal kind is delivered as
    ``signal`` (to the process that reaches the point; its node agent signals the node's
    others). Any other kind is an action the worker binds by its ``Kind`` (``actions`` of
    :class:`FaultPoints`: ``recovery/fault_points.py``)."""

    name: Kind
    signal: Optional[str] = None  # e.g. "SIGKILL"; None: an action in the rank
    rank_only: bool = False       # targets one rank (kind:rank=N), never a node
    node_only: bool = False       # targets a node (kind:node=N), never one rank
    claimed: bool = True          # fires once in the job (False: on every rank it targets)
    factor: bool = False          # takes ``factor=F`` (F > 1)
    what: str = ""


KINDS: Dict[Kind, FaultKind] = {k.name: k for k in (
    FaultKind(Kind.KILL, "SIGKILL", what="the process dies"),
    FaultKind(Kind.STOP, "SIGSTOP", what="the process hangs"),
    FaultKind(Kind.TERM, "SIGTERM", what="the process is asked to stop"),
    FaultKind(Kind.SEGV, "SIGSEGV", what="the process crashes"),
    # the node agent and its processes die together, as when a machine loses power: no
    # exit is reported, the node's heartbeat stops and the decider finds the loss by it
    FaultKind(Kind.POWEROFF, "SIGKILL", node_only=True,
              what="the node loses power: its agent and every process die at once"),
    # a local error raised by the rank itself (an exception in its step): the job must fail
    # fast, no recovery
    FaultKind(Kind.RAISE, claimed=False, what="an exception in the rank's step"),
    # the rank rejects every mirror copy it receives from then on (a holder that loses
    # copies; no failure: the run goes on unprotected)
    FaultKind(Kind.DROP, rank_only=True, what="the rank's held copies are rejected"),
    # the rank starts a foreign mirror client (the listeners must refuse it)
    FaultKind(Kind.IMPOSTOR, rank_only=True, what="a client without the secret knocks"),
    # a drain of the node is requested (the path of `deadpool drain`: membership/drain.py)
    FaultKind(Kind.DRAIN, what="the node is drained: its ranks move to spares"),
    # every targeted process computes FACTOR times slower from then on (a straggler)
    FaultKind(Kind.SLOW, claimed=False, factor=True, what="it computes F times slower"),
)}
SIGNALS = {k.name: k.signal for k in KINDS.values() if k.signal}
PHASES = tuple(p.value for p in FAULT_PHASES)
TARGETS = ("node", "rank")
FORM = (f"{'|'.join(KINDS)}:node=N|rank=N@iter=N[,phase={'|'.join(PHASES)}][,factor=F] or "
        "...@t=SECONDS (unstaged, from outside)")


class InjectedLocalError(RuntimeError):
    """What a ``raise`` fault throws inside the rank's step (not a communication failure)."""


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass(frozen=True)
class Fault:
    """One fault: ``kind`` on a node or a rank (exactly one of them) at ``iteration`` in
    ``phase``; ``index`` is its position in the schedule."""

    kind: Kind
    iteration: int
    node: Optional[int] = None
    rank: Optional[int] = None
    phase: Phase = Phase.FORWARD_BACKWARD
    index: int = 0
    at_s: Optional[float] = None  # unstaged: seconds after training began, not a fault point
    factor: Optional[float] = None  # a kind that takes one (slow): how many times slower

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ConfigError(f"fault kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        object.__setattr__(self, "kind", Kind(self.kind))  # JSON and specs give the value
        if self.phase not in PHASES:
            raise ConfigError(f"fault phase must be one of {', '.join(PHASES)}, "
                              f"got {self.phase!r}")
        object.__setattr__(self, "phase", Phase(self.phase))  # JSON gives the value
        if (self.node is None) == (self.rank is None):
            raise ConfigError(f"a fault targets exactly one of node or rank, got "
                              f"node={self.node!r} rank={self.rank!r}")
        if KINDS[self.kind].rank_only and self.node is not None:
            raise ConfigError(f"a '{self.kind}' fault targets one rank "
                              f"({self.kind}:rank=N@iter=N)")
        if KINDS[self.kind].node_only and self.rank is not None:
            raise ConfigError(f"a '{self.kind}' fault targets a node "
                              f"({self.kind}:node=N@iter=N)")
        if self.at_s is not None:
            if KINDS[self.kind].signal is None:
                raise ConfigError(f"a '{self.kind}' fault runs inside the rank: it needs @iter=N")
            if not isinstance(self.at_s, (int, float)) or self.at_s < 0:
                raise ConfigError(f"fault time must be >= 0 seconds, got {self.at_s!r}")
        if KINDS[self.kind].factor != (self.factor is not None) or (
                self.factor is not None and not (isinstance(self.factor, (int, float))
                                                 and self.factor > 1)):
            raise ConfigError(f"a '{self.kind}' fault " + (
                f"needs factor=F with F > 1, got {self.factor!r}" if KINDS[self.kind].factor
                else "takes no factor="))
        for name in ("iteration", "index", "node", "rank"):
            v = getattr(self, name)
            if v is not None and not _is_int(v):
                raise ConfigError(f"fault {name} must be an integer, got {v!r}")

    def targets(self, rank: int, node: int) -> bool:
        """Whether a worker with global ``rank`` running on ``node`` is hit by this fault."""
        if self.node is not None:
            return self.node == node
        return self.rank == rank

    def describe(self) -> str:
        """The spec form of this fault (``parse_fault(f.describe()) == f`` up to index)."""
        target = f"node={self.node}" if self.node is not None else f"rank={self.rank}"
        if self.at_s is not None:
            return f"{self.kind}:{target}@t={self.at_s:g}"
        phase = "" if self.phase is Phase.FORWARD_BACKWARD else f",phase={self.phase.value}"
        factor = "" if self.factor is None else f",factor={self.factor:g}"
        return f"{self.kind}:{target}@iter={self.iteration}{phase}{factor}"


def _bad(spec: str, what: str) -> ConfigError:
    return ConfigError(f"bad --inject spec {spec!r}: {what}; expected {FORM}")


def _int(spec: str, name: str, text: str) -> int:
    if not text.isdigit() or not text.isascii():
        raise _bad(spec, f"{name} must be a non-negative integer, got {text!r}")
    return int(text)


def parse_fault(spec: str, index: int = 0) -> Fault:
    """Parse one ``--inject`` spec; raises :class:`ConfigError` (one line) when malformed."""
    if not isinstance(spec, str):
        raise ConfigError(f"bad --inject spec {spec!r}: not a string; expected {FORM}")
    s = spec.strip()
    head, at, tail = s.partition("@")
    if not at:
        raise _bad(spec, "missing '@iter=N'")
    kind, colon, target = head.partition(":")
    if not colon:
        raise _bad(spec, "missing ':' after the kind")
    if kind not in KINDS:
        raise _bad(spec, f"kind must be one of {', '.join(KINDS)}, got {kind!r}")
    tkey, eq, tval = target.partition("=")
    if not eq or tkey not in TARGETS:
        raise _bad(spec, f"target must be node=N or rank=N, got {target!r}")
    tnum = _int(spec, tkey, tval)
    fields = {}
    for item in tail.split(","):
        key, eq, val = item.partition("=")
        if not eq or key not in ("iter", "phase", "t", "factor"):
            raise _bad(spec, f"unknown option {item!r} (iter=, phase=, t= and factor= are "
                             "allowed)")
        if key in fields:
            raise _bad(spec, f"{key}= given twice")
        fields[key] = val
    if "t" in fields:
        if "iter" in fields or "phase" in fields:
            raise _bad(spec, "t= (a wall-clock instant) excludes iter= and phase=")
        try:
            at_s = float(fields["t"])
        except ValueError:
            raise _bad(spec, f"t must be a number of seconds, got {fields['t']!r}") from None
        return Fault(kind=kind, iteration=0, node=tnum if tkey == "node" else None,
                     rank=tnum if tkey == "rank" else None, index=index, at_s=at_s)
    if "iter" not in fields:
        raise _bad(spec, "missing 'iter=N' after '@'")
    iteration = _int(spec, "iter", fields["iter"])
    phase = fields.get("phase", Phase.FORWARD_BACKWARD.value)
    if phase not in PHASES:
        raise _bad(spec, f"phase must be one of {', '.join(PHASES)}, got {phase!r}")
    try:
        factor = float(fields["factor"]) if "factor" in fields else None
    except ValueError:
        raise _bad(spec, f"factor must be a number, got {fields['factor']!r}") from None
    return Fault(kind=kind, iteration=iteration, node=tnum if tkey == "node" else None,
                 rank=tnum if tkey == "rank" else None, phase=phase, index=index,
                 factor=factor)


def parse_schedule(specs: Sequence[str]) -> List[Fault]:
    """Parse every spec; a fault's ``index`` is its position in ``specs``."""
    return [parse_fault(s, i) for i, s in enumerate(specs)]


def to_json(faults: Sequence[Fault]) -> str:
    """Serialise a schedule (for the ``DEADPOOL_INJECT`` environment variable)."""
    return json.dumps([asdict(f) for f in faults], separators=(",", ":"))


def from_json(s: Optional[str]) -> List[Fault]:
    """Inverse of :func:`to_json`; an empty string or None is the empty schedule."""
    if not s:
        return []
    try:
        data = json.loads(s)
        if not isinstance(data, list):
            raise TypeError(f"expected a list, got {type(data).__name__}")
        return [Fault(**d) for d in data]
    except (ValueError, TypeError) as exc:  # JSONDecodeError is a ValueError
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(f"bad fault schedule JSON: {exc}") from None


def validate_schedule(faults: Sequence[Fault], total_nodes: int, world_size: int,
                      train_iters: int) -> None:
    """Check every fault against the job: node in ``0..total_nodes-1`` (training plus spare
    nodes), rank in ``0..world_size-1``, iteration in ``1..train_iters``."""
    for f in faults:
        where = f"--inject {f.describe()}"
        if f.node is not None and not 0 <= f.node < total_nodes:
            raise ConfigError(f"{where}: node {f.node} does not exist "
                              f"(nodes are 0..{total_nodes - 1})")
        if f.rank is not None and not 0 <= f.rank < world_size:
            raise ConfigError(f"{where}: rank {f.rank} does not exist "
                              f"(ranks are 0..{world_size - 1})")
        if f.at_s is None and not 1 <= f.iteration <= train_iters:
            raise ConfigError(f"{where}: iteration {f.iteration} is outside 1..{train_iters}")


# (the fault, the iteration it fires at) -> None, or an effect that lasts: a callable run
# at every later iteration's start (the FORWARD_BACKWARD point), e.g. the ``slow`` kind's
Action = Callable[["Fault", int], Optional[Callable[[], None]]]


class FaultPoints:
    """The worker side of a schedule. ``claim(index)`` returns True for exactly one caller in
    the whole job (a store counter), so a fault fires once even when a replacement re-runs
    the iteration; ``report(fault, iteration, phase)`` tells the launcher before it acts.
    ``actions``: what each kind without a signal does in this worker, by its ``Kind``."""

    def __init__(self, faults: Sequence[Fault], rank: Callable[[], int], node: int,
                 claim: Callable[[int], bool], report: Callable[[Fault, int, str], None],
                 kill: Callable[[int], None] = lambda sig: os.kill(os.getpid(), sig),
                 actions: Optional[Dict[Kind, Action]] = None):
        self.faults = [f for f in faults if f.at_s is None]
        self.rank, self.node = rank, node
        self.claim, self.report, self.kill = claim, report, kill
        self.actions: Dict[Kind, Action] = {Kind.RAISE: self._raise_local, **(actions or {})}
        self.lasting: List[Callable[[], None]] = []  # effects of faults that fired before

    def due(self, iteration: int, phase: str) -> List[Fault]:
        return [f for f in self.faults if f.iteration == iteration and f.phase == phase
                and f.targets(self.rank(), self.node)]

    def __call__(self, iteration: int, phase: str) -> None:
        if phase == Phase.FORWARD_BACKWARD:
            for effect in self.lasting:
                effect()
        for f in self.due(iteration, phase):
            kind = KINDS[f.kind]
            if kind.claimed:
                if not self.claim(f.index):
                    continue
                self.report(f, iteration, phase)
            if kind.signal is not None and f.node is not None:
                self._await_node_signal(f, getattr(_signal, kind.signal))
            elif kind.signal is not None:
                self._signal(f, getattr(_signal, kind.signal), phase)
            elif f.kind in self.actions:
                effect = self.actions[f.kind](f, iteration)
                if effect is not None:
                    self.lasting.append(effect)
            else:
                raise ConfigError(f"fault kind {f.kind!r} has no action in this worker")

    def _signal(self, f: Fault, sig: int, phase: str) -> None:
        if phase == Phase.OPTIMIZER:  # land inside the real step, not before it
            delay = random.Random(f.index).uniform(0.0, 0.001)
            threading.Timer(delay, self.kill, args=(sig,)).start()
        else:
            self.kill(sig)

    def _await_node_signal(self, f: Fault, sig: int) -> None:
        """The agent signals the whole node, this process included, in one pass."""
        time.sleep(NODE_SIGNAL_WAIT_S)
        self.kill(sig)  # no agent pass came: the fault still lands

    def _raise_local(self, f: Fault, iteration: int) -> None:
        raise InjectedLocalError(
            f"injected local error on rank {self.rank()} at iteration {iteration}")
