"""Roles with the same members share one gloo group while megatron builds its groups: the
pure sharing rule, then megatron's real groups on a 4-process gloo world, where the shared
groups must carry every role's traffic with the same results as separate groups."""

import traceback
from datetime import timedelta

import pytest
import torch

from conftest import in_processes
from megatron_deadpool.recovery.shared_groups import share_key

WORLD = 4


def test_gloo_calls_with_the_same_members_and_timeout_share():
    t = timedelta(seconds=5)
    assert share_key({"ranks": [2, 0], "timeout": t}, "gloo", 4) == ((0, 2), t)
    assert share_key({"ranks": [0, 2], "timeout": t, "backend": "gloo"}, "nccl", 4) == \
        ((0, 2), t)
    assert share_key({"ranks": None}, "gloo", 3) == ((0, 1, 2), None)


@pytest.mark.parametrize("arguments, world_backend", [
    ({"ranks": [0, 1]}, "nccl"),                               # NCCL: never shared
    ({"ranks": [0, 1], "backend": "nccl"}, "gloo"),
    ({"ranks": [0, 1], "backend": "cpu:gloo,cuda:nccl"}, "gloo"),
    ({"ranks": [0, 1], "pg_options": object()}, "gloo"),       # its own options
    ({"ranks": [0, 1], "use_local_synchronization": True}, "gloo"),  # only members call
])
def test_calls_that_build_their_own_group(arguments, world_backend):
    assert share_key(arguments, world_backend, 4) is None


def _traffic(ps, rank):
    """Every role's ops, interleaved as a training step would issue them; returns results."""
    import torch.distributed as dist

    out = {}
    x = torch.full((4,), float(rank + 1))
    dp, dp_gloo = ps.get_data_parallel_group(), ps.get_data_parallel_group_gloo()
    tp = ps.get_tensor_model_parallel_group()
    works = [dist.all_reduce(a, group=g, async_op=True)
             for a, g in ((out.setdefault("dp", x.clone()), dp),
                          (out.setdefault("dp_gloo", 2 * x), dp_gloo),
                          (out.setdefault("dp_cp", 3 * x), ps.get_data_parallel_group(
                              with_context_parallel=True)))]
    out["tp"] = x.clone()
    dist.all_reduce(out["tp"], group=tp)
    out["intra_opt"] = 5 * x  # every rank's group: the default group when shared
    dist.all_reduce(out["intra_opt"], group=ps.get_intra_distributed_optimizer_instance_group())
    for w in works:
        w.wait()
    peer = dist.get_global_rank(dp, 1 - ps.get_data_parallel_rank())
    recv = torch.empty(4)
    ops = [dist.P2POp(dist.isend, x * 10, peer, group=dp),
           dist.P2POp(dist.irecv, recv, peer, group=dp)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    out["p2p"] = recv
    gathered = [torch.empty(4) for _ in range(2)]
    dist.all_gather(gathered, x, group=dp_gloo)
    out["gather"] = torch.stack(gathered)
    return {k: v.tolist() for k, v in out.items()}


def _worker(rank, port, share, q):
    try:
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        from megatron_deadpool.recovery.shared_groups import shared_gloo_groups

        store = dist.TCPStore("127.0.0.1", port, WORLD, rank == 0, wait_for_workers=False)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD)
        made = []
        original = dist.new_group

        def counting(*a, **k):
            made.append(1)
            return original(*a, **k)

        dist.new_group = counting  # a wrapper taking (*a, **k), as other tools install
        if share:  # megatron's default distributed_timeout_minutes, as World passes it
            with shared_gloo_groups("gloo", timedelta(minutes=30)) as shared:
                ps.initialize_model_parallel(tensor_model_parallel_size=2)
        else:
            shared = [0]
            ps.initialize_model_parallel(tensor_model_parallel_size=2)
        same = ps.get_data_parallel_group() is ps.get_data_parallel_group_gloo()
        world = ps.get_intra_distributed_optimizer_instance_group() is dist.group.WORLD
        q.put((rank, {"built": len(made) - shared[0], "shared": shared[0],
                      "dp_is_dp_gloo": same, "intra_opt_is_world": world,
                      "results": _traffic(ps, rank)}))
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001
        q.put((rank, traceback.format_exc()))


def _run(share: bool) -> dict:
    return in_processes(WORLD, _worker, share, timeout=180)


@pytest.mark.slow
@pytest.mark.ci
def test_megatrons_roles_share_gloo_groups_and_every_role_gets_the_same_results():
    shared, separate = _run(share=True), _run(share=False)
    for rank in range(WORLD):
        s, o = shared[rank], separate[rank]
        assert s["results"] == o["results"], rank
        assert s["dp_is_dp_gloo"] and not o["dp_is_dp_gloo"]
        assert s["intra_opt_is_world"] and not o["intra_opt_is_world"]
        assert s["shared"] > 0 and o["shared"] == 0
        assert s["built"] < o["built"]
    dp = [1.0 + 3.0] * 4  # ranks 0 and 2 (TP2: data-parallel pairs are (0,2) and (1,3))
    assert shared[0]["results"]["dp"] == dp
    assert shared[0]["results"]["p2p"] == [30.0] * 4
    assert shared[0]["results"]["intra_opt"] == [5.0 * (1 + 2 + 3 + 4)] * 4
