"""With ``--deadpool-grad-stats staged``, megatron's grad-stats group of every rank (one
distributed-optimizer instance) is served by the model-parallel and data-parallel groups in
two stages: no communicator of the world is made at the build or at any rebuild (issue 57),
and SUM and MAX are the world's. By default (``world``) megatron's own group is made."""

import json
import subprocess
import sys
import traceback

import pytest
import torch

from conftest import REPO, in_processes
from test_megatron_lm_train import FLAGS, NEWEST

WORLD = 8  # TP2 x PP2 x DP2


def _plan(*flags):
    p = subprocess.run([sys.executable, "-m", "megatron_deadpool.apps.group_plan", "--world",
                        "512", "--tp", "4", "--pp", "8", *flags], capture_output=True,
                       text=True, timeout=300, cwd=REPO)
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_the_plan_of_a_large_job_staged_makes_no_group_of_every_rank():
    """The group plan (megatron-core's own calls, on the fake backend) at 512 GPUs: staged,
    no ``new_group`` of every rank, and the busiest survivor rebuilds no group of the world;
    by default, megatron's group of every rank is rebuilt."""
    plan = _plan("--grad-stats", "staged")
    sizes = [g["size"] for g in plan["busiest_survivor"]["groups"]]
    assert max(sizes) < 512 and plan["grad_stats"] == "staged", plan
    assert "INTRA_DISTRIBUTED_OPTIMIZER_INSTANCE_GROUP" not in {
        g["megatron"] for g in plan["busiest_survivor"]["groups"]}
    plan = _plan()
    assert plan["grad_stats"] == "world", plan
    assert {"size": 512, "megatron": "INTRA_DISTRIBUTED_OPTIMIZER_INSTANCE_GROUP"} in \
        plan["busiest_survivor"]["groups"], plan


def _worker(rank, port, q):
    try:
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        from megatron_deadpool.adapters import groups

        store = dist.TCPStore("127.0.0.1", port, WORLD, rank == 0, wait_for_workers=False)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD)
        calls = []
        original = dist.new_group

        def recording(ranks=None, *a, **k):
            calls.append(len(ranks) if ranks is not None else WORLD)
            return original(ranks, *a, **k)

        dist.new_group = recording
        groups.initialize(True, tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
        dist.new_group = original
        g = ps.get_intra_distributed_optimizer_instance_group()
        out = {"staged": groups.is_staged(g), "world_calls": calls.count(WORLD),
               "size": g.size(), "rank": g.rank()}
        for op in ("SUM", "MAX"):
            a = torch.tensor([float((rank + 1) ** 2), -float(rank)])  # rank-distinct values
            b = a.clone()
            torch.distributed.all_reduce(a, op=getattr(dist.ReduceOp, op), group=g)
            torch.distributed.all_reduce(b, op=getattr(dist.ReduceOp, op))  # the world's
            out[op] = (a.tolist(), b.tolist())
        dist.destroy_process_group()
        q.put((rank, out))
    except BaseException:  # noqa: BLE001
        q.put((rank, traceback.format_exc()))


@pytest.mark.slow
@pytest.mark.ci
def test_the_staged_group_sums_and_maxes_as_the_world_and_no_world_group_is_made():
    got = in_processes(WORLD, _worker)
    for rank, out in got.items():
        assert out["staged"] and out["world_calls"] == 0, out
        assert (out["size"], out["rank"]) == (WORLD, rank)
        for op in ("SUM", "MAX"):
            staged, world = out[op]
            assert staged == world, (rank, op, out)
    assert got[0]["SUM"][0] == [float(sum((r + 1) ** 2 for r in range(WORLD))),
                                -float(sum(range(WORLD)))]


@pytest.mark.slow
@pytest.mark.parametrize("tag", [NEWEST])
def test_pretrain_gpt_with_the_grad_stats_staged_through_a_swap(tmp_path_factory, tmp_path,
                                                               tag):
    """``--deadpool-grad-stats staged`` in the real pretrain_gpt.py (TP2.PP2.DP2, node 1
    killed at iteration 6): the job says the grad stats were staged, and the killed run
    ends bitwise where its own failure-free run does (fingerprint and every loss)."""
    from mlm import patched_tree
    from test_megatron_lm_recipe import _pair

    tree = patched_tree(tmp_path_factory, tag)
    flags = FLAGS + ["--deadpool", "--deadpool-grad-stats", "staged"]
    (out_r, _), (out_k, k) = _pair(tree, tmp_path, flags, ["kill:node=1@iter=6"], (2, 3))
    for out in (out_r, out_k):
        assert "grad stats: staged (no group of every rank)" in out, out[-3000:]
    (rec,) = [r for r in k["recoveries"] if sorted(r["failed_ranks"]) == [2, 3]]
    assert rec["restored_iter"] in (4, 5) and rec["recomputed_iters"] <= 1
