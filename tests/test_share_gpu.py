"""The shared-GPU mode (``deadpool launch --device cuda --share-gpu``, launch/gpus.py), on
CPU: what each worker process gets (its own NCCL host id, spares and restarted processes
included; one GPU; the mode's NCCL settings), the refusals, the option parsing, and the
summary's record. The GPU run itself is scripts/gpu_swap_check.sh."""

import json
import os
import re
import subprocess
import sys

import pytest

from conftest import REPO, layout_flags
from megatron_deadpool.base.errors import ConfigError
from megatron_deadpool.base.state import Role
from megatron_deadpool.base.worker_env import WorkerEnv
from megatron_deadpool.launch import gpus
from megatron_deadpool.launch.agent import NodeAgent, WorkerSpec
from megatron_deadpool.launch.options import LaunchOptions, validate, worker_specs
from megatron_deadpool.launch.summary import build_summary

DUMP = ("import json, os, sys; json.dump(dict(os.environ), "
        "open(os.path.join(sys.argv[1], os.environ['DEADPOOL_LID'] + '.json'), 'w'))")


def _envs_of_job(tmp_path, opts: LaunchOptions, gpu_list, restarts=()):
    """Start every process of ``opts``'s job as its agents would (actives and spares, then
    ``restarts``: processes started later in a slot, as a local restart or a returning
    node does), each one dumping its environment; returns {lid: env}."""
    argv = [sys.executable, "-c", DUMP, str(tmp_path)]
    specs = worker_specs(opts, with_spares=True)
    device_env = opts.device_env(gpu_list)
    agents = {}
    for node in sorted({s.node for s in specs}):
        agents[node] = NodeAgent(node, [s for s in specs if s.node == node], argv, {},
                                 WorkerEnv(), None, {}, use_store=False,
                                 device_env=device_env)
        agents[node].start()
    for spec in restarts:
        agents[spec.node].spawn(spec)
    for a in agents.values():
        for p in a.procs.values():
            assert p.wait(timeout=60) == 0
        a.join_output()
    return {int(f.stem): json.loads(f.read_text()) for f in tmp_path.glob("*.json")}


def test_every_process_is_its_own_nccl_host_on_the_one_gpu(tmp_path):
    opts = LaunchOptions(nodes=4, procs_per_node=2, spare_nodes=1, device="cuda",
                         share_gpu=True)
    restarted = WorkerSpec(lid=10, node=1, role=Role.SPARE, rank=None, local_rank=1)
    envs = _envs_of_job(tmp_path, opts, ["3"], restarts=[restarted])
    assert sorted(envs) == list(range(11))  # 8 ranks, 2 spares, 1 restarted process
    ids = [e[gpus.HOSTID_VAR] for e in envs.values()]
    assert len(set(ids)) == len(ids), ids
    for lid, e in envs.items():
        assert {k: e[k] for k in gpus.SHARED_GPU_NCCL} == gpus.SHARED_GPU_NCCL
        assert e["CUDA_VISIBLE_DEVICES"] == "3" and e["LOCAL_RANK"] == "0", lid
    assert envs[8]["DEADPOOL_ROLE"] == "spare" and envs[10][gpus.HOSTID_VAR] == "deadpool-n1-p10"


def test_simulated_nodes_with_enough_gpus_get_one_each_without_the_mode(tmp_path):
    opts = LaunchOptions(nodes=2, procs_per_node=2, spare_nodes=1, device="cuda")
    envs = _envs_of_job(tmp_path, opts, [str(i) for i in range(6)])
    assert [envs[lid]["CUDA_VISIBLE_DEVICES"] for lid in range(6)] == ["0", "1", "2", "3", "4", "5"]
    assert all(gpus.HOSTID_VAR not in e and "NCCL_NET" not in e for e in envs.values())


def test_a_real_node_places_by_local_rank_and_sets_nothing(tmp_path):
    opts = LaunchOptions(nodes=2, procs_per_node=2, node_rank=1, device="cuda")
    env = opts.device_env(["0", "1"])
    assert env(WorkerSpec(lid=3, node=1, role=Role.ACTIVE, rank=3, local_rank=1)) == {}
    shared = LaunchOptions(nodes=2, procs_per_node=4, node_rank=1, device="cuda", share_gpu=True)
    e = shared.device_env(["0", "1"])(WorkerSpec(lid=7, node=1, role=Role.ACTIVE, rank=7,
                                                 local_rank=3))
    assert e["CUDA_VISIBLE_DEVICES"] == "1" and e[gpus.HOSTID_VAR] == "deadpool-n1-p7"
    assert LaunchOptions(nodes=2, procs_per_node=2, device="cpu").device_env([])(None) == {}


@pytest.mark.parametrize("procs,share,gpu_list,match", [
    (10, False, [], "no GPU is visible"),
    (10, True, [], "no GPU is visible"),
    (10, False, ["0"], r"10 processes on this machine and 1 GPU\(s\); --share-gpu"),
    (3, False, ["0", "1"], "--share-gpu"),
])
def test_refusals(procs, share, gpu_list, match):
    with pytest.raises(ConfigError, match=match):
        gpus.check(procs, share, gpu_list)


def test_what_fits_is_accepted_and_counted_per_machine():
    gpus.check(2, False, ["0", "1"])
    gpus.check(10, True, ["0"])
    sim = LaunchOptions(nodes=4, procs_per_node=2, spare_nodes=1)
    assert sim.procs_here(with_spares=True) == 10 and sim.procs_here(with_spares=False) == 8
    assert LaunchOptions(nodes=4, procs_per_node=2, spare_nodes=1,
                         node_rank=2).procs_here(with_spares=True) == 2
    with pytest.raises(ConfigError, match="--share-gpu needs --device cuda"):
        LaunchOptions(nodes=1, procs_per_node=1, share_gpu=True)


def test_visible_gpus_reads_the_variable():
    assert gpus.visible_gpus({"CUDA_VISIBLE_DEVICES": "2, 5"}) == ["2", "5"]
    assert gpus.visible_gpus({"CUDA_VISIBLE_DEVICES": ""}) == []
    assert gpus.visible_gpus({"CUDA_VISIBLE_DEVICES": "-1"}) == []


@pytest.mark.parametrize("visible,match", [
    ("", "no GPU is visible on this machine"),
    ("0", r"10 processes on this machine and 1 GPU\(s\); --share-gpu runs"),
])
def test_launch_refuses_before_any_worker_starts(tmp_path, visible, match):
    """The CLI: a CUDA launch that this machine cannot place is one error line and exit 2,
    with no worker started (before the mode, each worker failed and the spares were spent
    on a bad start-up)."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=visible, PYTHONPATH=str(REPO),
               OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, "-m", "megatron_deadpool.apps.cli", "launch",
                        "--nodes", "4", "--procs-per-node", "2", "--spare-nodes", "1",
                        "--device", "cuda", "--results-dir", str(tmp_path / "r"), "--",
                        *layout_flags(2, 2, 2), "--deadpool"],
                       env=env, capture_output=True, text=True, timeout=120)
    err = [x for x in p.stderr.splitlines() if x.strip()]
    assert p.returncode == 2 and len(err) == 1, p.stdout + p.stderr
    assert err[0].startswith("deadpool: error: ") and re.search(match, err[0]), err[0]
    assert "[launch]" not in p.stdout and not (tmp_path / "r").exists()


def test_validation_passes_with_the_mode(monkeypatch):
    monkeypatch.setattr(gpus, "visible_gpus", lambda env=None: ["0"])
    opts = dict(nodes=4, procs_per_node=2, spare_nodes=1, device="cuda",
                trainer_argv=layout_flags(2, 2, 2) + ["--deadpool"])
    validate(LaunchOptions(share_gpu=True, **opts))
    with pytest.raises(ConfigError, match="--share-gpu"):
        validate(LaunchOptions(**opts))


def test_the_summary_records_the_mode(tmp_path):
    opts = LaunchOptions(nodes=4, procs_per_node=2, spare_nodes=1, device="cuda",
                         share_gpu=True)
    s = build_summary(opts, None, str(tmp_path), None, {}, "stopped", 0.0)
    assert s["device"] == "cuda" and s["share_gpu"]["nccl_env"] == gpus.SHARED_GPU_NCCL
    assert gpus.HOSTID_VAR in s["share_gpu"]["per_process"]
    off = build_summary(LaunchOptions(nodes=1, procs_per_node=1), None, str(tmp_path), None,
                        {}, "stopped", 0.0)
    assert off["share_gpu"] is None
