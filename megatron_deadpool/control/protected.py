"""What DeadPool protects in one worker: the attached model, optimizer, scheduler and train
state, their in-memory mirror, and every holder of a process group (``rebind.GroupSlots``).
It protects and nothing else: the transport comes from the registry (mirror/transport.py),
measurement is the meter's (mirror/meter.py), fault actions are bound in
recovery/fault_points.py.

    attach ─► initial commit (first before_step) ─► after_step: snapshot ─► ...
    on recovery: quiesce ─► release_groups ─► rebind(new groups, new mirror transport)
                 ─► restore(rank)
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Optional

from ..adapters import ddp, extra_state, shard
from ..adapters import train_state as ts
from ..adapters.support import check_supported, parallel_layout, step_barrier
from ..base.errors import DeadpoolError
from ..base.vocabulary import Event, Phase
from ..mirror import handoff, meter as meters
from ..mirror.commit import RejectionBoard
from ..mirror.mirror import Mirror
from ..mirror.rounds import StoreRounds
from ..mirror.socket_transport import local_address
from ..mirror.threads import lower_thread_priority
from ..mirror.transport import GlooTransport, TransportContext, create_transport
from ..recovery import restore
from ..recovery.abort import communicator_sockets
from ..recovery.alarms import Alarms, unprotected
from ..recovery.fallback import Fallback
from ..recovery.quiet import CollectiveSuppressor
from ..recovery.reaper import Reaper
from ..recovery.rebind import GroupSlots, audit_rebind

log = logging.getLogger(__name__)
REAPER_WAIT_S = 30.0  # for the old groups to die (the heap audit, the exit)


@dataclass(frozen=True)
class MirrorSettings:
    """How this worker's mirror is built and reached (from ``DeadpoolConfig``)."""

    replicas: int = 1
    create_timeout_s: float = 600.0   # the gloo mirror group's creation (waits for all)
    op_timeout_s: float = 600.0       # each of the mirror's operations (and store rounds)
    transport: str = "socket"         # a name in the transport registry
    store_host: str = "127.0.0.1"     # a listener is published on the route toward it
    secret: Optional[str] = None      # the socket transport's handshakes, signed addresses
    job_id: int = 0                   # snapshot.job_id(secret): other jobs' copies refused
    fallback_dir: Optional[str] = None
    fallback_every: int = 0

    @property
    def transport_name(self) -> str:
        """The registered transport: the chosen one, or with no buddies the gloo group."""
        return self.transport if self.replicas else "gloo"


class Protected:
    def __init__(self, settings: MirrorSettings, meter: meters.NullMeter = meters.NO_METER,
                 emit: Callable[..., None] = lambda event, **fields: None):
        self.settings, self.meter = settings, meter
        self.fallback = Fallback(settings.fallback_dir, settings.fallback_every, settings.job_id)
        self.alarms, self._emit = Alarms(emit), emit  # mirror failures are loud (alarms.py)
        self.model = self.optimizer = self.scheduler = self.train_state = None
        self._extra: extra_state.Holders = []  # found at attach
        self.mirror: Optional[Mirror] = None
        self.slots: Optional[GroupSlots] = None
        self.reaper = Reaper()
        self._transport = self._old_transport = None
        self._rounds: Optional[StoreRounds] = None  # this generation's (connect)
        self._board: Optional[RejectionBoard] = None  # this generation's (commit.py)
        self._refused = 0  # mirror connections refused by earlier generations' listeners
        self.restored_meta: Optional[dict] = None
        self._with_cuda = self._initial_commit_pending = False
        self._suppressor: Optional[CollectiveSuppressor] = None

    def quiet_startup(self) -> None:
        """A promoted spare builds its model without talking to anyone (see quiet.py)."""
        self._suppressor = CollectiveSuppressor()
        self._suppressor.start()

    def attach(self, model, optimizer, scheduler, train_state, rank: int, world_size: int,
               with_cuda: bool, plan, fault_points) -> None:
        from megatron.core import parallel_state as ps

        if self._suppressor is not None:
            self._suppressor.stop()
        check_supported(model, optimizer)
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.train_state, self._with_cuda = train_state, with_cuda
        self._extra = extra_state.holders(model)  # TE's FP8 scaling state, if any
        self._wrap_optimizer_step(optimizer, fault_points)
        self.slots = GroupSlots([model, optimizer])
        if self.slots.unknown:
            log.warning("%s group slot(s) of unknown role: %s", len(self.slots.unknown),
                        ", ".join(self.slots.unknown[:5]))
        dp_size = ps.get_data_parallel_world_size()
        m = self.mirror = Mirror(rank, self.settings.replicas, use_cuda=with_cuda,
                                 job=self.settings.job_id, meter=self.meter)
        m.set_sources(lambda: shard.shard_tensors(optimizer, placeholders=True)
                      + shard.unreplicated_tensors(model, dp_size))
        why_not = step_barrier(optimizer)  # mirror/commit.py
        m.implicit_commit = why_not is None
        if why_not is not None and self.settings.replicas:
            log.info("mirror commits with its own collective: %s", why_not)
        m.set_hooks(fault=lambda it: fault_points(it, Phase.MIRROR),
                    committed=self.fallback.attach(m, world_size),  # e.g. periodic saves
                    copy_rejected=self.alarms.copy_rejected)
        if self._transport is None:  # initialize_model_parallel did not run through us
            self.connect(plan)
        m.set_topology(self._transport, plan.node_of_rank, self._board)
        self._initial_commit_pending = True

    def connect(self, plan) -> None:
        """This generation's mirror transport, from the registry by name. Its collectives are
        rounds on the generation's store (mirror/rounds.py: O(K) work per rank); only the
        gloo transport, whose exchange runs on it, builds a world-wide gloo group."""
        from torch.distributed import distributed_c10d as c10d

        s, store = self.settings, c10d._get_default_store()  # this generation's (world.py)
        rank, world = c10d.get_rank(), c10d.get_world_size()
        self._rounds = StoreRounds(store, rank, world, s.op_timeout_s)
        collectives = self._mirror_group() if s.transport_name == "gloo" else self._rounds
        self._transport = create_transport(s.transport_name, TransportContext(
            store, rank, world, collectives, s.store_host, s.secret, plan.gen, s.op_timeout_s))
        self._board = RejectionBoard(store)
        if self.mirror is not None:
            self.mirror.set_topology(self._transport, plan.node_of_rank, self._board)

    def _mirror_group(self) -> GlooTransport:
        """A world-wide gloo group for the gloo transport (the abort shuts it down)."""
        s, before = self.settings, meters.thread_names()
        with communicator_sockets():
            gloo = GlooTransport(timeout_s=s.op_timeout_s, create_timeout_s=s.create_timeout_s)
        tids = meters.started_threads(before, meters.GLOO_THREAD_NAMES)  # its I/O threads
        for tid in tids:
            lower_thread_priority(tid)
        self.meter.gloo_threads(tids)
        return gloo

    def _wrap_optimizer_step(self, optimizer, fault_points) -> None:
        orig = optimizer.step

        def step(*args, **kwargs):
            fault_points(self.train_state.iteration + 1, Phase.OPTIMIZER)
            with self.meter.on_main():
                self.mirror.wait()  # the snapshot of the previous step must be committed
            return orig(*args, **kwargs)

        optimizer.step = step

    def protect_groups_of(self, holders) -> None:
        """More holders of process groups, rebound like the model's (``rebind.GroupSlots``)."""
        self.slots.add(holders)

    def status(self) -> dict:
        """What heartbeats carry of it: the newest committed iteration, and the rank's own
        compute seconds per iteration (the meter's; the straggler check reads it)."""
        return {"committed": self.mirror.committed if self.mirror is not None else -1,
                "compute_s": self.meter.compute_s()}

    def progress(self, iteration: int) -> dict:
        """For ``iteration``'s progress line: the meter's lag and wait, and the commit."""
        c = self.mirror.committed
        return {**self.meter.progress(iteration), "committed": c,
                "unprotected": unprotected(iteration, c)}

    # ---------------------------------------------------------------- loop
    def before_step(self, iteration: int) -> None:
        """The first call of a fresh job commits the initial state, so that a failure in the
        very first step rolls back to a committed state too (a restored spare skips it)."""
        if self._initial_commit_pending:
            self._initial_commit_pending = False
            self.mirror.begin(iteration, dict(self._meta(iteration), initial=True))
            self.mirror.wait()  # once, before any training: a failure in step 1 finds it
            self.meter.progress(iteration)  # not a wait of step 1
            self.mirror.refresh_sources()  # the first step creates the optimizer state

    def after_step(self, iteration: int, mirror_on: bool = True) -> None:
        with self.meter.after_step(mirror_on):
            if mirror_on:
                self.alarms.step(self.mirror.rank, iteration, self.mirror.committed)
                self.mirror.begin(iteration, self._meta(iteration))

    def _meta(self, iteration: int) -> dict:
        import torch

        # Reading RNG states and counters needs no torch-function override: CPU mode's
        # device-rewriting mode would cost ~35 us of Python dispatch here, every step.
        with torch._C.DisableTorchFunction():
            meta = ts.capture(iteration, self.train_state, self.scheduler, self.optimizer,
                              with_cuda=self._with_cuda)
            meta["rng"] = ts.compact_rng(meta["rng"])
            meta["optimizer_state_empty"] = shard.optimizer_state_empty(self.optimizer)
            meta["param_groups"] = shard.group_state(self.optimizer)
            modules = extra_state.capture(self._extra)
            if modules:
                meta["module_extra_state"] = modules
        return meta

    # ---------------------------------------------------------------- recovery
    def quiesce(self, timeout_s: float) -> None:
        if self._transport is not None:
            self._transport.abort()  # wakes a mirror thread blocked on a dead peer
        if not self.mirror.quiesce(timeout_s):
            raise DeadpoolError("the mirror thread did not stop after the abort")
        self._old_transport, self._transport = self._transport, None
        self.mirror.disconnect()

    def abort_transport(self) -> None:
        """``World.on_abort`` (any thread): the transport's own sockets are not abort.py's."""
        if self._transport is not None:
            self._transport.abort()

    def release_groups(self) -> None:
        """Once the world is destroyed: the old groups still held die on the reaper thread."""
        old = self.slots.release() if self.slots is not None else []
        ddp.drop_pending(self.model or ())  # bucket handles on the dead groups: never waited
        if self._old_transport is not None:
            self._refused += getattr(self._old_transport, "refused", 0)
            old.append(self._old_transport.release())  # its gloo group dies on the reaper
        self._old_transport = None
        self.reaper.drop(old)

    def rebind(self, plan, audit: str, old_groups) -> Optional[dict]:
        """Point every holder of a group at the new generation's, the mirror at its transport
        and placement; then audit the rebind (``--deadpool-audit``): its event, or None."""
        self.slots.rebind()
        self.connect(plan)
        return audit_rebind(audit, self.slots, old_groups, self._settle_groups)

    def _settle_groups(self) -> None:
        if not self.reaper.wait(REAPER_WAIT_S):
            raise DeadpoolError(f"old process groups not destroyed in {REAPER_WAIT_S:g}s")

    def hand_off(self, gen: int, rank: int, timeout_s: float, iteration: Optional[int] = None):
        """A drain's direct path (mirror/handoff.py): send own slot ``iteration``, or receive."""
        from torch.distributed import distributed_c10d as c10d

        s, store = self.settings, c10d._get_default_store()
        args = (store, local_address(s.store_host), s.secret, gen, rank)
        if iteration is not None:
            return handoff.Sender(self.mirror, *args, iteration, timeout_s)
        restore.create_optimizer_state(self.optimizer)  # the layout a slot is checked against
        return handoff.receive(self.mirror, *args, timeout_s)

    def restore(self, rank: int) -> int:
        """Restore the newest iteration held for every rank (``restore.py``); returns it."""
        self._initial_commit_pending = False
        self.meter.restored()  # the first step after a restore waits for no snapshot
        chosen, meta = restore.execute(self.mirror, self.optimizer, self.model, rank,
                                       self._rounds)
        self._apply(meta)
        return chosen

    def resume(self, root: str, world: int) -> int:
        """``--deadpool-resume``: load the newest state every rank of this layout verifies."""
        self._initial_commit_pending = False
        chosen, meta = restore.resume(self.mirror, self.optimizer, self.model, root,
                                      parallel_layout(world))
        self._apply(meta)
        return chosen

    def _apply(self, meta: dict) -> None:
        shard.load_group_state(self.optimizer, meta["param_groups"])
        ts.apply(meta, self.train_state, self.scheduler, self.optimizer)
        extra_state.apply(self._extra, meta.get("module_extra_state", {}))
        self.restored_meta = meta

    def settle_snapshot(self) -> None:
        """A planned swap's boundary: the snapshot in flight lands at the buddies (or raises)."""
        with self.meter.on_main():
            self.mirror.wait()

    def save_fallback(self, quiesce_s: float, rank: int) -> None:
        """``--deadpool-fallback-save``: write the copies held here (an event names them)."""
        saved = self.fallback.save(self.mirror, quiesce_s)
        self._emit(Event.FALLBACK_SAVE, rank=rank, dir=self.settings.fallback_dir,
                   copies=[{"rank": r, "iteration": it, "bytes": b} for r, it, b in saved])

    # ---------------------------------------------------------------- fault actions
    def drop_arrivals(self, iteration: int) -> None:
        self.mirror.drop_arrivals(iteration)

    def start_impostor(self, start: Callable) -> None:
        start(self._transport)

    # ---------------------------------------------------------------- end
    def finish_info(self) -> dict:
        m = self.mirror
        if m is None:
            return {}
        m.wait()
        layout = m.layout
        return {**self.meter.report(m), **m.memory(),
                "mirror_bytes": layout.total_bytes if layout else 0,
                "mirror_tensor_bytes": layout.tensor_bytes if layout else 0,
                "committed": m.committed, "failed_commits": m.failed_commits,
                "rejected_copies": m.rejected_copies,
                "unprotected_steps": self.alarms.unprotected_steps,
                "mirror_commit": "implicit" if m.implicit_commit else "collective",
                "mirror_transport": getattr(self._transport, "kind", None),
                # connections that failed the socket transport's handshake (impostors)
                "mirror_refused_peers": self._refused + getattr(self._transport, "refused", 0)}

    def close(self, abort=None) -> None:
        """Stop the mirror thread; ``abort()`` first if a snapshot job still runs (blocked on a
        dead peer, a thread left in native code at exit ends in std::terminate)."""
        self.reaper.wait(REAPER_WAIT_S)
        if self.mirror is None:
            return
        if abort and not self.mirror.quiesce(0):
            abort()
            if self._transport is not None:
                self._transport.abort()  # e.g. waiting for a dead owner's connection
        self.mirror.close()
