"""The enabled DeadPool runtime of one worker process (used through ``api.Deadpool``).

States: STANDBY -> ACTIVE -> (RECOVERING -> ACTIVE)* -> DONE | FAILED.

A watcher thread heartbeats and watches the membership generation. When the decider
publishes a new generation, the watcher aborts this process's communicators so the main
thread, wherever it is blocked, reaches the one recovery boundary (``recover``).
"""

from __future__ import annotations

import json
import os
import threading
import time
from datetime import timedelta
from typing import List, Optional

from .config import DeadpoolConfig
from .errors import (DeadpoolError, NoSpareError, RebindAuditError,
                     StaleGenerationError)
from .launch import inject
from .megatron import shard
from .megatron import state as train_state_io
from .megatron.support import check_supported
from .membership import auth
from .membership import store as st
from .mirror import snapshot
from .mirror.mirror import Mirror, MirrorError, lower_thread_priority, native_thread_ids
from .mirror.transport import GlooTransport
from .recovery import abort as ab
from .recovery.phases import EventSink, Phase, PhaseTimer
from .recovery.classify import is_peer_failure
from .recovery import restore_plan
from .recovery.quiet import CollectiveSuppressor
from .recovery.restore_plan import Inventory
from .recovery.rebind import GroupSlots, heap_audit, weak_groups



def _env(name: str, default: Optional[str] = None) -> str:
    v = os.environ.get(name, default)
    if v is None:
        raise DeadpoolError(f"--deadpool needs {name} in the environment: start the job with "
                            "`deadpool launch`")
    return v


MAX_ATTEMPTS = 8  # recovery attempts per failure (each on a newer generation)


def _drop_traceback(exc: BaseException) -> None:
    """The failed step's frames hold the old groups (schedules, p2p communicators): clear
    them so the old generation can be freed."""
    import traceback

    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if exc.__traceback__ is not None:
            traceback.clear_frames(exc.__traceback__)
            exc.__traceback__ = None
        exc = exc.__context__ or exc.__cause__


class Runtime:
    def __init__(self, handle, config: DeadpoolConfig):
        self.h = handle
        self.config = config
        self.lid = int(_env("DEADPOOL_LID"))
        self.node = int(_env("DEADPOOL_NODE"))
        self.role = _env("DEADPOOL_ROLE", "active")
        self.token = auth.load_secret()
        self.host = _env("DEADPOOL_STORE_HOST")
        self.port = int(_env("DEADPOOL_STORE_PORT"))
        self.faults = inject.from_json(os.environ.get("DEADPOOL_INJECT", "[]"))
        self.sink = EventSink(config.events_path)
        self.store = st.connect(self.host, self.port, config.rendezvous_timeout_s)
        self.coord = st.Coordinator(self.store, self.token)
        self.state = "STANDBY"
        self.gen = -1
        self.plan: Optional[dict] = None
        self.iteration = 0
        self.mirror: Optional[Mirror] = None
        self.slots: Optional[GroupSlots] = None
        self.recoveries: List[dict] = []
        self._live_gen: Optional[int] = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._shutdown_reason: Optional[str] = None
        self._first_step: Optional[tuple] = None
        self._joined_as_spare = False
        self.restored_meta: Optional[dict] = None
        self._initial_commit_pending = False
        self._aborted = False
        self._watcher: Optional[threading.Thread] = None
        self._closed = False
        # Benchmark only (`deadpool bench overhead`): snapshot in alternating blocks of this
        # many iterations, so mirror-on and mirror-off steps are measured in one job.
        self._bench_block = int(os.environ.get("DEADPOOL_BENCH_BLOCK", "0"))
        self.bench_modes: List[str] = []

    # ================================================================ membership
    def join(self) -> None:
        self.coord.request_admission(self.lid, self.config.rendezvous_timeout_s)
        self._watcher = threading.Thread(target=self._watch, name="deadpool-watcher",
                                         daemon=True)
        self._watcher.start()
        if self.role == "spare":
            self._log(f"standby spare on node {self.node}: waiting for an assignment")
            plan = self._wait_for_plan(min_gen=1, exc=None, spare=True)
            self._joined_as_spare = True
            self.sink.emit("promoted", lid=self.lid, rank=plan["rank_of"][str(self.lid)],
                           generation=plan["gen"])
            self._promote_t0 = time.perf_counter()
        else:
            plan = self.coord.get_plan(0)
        self._form_world(plan, with_groups=False)

    def _form_world(self, plan: dict, with_groups: bool) -> None:
        """Adopt ``plan`` and build its world (``with_groups``: and replay the model-parallel
        groups). If a peer dies meanwhile, take the next generation's plan and build again;
        every attempt is bounded by the rendezvous timeout, and there are MAX_ATTEMPTS."""
        for attempt in range(1, MAX_ATTEMPTS + 1):
            self._adopt(plan)
            try:
                st.arrive(self.coord, self.gen, self.h.world_size,
                          self.config.rendezvous_timeout_s, stop=self._raise_if_shutdown)
            except st.GenerationMoved as moved:
                plan = self._wait_for_plan(self.gen + 1, moved, spare=self.role == "spare")
                continue
            try:
                self._init_process_group()
                if with_groups:
                    self._build_groups()
                return
            except Exception as exc:  # noqa: BLE001 - classified right below
                if not is_peer_failure(exc, aborted=False):
                    raise
                self._log(f"generation {self.gen}: the world did not form "
                          f"({type(exc).__name__}); waiting for the next generation")
                plan = self._next_plan_after(exc)
        raise DeadpoolError(f"the world did not form in {MAX_ATTEMPTS} generations")

    def _next_plan_after(self, exc: BaseException) -> dict:
        """This generation's world failed to form: drop it, wait for the next plan."""
        with self._lock:
            self._live_gen = None
        ab.destroy_world()
        return self._wait_for_plan(self.gen + 1, exc, spare=self.role == "spare")

    @property
    def promoted(self) -> bool:
        return self._joined_as_spare

    def initialize_model_parallel(self) -> None:
        """First build of the model-parallel groups (recorded kwargs in the handle)."""
        try:
            self._build_groups()
        except Exception as exc:  # noqa: BLE001 - classified right below
            if not is_peer_failure(exc, aborted=False):
                raise
            self._form_world(self._next_plan_after(exc), with_groups=True)
        self.after_model_parallel_init()

    def _adopt(self, plan: dict) -> None:
        rank = plan["rank_of"].get(str(self.lid))
        if rank is None:
            raise StaleGenerationError(
                f"process {self.lid} is not a member of generation {plan['gen']} (it was "
                "declared failed); exiting")
        self.plan, self.gen = plan, plan["gen"]
        self.h.rank, self.h.world_size = rank, plan["world_size"]
        os.environ["RANK"], os.environ["WORLD_SIZE"] = str(rank), str(plan["world_size"])

    def _init_process_group(self) -> None:
        import torch.distributed as dist

        prefix = dist.PrefixStore(f"gen{self.gen}/", self.store)
        kwargs = {}
        if self.h.backend == "nccl":
            os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")
        # Bounded by the rendezvous timeout while the world forms (a peer that dies now must
        # not hold everyone for the collective timeout); set_collective_timeouts() raises it
        # once the groups are built.
        dist.init_process_group(backend=self.h.backend, store=prefix, rank=self.h.rank,
                                world_size=self.h.world_size,
                                timeout=timedelta(seconds=self.config.rendezvous_timeout_s),
                                **kwargs)
        with self._lock:
            self._live_gen = self.gen
            self._aborted = False

    def _watch(self) -> None:
        """Heartbeat + generation watch. Aborts communicators when the generation moves on."""
        client = st.Coordinator(st.connect(self.host, self.port,
                                           self.config.rendezvous_timeout_s), self.token)
        seq, last_hb = 0, 0.0
        while not self._stop.is_set():
            try:
                g = client.current_gen()
                with self._lock:
                    live = self._live_gen
                if live is not None and g > live:
                    self._abort_current(reason=f"generation {g} published")
                now = time.monotonic()
                if now - last_hb >= self.config.heartbeat_interval_s:
                    seq += 1
                    client.beat(self.lid, seq=seq, iteration=self.iteration, state=self.state,
                                committed=self.mirror.committed if self.mirror else -1)
                    last_hb = now
                reason = client.shutdown_reason() if self._shutdown_reason is None else None
                if reason is not None:
                    self._shutdown_reason = reason
                    if self.state not in ("DONE", "STANDBY"):
                        self._abort_current(reason="job stopped: " + self._shutdown_reason)
            except Exception:  # noqa: BLE001 - the store is gone: the job is over
                if self._stop.is_set():
                    return
                time.sleep(0.5)
            time.sleep(0.1)

    def _abort_current(self, reason: str) -> None:
        with self._lock:
            if self._live_gen is None:
                return
            info = ab.abort_communicators(self.h.backend, self.port)
            self._aborted = True
            self.sink.emit("abort", generation=self._live_gen, rank=self.h.rank, reason=reason,
                           **info)
            self._live_gen = None

    def _wait_for_plan(self, min_gen: int, exc: Optional[BaseException], spare: bool) -> dict:
        deadline = time.monotonic() + (1e9 if spare else self.config.rendezvous_timeout_s)
        while True:
            if self._shutdown_reason is not None:
                if spare:
                    self._log(f"spare released: {self._shutdown_reason}")
                    self._stop.set()
                    raise SystemExit(0)
                raise self._shutdown_error()
            g = self.coord.current_gen()
            if g >= min_gen:
                plan = self.coord.get_plan(g)
                if not spare or str(self.lid) in plan["rank_of"]:
                    return plan
                min_gen = g + 1
            if time.monotonic() > deadline:
                if exc is not None:
                    raise exc
                raise DeadpoolError("no membership plan arrived in time")
            time.sleep(0.02)

    # ================================================================ attach
    def after_model_parallel_init(self) -> None:
        """A promoted spare builds its model without talking to anyone (see quiet.py)."""
        self._set_collective_timeouts()
        if self._joined_as_spare:
            self._suppressor = CollectiveSuppressor()
            self._suppressor.start()

    def attach(self, model, optimizer, scheduler, train_state) -> None:
        from megatron.core import parallel_state as ps

        if self._joined_as_spare:
            self._suppressor.stop()
        check_supported(model)

        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.train_state = train_state
        self._wrap_optimizer_step(optimizer)
        self.slots = GroupSlots([model, optimizer])
        if self.slots.unknown:
            self._log(f"warning: {len(self.slots.unknown)} group slot(s) of unknown role: "
                      + ", ".join(self.slots.unknown[:5]))
        dp_size = ps.get_data_parallel_world_size()
        self.mirror = Mirror(self.h.rank, self.config.replicas,
                             use_cuda=self.h.device.type == "cuda")
        self.mirror.set_sources(lambda: shard.shard_tensors(optimizer, placeholders=True)
                                + shard.unreplicated_tensors(model, dp_size))
        self.mirror.fault_hook = lambda it: self.fault_point(it, "mirror")
        self.mirror.job = snapshot.job_id(self.token)
        self._connect_mirror()
        self.state = "ACTIVE"
        if not self._joined_as_spare:
            self._initial_commit_pending = True
            return
        timer = PhaseTimer(self.sink, self.gen, self.h.rank)
        timer.record(Phase.REBUILD_GROUPS, time.perf_counter() - self._promote_t0)
        timer.start(Phase.RESTORE_STATE)
        try:
            restored = self._restore()
        except Exception as exc:  # noqa: BLE001 - a peer failed while this spare restored
            if not is_peer_failure(exc, aborted=self._aborted):
                raise
            self._recover_until_done(exc, iteration_at_failure=None)
            return
        timer.stop()
        self._begin_first_step(timer, restored, self.plan, iteration_at_failure=None)

    def _connect_mirror(self) -> None:
        before = native_thread_ids("gloo_tcp_loop")
        transport = GlooTransport(timeout_s=self.config.collective_timeout_s)
        for tid in native_thread_ids("gloo_tcp_loop") - before:  # the mirror group's I/O
            lower_thread_priority(tid)
        self.mirror.set_topology(transport, self.plan["node_of_rank"])

    def _wrap_optimizer_step(self, optimizer) -> None:
        orig = optimizer.step

        def step(*args, **kwargs):
            self.fault_point(self.train_state.iteration + 1, "optimizer")
            self.mirror.wait()  # the snapshot of the previous step must be committed
            return orig(*args, **kwargs)

        optimizer.step = step

    # ================================================================ loop hooks
    def fault_point(self, iteration: int, phase: str) -> None:
        for f in self.faults:
            if f.at_s is None and f.kind == "raise" and f.iteration == iteration and (
                    f.phase == phase and f.targets(self.h.rank, self.node)):
                raise inject.InjectedLocalError(
                    f"injected local error on rank {self.h.rank} at iteration {iteration}")
            if (f.at_s is None and f.iteration == iteration and f.phase == phase
                    and f.targets(self.h.rank, self.node)
                    and not self.store.check([st.k("inject", f.index)])):
                self.coord.push_event("fault_request", index=f.index, lid=self.lid,
                              rank=self.h.rank, node=self.node, iteration=iteration, phase=phase)
                self._log(f"fault {f.kind} requested at iteration {iteration} ({phase})")
                time.sleep(60)  # the agent delivers the signal; we never get past this
                raise DeadpoolError(f"fault {f.index} was requested but never delivered")

    def before_step(self, iteration: int) -> None:
        """Top of every loop iteration (``iteration`` steps done). The first call of a fresh
        job commits the initial state, so that a failure in the very first step rolls back
        to a committed state too."""
        if self._initial_commit_pending:
            self._initial_commit_pending = False
            self.mirror.begin(iteration, self._meta(iteration))
            self.mirror.wait()  # once, before any training: a failure in step 1 finds it
            self.mirror.refresh_sources()  # the first step creates the optimizer state
        self.fault_point(iteration + 1, "forward_backward")

    def after_step(self, iteration: int) -> None:
        self.iteration = iteration
        if self._bench_block and ((iteration - 1) // self._bench_block) % 2 == 1:
            self.bench_modes.append("off")
        else:
            self.bench_modes.append("on")
            self.mirror.begin(iteration, self._meta(iteration))
        if self._first_step is not None:
            timer, t0, report = self._first_step
            self._first_step = None
            timer.record(Phase.FIRST_STEP, time.perf_counter() - t0)
            report["phases_s"] = timer.durations
            self.store.set(st.k("report", self.gen, self.h.rank), json.dumps(report))
            self.recoveries.append(report)

    def _meta(self, iteration: int) -> dict:
        meta = train_state_io.capture(iteration, self.train_state, self.scheduler,
                                      self.optimizer, with_cuda=self.h.device.type == "cuda")
        meta["optimizer_state_empty"] = shard.optimizer_state_empty(self.optimizer)
        return meta

    def _apply_meta(self, meta: dict) -> None:
        train_state_io.apply(meta, self.train_state, self.scheduler, self.optimizer)
        self.iteration = meta["iteration"]
        self.restored_meta = meta

    # ================================================================ recovery
    def recover(self, exc: BaseException) -> None:
        """The recovery boundary. Returns with every rank restored to the same committed
        iteration on a rebuilt world; re-raises ``exc`` if it was not a job failure. A failure
        during recovery starts the recovery over on the next generation."""
        if self.state != "ACTIVE" or not is_peer_failure(exc, aborted=self._aborted):
            raise exc
        iteration_at_failure = self.iteration
        self._log(f"failure seen at iteration {iteration_at_failure}: "
                  f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}")
        self._recover_until_done(exc, iteration_at_failure)

    def _recover_until_done(self, exc: BaseException, iteration_at_failure: Optional[int]
                            ) -> None:
        """Each attempt uses the newest generation; a failure during an attempt (a peer
        died in rendezvous, rebuild or restore) starts the next one. Bounded: every attempt
        waits at most the rendezvous timeout, and there are at most MAX_ATTEMPTS."""
        for attempt in range(1, MAX_ATTEMPTS + 1):
            try:
                self._recover_once(exc, iteration_at_failure)
                return
            except Exception as again:  # noqa: BLE001 - classified right below
                if not is_peer_failure(again, aborted=self._aborted):
                    raise
                if self._shutdown_reason is not None:
                    raise self._shutdown_error() from None
                if isinstance(again, DeadpoolError) and not isinstance(again, MirrorError):
                    raise
                self._log(f"failure during recovery attempt {attempt} "
                          f"({type(again).__name__}); starting over on the next generation")
                exc = again
        raise DeadpoolError(f"recovery did not succeed in {MAX_ATTEMPTS} attempts; last "
                            f"failure: {type(exc).__name__}: {exc}")

    def _raise_if_shutdown(self) -> None:
        if self._shutdown_reason is not None:
            raise self._shutdown_error()

    def _shutdown_error(self) -> DeadpoolError:
        reason = self._shutdown_reason or "job stopped"
        return NoSpareError(reason) if "no spare" in reason else DeadpoolError(reason)

    def _recover_once(self, exc: BaseException, iteration_at_failure: int) -> None:
        self.state = "RECOVERING"
        timer = PhaseTimer(self.sink, self.gen + 1, self.h.rank)
        timer.start(Phase.ABORT)
        self._abort_current(reason=f"{type(exc).__name__} in the training step")
        if not self.mirror.quiesce(self.config.rendezvous_timeout_s):
            raise DeadpoolError("the mirror thread did not stop after the abort")
        _drop_traceback(exc)
        old_groups = weak_groups(ab.all_process_groups()) if self.config.audit == "full" else []
        self.mirror.transport = None
        ab.destroy_world()
        timer.start(Phase.RENDEZVOUS)
        plan = self._wait_for_plan(self.gen + 1, exc, spare=False)
        if iteration_at_failure is not None:  # test hook: a peer dies while the world forms
            self._adopt(plan)
            self.fault_point(iteration_at_failure + 1, "rendezvous")
        self._form_world(plan, with_groups=False)
        timer.start(Phase.REBUILD_GROUPS)
        self._build_groups()
        self.slots.rebind()
        self._audit(old_groups)
        self._connect_mirror()
        self._set_collective_timeouts()
        timer.start(Phase.RESTORE_STATE)
        if iteration_at_failure is not None:
            self.fault_point(iteration_at_failure + 1, "restore_state")
        restored = self._restore()
        timer.stop()
        self._begin_first_step(timer, restored, plan, iteration_at_failure)
        self.state = "ACTIVE"

    def _build_groups(self) -> None:
        """Replay ``initialize_model_parallel`` with the recorded arguments; group creation
        is bounded by the rendezvous timeout like the world's."""
        from megatron.core import parallel_state as ps

        kwargs = dict(self.h._mp_kwargs)
        if "distributed_timeout_minutes" in kwargs:
            kwargs["distributed_timeout_minutes"] = self.config.rendezvous_timeout_s / 60
        ps.initialize_model_parallel(**kwargs)

    def _set_collective_timeouts(self) -> None:
        from torch.distributed import distributed_c10d as c10d

        minutes = (self.h._mp_kwargs or {}).get("distributed_timeout_minutes")
        seconds = minutes * 60 if minutes else self.config.collective_timeout_s
        for pg in ab.all_process_groups():
            c10d._set_pg_timeout(timedelta(seconds=seconds), pg)

    def _audit(self, old_groups) -> None:
        if self.config.audit == "none":
            return
        self.slots.audit()
        if self.config.audit == "full":
            leaks = heap_audit(old_groups)
            if leaks:
                raise RebindAuditError(f"{len(leaks)} old process group(s) still alive after "
                                       f"the rebuild: {leaks[:5]}")
            self.sink.emit("audit", generation=self.gen, rank=self.h.rank, mode="full",
                           old_groups=len(old_groups), leaked=0)

    def _restore(self) -> int:
        """Agree on the iteration to restore from what every process holds, move missing
        shards from their holders, restore every rank, rebuild model params, and re-protect.
        Returns the restored iteration."""
        m = self.mirror
        invs = [Inventory.from_json(x) for x in m.transport.all_gather_json(m.inventory())]
        decision = restore_plan.decide(invs)
        chosen = decision.iteration
        me = self.h.rank
        if me in decision.sources:
            for opt in shard.distributed_optimizers(self.optimizer):
                if not opt.optimizer.state:  # a spare: create the state the copy fills
                    opt._init_optimizer_states_with_dummy_values()
        m.transfer_for_restore(chosen, decision.serves(me), decision.sources.get(me))
        meta = m.restore_local(chosen)
        if meta.get("optimizer_state_empty"):
            shard.reset_optimizer_state(self.optimizer)  # the initial commit: before step 1
        shard.copy_main_params_to_model(self.optimizer, self.model)
        self._apply_meta(meta)
        m.after_restore(chosen)
        # Buddies that already hold the restored iteration (same placement) are not re-sent.
        held = {(o, h) for h, inv in enumerate(invs) for o, its in inv.copies.items()
                if chosen in its}
        m.reprotect(chosen, skip=held)
        return chosen

    def _begin_first_step(self, timer: PhaseTimer, restored: int, plan: dict,
                          iteration_at_failure: Optional[int]) -> None:
        report = {"generation": plan["gen"], "rank": self.h.rank, "lid": self.lid,
                  "spare": self._joined_as_spare and iteration_at_failure is None,
                  "restored_iter": restored, "iteration_at_failure": iteration_at_failure,
                  "failed_ranks": plan["failed_ranks"]}
        self._log(f"generation {plan['gen']}: restored iteration {restored}")
        self.sink.emit("restored", generation=plan["gen"], rank=self.h.rank, iteration=restored)
        self._first_step = (timer, time.perf_counter(), report)

    # ================================================================ end
    def finish(self) -> dict:
        if self.mirror is not None:
            self.mirror.wait()
            info = {"mirror_waits": self.mirror.waits, "mirror_wait_s": self.mirror.wait_s,
                    "mirror_jobs": self.mirror.jobs, "mirror_job_s": self.mirror.job_s,
                    "bench_modes": self.bench_modes,
                    "host_bytes": self.mirror.host_bytes,
                    "mirror_bytes": self.mirror.layout.total_bytes if self.mirror.layout else 0,
                    "committed": self.mirror.committed}
        else:
            info = {}
        self.state = "DONE"
        self.coord.push_event("done", lid=self.lid, rank=self.h.rank)
        self.close(destroy=False)
        return {"recoveries": self.recoveries, "generation": self.gen, **info}

    def report_fatal(self, exc: BaseException) -> None:
        """This process stops on an error that recovery cannot or must not handle: tell the
        decider, which stops the job with this reason instead of spending a spare."""
        import traceback

        if self.state == "DONE" or self._closed:
            return
        text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        try:
            self.coord.push_event("fatal", lid=self.lid, rank=self.h.rank,
                          error=f"{type(exc).__name__}: {exc}"[:500], traceback=text[-4000:])
        except Exception:  # noqa: BLE001 - the coordinator is gone: nothing to tell
            pass

    def close(self, destroy: bool = True) -> None:
        """Stop the threads and (``destroy``) free every communicator before the process
        exits: exiting with live gloo groups and threads ends in std::terminate at
        interpreter shutdown."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._watcher is not None and self._watcher is not threading.current_thread():
            self._watcher.join(timeout=5)
        if self.mirror is not None:
            self.mirror.close()
        with self._lock:
            self._live_gen = None
        if destroy:
            ab.destroy_world()

    def _log(self, msg: str) -> None:
        print(f"[deadpool lid{self.lid}] {msg}", flush=True)
