"""Warm standbys on GPU nodes (``--deadpool-local-standby`` with ``--device cuda``, issue 58),
on CPU: the launch arithmetic (a node's standbys share its GPUs: only the processes that hold
one count), what a standby's environment says (no GPU bound, every GPU of its node visible),
and which GPU a promoted standby binds (the one its node's other ranks do not use, from their
heartbeats). The GPU run itself is for a session with a device."""

import types

import pytest

from conftest import layout_flags
from megatron_deadpool.base.errors import ConfigError
from megatron_deadpool.base.plan import Plan
from megatron_deadpool.base.state import Role
from megatron_deadpool.base.worker_env import WorkerEnv
from megatron_deadpool.control.runtime import Runtime
from megatron_deadpool.launch import gpus
from megatron_deadpool.launch.agent import WorkerSpec
from megatron_deadpool.launch.options import LaunchOptions, validate, worker_specs

LOCAL = ["--deadpool-max-local-restarts", "2", "--deadpool-local-standby", "1"]


def _opts(nodes: int, **kw) -> LaunchOptions:
    return LaunchOptions(nodes=nodes, procs_per_node=2, spare_nodes=0, device="cuda",
                         trainer_argv=layout_flags(2, 1, nodes) + ["--deadpool"] + LOCAL, **kw)


def test_standbys_share_their_nodes_gpus_in_the_launch_arithmetic(monkeypatch):
    """2 nodes x 2 ranks and a standby each on 4 GPUs: accepted (the standbys hold none);
    4 nodes' 8 ranks on 4 GPUs: still refused, standbys or not."""
    monkeypatch.setattr(gpus, "visible_gpus", lambda env=None: ["0", "1", "2", "3"])
    validate(_opts(2))
    with pytest.raises(ConfigError, match=r"8 processes on this machine and 4 GPU"):
        validate(_opts(4))
    specs = worker_specs(_opts(2), with_spares=False, standbys=1)
    assert [s.lid for s in specs if s.standby] == [4, 5]


def test_a_standbys_environment_binds_no_gpu_and_shows_its_nodes():
    simulated = _opts(2).device_env(["0", "1", "2", "3"])
    standby = WorkerSpec(lid=5, node=1, role=Role.SPARE, rank=None, local_rank=2, standby=True)
    assert simulated(standby) == {"LOCAL_RANK": gpus.UNBOUND, "CUDA_VISIBLE_DEVICES": "2,3"}
    active = WorkerSpec(lid=3, node=1, role=Role.ACTIVE, rank=3, local_rank=1)
    assert simulated(active) == {"CUDA_VISIBLE_DEVICES": "3", "LOCAL_RANK": "0"}
    real = _opts(2, node_rank=1).device_env(["0", "1"])
    assert real(standby) == {"LOCAL_RANK": gpus.UNBOUND}  # a real node's GPUs: all visible
    assert WorkerEnv.from_env({"DEADPOOL_LID": "5", "DEADPOOL_NODE": "1",
                               "DEADPOOL_STORE_PORT": "1", "LOCAL_RANK": "-1"}).local_rank == -1
    shared = _opts(2, share_gpu=True).device_env(["0"])(standby)  # the test mode: as before
    assert shared["CUDA_VISIBLE_DEVICES"] == "0" and shared["LOCAL_RANK"] == "0"


def test_a_promoted_standby_takes_a_gpu_its_node_does_not_use():
    assert gpus.promoted_gpu(["0", "1", "2", "3"], ["0", "2", "3"], [5], 5) == 1
    # two standbys promoted on one node in one plan: one GPU each, by rank
    assert gpus.promoted_gpu(["0", "1", "2", "3"], ["0", "2"], [6, 5], 5) == 1
    assert gpus.promoted_gpu(["0", "1", "2", "3"], ["0", "2"], [6, 5], 6) == 3
    with pytest.raises(ConfigError, match="no free GPU"):
        gpus.promoted_gpu(["0", "1"], ["0", "1"], [3], 3)
    assert gpus.physical_id(1, {"CUDA_VISIBLE_DEVICES": "4,5"}) == "5"
    assert gpus.physical_id(1, {}) == "1"


def test_the_runtime_binds_the_gpu_its_crashed_rank_left(monkeypatch):
    """Node 1 holds ranks 2 and 3 on GPUs 2 and 3; rank 3's process crashed and node 1's
    standby (lid 9, GPUs 2,3 visible) took it: it binds device 1 (GPU 3), read from rank
    2's heartbeat, and reports it in its own."""
    import torch

    bound = []
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", bound.append)
    plan = Plan(gen=1, world_size=4, rank_of={0: 0, 1: 1, 2: 2, 9: 3},
                node_of_rank=(0, 0, 1, 1), spare_of_rank={3: 9})
    asked = []

    def heartbeats(lids):
        asked.extend(lids)
        return {2: {"lid": 2, "gpu": "2"}}

    rt = types.SimpleNamespace(member=types.SimpleNamespace(heartbeats=heartbeats),
        state=types.SimpleNamespace(rank=3), gpu=None, local_rank=-1)
    Runtime._bind_gpu(rt, plan)
    assert asked == [2] and bound == [1] and (rt.gpu, rt.local_rank) == ("3", 1)
