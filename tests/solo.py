"""A single-rank megatron-core job inside one process (world size 1, gloo, CPU mode), for
tests that drive the mirror and restore paths directly. CPU mode is process-global: import
this only in a subprocess (see ``run_solo``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parents[1]

TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "2",
        "--global-batch-size", "4", "--train-iters", "100", "--lr", "1e-2", "--mock-data",
        "--vocab-size", "64", "--device", "cpu", "--hidden-dropout", "0.1"]


def run_solo(script: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """Run ``script`` (Python source) in a fresh process with tests/ and the repo on the
    path."""
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "tests")]))
    return subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=timeout)


def solo_result(script: str, timeout: int = 300) -> dict:
    """``run_solo(script)``, which must exit 0 and print a line ``RESULT <json>``; that JSON
    (the last such line)."""
    import json

    p = run_solo(script, timeout)
    lines = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
    assert p.returncode == 0 and lines, p.stdout[-3000:] + p.stderr[-5000:]
    return json.loads(lines[-1][len("RESULT "):])


def start(argv=None):
    """World of one, model parallel groups, model, optimizer, scheduler, train state."""
    import socket

    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_deadpool.adapters import cpu_mode
    from megatron_deadpool.trainer import gpt
    from megatron_deadpool.trainer.args import parse_args

    cpu_mode.enable()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                            world_size=1)
    ps.initialize_model_parallel(1, 1)
    args = parse_args(TINY + list(argv or []))
    model, optimizer, scheduler = gpt.build(args, torch.device("cpu"))
    state = SimpleNamespace(iteration=0, consumed_train_samples=0)
    return args, model, optimizer, scheduler, state


def step(args, model, optimizer, scheduler, state) -> None:
    import torch

    from megatron_deadpool.trainer import gpt

    gpt.train_step(args, state, model, optimizer, scheduler, torch.device("cpu"), None)
    state.iteration += 1
    state.consumed_train_samples += args.global_batch_size


class SoloTransport:
    """The mirror transport of a world of one: nothing to send, every vote is one's own."""

    rank, world_size = 0, 1

    def exchange(self, sends, recvs, timeout_s=None):
        assert not sends and not recvs, (sends, recvs)

    def all_ok(self, ok, timeout_s=None):
        return ok

    def all_gather_int(self, value, timeout_s=None):
        return [value]

    def all_gather_json(self, obj, timeout_s=None):
        return [obj]

    def gather_from(self, value, ranks, timeout_s=None):
        return {r: value for r in ranks}


def protect(model, optimizer, scheduler, state, replicas: int = 0):
    """``Attachment.attach`` as the runtime calls it, for a world of one (one node)."""
    import torch

    from megatron_deadpool.control.attachment import Attachment
    from megatron_deadpool.control.link import Links, MirrorSettings
    from megatron_deadpool.mirror.meter import Meter

    # the meter a launched job attaches (its costs are what the tests read)
    settings, meter = MirrorSettings(replicas=replicas, create_timeout_s=60, op_timeout_s=60), Meter()
    link = Links(settings, meter).connect(SimpleNamespace(node_of_rank=[0], gen=0))
    p = Attachment(settings, meter)
    p.attach(model, optimizer, scheduler, state, rank=0, world_size=1, with_cuda=False,
             link=link, fault_points=lambda it, phase: None)
    return p


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
