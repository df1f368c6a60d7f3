"""Declarative fault schedule (``kind:target=N@iter=N[,phase=P][,param=V]``) and its delivery.

    kill:node=1@iter=12                  SIGKILL every process of node 1 at iteration 12
    kill:rank=5@iter=7,phase=optimizer   SIGKILL rank 5 during its optimizer step
    slow:node=2@iter=4,factor=3          a kind's own parameter (``factor=``)
    poweroff:domain=0@iter=6             every node of failure domain 0 at once (the domains
                                         of ``--deadpool-failure-domains``: a rack, a switch)
    stop:node=2@t=30                     unstaged: 30 s after training began, from outside

The kinds are ``KINDS``, one ``FaultKind`` entry each: its parameters, its signal sequence
(or, empty, an action in the rank), where it can be delivered and its one-line help; the
parser, the validation, both deliveries, ``deadpool launch --help`` and docs/usage.md's list
read it.

    iteration:  ... | forward_backward | optimizer | mirror | ... next iteration
                          ^ default        ^              ^  (phase= picks the point)

    recovery from a failure seen while running iteration N: abort | rendezvous | rebuild
    | restore_state | ...       (rendezvous/restore_state at iter=N: a failure during a
                                 recovery, to test cascades)

The launcher parses and validates the ``--inject`` specs once and passes the schedule to every
worker (``base/worker_env.py``). ``Fault.index`` (its position) is the fault's unique id.

Delivery (:class:`FaultPoints`, in the worker): the first process at a fault's point claims
and reports it. A rank fault's victim signals itself at once when its kind sends one signal
(in the optimizer step after a seeded sub-millisecond delay: a torn step). Otherwise
(``Fault.by_agent``: a node fault, or a sequence a stopped process could not finish) the
victim waits while its agent signals, as a real node loss takes a whole node in one pass
(``launch/``, which also delivers ``@t=S`` faults and the waits of a sequence); detection
has no injected case (``procs.py: window_over``).
"""

from __future__ import annotations

import json
import os
import random
import signal as _signal
import textwrap
import threading
import time
from dataclasses import asdict, dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

from .errors import ConfigError
from .vocabulary import FAULT_PHASES, Phase, ValueEnum

NODE_SIGNAL_WAIT_S = 10.0  # a victim that waits for its agent, then it signals itself


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


class Target(ValueEnum):
    """What a fault hits (``kind:node=N``, ``kind:rank=N`` or ``kind:domain=D``). A domain
    is a node fault on every node of the domain in one instant; a kind that can hit a node
    can hit a domain."""

    NODE = "node"
    RANK = "rank"
    DOMAIN = "domain"


@dataclass(frozen=True)
class Param:
    """A number a kind takes (``name=V`` after the ``@``); it must be at least ``low``
    (``strict``: above it). ``default`` None: the spec must give it."""

    name: str
    symbol: str  # its letter in the help: factor=F
    low: float
    strict: bool = False
    default: Optional[float] = None

    def rule(self) -> str:
        return f"{self.symbol} {'>' if self.strict else '>='} {self.low:g}"

    def valid(self, v) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and (
            v > self.low if self.strict else v >= self.low)

    def help(self) -> str:
        default = "" if self.default is None else f", default {self.default:g}"
        return f"{self.name}={self.symbol}, {self.rule()}{default}"


@dataclass(frozen=True)
class Wait:
    """A pause in a kind's signal sequence: as many seconds as its parameter ``param``."""

    param: str


Step = Union[str, Wait]  # a signal's name ("SIGKILL") or a pause


@dataclass(frozen=True)
class FaultKind:
    """One kind of fault, the only place a kind is described. ``sequence``: the signals it
    sends (and the pauses between them), to the process that reaches the point or, for
    ``Fault.by_agent``, through the victims' agents; empty: an action the worker binds by
    ``name`` (``actions`` of :class:`FaultPoints`: ``recovery/fault_points.py``)."""

    name: Kind
    what: str  # its one-line help
    sequence: Tuple[Step, ...] = ()
    params: Tuple[Param, ...] = ()
    targets: Tuple[Target, ...] = (Target.NODE, Target.RANK)  # where it can be delivered
    timed: bool = False       # may also fire at a wall-clock time (@t=S), from outside
    claimed: bool = True      # fires once in the job, on the first target to reach it
    #                           (False: on every rank it targets)
    power_off: bool = False   # its node's agent dies with the last signal (no exit reported)

    def __post_init__(self) -> None:
        names = {p.name for p in self.params}
        steps_ok = all(isinstance(s, str) or s.param in names for s in self.sequence)
        if not steps_ok or (self.sequence and not isinstance(self.sequence[0], str)) or (
                self.timed and not self.sequence):
            raise ValueError(f"fault kind {self.name}: a sequence starts with a signal, waits "
                             "for one of its params, and only a signal kind is timed")

    def signals(self) -> Tuple[str, ...]:
        return tuple(s for s in self.sequence if isinstance(s, str))

    def param(self, name: str) -> Optional[Param]:
        return next((p for p in self.params if p.name == name), None)

    def terms(self) -> str:
        """Its signals, where it can be delivered and its parameters, in words."""
        terms = [", ".join(s if isinstance(s, str) else f"wait {s.param} s"
                           for s in self.sequence)] if self.sequence else []
        if self.targets == (Target.NODE,):
            terms.append("node or domain only")
        elif len(self.targets) == 1:
            terms.append(f"{self.targets[0]} only")
        if not self.timed:
            terms.append("@iter only")
        return "; ".join(terms + [p.help() for p in self.params])

    def line(self) -> str:
        """Its one-line help: ``name (terms): what``."""
        return f"{self.name} ({self.terms()}): {self.what}"


KINDS: Dict[Kind, FaultKind] = {k.name: k for k in (
    FaultKind(Kind.KILL, "the process dies", ("SIGKILL",), timed=True),
    FaultKind(Kind.STOP, "the process hangs; the heartbeat timeout finds it, then it is fenced",
              ("SIGSTOP",), timed=True),
    FaultKind(Kind.TERM, "the process is asked to stop", ("SIGTERM",), timed=True),
    FaultKind(Kind.SEGV, "the process crashes", ("SIGSEGV",), timed=True),
    FaultKind(Kind.POWEROFF, "the node loses power: its agent and every process die at once, "
              "no exit is reported, the heartbeats find the loss and the whole node goes in "
              "one plan", ("SIGKILL",), targets=(Target.NODE,), timed=True, power_off=True),
    FaultKind(Kind.RAISE, "an exception in the rank's step: a local error, the job must fail "
              "fast", claimed=False),
    FaultKind(Kind.DROP, "the rank rejects every mirror copy it receives from then on: "
              "nothing fails, the run must say it is unprotected", targets=(Target.RANK,)),
    FaultKind(Kind.IMPOSTOR, "the rank starts a client without the job secret that knocks on "
              "every mirror listener; they must refuse it (mirror/impostor.py)",
              targets=(Target.RANK,)),
    FaultKind(Kind.DRAIN, "a drain of the node is requested, the path of `deadpool drain` "
              "(planned-swaps.md): its ranks move to spares"),
    FaultKind(Kind.SLOW, "every targeted process burns (F - 1) x its own compute per "
              "iteration from then on: a straggler", params=(Param("factor", "F", 1.0, True),),
              claimed=False),
)}


def kinds_doc() -> str:
    """docs/usage.md's list of the kinds, an item each (a test compares the two)."""
    return "\n".join(textwrap.fill(f"`{k.name}` ({k.terms()}): {k.what}.", 92,
                                    initial_indent="  * ", subsequent_indent="    ",
                                    break_long_words=False, break_on_hyphens=False)
                      for k in KINDS.values())


PHASES = tuple(p.value for p in FAULT_PHASES)
PARAMS: Dict[str, Param] = {p.name: p for k in KINDS.values() for p in k.params}
OPTIONS = ("iter", "phase", "t", *PARAMS)  # what may follow the '@'
FORM = (f"{'|'.join(KINDS)}:node=N|rank=N|domain=D@iter=N[,phase={'|'.join(PHASES)}]"
        + "".join(f"[,{p.name}={p.symbol}]" for p in PARAMS.values())
        + " or ...@t=SECONDS (unstaged, from outside)")
TARGETS = tuple(t.value for t in Target)
TARGET_WORDS = {Target.NODE: "a node", Target.RANK: "one rank",
                Target.DOMAIN: "a failure domain"}
Params = Tuple[Tuple[str, float], ...]


class InjectedLocalError(RuntimeError):
    """What a ``raise`` fault throws inside the rank's step (not a communication failure)."""


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass(frozen=True)
class Fault:
    """One fault: ``kind`` on a node, a rank or a failure domain (exactly one of them) at
    ``iteration`` in ``phase``; ``index`` is its position in the schedule. A domain fault's
    ``nodes`` are the domain's nodes, filled in by :func:`resolve_domains` at launch."""

    kind: Kind
    iteration: int
    node: Optional[int] = None
    rank: Optional[int] = None
    domain: Optional[str] = None
    nodes: Tuple[int, ...] = ()
    phase: Phase = Phase.FORWARD_BACKWARD
    index: int = 0
    at_s: Optional[float] = None  # unstaged: seconds after training began, not a fault point
    params: Params = ()  # its kind's parameters, (name, value) in the kind's order

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ConfigError(f"fault kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        object.__setattr__(self, "kind", Kind(self.kind))  # JSON and specs give the value
        if self.phase not in PHASES:
            raise ConfigError(f"fault phase must be one of {', '.join(PHASES)}, "
                              f"got {self.phase!r}")
        object.__setattr__(self, "phase", Phase(self.phase))  # JSON gives the value
        given = [t for t, v in ((Target.NODE, self.node), (Target.RANK, self.rank),
                                (Target.DOMAIN, self.domain)) if v is not None]
        if len(given) != 1:
            raise ConfigError(f"a fault targets exactly one of node, rank or domain, got "
                              f"node={self.node!r} rank={self.rank!r} domain={self.domain!r}")
        if self.domain is not None and (not isinstance(self.domain, str) or not self.domain):
            raise ConfigError(f"fault domain must be a name, got {self.domain!r}")
        object.__setattr__(self, "nodes", tuple(self.nodes))  # JSON gives a list
        if not all(_is_int(n) for n in self.nodes):
            raise ConfigError(f"fault nodes must be integers, got {self.nodes!r}")
        kind = KINDS[self.kind]
        target = given[0]
        if target not in kind.targets and not (target is Target.DOMAIN
                                               and Target.NODE in kind.targets):
            only = kind.targets[0]
            raise ConfigError(f"a '{self.kind}' fault targets {TARGET_WORDS[only]} "
                              f"({self.kind}:{only}=N@iter=N)")
        if self.at_s is not None:
            if not kind.timed:
                raise ConfigError(f"a '{self.kind}' fault runs inside the rank: it needs @iter=N")
            if not isinstance(self.at_s, (int, float)) or self.at_s < 0:
                raise ConfigError(f"fault time must be >= 0 seconds, got {self.at_s!r}")
        object.__setattr__(self, "params", self._checked_params(kind))
        for name in ("iteration", "index", "node", "rank"):
            v = getattr(self, name)
            if v is not None and not _is_int(v):
                raise ConfigError(f"fault {name} must be an integer, got {v!r}")

    def _checked_params(self, kind: FaultKind) -> Params:
        """The kind's parameters in its order, defaults filled in (JSON gives lists)."""
        try:
            given = dict(self.params)
        except (TypeError, ValueError):
            raise ConfigError(f"fault params must be (name, value) pairs, "
                              f"got {self.params!r}") from None
        for name in given:
            if kind.param(name) is None:
                raise ConfigError(f"a '{self.kind}' fault takes no {name}=")
        out = []
        for p in kind.params:
            v = given.get(p.name, p.default)
            if not p.valid(v):
                raise ConfigError(f"a '{self.kind}' fault needs {p.name}={p.symbol} with "
                                  f"{p.rule()}, got {v!r}")
            out.append((p.name, v))
        return tuple(out)

    def param(self, name: str) -> float:
        """The value of its kind's parameter ``name`` (e.g. ``slow``'s ``factor``)."""
        return dict(self.params)[name]

    @property
    def by_agent(self) -> bool:
        """Whether the victims' agents send its signals: a node fault (the node in one pass),
        an unstaged one, or a sequence a stopped or dead victim could not finish itself."""
        sequence = KINDS[self.kind].sequence
        return bool(sequence) and (self.rank is None or self.at_s is not None
                                   or len(sequence) > 1)

    def signal_times(self) -> List[Tuple[float, str]]:
        """Its kind's signals, each with its offset in seconds from the first (the waits)."""
        out, offset = [], 0.0
        for step in KINDS[self.kind].sequence:
            if isinstance(step, Wait):
                offset += self.param(step.param)
            else:
                out.append((offset, step))
        return out

    def targets(self, rank: int, node: int) -> bool:
        """Whether a worker with global ``rank`` running on ``node`` is hit by this fault."""
        if self.domain is not None:
            return node in self.nodes
        if self.node is not None:
            return self.node == node
        return self.rank == rank

    def where(self) -> str:
        """Its target in words: ``node 1``, ``rank 5``, ``domain 0 (nodes 0, 1)``."""
        if self.domain is not None:
            return f"domain {self.domain} (nodes {', '.join(map(str, self.nodes))})"
        return f"node {self.node}" if self.node is not None else f"rank {self.rank}"

    def describe(self) -> str:
        """The spec form of this fault (``parse_fault(f.describe()) == f`` up to index and
        a domain's resolved nodes)."""
        target = (f"domain={self.domain}" if self.domain is not None else
                  f"node={self.node}" if self.node is not None else f"rank={self.rank}")
        params = "".join(f",{name}={v:g}" for name, v in self.params)
        if self.at_s is not None:
            return f"{self.kind}:{target}@t={self.at_s:g}{params}"
        phase = "" if self.phase is Phase.FORWARD_BACKWARD else f",phase={self.phase.value}"
        return f"{self.kind}:{target}@iter={self.iteration}{phase}{params}"


def _bad(spec: str, what: str) -> ConfigError:
    return ConfigError(f"bad --inject spec {spec!r}: {what}; expected {FORM}")


def _int(spec: str, name: str, text: str) -> int:
    if not text.isdigit() or not text.isascii():
        raise _bad(spec, f"{name} must be a non-negative integer, got {text!r}")
    return int(text)


def _options(spec: str, tail: str) -> Dict[str, str]:
    """The ``key=value`` items after the ``@``, each one of ``OPTIONS`` and given once."""
    allowed = ", ".join(f"{o}=" for o in OPTIONS[:-1]) + f" and {OPTIONS[-1]}="
    fields: Dict[str, str] = {}
    for item in tail.split(","):
        key, eq, val = item.partition("=")
        if not eq or key not in OPTIONS:
            raise _bad(spec, f"unknown option {item!r} ({allowed} are allowed)")
        if key in fields:
            raise _bad(spec, f"{key}= given twice")
        fields[key] = val
    return fields


def _params(spec: str, fields: Dict[str, str]) -> Params:
    """The kinds' parameters given in the spec (which the kind takes: ``Fault`` checks)."""
    out = []
    for name in PARAMS:
        if name in fields:
            try:
                out.append((name, float(fields[name])))
            except ValueError:
                raise _bad(spec, f"{name} must be a number, got {fields[name]!r}") from None
    return tuple(out)


def parse_fault(spec: str, index: int = 0) -> Fault:
    """Parse one ``--inject`` spec; raises :class:`ConfigError` (one line) when malformed."""
    if not isinstance(spec, str):
        raise ConfigError(f"bad --inject spec {spec!r}: not a string; expected {FORM}")
    head, at, tail = spec.strip().partition("@")
    if not at:
        raise _bad(spec, "missing '@iter=N'")
    kind, colon, target = head.partition(":")
    if not colon:
        raise _bad(spec, "missing ':' after the kind")
    if kind not in KINDS:
        raise _bad(spec, f"kind must be one of {', '.join(KINDS)}, got {kind!r}")
    tkey, eq, tval = target.partition("=")
    if not eq or tkey not in TARGETS:
        raise _bad(spec, f"target must be node=N, rank=N or domain=D, got {target!r}")
    node = rank = domain = None
    if tkey == Target.DOMAIN:
        if not tval or not all(c.isalnum() or c in "-_." for c in tval):
            raise _bad(spec, f"domain must be a name (letters, digits, '-', '_', '.'), "
                             f"got {tval!r}")
        domain = tval
    elif tkey == Target.NODE:
        node = _int(spec, tkey, tval)
    else:
        rank = _int(spec, tkey, tval)
    fields = _options(spec, tail)
    if "t" in fields:
        if "iter" in fields or "phase" in fields:
            raise _bad(spec, "t= (a wall-clock instant) excludes iter= and phase=")
        try:
            at_s = float(fields["t"])
        except ValueError:
            raise _bad(spec, f"t must be a number of seconds, got {fields['t']!r}") from None
        return Fault(kind=kind, iteration=0, node=node, rank=rank, domain=domain, index=index,
                     at_s=at_s, params=_params(spec, fields))
    if "iter" not in fields:
        raise _bad(spec, "missing 'iter=N' after '@'")
    iteration = _int(spec, "iter", fields["iter"])
    phase = fields.get("phase", Phase.FORWARD_BACKWARD.value)
    if phase not in PHASES:
        raise _bad(spec, f"phase must be one of {', '.join(PHASES)}, got {phase!r}")
    return Fault(kind=kind, iteration=iteration, node=node, rank=rank, domain=domain,
                 phase=phase, index=index, params=_params(spec, fields))


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


def resolve_domains(faults: Sequence[Fault], domain_of: Optional[Callable[[int], object]],
                    total_nodes: int) -> List[Fault]:
    """The schedule with each domain fault's ``nodes`` filled in: the nodes among
    ``0..total_nodes-1`` whose domain (``domain_of``, from ``--deadpool-failure-domains``)
    is named as the fault names it. Refused when no domains are given or none matches."""
    from dataclasses import replace

    out = []
    for f in faults:
        if f.domain is not None:
            where = f"--inject {f.describe()}"
            if domain_of is None:
                raise ConfigError(f"{where}: a domain fault needs --deadpool-failure-domains "
                                  "in the trainer flags")
            nodes = tuple(n for n in range(total_nodes) if str(domain_of(n)) == f.domain)
            if not nodes:
                names = sorted({str(domain_of(n)) for n in range(total_nodes)})
                raise ConfigError(f"{where}: no node is in domain {f.domain!r} (the domains "
                                  f"are {', '.join(names)})")
            f = replace(f, nodes=nodes)
        out.append(f)
    return out


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
    ``actions``: what each kind without a signal sequence does in this worker, by the
    ``name`` of its ``KINDS`` entry."""

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
            if f.by_agent:
                self._await_agent(f, getattr(_signal, kind.signals()[0]))
            elif kind.sequence:  # one signal, sent by the victim itself
                self._signal(f, getattr(_signal, kind.signals()[0]), phase)
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

    def _await_agent(self, f: Fault, sig: int) -> None:
        """The agent sends the signals (to the whole node, this process included, in one
        pass for a node fault); ``sig`` is the first of them."""
        time.sleep(NODE_SIGNAL_WAIT_S)
        self.kill(sig)  # no agent pass came: the fault still lands

    def _raise_local(self, f: Fault, iteration: int) -> None:
        raise InjectedLocalError(
            f"injected local error on rank {self.rank()} at iteration {iteration}")
