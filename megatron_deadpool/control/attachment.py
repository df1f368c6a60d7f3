"""What DeadPool protects in one worker, for the job's whole life: the attached model,
optimizer, scheduler and train state, their in-memory mirror (the rank's own slots and the
copies it holds). It captures the state after each step and applies a restored one. How
the mirror reaches the other ranks is one generation's (``link.py``), handed in by the
runtime and the recovery steps; the holders of process groups are ``holders.py``'s.
Measurement is the meter's (mirror/meter.py); fault actions are bound in
recovery/fault_points.py.

    attach(link) ─► initial commit (first before_step) ─► after_step: capture, snapshot ...
    on recovery: quiesce ─► use(link') ─► restoring(rank, link'): agree ... load
"""

from __future__ import annotations

import logging
from typing import Callable, Optional

from ..adapters import extra_state, groups, shard
from ..adapters import train_state as ts
from ..adapters.support import check_supported, parallel_layout, step_barrier
from ..base.errors import DeadpoolError
from ..base.vocabulary import Event, Phase
from ..mirror import meter as meters
from ..mirror import placement
from ..mirror.commit import CommitTracker
from ..mirror.exchange import Rejections
from ..mirror.mirror import Mirror
from ..recovery import restore
from ..recovery.alarms import Alarms, unprotected
from ..recovery.fallback import Fallback
from .link import Link, MirrorSettings

log = logging.getLogger(__name__)


class Attachment:
    def __init__(self, settings: MirrorSettings, meter: meters.NullMeter = meters.NO_METER,
                 emit: Callable[..., None] = lambda event, **fields: None):
        self.settings, self.meter = settings, meter
        self.fallback = Fallback(settings.fallback_dir, settings.fallback_every, settings.job_id)
        self.alarms, self._emit = Alarms(emit), emit  # mirror failures are loud (alarms.py)
        self.model = self.optimizer = self.scheduler = self.train_state = None
        self._extra: extra_state.Holders = []  # found at attach
        self.mirror: Optional[Mirror] = None
        # handed to the mirror at attach and read here: its commits, the copies it refused
        self.commits: Optional[CommitTracker] = None
        self.rejections = Rejections(self.alarms.copy_rejected)  # also the 'drop' fault's
        self.restored_meta: Optional[dict] = None
        self._with_cuda = self._initial_commit_pending = False

    def attach(self, model, optimizer, scheduler, train_state, rank: int, world_size: int,
               with_cuda: bool, link: Link, fault_points) -> None:
        check_supported(model, optimizer)
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.train_state, self._with_cuda = train_state, with_cuda
        self._extra = extra_state.holders(model)  # TE's FP8 scaling state, if any
        self._wrap_optimizer_step(optimizer, fault_points)
        dp_size = groups.data_parallel_size()
        why_not = step_barrier(optimizer)  # mirror/commit.py
        self.commits = CommitTracker(implicit=why_not is None)

        def sources():
            return (shard.shard_tensors(optimizer, placeholders=True)
                    + shard.unreplicated_tensors(model, dp_size))

        m = self.mirror = Mirror(rank, self.settings.replicas, use_cuda=with_cuda,
                                 job=self.settings.job_id, meter=self.meter, sources=sources,
                                 commits=self.commits, rejections=self.rejections,
                                 domains=placement.domains(self.settings.failure_domains))
        log.info("mirror placement: %s", placement.describe(self.settings.failure_domains))
        if why_not is not None and self.settings.replicas:
            log.info("mirror commits with its own collective: %s", why_not)
        m.set_hooks(fault=lambda it: fault_points(it, Phase.MIRROR),
                    committed=self.fallback.attach(m, world_size))  # e.g. periodic saves
        self.use(link)
        self._initial_commit_pending = True

    def _wrap_optimizer_step(self, optimizer, fault_points) -> None:
        orig = optimizer.step

        def step(*args, **kwargs):
            fault_points(self.train_state.iteration + 1, Phase.OPTIMIZER)
            with self.meter.on_main():
                self.mirror.wait()  # the snapshot of the previous step must be committed
            return orig(*args, **kwargs)

        optimizer.step = step

    def status(self) -> dict:
        """What heartbeats carry of it: the newest committed iteration, and the rank's own
        compute seconds per iteration (the meter's; the straggler check reads it)."""
        return {"committed": self.commits.committed if self.commits is not None else -1,
                "compute_s": self.meter.compute_s()}

    def progress(self, iteration: int) -> dict:
        """For ``iteration``'s progress line: the meter's lag and wait, and the commit."""
        c = self.commits.committed
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
        """Capture ``iteration``'s state: its snapshot begins (off the critical path). With
        ``mirror_on`` False (a bench's mirror-off block) nothing is captured."""
        with self.meter.after_step(mirror_on):
            if mirror_on:
                self.alarms.step(self.mirror.rank, iteration, self.commits.committed)
                self.mirror.begin(iteration, self._meta(iteration))

    def settle_snapshot(self) -> None:
        """A planned swap's boundary: the snapshot in flight lands at the buddies (or raises)."""
        with self.meter.on_main():
            self.mirror.wait()

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
        """After the link's abort: the mirror thread stops and forgets the generation."""
        if not self.mirror.quiesce(timeout_s):
            raise DeadpoolError("the mirror thread did not stop after the abort")
        self.mirror.disconnect()

    def use(self, link: Link) -> None:
        """The mirror exchanges over a new generation's link (and its placement)."""
        self.mirror.set_topology(link.transport, link.nodes, link.board)

    def restoring(self, rank: int, link: Link) -> restore.Restore:
        """A restore of the newest iteration held for every rank, its rounds on the new
        generation's ``link``: the recovery's steps run it (``restore.py``)."""
        self._initial_commit_pending = False
        self.meter.restored()  # the first step after a restore waits for no snapshot
        return restore.Restore(self.mirror, self.optimizer, self.model, rank, link.rounds,
                               self._apply)

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

    def save_fallback(self, quiesce_s: float, rank: int) -> None:
        """``--deadpool-fallback-save``: write the copies held here (an event names them)."""
        saved = self.fallback.save(self.mirror, quiesce_s)
        self._emit(Event.FALLBACK_SAVE, rank=rank, dir=self.settings.fallback_dir,
                   copies=[{"rank": r, "iteration": it, "bytes": b} for r, it, b in saved])

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
                "committed": self.commits.committed, "failed_commits": self.commits.failed,
                "rejected_copies": self.rejections.count,
                "unprotected_steps": self.alarms.unprotected_steps,
                "mirror_commit": "implicit" if self.commits.implicit else "collective"}

    def close(self, abort=None) -> None:
        """Stop the mirror thread; ``abort()`` first if a snapshot job still runs (blocked on a
        dead peer, a thread left in native code at exit ends in std::terminate)."""
        if self.mirror is None:
            return
        if abort and not self.mirror.quiesce(0):
            abort()  # the world's and the link's (e.g. waiting for a dead owner's connection)
        self.mirror.close()

