"""What DeadPool protects in one worker: the attached model, optimizer, scheduler and train
state, their in-memory mirror, and every holder of a process group (``rebind.GroupSlots``).

    attach ─► initial commit (first before_step) ─► after_step: snapshot ─► ...
    on recovery: quiesce ─► rebind(new groups, new mirror group) ─► restore(rank)
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Optional

from ..errors import DeadpoolError
from ..faults import Phase as FaultPhase
from ..megatron import ddp, shard
from ..megatron import train_state as ts
from ..megatron.support import check_supported, parallel_layout, step_barrier
from ..mirror import cpu, snapshot
from ..mirror.commit import RejectionBoard
from ..mirror.mirror import Mirror
from ..mirror.threads import lower_thread_priority, started_threads, thread_names
from ..mirror.socket_transport import SocketTransport, local_address
from ..mirror.transport import GlooTransport
from . import restore
from .quiet import CollectiveSuppressor
from .abort import communicator_sockets
from .alarms import Alarms, unprotected
from .fallback import Fallback
from .reaper import Reaper
from .rebind import GroupSlots

log = logging.getLogger(__name__)
REAPER_WAIT_S = 30.0  # for the old groups to die (the heap audit, the exit)


class Protected:
    def __init__(self, replicas: int, mirror_timeouts_s: tuple, job_id: int = 0,
                 fallback_dir: Optional[str] = None, fallback_every: int = 0,
                 mirror_transport: str = "socket", store_host: str = "127.0.0.1",
                 secret: Optional[str] = None):
        # (the mirror group's creation, each of its operations): see GlooTransport
        self.replicas, self.mirror_timeouts_s = replicas, mirror_timeouts_s
        # "socket": the exchange on connections of its own, on the interface that reaches
        # the store (socket_transport.py); "gloo": on the mirror's gloo group
        self.mirror_transport, self._store_host = mirror_transport, store_host
        self.fallback = Fallback(fallback_dir, fallback_every, job_id)  # fallback.py
        self.job_id = job_id  # snapshot.job_id(secret): copies of another job are refused
        self._secret = secret  # the socket transport's handshakes and signed addresses
        self._refused = 0  # mirror connections refused by earlier generations' listeners
        self.model = self.optimizer = self.scheduler = self.train_state = None
        self.mirror: Optional[Mirror] = None
        self.slots: Optional[GroupSlots] = None
        self.reaper, self._transport, self._old_transport = Reaper(), None, None
        self._board: Optional[RejectionBoard] = None  # this generation's (commit.py)
        self.alarms = Alarms()  # mirror failures are loud (alarms.py)
        self.iteration = 0
        self.restored_meta: Optional[dict] = None
        self.bench_modes = []
        self._with_cuda = False
        self._initial_commit_pending = False
        self._main_tid: Optional[int] = None
        self._suppressor: Optional[CollectiveSuppressor] = None
        # CPU accounting (mirror/cpu.py): the main thread's mirror share, the mirror
        # group's gloo threads, window samples from the CPU_WINDOW_START-th snapshot on
        self._main_mirror_s = 0.0
        self._gloo_tids: set = set()
        self._cpu_start: Optional[cpu.Sample] = None
        self._cpu_last: Optional[cpu.Sample] = None
        self._t_begin = self._wait_mark = 0.0  # progress(): newest snapshot's start, waits

    CPU_WINDOW_START = 3  # steps before it (startup, first allocations) are not counted

    def quiet_startup(self) -> None:
        """A promoted spare builds its model without talking to anyone (see quiet.py)."""
        self._suppressor = CollectiveSuppressor()
        self._suppressor.start()

    def attach(self, model, optimizer, scheduler, train_state, handle, plan, fault_points
               ) -> None:
        from megatron.core import parallel_state as ps

        if self._suppressor is not None:
            self._suppressor.stop()
        check_supported(model, optimizer)
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.train_state = train_state
        self._with_cuda = handle.device.type == "cuda"
        self._main_tid = threading.get_native_id()  # the training main thread
        self._wrap_optimizer_step(optimizer, fault_points)
        self.slots = GroupSlots([model, optimizer])
        if self.slots.unknown:
            log.warning("%s group slot(s) of unknown role: %s", len(self.slots.unknown),
                        ", ".join(self.slots.unknown[:5]))
        dp_size = ps.get_data_parallel_world_size()
        self.mirror = Mirror(handle.rank, self.replicas, use_cuda=self._with_cuda)
        self.mirror.set_sources(lambda: shard.shard_tensors(optimizer, placeholders=True)
                                + shard.unreplicated_tensors(model, dp_size))
        self.mirror.fault_hook = lambda it: fault_points(it, FaultPhase.MIRROR)
        why_not = step_barrier(optimizer)  # mirror/commit.py
        self.mirror.commits.implicit = why_not is None
        if why_not is not None and self.replicas:
            log.info("mirror commits with its own collective: %s", why_not)
        self.mirror.job = self.job_id
        self.mirror.on_copy_rejected = self.alarms.copy_rejected
        # on the mirror thread, once per commit
        self.mirror.on_committed = self.fallback.attach(self.mirror, handle)
        if self._transport is None:  # initialize_model_parallel did not run through us
            self.connect(plan)
        self.mirror.set_topology(self._transport, plan.node_of_rank)
        self.mirror.commits.board = self._board
        self._initial_commit_pending = True

    def connect(self, plan) -> None:
        """Create the mirror's group: a world-wide collective, made right after the
        model-parallel groups, so that every group exists before any rank builds (a promoted
        spare) or restores its state."""
        from torch.distributed import distributed_c10d as c10d

        names = cpu.GLOO_THREAD_NAMES
        before = thread_names()
        create_s, op_s = self.mirror_timeouts_s
        with communicator_sockets():  # the generation's abort shuts its connections down
            self._transport = GlooTransport(timeout_s=op_s, create_timeout_s=create_s)
        # the mirror group's I/O thread and workers (training groups' threads existed before)
        self._gloo_tids = started_threads(before, names)
        if self.mirror_transport == "socket" and self.replicas:
            if self._secret is None:
                raise DeadpoolError("the socket mirror transport needs the job secret")
            self._transport = SocketTransport(  # this generation's store (world.py)
                c10d._get_default_store(), self._transport.rank, self._transport.world_size,
                self._transport, local_address(self._store_host), self._secret, plan.gen,
                timeout_s=op_s)
        for tid in self._gloo_tids:
            lower_thread_priority(tid)
        self._board = RejectionBoard(c10d._get_default_store())  # this generation's store
        if self.mirror is not None:
            self.mirror.set_topology(self._transport, plan.node_of_rank)
            self.mirror.commits.board = self._board

    def _wrap_optimizer_step(self, optimizer, fault_points) -> None:
        orig = optimizer.step

        def step(*args, **kwargs):
            fault_points(self.train_state.iteration + 1, FaultPhase.OPTIMIZER)
            c0 = time.thread_time()
            self.mirror.wait()  # the snapshot of the previous step must be committed
            self._main_mirror_s += time.thread_time() - c0
            return orig(*args, **kwargs)

        optimizer.step = step

    def protect_groups_of(self, holders) -> None:
        """More holders of process groups, rebound like the model's (``rebind.GroupSlots``)."""
        self.slots.add(holders)

    def progress(self, iteration: int) -> dict:
        """For ``iteration``'s progress line: ``mirror_lag_s``, how long after the previous
        optimizer step its snapshot was copied, sent and verified (None: none, e.g. the first
        step after a restore); ``mirror_wait_s``, how long this optimizer step waited."""
        m = self.mirror
        waited, self._wait_mark = m.wait_s - self._wait_mark, m.wait_s
        done = m.last_done  # (iteration, when its job ended), from the mirror thread
        lag = done[1] - self._t_begin if done and done[0] == iteration - 1 else None
        return {"mirror_lag_s": lag, "mirror_wait_s": waited, "committed": m.committed,
                "unprotected": unprotected(iteration, m.committed)}

    # ---------------------------------------------------------------- loop
    def before_step(self, iteration: int) -> None:
        """The first call of a fresh job commits the initial state, so that a failure in the
        very first step rolls back to a committed state too (a restored spare skips it)."""
        if self._initial_commit_pending:
            self._initial_commit_pending = False
            self._t_begin = time.perf_counter()
            self.mirror.begin(iteration, dict(self._meta(iteration), initial=True))
            self.mirror.wait()  # once, before any training: a failure in step 1 finds it
            self._wait_mark = self.mirror.wait_s  # not a wait of step 1 (progress())
            self.mirror.refresh_sources()  # the first step creates the optimizer state

    def after_step(self, iteration: int, mirror_on: bool = True) -> None:
        c0 = time.thread_time()
        self.iteration = iteration
        self.bench_modes.append("on" if mirror_on else "off")
        if len(self.bench_modes) == self.CPU_WINDOW_START:
            self._cpu_start = self._cpu_sample(c0, with_threads=True)
        if mirror_on:
            self.alarms.step(self.mirror.rank, iteration, self.mirror.committed)
            self._t_begin = time.perf_counter()
            self.mirror.begin(iteration, self._meta(iteration))
        c1 = time.thread_time()
        self._main_mirror_s += c1 - c0
        self._cpu_last = self._cpu_sample(c1)

    def _cpu_sample(self, main_s: float, with_threads: bool = False) -> cpu.Sample:
        s = cpu.Sample(main_s, self._main_mirror_s, len(self.bench_modes))
        if with_threads:
            m = self.mirror
            s.jobs = m.jobs
            s.parts = {"mirror_thread": m.job_cpu_s, "checksum_pool": snapshot.pool_cpu_s(),
                       "gloo": cpu.threads_cpu_s(self._gloo_tids)}
            s.phases = dict(m.phase_cpu)
        return s

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
        return meta

    # ---------------------------------------------------------------- recovery
    def quiesce(self, timeout_s: float) -> None:
        if self._transport is not None:
            self._transport.abort()  # wakes a mirror thread blocked on a dead peer
        if not self.mirror.quiesce(timeout_s):
            raise DeadpoolError("the mirror thread did not stop after the abort")
        self._old_transport, self._transport = self._transport, None
        self.mirror.transport = None

    def abort_transport(self) -> None:
        """``World.on_abort`` (any thread): the transport's own sockets are not abort.py's."""
        if self._transport is not None:
            self._transport.abort()

    def release_groups(self) -> None:
        """Once the world is destroyed: the old groups that the model, the optimizer and the
        mirror still hold die on the reaper thread, not in the next ``rebind`` (reaper.py)."""
        old = self.slots.release() if self.slots is not None else []
        ddp.drop_pending(self.model or ())  # bucket handles on the dead groups: never waited
        if self._old_transport is not None:
            self._refused += getattr(self._old_transport, "refused", 0)
            old.append(self._old_transport.release())  # its gloo group dies on the reaper
        self._old_transport = None
        self.reaper.drop(old)

    def settle_groups(self) -> None:
        if not self.reaper.wait(REAPER_WAIT_S):
            raise DeadpoolError(f"old process groups not destroyed in {REAPER_WAIT_S:g}s")

    def rebind(self, handle, plan) -> None:
        """Point every holder of a group at the new generation's, and the mirror at its new
        group and placement."""
        self.slots.rebind()
        self.connect(plan)
        self._cpu_start = None  # new gloo threads: the CPU window does not span a recovery

    def restore(self, rank: int) -> int:
        """Restore the newest iteration held for every rank (``restore.py``); returns it."""
        self._initial_commit_pending = False
        self.mirror.last_done = None  # the first step after a restore waits for no snapshot
        chosen, meta = restore.execute(self.mirror, self.optimizer, self.model, rank)
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
        self.iteration = meta["iteration"]
        self.restored_meta = meta

    # ---------------------------------------------------------------- end
    def finish_info(self) -> dict:
        m = self.mirror
        if m is None:
            return {}
        m.wait()
        return {**self._cost_info(m), "mirror_waits": m.waits, "mirror_wait_s": m.wait_s, "mirror_jobs": m.jobs,
                "mirror_job_s": m.job_s, "bench_modes": self.bench_modes,
                "host_bytes": m.host_bytes, "pinned_bytes": m.pinned_bytes,
                "mirror_bytes": m.layout.total_bytes if m.layout else 0,
                "mirror_tensor_bytes": m.layout.tensor_bytes if m.layout else 0,
                "mirror_copies": m.copy_stats(),
                "committed": m.committed, "failed_commits": m.failed_commits,
                "rejected_copies": m.rejected_copies,
                "unprotected_steps": self.alarms.unprotected_steps,
                "mirror_commit": "implicit" if m.commits.implicit else "collective",
                "mirror_transport": getattr(self._transport, "kind", None),
                # connections that failed the socket transport's handshake (impostors)
                "mirror_refused_peers": self._refused + getattr(self._transport, "refused", 0)}

    def _cost_info(self, m: Mirror) -> dict:
        """``mirror_cpu`` (mirror/cpu.py) over the steps from CPU_WINDOW_START on, and the
        snapshot's copy bandwidth against a plain copy of the same bytes (host slots)."""
        out = {"main_tid": self._main_tid, "gloo_tids": sorted(self._gloo_tids)}
        if self._cpu_start is not None and self._cpu_last is not None:
            end = self._cpu_sample(0.0, with_threads=True)
            out["mirror_cpu"] = cpu.window(self._cpu_start, self._cpu_last, end)
        if m.layout is not None and m.jobs:
            n = m.layout.tensor_bytes
            calib = None if m.pin else m.run_on_thread(lambda: cpu.calibrate(n))
            out["snapshot"] = cpu.snapshot_stats(m.copier.copy_times, n, calib)
        return out

    def close(self, abort=None) -> None:
        """Stop the mirror thread. ``abort()`` first when a snapshot job is still running: it
        may be blocked on a dead peer, and a thread left in native code when the process
        exits ends it in std::terminate. Released groups die first (reaper.py)."""
        self.reaper.wait(REAPER_WAIT_S)
        if self.mirror is None:
            return
        if abort and not self.mirror.quiesce(0):
            abort()
            if self._transport is not None:
                self._transport.abort()  # e.g. waiting for a dead owner's connection
        self.mirror.close()
