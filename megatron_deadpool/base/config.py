"""DeadPool configuration: one validated dataclass plus the argparse group that the
reference trainer and the Megatron-LM patch share (``--deadpool*`` flags)."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Tuple, Type, TypeVar

from .errors import ConfigError
from .sections import SECTION_TIMEOUTS_S, Section, checked_timeouts, parse_section_timeouts
from .vocabulary import ValueEnum

# Each choice of a ``--deadpool-*`` flag is one enum: its values are the flag's choices, and
# ``DeadpoolConfig`` holds its members (a ``str`` enum: a member equals its value). The mirror
# transport is the exception: its choices are the transport registry's names
# (mirror/transport.py), held as a name.


class Audit(ValueEnum):
    """``--deadpool-audit``: what proves, after a rebuild, that no old group is reachable."""

    NONE = "none"
    WALK = "walk"  # re-walk the attached objects (recovery/rebind.py)
    FULL = "full"  # also scan the whole heap


class OnNoSpare(ValueEnum):
    """``--deadpool-on-no-spare``: what a failure with no spare left does."""

    FAIL = "fail"  # stop the job, naming the last committed iteration
    WAIT = "wait"  # wait for a spare to join (``deadpool launch --join-as-spare``)


class DrainSource(ValueEnum):
    """``--deadpool-drain-source``: where a drained node's ranks take their state from
    (mirror/handoff.py)."""

    DIRECT = "direct"  # the draining process (the buddy's copy if that fails)
    BUDDY = "buddy"    # the buddy's copy


class GradStats(ValueEnum):
    """``--deadpool-grad-stats``: how megatron-core's grad stats of every rank (the grad
    norm, the zeros count, found-inf; one distributed-optimizer instance) are reduced."""

    WORLD = "world"    # megatron's group of every rank: bitwise to the unpatched script
    STAGED = "staged"  # the model-parallel then the data-parallel group (adapters/groups.py)


_Choice = TypeVar("_Choice", bound=ValueEnum)


def values(choice: Type[ValueEnum]) -> Tuple[str, ...]:
    """A choice's values, in declaration order (a flag's ``choices``)."""
    return tuple(m.value for m in choice)


def parse_choice(choice: Type[_Choice], value: object, flag: str) -> _Choice:
    """``value`` (a member or its value) as a member of ``choice``; ConfigError naming
    ``flag`` and the values otherwise."""
    try:
        return choice(value)
    except ValueError:
        raise ConfigError(f"{flag} must be one of {values(choice)}, got {value!r}") from None


def replicas_refusal(k: object, name: str = "--deadpool-replicas", least: int = 0,
                     most: Optional[int] = None, nodes: Optional[int] = None,
                     spare_nodes: int = 0) -> Optional[str]:
    """The one rule of K, the buddy copies of each rank's state: None when ``k`` keeps it,
    else why not, naming K as the caller's user knows it (``name``).

    K is an integer >= 0. K = 0 keeps only each rank's local double-buffered snapshot: no
    copy a spare could restore from, so no spare nodes. K >= 1 puts each copy on another
    node, so the job needs K + 1 nodes. Context narrows it: the placement, which is only
    asked for buddies, gives ``least=1``; the capacity planner, whose table covers K = 1 and
    2, gives ``least`` and ``most``; ``nodes`` and ``spare_nodes`` where they are known."""
    if isinstance(k, bool) or not isinstance(k, int) or k < least or (
            most is not None and k > most):
        bound = f">= {least}" if most is None else f"in {least}..{most}"
        return f"{name} must be an integer {bound}, got {k!r}"
    if k == 0 and spare_nodes > 0:
        return (f"{name} 0 keeps only each rank's local snapshot (no buddy copy), so no spare "
                "could restore a dead rank's state: it cannot be combined with --spare-nodes "
                f"{spare_nodes}; use {name} >= 1 for fault tolerance")
    if nodes is not None and nodes < k + 1:
        return (f"{name}: {k} replica(s) need at least {k + 1} nodes (each copy on another "
                f"node), the job has {nodes} node(s)")
    return None


@dataclass(frozen=True)
class DeadpoolConfig:
    """Validated up front; cross-field invariants are checked in ``__post_init__``."""

    enabled: bool = False
    replicas: int = 1
    heartbeat_interval_s: float = 0.5
    heartbeat_timeout_s: float = 5.0
    progress_timeout_s: float = 300.0
    rendezvous_timeout_s: float = 120.0
    collective_timeout_s: float = 600.0
    events_path: Optional[str] = None
    audit: Audit = Audit.WALK
    max_local_restarts: int = 0
    # pre-started standby processes per active node that take a crashed rank of that node
    # (with --deadpool-max-local-restarts); 0: a local restart starts a process cold
    local_standby: int = 1
    on_no_spare: OnNoSpare = OnNoSpare.FAIL
    spare_wait_timeout_s: float = 600.0
    # survivors wait this long for a promoted spare to build its model before the restore
    spare_ready_timeout_s: float = 600.0
    fallback_save_dir: Optional[str] = None
    fallback_every: int = 0
    resume_dir: Optional[str] = None
    # a name in the mirror transport registry (mirror/transport.py), the flag's choices;
    # checked there, where the names are known (control/link.py's MirrorSettings)
    mirror_transport: str = "socket"
    # a drain's moved ranks take their state from the buddy's copy ("buddy", measured the
    # faster: docs/planned-swaps.md) or from the draining rank ("direct"): mirror/handoff.py
    drain_source: DrainSource = DrainSource.BUDDY
    # --deadpool-straggler-swap FACTOR:WINDOW: a node whose ranks' compute time per
    # iteration stays above FACTOR x the median for WINDOW iterations is drained
    straggler_swap: Optional[Tuple[float, int]] = None
    count_work: bool = False  # --deadpool-count-work: base/counts.py, bench recovery --counts
    # --deadpool-rebuild-all-groups: a recovery on a gloo world makes every group again
    # instead of keeping those the failure did not break (recovery/repair.py)
    rebuild_all_groups: bool = False
    # --deadpool-grad-stats staged: no group of every rank is made, at the build or at any
    # recovery (issue 57); the grad norm's sum is rounded in the two stages' order
    grad_stats: GradStats = GradStats.WORLD
    # --deadpool-failure-domains blocks:N | file:PATH: each rank's buddies in other failure
    # domains than its own (mirror/placement.py); "": every node its own domain (the ring)
    failure_domains: str = ""
    # startup/save/eval/data -> seconds (STEP's is progress_timeout_s); defaults filled in
    section_timeouts_s: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self):
        why = replicas_refusal(self.replicas)
        if why:
            raise ConfigError(why)
        for name in ("heartbeat_interval_s", "heartbeat_timeout_s", "progress_timeout_s",
                     "rendezvous_timeout_s", "collective_timeout_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{_flag(name)} must be > 0, got {getattr(self, name)}")
        if not self.heartbeat_interval_s * 2 <= self.heartbeat_timeout_s:
            raise ConfigError(
                "--deadpool-heartbeat-timeout must be at least twice --deadpool-heartbeat-interval "
                f"({self.heartbeat_timeout_s} < 2 x {self.heartbeat_interval_s})")
        if not self.heartbeat_timeout_s < self.progress_timeout_s:
            raise ConfigError("--deadpool-heartbeat-timeout must be smaller than "
                              "--deadpool-progress-timeout (soft < hard)")
        if not self.heartbeat_timeout_s < self.rendezvous_timeout_s:
            raise ConfigError("--deadpool-heartbeat-timeout must be smaller than "
                              "--deadpool-rendezvous-timeout")
        if not self.rendezvous_timeout_s <= self.collective_timeout_s:
            raise ConfigError("--deadpool-rendezvous-timeout must not exceed "
                              "--deadpool-collective-timeout")
        if self.max_local_restarts < 0:
            raise ConfigError(f"--deadpool-max-local-restarts must be >= 0, got "
                              f"{self.max_local_restarts}")
        if self.local_standby < 0:
            raise ConfigError(f"--deadpool-local-standby must be >= 0, got {self.local_standby}")
        self._parse("on_no_spare", OnNoSpare)
        if not self.spare_ready_timeout_s > 0:
            raise ConfigError("--deadpool-spare-ready-timeout must be > 0, got "
                              f"{self.spare_ready_timeout_s}")
        if not self.spare_wait_timeout_s > 0:
            raise ConfigError("--deadpool-spare-wait-timeout must be > 0, got "
                              f"{self.spare_wait_timeout_s}")
        if self.fallback_every < 0:
            raise ConfigError(f"--deadpool-fallback-every must be >= 0, got {self.fallback_every}")
        if self.fallback_every and not self.fallback_save_dir:
            raise ConfigError("--deadpool-fallback-every needs --deadpool-fallback-save DIR")
        self._parse("drain_source", DrainSource)
        self._parse("grad_stats", GradStats)
        if self.straggler_swap is not None and not (
                self.straggler_swap[0] > 1 and self.straggler_swap[1] >= 1):
            raise ConfigError("--deadpool-straggler-swap FACTOR:WINDOW needs FACTOR > 1 and "
                              f"WINDOW >= 1, got {self.straggler_swap}")
        self._parse("audit", Audit)
        object.__setattr__(self, "section_timeouts_s", checked_timeouts(
            self.section_timeouts_s, self.heartbeat_timeout_s))

    def _parse(self, name: str, choice: Type[ValueEnum]) -> None:
        """The field ``name`` as a member of ``choice`` (given a member or its value, from
        argparse, keywords or JSON alike): parsed once, here."""
        object.__setattr__(self, name, parse_choice(choice, getattr(self, name), _flag(name)))

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "DeadpoolConfig":
        return cls(
            enabled=bool(getattr(args, "deadpool", False)),
            replicas=args.deadpool_replicas,
            heartbeat_interval_s=args.deadpool_heartbeat_interval,
            heartbeat_timeout_s=args.deadpool_heartbeat_timeout,
            progress_timeout_s=args.deadpool_progress_timeout,
            rendezvous_timeout_s=args.deadpool_rendezvous_timeout,
            collective_timeout_s=args.deadpool_collective_timeout,
            events_path=args.deadpool_events,
            audit=args.deadpool_audit,
            max_local_restarts=getattr(args, "deadpool_max_local_restarts", 0),
            local_standby=getattr(args, "deadpool_local_standby", 1),
            on_no_spare=getattr(args, "deadpool_on_no_spare", OnNoSpare.FAIL),
            spare_wait_timeout_s=getattr(args, "deadpool_spare_wait_timeout", 600.0),
            spare_ready_timeout_s=getattr(args, "deadpool_spare_ready_timeout", 600.0),
            fallback_save_dir=getattr(args, "deadpool_fallback_save", None),
            fallback_every=getattr(args, "deadpool_fallback_every", 0),
            resume_dir=getattr(args, "deadpool_resume", None),
            mirror_transport=getattr(args, "deadpool_mirror_transport", "socket"),
            drain_source=getattr(args, "deadpool_drain_source", DrainSource.BUDDY),
            straggler_swap=parse_straggler_swap(getattr(args, "deadpool_straggler_swap", None)),
            count_work=bool(getattr(args, "deadpool_count_work", False)),
            rebuild_all_groups=bool(getattr(args, "deadpool_rebuild_all_groups", False)),
            grad_stats=getattr(args, "deadpool_grad_stats", GradStats.WORLD),
            failure_domains=getattr(args, "deadpool_failure_domains", None) or "",
            section_timeouts_s=parse_section_timeouts(
                getattr(args, "deadpool_section_timeouts", None) or ""),
        )

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @property
    def standbys_per_node(self) -> int:
        """Warm standby processes each active node starts (only with local restarts)."""
        return self.local_standby if self.enabled and self.max_local_restarts > 0 else 0

    @property
    def take_plan_timeout_s(self) -> float:
        """How long a member of a newly published generation may take to reach its plan
        (abort, quiesce, destroy) before the decider fences it as hung: well inside the
        rendezvous timeout, so the others never wait that out."""
        return max(10.0, self.rendezvous_timeout_s / 4)

    @property
    def gloo_op_timeout_s(self) -> float:
        """The deadline of one gloo operation on the mirror's group, and on every training
        group when the backend is gloo (CPU). gloo never wakes a send that was queued on a
        connection when that connection fails (tcp::Pair::signalException signals the
        queued ops' ``buf`` but not their ``ubuf``): the sender waits out its deadline, and
        the process reaches its plan only after that. So the deadline stays well inside the
        time the decider gives a member to take its plan (half of it)."""
        return self.take_plan_timeout_s / 2

    @property
    def regroup_timeout_s(self) -> float:
        """The bound on forming a recovery generation's communicators (``init_process_group``
        and every ``new_group`` of the replayed ``initialize_model_parallel``): a store wait
        no abort reaches, so, like a gloo operation, it must end well inside the take-plan
        fence. The same bound, derived in one place."""
        return self.gloo_op_timeout_s

    def decider(self) -> "DeciderConfig":
        """The decider's settings, derived (never repeated)."""
        return DeciderConfig(heartbeat_timeout_s=self.heartbeat_timeout_s,
                             progress_timeout_s=self.progress_timeout_s,
                             section_timeouts_s=dict(self.section_timeouts_s),
                             heartbeat_interval_s=self.heartbeat_interval_s,
                             starting_spare_wait_s=min(30.0, self.rendezvous_timeout_s / 2),
                             max_local_restarts=self.max_local_restarts,
                             local_restart_wait_s=self.rendezvous_timeout_s / 2,
                             take_plan_timeout_s=self.take_plan_timeout_s,
                             spare_wait_s=(self.spare_wait_timeout_s
                                           if self.on_no_spare is OnNoSpare.WAIT else 0.0),
                             straggler_swap=self.straggler_swap)


@dataclass(frozen=True)
class DeciderConfig:
    """What the decider needs; made by :meth:`DeadpoolConfig.decider` (tests build it
    directly with short timeouts)."""

    heartbeat_timeout_s: float = 5.0
    progress_timeout_s: float = 300.0
    heartbeat_interval_s: float = 0.5
    grace_s: float = 0.3  # after the first death: collect the rest of the node
    # A failure with no idle spare waits this long for spares that are still starting
    # (e.g. replacements the launcher just started) before the job stops.
    starting_spare_wait_s: float = 30.0
    # A rank whose process crashed on a healthy node is restarted in place (up to this many
    # times per rank) instead of taking a spare node.
    max_local_restarts: int = 0
    # A process restarted in place starts cold (imports, model build): the plan waits this
    # long for it to register before the rank takes a spare instead.
    local_restart_wait_s: float = 60.0
    # --deadpool-on-no-spare wait: a failure with no spare waits this long for a spare to
    # join (``deadpool launch --join-as-spare``); 0: stop at once.
    spare_wait_s: float = 0.0
    # A member of the newest generation that has not taken its plan this long after it was
    # published is hung (e.g. blocked where the abort did not reach): it is fenced.
    take_plan_timeout_s: float = 30.0
    straggler_swap: Optional[Tuple[float, int]] = None  # (FACTOR, WINDOW): straggler.py
    # startup/save/eval/data -> seconds; STEP's timeout is progress_timeout_s
    section_timeouts_s: Mapping[str, float] = field(
        default_factory=lambda: dict(SECTION_TIMEOUTS_S))

    def section_timeout_s(self, section: str) -> float:
        """How long a rank in ``section`` may go without progress (an unknown or empty
        section, e.g. from an older worker, is judged as a step)."""
        if section == Section.STEP.value:
            return self.progress_timeout_s
        return self.section_timeouts_s.get(section, self.progress_timeout_s)


def _flag(field_name: str) -> str:
    return "--deadpool-" + field_name.removesuffix("_s").replace("_", "-")


def add_config_args(parser: argparse.ArgumentParser,
                    transport_arg: Callable[[Any, str], None]) -> argparse.ArgumentParser:
    """Add the ``--deadpool*`` group. ``transport_arg(group, default)`` adds
    ``--deadpool-mirror-transport``, whose choices are the transport registry's, which this
    layer does not see: callers take ``add_deadpool_args`` (megatron_deadpool/flags.py),
    which hands it in."""
    d = DeadpoolConfig()
    g = parser.add_argument_group("deadpool", "in-memory peer mirror and hot-swap recovery")
    g.add_argument("--deadpool", action="store_true",
                   help="mirror every rank's state to buddy ranks and hot-swap spares on failure")
    g.add_argument("--deadpool-replicas", type=int, default=d.replicas,
                   help="buddy copies of each rank's state, on other nodes (default "
                        "%(default)s); 0: only the local double-buffered host snapshot, no "
                        "buddy and no exchange (not fault tolerant: refused with "
                        "--spare-nodes; for measuring the device-to-host path)")
    _add_timing_args(g, d)
    g.add_argument("--deadpool-events", default=None, metavar="FILE",
                   help="append one JSON line per recovery phase to FILE")
    g.add_argument("--deadpool-audit", choices=values(Audit), default=d.audit.value,
                   help="after a rebuild, prove no old process group is reachable: 'walk' re-walks "
                        "the attached objects (fast), 'full' also scans the whole heap "
                        "(default %(default)s)")
    _add_restart_args(g, d)
    g.add_argument("--deadpool-on-no-spare", choices=values(OnNoSpare), default=d.on_no_spare.value,
                   help="a failure with no spare left: 'fail' stops the job naming the last "
                   "committed iteration; 'wait' waits for a spare to join (`deadpool launch "
                   "--join-as-spare`) (default %(default)s)")
    g.add_argument("--deadpool-spare-wait-timeout", type=float,
                   default=d.spare_wait_timeout_s, metavar="SECONDS",
                   help="with --deadpool-on-no-spare wait: how long (default %(default)s)")
    g.add_argument("--deadpool-spare-ready-timeout", type=float,
                   default=d.spare_ready_timeout_s, metavar="SECONDS",
                   help="after a failure, how long the survivors wait for a promoted spare "
                   "to build its model and optimizer before the restore; a spare that dies "
                   "meanwhile is detected by its heartbeats, not by this (default "
                   "%(default)s)")
    g.add_argument("--deadpool-fallback-save", default=None, metavar="DIR",
                   help="last resort: when a failure cannot be recovered from memory (no "
                   "spare, or a rank and all its buddies lost), the survivors write the "
                   "copies they hold to DIR and the job stops; resume with --deadpool-resume")
    g.add_argument("--deadpool-fallback-every", type=int, default=d.fallback_every,
                   metavar="N", help="also write each rank's own committed snapshot to "
                   "--deadpool-fallback-save DIR every N iterations (mirror thread, after "
                   "the commit), so that a shard whose every in-memory copy died can come "
                   "from disk; 0: only when the job stops (default %(default)s)")
    g.add_argument("--deadpool-resume", default=None, metavar="DIR",
                   help="start from the newest iteration saved in DIR for every rank "
                   "(by --deadpool-fallback-save); bitwise the run that saved it")
    transport_arg(g, d.mirror_transport)
    g.add_argument("--deadpool-count-work", action="store_true", help="count each recovery "
                   "phase's store operations too (its groups, connections and mirror traffic "
                   "are always counted): the recovery reports carry them (bench recovery)")
    _add_placement_args(g, d)
    _add_group_args(g, d)
    _add_drain_args(g, d)
    return parser


def _add_group_args(g, d: DeadpoolConfig) -> None:
    """What a recovery makes again among the process groups."""
    g.add_argument("--deadpool-rebuild-all-groups", action="store_true",
                   default=d.rebuild_all_groups, help="on a gloo (CPU) world, a recovery "
                   "makes every process group again; by default it keeps the groups the "
                   "failure did not break (no dead member, no operation in flight) and "
                   "rebuilds only the others. NCCL worlds always rebuild every group")
    g.add_argument("--deadpool-grad-stats", choices=values(GradStats),
                   default=d.grad_stats.value, help="how megatron-core's grad norm, zeros "
                   "count and found-inf are reduced over every rank: 'world', on its group "
                   "of every rank, which every recovery makes again (bitwise to the "
                   "unpatched script); 'staged', over the model-parallel then the "
                   "data-parallel group, so that no group of every rank is ever made (a "
                   "recovery at scale does not grow with the job; the grad norm's sum is "
                   "rounded in another order, bitwise to its own failure-free run) "
                   "(default %(default)s)")


def _add_placement_args(g, d: DeadpoolConfig) -> None:
    g.add_argument("--deadpool-failure-domains", default=d.failure_domains or None,
                   metavar="blocks:N|file:PATH",
                   help="each rank's buddy copies go to nodes of other failure domains (a "
                   "rack, a leaf switch: what one event takes down at once): blocks:N, N "
                   "consecutive nodes per domain; file:PATH, JSON {node: domain}. Default: "
                   "every node its own domain (the node ring)")


def _add_restart_args(g, d: DeadpoolConfig) -> None:
    """Local restarts: a crashed rank on a healthy node (membership/local_restart.py)."""
    g.add_argument("--deadpool-max-local-restarts", type=int, default=d.max_local_restarts,
                   metavar="N", help="a process that crashes on a healthy node is restarted in "
                   "its slot, up to N times per rank, instead of spending a spare node; spares "
                   "are for dead nodes (default %(default)s)")
    g.add_argument("--deadpool-local-standby", type=int, default=d.local_standby,
                   metavar="N", help="with --deadpool-max-local-restarts: N pre-started "
                   "standby processes per active node (imports done, waiting like a spare) "
                   "take a crashed rank of their node as fast as a spare takes a dead node's; "
                   "the used one is replaced in the background. 0: the crashed rank's "
                   "replacement starts cold (default %(default)s)")


def _add_drain_args(g, d: DeadpoolConfig) -> None:
    """Planned swaps (membership/drain.py)."""
    g.add_argument("--deadpool-drain-source", choices=values(DrainSource),
                   default=d.drain_source.value, help="where a drained node's ranks' state comes "
                   "from: 'buddy', the buddy's copy, or 'direct', straight from the draining "
                   "process (the buddy's copy if that fails) (default %(default)s)")
    g.add_argument("--deadpool-straggler-swap", default=None, metavar="FACTOR:WINDOW",
                   help="drain a node (a planned swap, if a spare exists) whose ranks' compute "
                   "time per iteration stays above FACTOR x the median for WINDOW iterations "
                   "(default: off)")


def parse_straggler_swap(text: Optional[str]) -> Optional[Tuple[float, int]]:
    """``"2:5"`` -> (2.0, 5); None or empty: off. Raises ConfigError on another form."""
    if not text:
        return None
    factor, colon, window = text.partition(":")
    try:
        return float(factor), int(window)
    except ValueError:
        raise ConfigError(f"--deadpool-straggler-swap takes FACTOR:WINDOW (e.g. 2:5), got "
                          f"{text!r}") from None


def _add_timing_args(g, d: DeadpoolConfig) -> None:
    """The detection and recovery deadlines of ``add_config_args``."""
    g.add_argument("--deadpool-heartbeat-interval", type=float, default=d.heartbeat_interval_s,
                   help="seconds between heartbeats (default %(default)s)")
    g.add_argument("--deadpool-heartbeat-timeout", type=float, default=d.heartbeat_timeout_s,
                   help="a process whose heartbeat is older is declared hung and fenced "
                        "(default %(default)s)")
    g.add_argument("--deadpool-progress-timeout", type=float, default=d.progress_timeout_s,
                   help="the step section's timeout: a training rank whose iteration does "
                        "not advance for this long is fenced (default %(default)s)")
    g.add_argument("--deadpool-section-timeouts", default="", metavar="NAME=S,...",
                   help="the other sections' timeouts, e.g. save=3600,eval=900 (sections: "
                        "startup, save, eval, data; default "
                        + ",".join(f"{k}={v:g}" for k, v in SECTION_TIMEOUTS_S.items())
                        + "); a rank inside one is fenced after that long without progress")
    g.add_argument("--deadpool-rendezvous-timeout", type=float, default=d.rendezvous_timeout_s,
                   help="how long recovery waits for a plan and for the new world "
                        "(default %(default)s)")
    g.add_argument("--deadpool-collective-timeout", type=float, default=d.collective_timeout_s,
                   help="process-group timeout, a last resort behind heartbeats "
                        "(default %(default)s)")
