"""``deadpool launch``: start worker processes grouped into nodes, locally (every node
simulated on this machine) or as the agent of one real node (``--node-rank``).

Process ids ("lid"): active ranks take lids 0..W-1 (lid == initial global rank, node =
lid // procs_per_node); spare processes take lids W.. on nodes N..N+S-1. Node 0's agent
hosts the coordinator store and the decider.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import socket
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional

from ..config import add_deadpool_args, DeadpoolConfig
from ..errors import ConfigError
from ..membership import store as st
from ..membership.decider import Decider, DeciderConfig, Proc
from . import inject
from .agent import NodeAgent, WorkerSpec


@dataclass
class LaunchOptions:
    nodes: int
    procs_per_node: int
    spare_nodes: int = 0
    node_rank: Optional[int] = None
    master_addr: str = "127.0.0.1"
    master_port: Optional[int] = None
    summary_json: Optional[str] = None
    script: Optional[str] = None
    inject: List[str] = field(default_factory=list)
    results_dir: Optional[str] = None
    trainer_argv: List[str] = field(default_factory=list)
    quiet: bool = False
    device: Optional[str] = None  # cpu | cuda; None: the trainer's own default
    # Simulated nodes only: a process that died is replaced by a fresh standby spare on
    # the same node (the node "returns"), so the spare pool stays topped up (soak).
    respawn_spares: bool = False


    def __post_init__(self):
        if self.nodes < 1 or self.procs_per_node < 1:
            raise ConfigError("--nodes and --procs-per-node must be >= 1")
        if self.spare_nodes < 0:
            raise ConfigError("--spare-nodes must be >= 0")
        total = self.nodes + self.spare_nodes
        if self.node_rank is not None and not 0 <= self.node_rank < total:
            raise ConfigError(f"--node-rank {self.node_rank} is outside 0..{total - 1}")
        if self.device not in (None, "cpu", "cuda"):
            raise ConfigError(f"--device must be cpu or cuda, got {self.device!r}")

    @property
    def world_size(self) -> int:
        return self.nodes * self.procs_per_node


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _deadpool_config(argv: List[str]) -> DeadpoolConfig:
    p = argparse.ArgumentParser(add_help=False)
    add_deadpool_args(p)
    known, _ = p.parse_known_args(argv)
    return DeadpoolConfig.from_args(known)


def validate(opts: LaunchOptions):
    """Reject bad input once, before anything starts. Returns (deadpool config, faults)."""
    if opts.script is None:
        from ..trainer.args import parse_args, validate as validate_trainer

        targs = validate_trainer(parse_args(opts.trainer_argv), opts.world_size)
        cfg, train_iters = targs.deadpool_config, targs.train_iters
        if cfg.enabled:
            from ..megatron.lm import check_installed_megatron_core

            check_installed_megatron_core()
    else:
        if not os.path.exists(opts.script):
            raise ConfigError(f"--script {opts.script} does not exist")
        cfg, train_iters = _deadpool_config(opts.trainer_argv), _flag_int(
            opts.trainer_argv, "--train-iters")
        from ..trainer.args import check_layout

        a = opts.trainer_argv
        check_layout(opts.world_size, _flag_int(a, "--tensor-model-parallel-size", 1),
                     _flag_int(a, "--pipeline-model-parallel-size", 1),
                     _flag_int(a, "--micro-batch-size"), _flag_int(a, "--global-batch-size"),
                     cp=_flag_int(a, "--context-parallel-size", 1))
    if opts.script is not None and cfg.enabled:
        from ..megatron import tree

        root = os.path.dirname(os.path.abspath(opts.script))
        if tree.is_megatron_tree(root):
            tree.check_for_deadpool(root)
            from ..errors import UnsupportedConfigError
            from ..megatron.lm import unsupported_argv

            bad = unsupported_argv(opts.trainer_argv)
            if bad:
                raise UnsupportedConfigError("--deadpool does not support: " + "; ".join(bad))
    faults = inject.parse_schedule(opts.inject)
    if faults and not cfg.enabled:
        raise ConfigError("--inject needs --deadpool in the trainer flags")
    if faults:
        inject.validate_schedule(faults, total_nodes=opts.nodes + opts.spare_nodes,
                                 world_size=opts.world_size,
                                 train_iters=train_iters if train_iters else 10**9)
    if cfg.enabled and opts.nodes < cfg.replicas + 1:
        raise ConfigError(f"--deadpool-replicas {cfg.replicas} needs at least "
                          f"{cfg.replicas + 1} nodes (got --nodes {opts.nodes})")
    return cfg, faults


def _flag_int(argv: List[str], flag: str, default: Optional[int] = None) -> Optional[int]:
    """The value of ``flag N`` or ``flag=N`` (the last one, as argparse takes it)."""
    value = None
    for i, x in enumerate(argv):
        if x == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif x.startswith(flag + "="):
            value = x[len(flag) + 1:]
    try:
        return default if value is None else int(value)
    except ValueError:
        raise ConfigError(f"{flag} needs an integer, got {value!r}") from None


def worker_command(opts: LaunchOptions) -> List[str]:
    """The worker's command line. The reference trainer runs as a module; ``--script`` runs
    through the child wrapper (``launch/child.py``), which in CPU mode gets the CPU-only
    Megatron-LM flags that are missing (``megatron.lm.CPU_FLAGS``)."""
    if opts.script is None:
        argv = list(opts.trainer_argv)
        if opts.device and "--device" not in argv:
            argv += ["--device", opts.device]
        return [sys.executable, "-m", "megatron_deadpool.trainer.gpt", *argv]
    from ..megatron import lm

    cmd = [sys.executable, "-m", "megatron_deadpool.launch.child"]
    argv = list(opts.trainer_argv)
    if opts.device:
        cmd += ["--device", opts.device]
    if opts.device == "cpu":
        argv = lm.cpu_flags(argv)
    return [*cmd, os.path.abspath(opts.script), *argv]


def worker_specs(opts: LaunchOptions, with_spares: bool) -> List[WorkerSpec]:
    W, P = opts.world_size, opts.procs_per_node
    specs = [WorkerSpec(lid=r, node=r // P, role="active", rank=r, local_rank=r % P)
             for r in range(W)]
    if with_spares:
        for i in range(opts.spare_nodes * P):
            specs.append(WorkerSpec(lid=W + i, node=opts.nodes + i // P, role="spare",
                                    rank=None, local_rank=i % P))
    return specs


def run(opts: LaunchOptions, out=sys.stdout) -> dict:
    """Run the job; returns the summary dict (also written to --summary-json)."""
    cfg, faults = validate(opts)
    say = (lambda m: None) if opts.quiet else (lambda m: print(f"[launch] {m}", file=out,
                                                               flush=True))
    if opts.spare_nodes and not cfg.enabled:
        say("warning: --spare-nodes ignored: spares are only started with --deadpool")
    local = opts.node_rank is None
    if opts.master_port is None:
        opts.master_port = free_port() if local else 29500
    store_port = opts.master_port + 1 if not local else free_port()
    results_dir = opts.results_dir or tempfile.mkdtemp(prefix="deadpool-run-")
    os.makedirs(results_dir, exist_ok=True)
    token = os.environ.get("DEADPOOL_TOKEN") or secrets.token_hex(16)
    specs = worker_specs(opts, with_spares=cfg.enabled)
    my_nodes = sorted({s.node for s in specs}) if local else [opts.node_rank]
    hosts_store = local or opts.node_rank == 0

    store = coord = None
    if cfg.enabled:
        store = st.connect(opts.master_addr, store_port, timeout_s=cfg.rendezvous_timeout_s,
                           is_master=hosts_store)
        coord = st.Coordinator(store, token)
        if not hosts_store:
            coord.check_secret(cfg.rendezvous_timeout_s)  # wrong token: refuse, start nothing
    base_env = dict(os.environ)
    base_env.update({
        "MASTER_ADDR": opts.master_addr, "MASTER_PORT": str(opts.master_port),
        "WORLD_SIZE": str(opts.world_size), "DEADPOOL_TOKEN": token,
        "DEADPOOL_STORE_HOST": opts.master_addr, "DEADPOOL_STORE_PORT": str(store_port),
        "DEADPOOL_INJECT": inject.to_json(faults), "DEADPOOL_RESULTS_DIR": results_dir,
        "PYTHONUNBUFFERED": "1",
    })
    if opts.script:
        from ..megatron import tree

        base_env.update(tree.prepare(os.path.dirname(os.path.abspath(opts.script)),
                                     cpu=opts.device == "cpu", log=say))
    argv = worker_command(opts)

    prefix = {s.lid: (f"n{s.node} r{s.rank}" if s.rank is not None else f"n{s.node} spare{s.lid}")
              for s in specs}
    decider = None
    if cfg.enabled and hosts_store:
        procs = {s.lid: Proc(lid=s.lid, node=s.node, role=s.role, rank=s.rank) for s in specs}
        decider = Decider(
            store=store, procs=procs, world_size=opts.world_size, token=token, faults=faults,
            send_command=coord.push_command,
            config=DeciderConfig(heartbeat_timeout_s=cfg.heartbeat_timeout_s,
                                 progress_timeout_s=cfg.progress_timeout_s,
                                 heartbeat_interval_s=cfg.heartbeat_interval_s,
                                 starting_spare_wait_s=min(30.0,
                                                           cfg.rendezvous_timeout_s / 2)),
            log=say)
        decider.publish_initial_plan()
    agents = [NodeAgent(node, [s for s in specs if s.node == node], argv, base_env, coord,
                        prefix, out=out, use_store=cfg.enabled) for node in my_nodes]
    t0 = time.time()
    say(f"{opts.nodes} node(s) x {opts.procs_per_node} + {opts.spare_nodes if cfg.enabled else 0}"
        f" spare node(s); world size {opts.world_size}; results in {results_dir}")
    for a in agents:
        a.start()
    failed: Optional[str] = None
    seen_plans = 1
    next_lid = len(specs)
    by_node = {a.node: a for a in agents}
    try:
        while True:
            exited = [(a, lid, code) for a in agents for lid, code in a.poll()]
            if opts.respawn_spares and decider is not None and not decider.finished:
                for a, lid, code in exited:
                    dead = decider.procs.get(lid)
                    if dead is None or dead.state == "done" or code == 0:
                        continue
                    spec = WorkerSpec(lid=next_lid, node=dead.node, role="spare", rank=None,
                                      local_rank=next((w.local_rank for w in a.workers
                                                       if w.lid == lid), 0))
                    decider.procs[next_lid] = Proc(lid=next_lid, node=dead.node, role="spare")
                    prefix[next_lid] = f"n{dead.node} spare{next_lid}"
                    by_node[dead.node].spawn(spec)
                    say(f"process {lid} replaced by standby spare {next_lid} on node "
                        f"{dead.node}")
                    next_lid += 1
            if decider is None:
                bad = [(lid, code) for _, lid, code in exited if code != 0]
                if bad and failed is None:
                    failed = f"worker(s) {bad} failed (lid, exit code); stopping the job"
                    say(failed)
                    break
            else:
                decider.step()
                while seen_plans < len(decider.plans):
                    plan = decider.plans[seen_plans]
                    for r, lid in plan["spare_ranks"].items():
                        prefix[int(lid)] = f"n{decider.procs[int(lid)].node} r{r}"
                    seen_plans += 1
                if decider.failed_reason and failed is None:
                    failed = decider.failed_reason
                    break
            if not cfg.enabled or not hosts_store:
                if cfg.enabled and coord.shutdown_reason() is not None and not any(
                        a.alive() for a in agents):
                    break
            if not any(a.alive() for a in agents):
                break
            time.sleep(0.02)
    except KeyboardInterrupt:
        failed = "interrupted"
    finally:
        if failed and decider is not None:
            decider._shutdown(failed)
            deadline = time.time() + 10
            while any(a.alive() for a in agents) and time.time() < deadline:
                time.sleep(0.05)
        for a in agents:
            a.terminate_all()
            a.join_output()
    codes = {lid: code for a in agents for lid, code in a.exit_codes.items()}
    summary = build_summary(opts, cfg, results_dir, decider, store, codes, failed,
                            time.time() - t0)
    if opts.summary_json and hosts_store:
        with open(opts.summary_json, "w") as f:
            json.dump(summary, f, indent=2)
    return summary


def _layout(opts: LaunchOptions) -> dict:
    tp = pp = 1
    a = opts.trainer_argv
    for i, x in enumerate(a):
        if x == "--tensor-model-parallel-size":
            tp = int(a[i + 1])
        if x == "--pipeline-model-parallel-size":
            pp = int(a[i + 1])
    return {"tp": tp, "pp": pp, "dp": opts.world_size // (tp * pp),
            "world_size": opts.world_size, "nodes": opts.nodes,
            "procs_per_node": opts.procs_per_node, "spare_nodes": opts.spare_nodes}


def read_losses(results_dir: str) -> List[float]:
    path = os.path.join(results_dir, "losses.jsonl")
    by_iter: Dict[int, float] = {}
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                rec = json.loads(line)
                by_iter[rec["iteration"]] = rec["loss"]
    return [by_iter[i] for i in sorted(by_iter)]


def build_summary(opts, cfg, results_dir, decider, store, codes, failed, wall_s) -> dict:
    ranks = []
    for r in range(opts.world_size):
        path = os.path.join(results_dir, f"rank{r}.json")
        if os.path.exists(path):
            with open(path) as f:
                ranks.append(json.load(f))
    shas = {x["final_state_sha256"] for x in ranks}
    complete = len(ranks) == opts.world_size and len(shas) == 1 and not failed
    losses = read_losses(results_dir)
    summary = {
        "layout": _layout(opts),
        "completed_iters": len(losses),
        "losses": losses,
        "final_state_sha256": shas.pop() if complete else None,
        "ok": complete,
        "error": failed,
        "wall_s": round(wall_s, 3),
        "results_dir": results_dir,
        "exit_codes": {str(k): v for k, v in sorted(codes.items())},
    }
    if ranks:
        summary["mirror"] = {
            "waits": sum(x.get("mirror_waits", 0) for x in ranks),
            "host_bytes_per_rank": max(x.get("host_bytes", 0) for x in ranks),
            "mirror_bytes_per_rank": max(x.get("mirror_bytes", 0) for x in ranks),
        }
    if decider is not None:
        summary["faults"] = [{k: v for k, v in f.items() if k != "t"} | {"t": round(f["t"], 3)}
                             for f in decider.fault_records]
        summary["recoveries"] = [_recovery(plan, store, opts.world_size)
                                 for plan in decider.plans[1:]]
    return summary


def _recovery(plan: dict, store, world_size: int) -> dict:
    from ..recovery.phases import PHASE_ORDER

    reports = []
    for r in range(world_size):
        key = st.k("report", plan["gen"], r)
        if store.check([key]):
            reports.append(st.get_json(store, key))
    phases = {"detect": round(plan.get("detect_s", 0.0), 4)}
    for ph in PHASE_ORDER[1:]:
        vals = [x["phases_s"].get(ph) for x in reports if ph in x.get("phases_s", {})]
        if vals:
            phases[ph] = round(max(vals), 4)
    restored = reports[0]["restored_iter"] if reports else None
    at_fail = [x["iteration_at_failure"] for x in reports if x["iteration_at_failure"] is not None]
    return {
        "generation": plan["gen"],
        "failed_ranks": plan["failed_ranks"],
        "spare_ranks": plan["spare_ranks"],
        "restored_iter": restored,
        "recomputed_iters": (max(at_fail) - restored) if at_fail and restored is not None
        else None,
        "phases_s": phases,
        "total_s": round(sum(phases.values()), 4),
        "ranks_reported": len(reports),
        # superseded: a further failure during this recovery moved on to a newer generation
        "superseded": not reports,
    }
