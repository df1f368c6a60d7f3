"""World's gloo deadlines: the collective timeout while startup may keep ranks apart, then
(first training step) the bounded per-op deadline on a gloo world, never on NCCL."""

from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from megatron_deadpool.config import DeadpoolConfig
from megatron_deadpool.recovery.world import World


def _timeout_s(pg) -> float:
    return pg._get_backend(torch.device("cpu")).options._timeout.total_seconds()


def test_deadlines_follow_startup_then_training(tmp_path):
    cfg = DeadpoolConfig(enabled=True)
    assert cfg.gloo_op_timeout_s == cfg.take_plan_timeout_s / 2 == 15.0
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1,
                            timeout=timedelta(seconds=30))
    try:
        g = dist.new_group([0], backend="gloo", timeout=timedelta(seconds=30))
        w = World("gloo", 0, 30.0, 600.0, lambda *a, **k: None,
                  gloo_op_timeout_s=cfg.gloo_op_timeout_s)
        w.set_collective_timeouts()
        assert _timeout_s(g) == 600.0
        w.bound_gloo_deadlines()
        assert _timeout_s(g) == 15.0
        c10d._set_pg_timeout(timedelta(seconds=99), g)
        w.bound_gloo_deadlines()        # once per build: steps do not touch it again
        assert _timeout_s(g) == 99.0
        nccl = World("nccl", 0, 30.0, 600.0, lambda *a, **k: None, gloo_op_timeout_s=15.0)
        nccl.set_collective_timeouts()
        nccl.bound_gloo_deadlines()     # an NCCL world keeps the collective timeout
        assert _timeout_s(g) == 600.0
    finally:
        dist.destroy_process_group()
