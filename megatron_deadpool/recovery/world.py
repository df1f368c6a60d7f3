"""This process's communicators across generations: form a generation's world, replay the
model-parallel groups, abort them when the generation moves on, destroy them.

    form(plan) ──► arrive (abortable) ──► init_process_group ──► [build_groups]
        ──► set_collective_timeouts ... abort() ──► destroy()

Forming is bounded by the rendezvous timeout for generation 0 (the job's start) and by the
shorter regroup timeout for a recovery's generation (config.regroup_timeout_s): a member that
dies after the arrival barrier leaves the others blocked in a store wait that no abort can
reach, and they must reach the next plan before the decider fences them. On a gloo world
every generation forms under the gloo op deadline, because gloo's point-to-point waits keep
the creation timeout for good (``form_timeout_s``).

``abort`` may run on the watcher thread while the main thread is blocked in a collective;
the lock keeps it from racing with ``init_process_group`` publishing a new live generation.
"""

from __future__ import annotations

import contextlib

import logging
import os
import threading
from datetime import timedelta
from typing import Callable, Mapping, Optional

from ..adapters import groups
from ..base.sections import LOPSIDED_SECTIONS
from ..base.vocabulary import Event
from . import abort as ab
from . import counting, gloo_waits, repair
from .shared_groups import shared_gloo_groups

log = logging.getLogger(__name__)

# TORCH_NCCL_ASYNC_ERROR_HANDLING, read per process group by ProcessGroupNCCL (torch 2.13,
# ProcessGroupNCCL.hpp, enum ErrorHandlingMode): 0 NoHandling; 1 TearDown (abort the
# communicators, then take the process down); 2 CleanUpOnly (abort the communicators and
# raise in the thread that waits on the work; the process lives); 3 SkipCleanUp (the default
# when unset: take the process down without aborting the communicators). When a peer dies,
# the watchdog of every survivor sees the NCCL error or the timeout: under 1 or 3 it kills
# the survivor before the recovery plan arrives. 2 is the value under which a dead peer never
# takes a survivor down: the blocked collective raises, the main thread reaches the recovery
# boundary, and DeadPool's own abort (abort.py) frees whatever is still pending. A value of 1
# or 3 set by the user is overridden, with a warning. (TORCH_NCCL_ENABLE_MONITORING's heartbeat
# monitor still ends a process whose watchdog itself hangs for TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC.)
NCCL_ASYNC_ERROR_HANDLING = "2"
# the backends on which a recovery keeps the groups a failure did not break (repair.py):
# gloo only; on NCCL every communicator is aborted and every group made again (what keeping
# needs there: each communicator's in-flight work known, the abort limited to the broken)
KEEPS_GROUPS = ("gloo",)
_NCCL_ERROR_VARS = ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_ASYNC_ERROR_HANDLING")


def nccl_error_handling_env(environ) -> list:
    """Set CleanUpOnly in ``environ`` (both spellings torch reads); returns the
    (variable, old value) pairs that were overridden with another value."""
    overridden = []
    for var in _NCCL_ERROR_VARS:
        old = environ.get(var)
        if old is not None and old.strip() != NCCL_ASYNC_ERROR_HANDLING:
            overridden.append((var, old))
        environ[var] = NCCL_ASYNC_ERROR_HANDLING
    return overridden


# gloo groups are connected eagerly (a full mesh per group when it is built). With
# TORCH_GLOO_LAZY_INIT=1 (pairs connect on first use) a recovery would open no connections
# until the first step, but on torch 2.13's gloo a W=16 hot swap hung twice: after the
# peer died, a gloo_tcp_loop thread spun on a lazily connected pair and the old group's
# destructor never returned, also when the abort shut nothing lazy down (pytorch/gloo#520:
# the lazy listener's connect has no timeout; docs/benchmarks.md). Not set here.


ARRIVE_KEY = "arrived/"  # the rendezvous barrier's keys (World.meet)
ARRIVE_SLICE_S = 0.2     # how soon a member waiting at it sees a newer generation


class World:
    def __init__(self, backend: str, store_port: int, rendezvous_timeout_s: float,
                 collective_timeout_s: float, emit: Callable[..., None],
                 gloo_op_timeout_s: Optional[float] = None,
                 regroup_timeout_s: Optional[float] = None, keep_groups: bool = True,
                 secret: str = "", node_store: Optional[Callable[[int], Optional[tuple]]] = None,
                 staged_grad_stats: bool = False):
        self.backend, self.store_port = backend, store_port
        self.rendezvous_timeout_s = rendezvous_timeout_s
        self.collective_timeout_s = collective_timeout_s
        self.gloo_op_timeout_s = gloo_op_timeout_s  # config.gloo_op_timeout_s
        self.regroup_timeout_s = regroup_timeout_s  # config.regroup_timeout_s
        self._form_timeout_s = rendezvous_timeout_s  # of the generation being formed
        self._long = False  # groups at the collective timeout (set_collective_timeouts)
        self.emit = emit
        self.secret = secret  # the job's: it seals the keep votes' records (repair.settle)
        # node -> (host, port) of its record store (store.Coordinator.node_store), or None
        self.node_store = node_store
        self._records: Optional[tuple] = None  # (generation, its record_stores function)
        self._records_alive: list = []  # the last generations' record store clients
        self.mp_kwargs: Optional[dict] = None  # initialize_model_parallel's, recorded
        self.aborted = False
        self._live_gen: Optional[int] = None
        self._lock = threading.Lock()
        # what else an abort must wake: the mirror's own connections (control/link.py)
        self.on_abort: Callable[[], None] = _nothing
        # a gloo world keeps the groups a failure did not break (repair.py); with
        # keep_groups False (--deadpool-rebuild-all-groups) every group is made again
        self.keep = backend in KEEPS_GROUPS and keep_groups
        # --deadpool-grad-stats staged: megatron's grad-stats group of every rank is never
        # made (adapters/groups.py), at the first build or at any rebuild
        self.staged_grad_stats = staged_grad_stats
        self.book = repair.Book()         # the last complete build's groups
        self.plan = None                  # the plan of the generation formed last
        self.dropped: list = []           # groups no longer used, for the reaper
        self._default_sockets: set = set()
        counting.install()  # every group creation, counted (base/counts.py)
        if backend == "gloo":
            gloo_waits.install()  # a wait the socket shutdown does not reach: the abort ends it

    def also_on_abort(self, wake: Callable[[], None]) -> None:
        """What else a generation's abort must wake (any thread): e.g. the mirror's own
        connections, which are not the communicators' (control/link.py)."""
        self.on_abort = wake

    def init_process_group(self, store, gen: int, rank: int, world_size: int,
                           plan=None) -> None:
        """Bounded by ``form_timeout_s(gen)`` while the world forms (a peer that dies now
        must not hold everyone for the collective timeout); ``set_collective_timeouts``
        raises it once the groups exist. ``plan``: the plan being formed (the replay's
        votes need its processes and failed ranks). A survivor that keeps groups replaces
        only the default group (``repair.forget_default``)."""
        import torch.distributed as dist

        if self.backend == "nccl":
            for var, old in nccl_error_handling_env(os.environ):
                log.warning("%s=%s would let a dead peer take this process down; using %s "
                            "(CleanUpOnly)", var, old, NCCL_ASYNC_ERROR_HANDLING)
        self._form_timeout_s = self.form_timeout_s(gen)
        self.plan = plan
        old = self._forget_default() if self.keep and dist.is_initialized() else None
        if self.keep:
            repair.name_next(gen, repair.DEFAULT_AT)  # alike on every rank
        store = ab.generation_store(store)  # a group creation's store wait ends at the abort
        before = set(ab.socket_inodes())
        lazy = self.lazy_default(gen)
        with ab.communicator_sockets(), _gloo_lazy(lazy):  # the abort shuts these down
            dist.init_process_group(backend=self.backend, store=dist.PrefixStore(
                f"gen{gen}/", counting.generation_store(store)), rank=rank,
                world_size=world_size, timeout=timedelta(seconds=self._form_timeout_s))
        self._default_sockets = set(ab.socket_inodes()) - before
        counting.count_group(self.backend, world_size, lazy=lazy)
        if old is not None:  # a survivor: the default group is one of the dead ranks'
            repair._count_rebuilt(world_size, unsettled=False, lazy=lazy)
        with self._lock:
            self._live_gen = gen
            self.aborted = False
        gloo_waits.reopen()  # the next generation is live: its operations run (a world
        # formed again after a failed formation is never retired: formation.py)

    def lazy_default(self, gen: int) -> bool:
        """A recovery's default group (generation > 0, gloo, groups kept) opens no
        connection when it is made: gloo connects a pair of it on first use. Nothing on
        the training path uses it (megatron-core's and the trainers' collectives run on
        their own groups; docs/how-it-works.md lists its uses: a save's barriers, the end's
        digests), so a recovery no longer builds a full mesh of W - 1 connections per rank.
        Only the default group is lazy: gloo's lazy connect to a dead peer has no timeout
        (pytorch/gloo#520), and megatron's groups are the ones in use when a peer dies."""
        return self.backend == "gloo" and self.keep and gen > 0

    def _forget_default(self):
        """The old default group, out of torch's registry, its connections shut; the
        reaper takes it with the replay's dropped groups."""
        ab.shutdown_gloo_connections(self.store_port, self._default_sockets,
                                     with_store=False)
        old = repair.forget_default()
        if old is not None:
            self.dropped.append(old)
        return old

    def form_timeout_s(self, gen: int) -> float:
        """The timeout generation ``gen``'s communicators are created with. On a gloo world
        it is also the deadline of every point-to-point wait on them for their whole life
        (the pipeline's send/recv): gloo's p2p ops read the transport context's timeout, set
        at creation, which ``_set_pg_timeout`` does not change. So it never exceeds the gloo
        op deadline there, or a send that gloo never wakes (config.gloo_op_timeout_s) holds
        a survivor past the take-plan fence."""
        bounds = [self.rendezvous_timeout_s]
        if gen > 0 and self.regroup_timeout_s:
            bounds.append(self.regroup_timeout_s)
        if self.backend == "gloo" and self.gloo_op_timeout_s:
            bounds.append(self.gloo_op_timeout_s)
        return min(bounds)

    def build_groups(self, mp_kwargs: Optional[dict] = None) -> None:
        """Replay ``initialize_model_parallel`` with the recorded arguments (``mp_kwargs``:
        the first build's, recorded); each group's creation is bounded like the world's (not
        by megatron's default of 30 minutes), and roles with the same members share one gloo
        group (shared_groups.py)."""
        if mp_kwargs is not None:
            self.mp_kwargs = dict(mp_kwargs)
        kwargs = dict(self.mp_kwargs or {})
        kwargs["distributed_timeout_minutes"] = self._form_timeout_s / 60
        timeout = timedelta(minutes=kwargs["distributed_timeout_minutes"])  # megatron's own
        if not self.keep:
            with shared_gloo_groups(self.backend, timeout) as shared, \
                    ab.communicator_sockets():
                groups.initialize(self.staged_grad_stats, **kwargs)
            log.debug("model-parallel groups built; %d gloo group(s) shared", shared[0])
            return
        replay = self._replay()
        try:
            replay.settle()
            with repair.repairing(replay), shared_gloo_groups(self.backend, timeout), \
                    ab.communicator_sockets():
                groups.initialize(self.staged_grad_stats, **kwargs)
        except BaseException:
            self.book = repair.Book()  # half built: the next recovery destroys everything
            raise
        dropped = replay.dropped()
        repair.drop(dropped, self.book, self.store_port)
        self.dropped.extend(dropped)
        self.book = replay.new

    def _replay(self) -> "repair.Replay":
        """This rank's replay of megatron's groups against the last complete build."""
        import torch.distributed as dist
        from torch.distributed import distributed_c10d as c10d

        plan = self.plan
        lids = {r: lid for lid, r in plan.rank_of.items()} if plan is not None else {}
        rounds = None
        if plan is not None and plan.gen > 0:  # the first generation has nothing to keep
            from ..mirror.rounds import StoreRounds

            rounds = StoreRounds(c10d._get_default_store(), dist.get_rank(),
                                 dist.get_world_size(), self._form_timeout_s, self.secret,
                                 plan.gen, at=self.record_stores(plan), prefix="repair/")
        return repair.Replay(gen=plan.gen if plan is not None else 0, me=dist.get_rank(),
                             lids=lids, failed=set(plan.failed_ranks) if plan else set(),
                             old=self.book, rounds=rounds, new=repair.Book(lids=dict(lids)))

    def record_stores(self, plan) -> Callable[[int], object]:
        """Generation ``plan.gen``'s rank -> the store that keeps the round records that rank
        reads (mirror/rounds.py): the record store of the node that hosts the rank in this
        plan (its agent's, launch/agent.py), connected once per generation and shut at its
        abort; the generation's own store where a node published none (issue 57: the rounds
        no longer all land on the job's one store)."""
        if self._records is not None and self._records[0] == plan.gen:
            return self._records[1]
        from torch.distributed import distributed_c10d as c10d

        at = self._stores_at(plan, c10d._get_default_store(), ab.record_store_client)
        self._records = (plan.gen, at)
        return at

    def meet(self, plan, rank: int, store, moved: Callable[[], None]) -> None:
        """Before generation ``plan.gen``'s world forms, every member arrived: a round of the
        store tree on the node record stores (mirror/rounds.py ``barrier``, keys
        ``ARRIVE_KEY``), on connections of its own (the generation's are made with its
        world). No abort reaches a world not yet formed: ``moved()`` runs every
        ``ARRIVE_SLICE_S`` a wait lasts and raises GenerationMoved or JobStopped. Before
        issue 57 a counter on the job's one store, polled every 0.2 s."""
        import torch.distributed as dist

        from ..base.errors import DeadpoolError, TransportTimeout
        from ..mirror.rounds import barrier

        def connect(host, port, timeout):
            return dist.TCPStore(host, port, is_master=False, wait_for_workers=False,
                                 timeout=timeout)

        own = dist.PrefixStore(f"gen{plan.gen}/", store)
        try:
            barrier(own, rank, plan.world_size, self.rendezvous_timeout_s, self.secret, plan.gen, ARRIVE_KEY,
                    at=self._stores_at(plan, own, connect), check=moved,
                    slice_s=ARRIVE_SLICE_S)
        except TransportTimeout as exc:
            moved()
            raise DeadpoolError(f"generation {plan.gen}: {exc}") from None

    def _stores_at(self, plan, own, connect) -> Callable[[int], object]:
        """rank -> its node's record store in ``plan`` (``connect(host, port, timeout)``
        once per node, lazily), ``own`` where a node published none. The address is the
        one the signed plan carries; read from the job's store only where the plan has
        none, or when a connection to it failed."""
        import torch.distributed as dist

        clients, inner = {}, []
        timeout = timedelta(seconds=self._form_timeout_s)
        # a counting store is a Python object that torch's PrefixStore calls back into: it
        # must outlive the generation's rounds (the retired link's too), or "Not implemented"
        self._records_alive = (self._records_alive + [inner])[-6:]  # meet and rounds, 3 gens

        def at(rank: int):
            node = plan.node_of_rank[rank]
            if node not in clients:
                where = plan.node_store(node) or (self.node_store(node) if self.node_store
                                                  else None)
                if where is None:
                    clients[node] = own
                else:
                    try:
                        client = connect(*where, timeout)
                    except Exception:  # noqa: BLE001 - a kept address gone stale: read it again
                        where = self.node_store(node, fresh=True)
                        if where is None:
                            raise
                        client = connect(*where, timeout)
                    inner.append(counting.counted(client))
                    clients[node] = dist.PrefixStore(f"gen{plan.gen}/", inner[-1])
            return clients[node]
        return at

    def kept(self) -> set:
        """The ids of the groups of the last complete build (a recovery's kept ones)."""
        return {id(g) for g in self.book.groups.values()}

    def take_dropped(self) -> list:
        """The groups no longer used (the old default group, the replay's dropped ones):
        the caller hands them to the reaper."""
        out, self.dropped = self.dropped, []
        return out

    def set_collective_timeouts(self) -> None:
        """Raise every group's timeout from the rendezvous bound to the collective timeout
        (megatron's ``distributed_timeout_minutes`` if given): startup (model build, dataset
        barriers, a spare's restore) may keep ranks apart for long."""
        minutes = (self.mp_kwargs or {}).get("distributed_timeout_minutes")
        self._set_timeouts(minutes * 60 if minutes else self.collective_timeout_s)
        self._long = True

    def bound_gloo_deadlines(self) -> None:
        """Once training runs (every step calls this; it acts once per build), a gloo world's
        groups get ``gloo_op_timeout_s``: an op that gloo never wakes after a failure
        (config.gloo_op_timeout_s) must not hold this process away from recovery."""
        if self._long and self.backend == "gloo" and self.gloo_op_timeout_s:
            self._set_timeouts(self.gloo_op_timeout_s)
        self._long = False

    def enter_section(self, name: str, timeouts_s: Mapping[str, float]) -> None:
        """Section ``name`` begins. In a lopsided one (base/sections.py: a checkpoint save, a
        dataset build) on a gloo world, every group's collectives wait up to the section's
        timeout, until the next step's ``bound_gloo_deadlines``: the gloo op deadline would
        end a save's closing barrier, as a local error, on the ranks that finished writing
        first whenever another rank's writes take longer. A failure in the section still
        wakes those waits (the abort shuts their connections down)."""
        if name in LOPSIDED_SECTIONS and self.backend == "gloo" and self.gloo_op_timeout_s \
                and self._live_gen is not None:
            self._set_timeouts(max(timeouts_s[name], self.gloo_op_timeout_s))
            self._long = True

    def _set_timeouts(self, seconds: float) -> None:
        from torch.distributed import distributed_c10d as c10d

        for pg in ab.all_process_groups():
            c10d._set_pg_timeout(timedelta(seconds=seconds), pg)

    def abort(self, reason: str, rank: int, newer_than: Optional[int] = None) -> None:
        """Abort the live generation's communicators (``newer_than``: only if the live
        generation is older than that). Idempotent; safe from any thread."""
        with self._lock:
            live = self._live_gen
            if live is None or (newer_than is not None and newer_than <= live):
                return
            only = None  # every communicator's connections, unless groups may be kept:
            if self.keep and self.book.lids:  # then all but the last build's (repair.py)
                only = ab.owned_socket_inodes() - self.book.inodes()
            info = ab.abort_communicators(self.backend, self.store_port, only)
            info["gloo_waits_abandoned"] = gloo_waits.abandon_all()
            self.on_abort()
            self.aborted = True
            self._live_gen = None
        self.emit(Event.ABORT, generation=live, rank=rank, reason=reason, **info)

    def forget(self) -> None:
        """The live generation is over without an abort (it never formed, or we exit)."""
        with self._lock:
            self._live_gen = None

    def retire(self) -> None:
        """The aborted generation is over. A gloo world with a complete build forgets
        megatron's globals and keeps torch's registry (the replay decides what stays);
        otherwise everything is destroyed. gloo operations may start again (the abort
        refused them: gloo_waits.reopen)."""
        gloo_waits.reopen()
        if not (self.keep and self.book.lids):
            self.destroy()
            return
        self.forget()
        groups.forget()
        repair.unregister_others(self.kept())  # e.g. the retired link's gloo group

    def destroy(self) -> None:
        self.forget()
        self.book, self._default_sockets = repair.Book(), set()
        ab.destroy_world(aborted=self.aborted)


@contextlib.contextmanager
def _gloo_lazy(on: bool):
    """``TORCH_GLOO_LAZY_INIT`` set while one group is made (ProcessGroupGloo reads it when
    it is constructed); the variable as it was afterwards."""
    if not on:
        yield
        return
    old = os.environ.get(LAZY_VAR)
    os.environ[LAZY_VAR] = "1"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(LAZY_VAR, None)
        else:
            os.environ[LAZY_VAR] = old


LAZY_VAR = "TORCH_GLOO_LAZY_INIT"


def _nothing() -> None:
    """``World.on_abort`` until the runtime sets it."""
