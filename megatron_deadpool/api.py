"""The small public API. The reference trainer and the Megatron-LM patch are both thin
callers of exactly these methods:

    dp = Deadpool.start(config, device="cpu"|"cuda", backend="gloo"|"nccl")
         # joins the job; a spare blocks here until it is promoted to a dead rank's id
    dp.initialize_model_parallel(**kwargs)      # recorded, replayed on every rebuild
    dp.attach(model=chunks, optimizer=opt, scheduler=sched, train_state=state)
         # state: any object with .iteration and .consumed_train_samples (Megatron's args)
         # a promoted spare returns from attach already restored to the committed iteration
    loop:
        try:
            dp.before_step(state.iteration)         # first call: commits the initial state
            ... train step ...   (optimizer.step is wrapped: waits for the in-flight snapshot)
            dp.after_step(state.iteration, loss=loss)   # last rank: loss log + progress line
        except Exception as exc:     # the one recovery boundary
            dp.recover(exc)          # restores state.iteration etc.; re-raises if not a failure
    with dp.section("save"): ...     # a long phase (save, eval, data): its own timeout
    dp.finish(model, optimizer)      # fingerprint + results
    dp.shutdown(exc)                 # on an error path: report it, free communicators

With ``config.enabled`` False every call degrades to plain torch.distributed/megatron setup.
The enabled runtime lives in ``control/runtime.py``; this class only wires it.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from datetime import timedelta
from typing import Iterator, Optional

from .adapters import shard
from .base.config import DeadpoolConfig, GradStats
from .base.sections import checked_name
from .base.worker_env import PROGRESS_PREFIX, WorkerEnv


class Deadpool:
    """Runtime handle of one worker process."""

    def __init__(self, config: DeadpoolConfig, device: str, backend: str):
        import torch

        self.config = config
        self.backend = backend
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if device == "cuda" and self.local_rank < 0:
            # a node's warm standby: the GPU is the one of the rank it takes (bound then,
            # control/runtime.py); before that only the rank-independent part is warmed
            torch.cuda.init()
            self.device = torch.device("cuda")
        elif device == "cuda":
            torch.cuda.set_device(self.local_rank)
            self.device = torch.device("cuda", self.local_rank)
        else:
            self.device = torch.device("cpu")
        self._rank = int(os.environ.get("RANK", "0"))  # without the runtime (disabled)
        self._world_size = int(os.environ.get("WORLD_SIZE", "1"))
        self._runtime = None  # the enabled runtime (membership, mirror, recovery)
        self.results_dir = os.environ.get("DEADPOOL_RESULTS_DIR")
        self._loss_log = None
        self._t_step: Optional[float] = None  # when the current step began (progress)
        self._trace = None  # DEADPOOL_TRACE_DIGESTS=1: adapters/digest_trace.py

    # ------------------------------------------------------------------ setup
    @classmethod
    def start(cls, config: DeadpoolConfig, device: str = "cpu", backend: str = "gloo",
              env: Optional[WorkerEnv] = None) -> "Deadpool":
        """Join the job. A standby spare blocks here until it is promoted to a dead rank's
        id (or exits 0 when the job ends without needing it).

        ``env``: what the launcher told this process (default: ``WorkerEnv.from_env()``);
        test and benchmark hooks (fault schedule, mirror blocks) arrive through it.

        Raises:
            DeadpoolError: not started by ``deadpool launch`` (enabled config only).
            TokenError: the coordinator refused this process (wrong job secret).
            JobStopped: the job stopped while this process was joining.
        """
        self = cls(config, device, backend)
        if config.enabled:
            self._runtime = self._make_runtime(env or WorkerEnv.from_env())
            try:
                self._runtime.join()  # spare: blocks until promoted; sets rank/world_size
                if self.local_rank < 0 and self.device.type == "cuda":  # a standby's GPU
                    self.local_rank = self._runtime.local_rank
                    self.device = torch.device("cuda", self.local_rank)
            except BaseException:
                # Nobody else holds this handle: stop the watcher thread and free the groups
                # here, or the process leaves with a daemon thread inside a store call and
                # the interpreter's exit ends it in std::terminate (SIGABRT).
                self._runtime.close()
                raise
        else:
            self._init_process_group_plain()
        return self

    @classmethod
    def over_default_group(cls, config: DeadpoolConfig, device: str, backend: str
                           ) -> "Deadpool":
        """A handle with the mirror off over an initialized default group (its rank)."""
        import torch.distributed as dist

        self = cls(config, device, backend)
        self._rank, self._world_size = dist.get_rank(), dist.get_world_size()
        return self

    def _make_runtime(self, env: WorkerEnv):
        from .control.attachment import Attachment
        from .control.link import Links, MirrorSettings
        from .control.runtime import Runtime
        from .membership import auth
        from .membership.member import Member
        from .mirror import snapshot
        from .mirror.meter import NO_METER, Meter
        from .recovery import counting
        from .recovery.phases import EventSink
        from .recovery.world import World

        cfg = self.config
        secret = auth.load_secret()
        sink = EventSink(cfg.events_path)
        if cfg.count_work:
            counting.count_store_ops()
        member = Member(env.lid, env.node, env.store_host, env.store_port, secret,
                        cfg.heartbeat_interval_s, cfg.rendezvous_timeout_s,
                        counted=counting.main_connection)
        world = World(self.backend, env.store_port, cfg.rendezvous_timeout_s,
                      cfg.collective_timeout_s, sink.emit,
                      gloo_op_timeout_s=cfg.gloo_op_timeout_s,
                      regroup_timeout_s=cfg.regroup_timeout_s,
                      keep_groups=not cfg.rebuild_all_groups, secret=secret,
                      staged_grad_stats=cfg.grad_stats is GradStats.STAGED,
                      node_store=member.node_store)
        settings = MirrorSettings(
            replicas=cfg.replicas, create_timeout_s=cfg.rendezvous_timeout_s,
            op_timeout_s=cfg.gloo_op_timeout_s, transport=cfg.mirror_transport,
            store_host=env.store_host, secret=secret, job_id=snapshot.job_id(secret),
            fallback_dir=cfg.fallback_save_dir, fallback_every=cfg.fallback_every,
            failure_domains=cfg.failure_domains)
        # a launched job reports what the mirror costs (progress line, rank results, bench)
        meter = Meter() if env.results_dir or cfg.events_path else NO_METER
        return Runtime(cfg, env, member, world, Attachment(settings, meter, sink.emit),
                       Links(settings, meter, records=world.record_stores), sink,
                       with_cuda=self.device.type == "cuda")

    @property
    def rank(self) -> int:
        """This process's rank in the current generation (a spare takes a dead rank's)."""
        return self._runtime.state.rank if self._runtime is not None else self._rank

    @property
    def world_size(self) -> int:
        return (self._runtime.state.world_size if self._runtime is not None
                else self._world_size)

    def _init_process_group_plain(self) -> None:
        import torch.distributed as dist

        if not dist.is_initialized():
            dist.init_process_group(
                backend=self.backend, rank=self.rank, world_size=self.world_size,
                timeout=timedelta(seconds=self.config.collective_timeout_s))

    def initialize_model_parallel(self, **kwargs) -> None:
        """``parallel_state.initialize_model_parallel(**kwargs)``, recorded and replayed on
        every rebuild; a peer dying meanwhile is survived."""
        from .adapters import groups

        if self._runtime is not None:
            self._runtime.initialize_model_parallel(kwargs)
        else:
            groups.initialize(**kwargs)

    def attach(self, model, optimizer, scheduler=None, train_state=None) -> None:
        """Protect these objects. A promoted spare returns from here restored.

        Raises:
            UnsupportedConfigError: a model feature whose groups cannot be rebound, or an
                optimizer that is not Megatron's distributed optimizer.
        """
        shard.distributed_optimizers(optimizer)  # refuses a non-distributed optimizer early
        if self._runtime is not None:
            self._runtime.attach(model, optimizer, scheduler, train_state)
        from .adapters.digest_trace import DigestTrace

        self._trace = DigestTrace.from_env(self.results_dir, model, optimizer, scheduler,
                                           train_state, self.device.type == "cuda")
        if self._trace is not None and self.promoted:
            self._trace.record("restored", self.rank, self._trace.iteration())

    def protect_groups_of(self, holders) -> None:
        """Objects besides the attached ones that hold process groups (e.g. arguments a
        training loop receives): rebound after every rebuild, like the model's."""
        if self._runtime is not None and holders:
            self._runtime.protect_groups_of(list(holders))

    # ------------------------------------------------------------------ loop
    def before_step(self, iteration: int) -> None:
        """Call at the top of every loop iteration, ``iteration`` steps being done. The
        first call of a fresh job commits the initial state (iteration 0)."""
        if self._runtime is not None:
            self._runtime.before_step(iteration)
        self._t_step = time.perf_counter()

    def after_step(self, iteration: int, loss: Optional[float] = None) -> None:
        """Call after every completed iteration: starts the snapshot of its state and, on the
        last rank of a launched job, appends ``loss`` to the results' loss log (read by the
        launch summary) and prints the iteration's progress record for the launcher."""
        now = time.perf_counter()
        rt = self._runtime
        last = bool(self.results_dir) and self.rank == self.world_size - 1
        rec = self._progress(iteration, loss, now) if last else None
        if rt is not None:
            r = rt.step_done(iteration)
            if rec is not None and r is not None:
                rec["recovery"] = {k: r.get(k) for k in ("generation", "restored_iter",
                                                         "failed_ranks", "phases_s")}
        if loss is not None and last:
            if self._loss_log is None:
                self._loss_log = open(os.path.join(self.results_dir, "losses.jsonl"), "a")
            self._loss_log.write(json.dumps({"iteration": iteration, "loss": loss}) + "\n")
            self._loss_log.flush()
        if rec is not None:
            print(PROGRESS_PREFIX + json.dumps(rec), flush=True)
        if self._trace is not None:
            self._trace.record("step", self.rank, iteration)
        self._t_step = now

    @contextlib.contextmanager
    def section(self, name: str) -> Iterator[None]:
        """Run the body as section ``name`` (save, eval, data; step; startup): the decider
        judges this rank's progress by that section's timeout (--deadpool-section-timeouts)
        instead of the step's, and, in a section that may hold the GIL (all but step), a
        stale heartbeat too. Entering and leaving are progress. A no-op with the mirror off.

        Raises:
            ConfigError: an unknown section name.
        """
        if self._runtime is None:
            checked_name(name)
            yield
            return
        with self._runtime.section(name):
            yield

    def _progress(self, iteration: int, loss: Optional[float], now: float) -> dict:
        """One iteration's progress record: loss, step seconds (since ``before_step``, or
        the previous ``after_step`` when the caller has no ``before_step``), mirror lag and
        wait (``Attachment.progress``; None with the mirror off), generation."""
        rec = {"iteration": iteration, "loss": loss, "rank": self.rank,
               "step_s": None if self._t_step is None else now - self._t_step,
               "mirror_lag_s": None, "mirror_wait_s": None, "generation": None}
        if self._runtime is not None:
            rec.update(self._runtime.progress(iteration))
        return rec

    @property
    def promoted(self) -> bool:
        """True in a spare process that took a dead rank's id (it walks startup alone)."""
        return self._runtime is not None and self._runtime.promoted

    @property
    def restored_meta(self) -> Optional[dict]:
        """The snapshot metadata of the last restore (RNG, counters), or None."""
        return self._runtime.restored_meta if self._runtime is not None else None

    def recover(self, exc: BaseException) -> None:
        """The recovery boundary: call from the one ``except`` around the loop body.

        Returns with this rank restored to the last committed iteration on a rebuilt
        world (``train_state.iteration`` etc. restored).

        Raises:
            exc itself: a local error (not backed by a membership change), at once.
            JobStopped: the job stopped (no spare left, or a rank's fatal error).
            NoCommittedStateError: a rank and every holder of its copy are gone.
        """
        if self._runtime is None:
            raise exc
        self._runtime.recover(exc)
        if self._trace is not None:
            self._trace.record("restored", self.rank, self._trace.iteration())

    # ------------------------------------------------------------------ end
    def shutdown(self, exc: Optional[BaseException] = None) -> None:
        """Leave the job on an error path (idempotent): report ``exc`` to the coordinator
        (the job stops with it; no spare is spent on a local error), stop the threads and
        free the communicators, so the process exits cleanly."""
        if self._runtime is not None:
            if exc is not None and not (isinstance(exc, SystemExit) and not exc.code):
                self._runtime.report_fatal(exc)
            self._runtime.close()
        else:
            from .recovery.abort import destroy_world

            destroy_world()

    def finish(self, model, optimizer, results_dir: Optional[str] = None,
               extra: Optional[dict] = None, train_state=None, scheduler=None) -> str:
        """The job's state fingerprint: every rank's params, optimizer shard (main params,
        moments, step) and, given ``train_state``, everything else a resumed run depends on
        (RNG states, iteration, consumed samples, scheduler, grad scaler)."""
        import torch.distributed as dist

        from .adapters import train_state as state_io

        resume = None
        if train_state is not None:
            resume = state_io.capture(train_state.iteration, train_state, scheduler, optimizer,
                                      with_cuda=self.device.type == "cuda")
        digest = shard.rank_digest(model, optimizer, resume)
        parts = shard.digest_parts(model, optimizer, resume)
        combined = shard.combine_digests(shard.gather_digests(digest, self.device))
        extra_fields = extra
        extra = self._runtime.finish() if self._runtime is not None else {}
        dist.barrier()
        from .recovery.abort import destroy_world

        destroy_world()
        results_dir = results_dir or self.results_dir
        if self._loss_log is not None:
            self._loss_log.close()
        if results_dir:
            with open(os.path.join(results_dir, f"rank{self.rank}.json"), "w") as f:
                json.dump({"rank": self.rank, "digest": digest, "digest_parts": parts,
                           "final_state_sha256": combined,
                           **extra, **(extra_fields or {})}, f)
        return combined
