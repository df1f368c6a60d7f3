"""``deadpool launch`` options: the job's shape, validated once before anything starts,
and what each worker process runs.

Process ids ("lid"): active ranks take lids 0..W-1 (lid == initial global rank, node =
lid // procs_per_node); spare processes take lids W.. on nodes N..N+S-1.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from dataclasses import dataclass, field
from typing import List, Optional

from ..base import faults as fault_schedule
from ..base.config import DeadpoolConfig, replicas_refusal
from ..base.errors import ConfigError
from ..base.state import Role
from ..flags import add_deadpool_args
from .agent import WorkerSpec
from .nvrx import flag_value


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
    # --device cuda with more processes than GPUs on a machine (launch/gpus.py): a test
    # layout, every process its own NCCL host on the socket transport
    share_gpu: bool = False
    # Simulated nodes only: a process that died is replaced by a fresh standby spare on
    # the same node (the node "returns"), so the spare pool stays topped up (soak).
    respawn_spares: bool = False
    # Benchmark only (`deadpool bench overhead`): mirror in alternating blocks of this many
    # iterations (0: every iteration).
    bench_block: int = 0
    # Add a spare node to a running job (its coordinator at --master-addr/--master-port+1,
    # DEADPOOL_TOKEN as the job's): needs the job's --nodes, --procs-per-node and flags.
    join_as_spare: bool = False

    def __post_init__(self):
        if self.nodes < 1 or self.procs_per_node < 1:
            raise ConfigError("--nodes and --procs-per-node must be >= 1")
        if self.spare_nodes < 0:
            raise ConfigError("--spare-nodes must be >= 0")
        total = self.nodes + self.spare_nodes
        if self.node_rank is not None and not 0 <= self.node_rank < total:
            raise ConfigError(f"--node-rank {self.node_rank} is outside 0..{total - 1}")
        if self.join_as_spare and (self.master_port is None or self.node_rank is not None):
            raise ConfigError("--join-as-spare needs the running job's --master-addr and "
                              "--master-port (and no --node-rank)")
        if self.device not in (None, "cpu", "cuda"):
            raise ConfigError(f"--device must be cpu or cuda, got {self.device!r}")
        if self.share_gpu and self.device != "cuda":
            raise ConfigError("--share-gpu needs --device cuda")

    @property
    def world_size(self) -> int:
        return self.nodes * self.procs_per_node

    @property
    def simulated(self) -> bool:
        """Every node simulated on this machine (no --node-rank, not joining a job)."""
        return self.node_rank is None and not self.join_as_spare

    def procs_here(self, with_spares: bool, standbys: int = 0) -> int:
        """Worker processes started on this machine at launch."""
        nodes = (self.nodes + (self.spare_nodes if with_spares else 0)
                 if self.simulated else 1)
        return nodes * self.procs_per_node + (self.nodes if self.simulated else 1) * standbys

    def device_env(self, gpus: List[str]):
        """Per worker: the variables that place it on a GPU (``launch/gpus.py``)."""
        from . import gpus as placement

        if self.device != "cuda":
            return lambda w: {}
        P = self.procs_per_node

        def env(w: WorkerSpec) -> dict:
            if w.standby and not self.share_gpu:  # it binds the GPU of the rank it takes
                return placement.standby_env(gpus, w.node, P, pin=self.simulated)
            slot = w.node * P + w.local_rank if self.simulated else w.local_rank
            return placement.process_env(gpus, slot, w.node, w.lid, self.share_gpu,
                                         pin=self.simulated)
        return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port_pair() -> int:
    """A port P with P and P+1 free (the store and the coordinator, --master-port)."""
    while True:
        p = free_port()
        if p < 60000:
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", p + 1))
                    return p
                except OSError:
                    continue


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
            from ..adapters.lm_rules import check_installed_megatron_core

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
            from ..base.errors import UnsupportedConfigError
            from ..adapters.lm_rules import unsupported_argv

            from .nvrx import under_ft_launcher

            bad = unsupported_argv(opts.trainer_argv, under_ft_launcher())
            if bad:
                raise UnsupportedConfigError("--deadpool does not support: " + "; ".join(bad))
    faults = _faults(opts, cfg, train_iters)
    why = replicas_refusal(cfg.replicas, nodes=opts.nodes, spare_nodes=opts.spare_nodes)
    if cfg.enabled and why:
        raise ConfigError(why)
    if opts.device == "cuda":
        from . import gpus

        # a node's standbys share its GPUs (none bound until one takes a rank): only the
        # processes that hold a GPU count, except in the shared mode, where each is placed
        standbys = cfg.standbys_per_node if opts.share_gpu else 0
        gpus.check(opts.procs_here(cfg.enabled, standbys), opts.share_gpu,
                   gpus.visible_gpus())
    return cfg, faults


def _faults(opts: LaunchOptions, cfg, train_iters: Optional[int]):
    """The ``--inject`` schedule, parsed, its domains resolved, checked against the job."""
    faults = fault_schedule.parse_schedule(opts.inject)
    if faults and not cfg.enabled:
        raise ConfigError("--inject needs --deadpool in the trainer flags")
    if faults:
        from ..mirror import placement

        doms = placement.domains(cfg.failure_domains)
        faults = fault_schedule.resolve_domains(faults, doms.get if doms else None,
                                                opts.nodes + opts.spare_nodes)
        fault_schedule.validate_schedule(faults, total_nodes=opts.nodes + opts.spare_nodes,
                                         world_size=opts.world_size,
                                         train_iters=train_iters if train_iters else 10**9)
    return faults


def _flag_int(argv: List[str], flag: str, default: Optional[int] = None) -> Optional[int]:
    """The value of ``flag N`` or ``flag=N`` as an int (the last one)."""
    value = flag_value(argv, flag)
    try:
        return default if value is None else int(value)
    except ValueError:
        raise ConfigError(f"{flag} needs an integer, got {value!r}") from None


def worker_command(opts: LaunchOptions) -> List[str]:
    """The worker's command line. The reference trainer runs as a module; ``--script`` runs
    through the child wrapper (``launch/child.py``), which in CPU mode gets the CPU-only
    Megatron-LM flags that are missing (``megatron.lm_rules.CPU_FLAGS``)."""
    if opts.script is None:
        argv = list(opts.trainer_argv)
        if opts.device and "--device" not in argv:
            argv += ["--device", opts.device]
        return [sys.executable, "-m", "megatron_deadpool.trainer.gpt", *argv]
    from ..adapters import lm_rules

    cmd = [sys.executable, "-m", "megatron_deadpool.launch.child"]
    argv = list(opts.trainer_argv)
    if opts.device:
        cmd += ["--device", opts.device]
    if opts.device == "cpu":
        argv = lm_rules.cpu_flags(argv)
    return [*cmd, os.path.abspath(opts.script), *argv]


def worker_specs(opts: LaunchOptions, with_spares: bool, standbys: int = 0
                 ) -> List[WorkerSpec]:
    """Actives, then the spare nodes' processes, then ``standbys`` warm standbys on each
    active node (local slots P, P+1, ...)."""
    W, P = opts.world_size, opts.procs_per_node
    specs = [WorkerSpec(lid=r, node=r // P, role=Role.ACTIVE, rank=r, local_rank=r % P)
             for r in range(W)]
    if with_spares:
        for i in range(opts.spare_nodes * P):
            specs.append(WorkerSpec(lid=W + i, node=opts.nodes + i // P, role=Role.SPARE,
                                    rank=None, local_rank=i % P))
    for i in range(opts.nodes * standbys):
        specs.append(WorkerSpec(lid=len(specs), node=i // standbys, role=Role.SPARE,
                                rank=None, local_rank=P + i % standbys, standby=True))
    return specs


