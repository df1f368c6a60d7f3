"""``deadpool launch``: start worker processes grouped into nodes, locally (every node
simulated on this machine) or as the agent of one real node (``--node-rank``), and supervise
them until the job ends. Node 0's agent hosts the coordinator store, the decider and the
fault driver::

    validate ─► store + decider (node 0) ─► agents start workers ─► supervise loop:
        agent.poll (exits, commands, heartbeat) ─► decider.step ─► fault driver
        ─► [respawn replaced processes as spares] ─► until every worker has exited
    ─► summary (``summary.py``)
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional

from ..membership import store as st
from ..base.errors import StopReason
from ..base.state import Role
from ..membership.decider import Decider, Proc
from ..mirror import placement
from ..recovery.phases import EventSink
from ..base.worker_env import WorkerEnv
from .agent import STOP_GRACE_S, NodeAgent, WorkerSpec
from .fault_driver import FaultDriver
from .name_lookup import warn_if_slow
from .nvrx import Nvrx, resume_or_load, worker_env
from .options import LaunchOptions, free_port, validate, worker_command, worker_specs
from .slurm_drain import watch_this_node
from .summary import build_summary

__all__ = ["LaunchOptions", "run"]


@dataclass
class Job:
    """One launch, as the supervision loop sees it."""

    opts: LaunchOptions
    cfg: object
    say: object
    agents: List[NodeAgent]
    prefix: Dict[int, str]
    store: object = None
    coord: Optional[st.Coordinator] = None
    decider: Optional[Decider] = None
    driver: Optional[FaultDriver] = None
    failed: Optional[str] = None
    seen_plans: int = 1
    env: WorkerEnv = field(default_factory=WorkerEnv)
    joined: bool = False  # a spare node that joined a running job (--join-as-spare)
    stop_reason: Optional[str] = None  # the coordinator's shutdown message, once seen
    nvrx: Optional[Nvrx] = None  # NVRx's rank-monitor client, under ft_launcher

    def beat(self) -> None:
        if self.nvrx is not None:
            self.nvrx.beat()

    @property
    def hosts_store(self) -> bool:
        return not self.joined and (self.opts.node_rank is None or self.opts.node_rank == 0)


def run(opts: LaunchOptions, out=sys.stdout) -> dict:
    """Run the job; returns the summary dict (also written to --summary-json)."""
    cfg, faults = validate(opts)
    say = (lambda m: None) if opts.quiet else (lambda m: print(f"[launch] {m}", file=out,
                                                               flush=True))
    if opts.spare_nodes and not cfg.enabled:
        say("warning: --spare-nodes ignored: spares are only started with --deadpool")
    if opts.join_as_spare:
        return _join_as_spare(opts, cfg, say, out)
    if opts.script and cfg.enabled:  # a restart under ft_launcher: the fallback or --load
        opts.trainer_argv = resume_or_load(opts.trainer_argv, opts.world_size, say)
    job = _setup(opts, cfg, faults, say, out)
    if cfg.enabled:  # every connection to the coordinator, this node's included
        warn_if_slow(opts.master_addr, say)
    job.nvrx = Nvrx.connect(say) if cfg.enabled else None
    t0 = time.time()
    say(f"{opts.nodes} node(s) x {opts.procs_per_node} + {opts.spare_nodes if cfg.enabled else 0}"
        f" spare node(s); world size {opts.world_size}; results in {job.env.results_dir}")
    if cfg.enabled and job.hosts_store:  # for `deadpool drain` (with the job's secret)
        say(f"coordinator {opts.master_addr}:{job.env.store_port}")
    for a in job.agents:
        a.start()
    slurm = (watch_this_node(opts.node_rank, job.coord, say)
             if cfg.enabled and opts.node_rank is not None else None)  # a Slurm DRAIN
    restore = _stop_on_signals(job)
    try:
        _supervise(job)
    except KeyboardInterrupt:
        job.failed = "interrupted"
    except Signalled as exc:
        job.failed = f"launcher stopped by {exc}"
        say(f"{job.failed}: winding down (a second signal kills the workers at once)")
    finally:
        if slurm is not None:
            slurm.stop()
        _wind_down(job)
        restore()
        if job.nvrx is not None:
            job.nvrx.close()
    codes = {lid: code for a in job.agents for lid, code in a.exit_codes.items()}
    summary = build_summary(opts, cfg, job.env.results_dir, job.decider, codes,
                            job.failed, time.time() - t0,
                            fault_records=job.driver.records if job.driver else ())
    if (cfg.enabled and not job.hosts_store and not summary["ok"] and _killed_here(job)
            and not any(a.alive() for a in job.agents)
            and job.stop_reason and StopReason.of(job.stop_reason) is StopReason.COMPLETE):
        # every process of this node was replaced elsewhere, and the job completed: the
        # node's outcome is the job's (its results may still be on their way, or on
        # another node's disk), not a failure its restarter would answer
        summary.update(ok=True, replaced_here=True, reason=job.stop_reason)
    saved = summary.get("fallback_save")
    if job.failed and saved:
        say(f"fallback save: iteration {saved['iteration']} of every rank in {saved['dir']} "
            f"({saved['bytes']} bytes); resume with --deadpool-resume {saved['dir']}"
            if saved["iteration"] is not None else
            f"fallback save: {saved['dir']} holds no iteration for every rank")
    if opts.summary_json and job.hosts_store:
        with open(opts.summary_json, "w") as f:
            json.dump(summary, f, indent=2)
    return summary


class Signalled(Exception):
    """The launcher got SIGTERM or SIGHUP (the signal's name): the job winds down."""


def _stop_on_signals(job: Job):
    """SIGTERM or SIGHUP ends supervision like Ctrl-C: the wind-down gives every worker
    SIGTERM, then SIGKILL after its grace. A second SIGTERM, SIGHUP or SIGINT kills every
    worker's process group at once. A launcher killed outright is covered on the workers'
    side (``worker_env.exit_with_launcher``). Returns what puts the old handlers back."""
    seen = []

    def handler(signum, frame):
        seen.append(signum)
        if len(seen) == 1:
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            raise Signalled(signal.Signals(signum).name)
        for a in job.agents:
            a.kill_all()

    old = {}
    try:
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
            old[sig] = signal.signal(sig, handler)
    except ValueError:  # not the main thread (an embedding caller): its signals, its call
        pass
    return lambda: [signal.signal(sig, h) for sig, h in old.items()]


def _setup(opts: LaunchOptions, cfg, faults, say, out) -> Job:
    local = opts.node_rank is None
    fixed_port = opts.master_port is not None  # then the store is at master_port + 1
    if opts.master_port is None:
        opts.master_port = free_port() if local else 29500
    store_port = opts.master_port + 1 if (fixed_port or not local) else free_port()
    results_dir = opts.results_dir or tempfile.mkdtemp(prefix="deadpool-run-")
    os.makedirs(results_dir, exist_ok=True)
    token = os.environ.get("DEADPOOL_TOKEN") or secrets.token_hex(16)
    specs = worker_specs(opts, with_spares=cfg.enabled, standbys=cfg.standbys_per_node)
    job = Job(opts=opts, cfg=cfg, say=say, agents=[],
              prefix={s.lid: (f"n{s.node} r{s.rank}" if s.rank is not None
                              else f"n{s.node} {'standby' if s.standby else 'spare'}{s.lid}")
                      for s in specs},
              # store port 0: no coordinator (without --deadpool), nobody to report to
              env=WorkerEnv(store_host=opts.master_addr,
                            store_port=store_port if cfg.enabled else 0,
                            results_dir=results_dir, faults=faults,
                            bench_block=opts.bench_block, world_size=opts.world_size,
                            master_addr=opts.master_addr, master_port=opts.master_port))
    if cfg.enabled:
        job.store = st.connect(opts.master_addr, store_port,
                               timeout_s=cfg.rendezvous_timeout_s, is_master=job.hosts_store)
        job.coord = st.Coordinator(job.store, token)
        if not job.hosts_store:
            job.coord.check_secret(cfg.rendezvous_timeout_s)  # wrong token: start nothing
    base_env = {k: v for k, v in os.environ.items() if k not in WorkerEnv.variables()}
    base_env.update({"DEADPOOL_TOKEN": token, "PYTHONUNBUFFERED": "1"})
    base_env = worker_env(base_env)  # NVRx's sockets stay with this launcher
    if opts.script:
        from ..megatron import tree

        base_env.update(tree.prepare(os.path.dirname(os.path.abspath(opts.script)),
                                     cpu=opts.device == "cpu", log=say))
    if cfg.enabled and job.hosts_store:
        _start_decider(job, specs, token, faults)
        job.coord.publish_job_env(job.env.to_env())  # for spare nodes that join later
    nodes = sorted({s.node for s in specs}) if local else [opts.node_rank]
    argv = worker_command(opts)
    device_env = _device_env(opts, say)
    job.agents = [NodeAgent(node, [s for s in specs if s.node == node], argv, base_env,
                            job.env, job.coord, job.prefix, out=out, use_store=cfg.enabled,
                            device_env=device_env)
                  for node in nodes]
    return job


def _device_env(opts: LaunchOptions, say):
    """Each worker's GPU placement; the shared-GPU mode's NCCL settings are said once."""
    from . import gpus

    if opts.share_gpu:
        mode = gpus.describe(True)
        say(f"shared-GPU mode ({mode['note']}): GPU(s) {','.join(gpus.visible_gpus())}; "
            + " ".join(f"{k}={v}" for k, v in mode["nccl_env"].items())
            + f" and {gpus.HOSTID_VAR}={mode['per_process'][gpus.HOSTID_VAR]} per process")
    return opts.device_env(gpus.visible_gpus() if opts.device == "cuda" else [])


def _join_as_spare(opts: LaunchOptions, cfg, say, out) -> dict:
    """``--join-as-spare``: one more spare node for a running job. Its processes stand by
    like the job's own spares until promoted or released at the end."""
    token = os.environ.get("DEADPOOL_TOKEN")
    if not token:
        from ..base.errors import ConfigError

        raise ConfigError("--join-as-spare needs the job's DEADPOOL_TOKEN in the environment")
    store = st.connect(opts.master_addr, opts.master_port + 1, cfg.rendezvous_timeout_s)
    coord = st.Coordinator(store, token)
    coord.check_secret(cfg.rendezvous_timeout_s)
    node, lids = coord.request_spare_node(opts.procs_per_node, cfg.rendezvous_timeout_s)
    env = WorkerEnv.from_env(coord.job_env(cfg.rendezvous_timeout_s))
    specs = [WorkerSpec(lid=lid, node=node, role=Role.SPARE, rank=None, local_rank=i)
             for i, lid in enumerate(lids)]
    prefix = {lid: f"n{node} spare{lid}" for lid in lids}
    base_env = {k: v for k, v in os.environ.items() if k not in WorkerEnv.variables()}
    base_env["PYTHONUNBUFFERED"] = "1"
    agent = NodeAgent(node, specs, worker_command(opts), base_env, env, coord, prefix, out=out,
                      device_env=_device_env(opts, say))
    job = Job(opts=opts, cfg=cfg, say=say, agents=[agent], prefix=prefix, store=store,
              coord=coord, env=env, joined=True)
    say(f"joined as spare node {node} with processes {lids}")
    agent.start()
    try:
        _supervise(job)
    finally:
        agent.terminate_all()
        agent.join_output()
    codes = agent.exit_codes
    return {"ok": all(c == 0 for c in codes.values()), "node": node, "exit_codes": codes,
            "reason": job.stop_reason, "error": None if all(
                c == 0 for c in codes.values()) else f"spare process exit codes {codes}"}


def _start_decider(job: Job, specs: List[WorkerSpec], token: str, faults) -> None:
    procs = {s.lid: Proc(lid=s.lid, node=s.node, role=s.role, rank=s.rank, standby=s.standby)
             for s in specs}
    doms = placement.domains(job.cfg.failure_domains)
    job.decider = Decider(store=job.store, procs=procs, world_size=job.opts.world_size,
                          token=token, send_command=job.coord.push_command,
                          config=job.cfg.decider(), log=job.say,
                          domain_of=(lambda n: doms.get(n, ("node", n))) if doms else None,
                          emit=EventSink(job.cfg.events_path).emit)
    job.driver = FaultDriver(faults, job.decider, job.coord.push_command, job.say,
                             claim=lambda i: job.store.add(st.k("inject", i), 1) == 1)
    job.decider.publish_initial_plan()


def _supervise(job: Job) -> None:
    while True:
        try:
            exited = [(a, lid, code) for a in job.agents for lid, code in a.poll()]
        except RuntimeError:  # DistNetworkError: node 0 closed the store after the job ended
            if job.hosts_store or job.stop_reason is None:
                raise  # the coordinator vanished mid-job
            _wait_for_exit(job, grace_s=30.0)  # our processes saw the stop: they leave
            return
        d = job.decider
        if job.opts.respawn_spares and d is not None and not d.finished:
            _respawn(job, exited)
        if not job.cfg.enabled:  # no DeadPool: a failed worker ends the job
            bad = [(lid, code) for _, lid, code in exited if code != 0]
            if bad and job.failed is None:
                job.failed = f"worker(s) {bad} failed (lid, exit code); stopping the job"
                job.say(job.failed)
                return
        elif d is not None:  # node 0 decides what a failed worker means; others run theirs
            d.step()
            job.driver.poll(time.time())
            _name_promoted(job)
            if d.failed_reason and job.failed is None:
                job.failed = d.failed_reason
                return
        idle = not any(a.alive() for a in job.agents)
        if job.cfg.enabled and not job.hosts_store:
            job.stop_reason = job.stop_reason or job.coord.shutdown_reason()
            if job.stop_reason is not None and idle:
                return
            # its processes crashed or were killed, and DeadPool moved their ranks: the node
            # is alive and stays up until the job ends. Leaving now would end the node's
            # launcher early with a failure, which a restarter above it (one NVRx
            # ft_launcher per node) answers by restarting every node.
            idle = idle and not _killed_here(job)
        if idle:
            return
        job.beat()
        time.sleep(0.02)


def _killed_here(job: Job) -> bool:
    """A process of this machine's nodes ended with a failure (not drained, not done)."""
    return any(code != 0 for a in job.agents for code in a.exit_codes.values())


def _wait_for_exit(job: Job, grace_s: float) -> None:
    deadline = time.monotonic() + grace_s
    while any(a.alive() for a in job.agents) and time.monotonic() < deadline:
        time.sleep(0.05)


def _respawn(job: Job, exited) -> None:
    """Simulated nodes: a process that died is replaced by a fresh standby spare on its
    node (the node "returns"), so the spare pool stays topped up."""
    by_node = {a.node: a for a in job.agents}
    for a, lid, code in exited:
        dead = job.decider.procs.get(lid)
        if dead is None or dead.state == "done" or code == 0:
            continue
        new = job.decider.new_lid()
        spec = WorkerSpec(lid=new, node=dead.node, role=Role.SPARE, rank=None,
                          local_rank=next((w.local_rank for w in a.workers if w.lid == lid), 0))
        job.decider.procs[new] = Proc(lid=new, node=dead.node, role=Role.SPARE)
        job.prefix[new] = f"n{dead.node} spare{new}"
        by_node[dead.node].spawn(spec)
        job.say(f"process {lid} replaced by standby spare {new} on node {dead.node}")


def _name_promoted(job: Job) -> None:
    """Output prefixes follow promotions: a spare's lines read as the rank it took."""
    plans = job.decider.plans
    while job.seen_plans < len(plans):
        for r, lid in plans[job.seen_plans].spare_of_rank.items():
            job.prefix[lid] = f"n{job.decider.procs[lid].node} r{r}"
        job.seen_plans += 1


def _wind_down(job: Job) -> None:
    if job.failed and job.decider is not None:
        job.decider.stop(job.failed)
        # Workers leave on their own; with a fallback save they first write their copies.
        deadline = time.time() + (max(10.0, job.cfg.rendezvous_timeout_s)
                                  if job.cfg.fallback_save_dir else 10.0)
        while any(a.alive() for a in job.agents) and time.time() < deadline:
            job.beat()  # the survivors write the fallback save: NVRx keeps waiting
            time.sleep(0.05)
    for a in job.agents:  # one grace for all the nodes, not one per node in turn
        a.ask_to_stop()
    deadline = time.monotonic() + STOP_GRACE_S
    while any(a.alive() for a in job.agents) and time.monotonic() < deadline:
        time.sleep(0.05)
    for a in job.agents:
        a.terminate_all(grace_s=0.0)
        a.join_output()

