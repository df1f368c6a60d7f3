import argparse

import pytest

from megatron_deadpool.base.config import DeadpoolConfig, add_deadpool_args
from megatron_deadpool.base.errors import ConfigError


def test_defaults_valid():
    c = DeadpoolConfig()
    assert c.replicas == 1 and not c.enabled


@pytest.mark.parametrize("kwargs,match", [
    ({"replicas": -1}, "replicas"),
    ({"heartbeat_interval_s": 3.0, "heartbeat_timeout_s": 5.0}, "twice"),
    ({"heartbeat_timeout_s": 400.0}, "soft < hard"),
    ({"rendezvous_timeout_s": 700.0}, "collective-timeout"),
    ({"audit": "deep"}, "audit"),
    ({"progress_timeout_s": -1.0}, "> 0"),
])
def test_invariants(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        DeadpoolConfig(**kwargs)


def test_argparse_roundtrip():
    p = add_deadpool_args(argparse.ArgumentParser())
    a = p.parse_args(["--deadpool", "--deadpool-replicas", "2",
                      "--deadpool-heartbeat-timeout", "3", "--deadpool-events", "e.jsonl"])
    c = DeadpoolConfig.from_args(a)
    assert c.enabled and c.replicas == 2 and c.heartbeat_timeout_s == 3.0
    assert c.events_path == "e.jsonl"


def test_unrebindable_configs_are_refused():
    from types import SimpleNamespace as NS

    from megatron_deadpool.base.errors import UnsupportedConfigError
    from megatron_deadpool.adapters.support import check_supported, unsupported_features

    ok = NS(config=NS(tp_comm_overlap=False, enable_cuda_graph=False, cuda_graph_impl="none"),
            ddp_config=NS(nccl_ub=False, use_megatron_fsdp=False))
    check_supported([ok])
    bad = NS(config=NS(tp_comm_overlap=True, enable_cuda_graph=False, cuda_graph_impl="local"),
             ddp_config=NS(nccl_ub=True, use_megatron_fsdp=True))
    assert len(unsupported_features([bad])) == 4
    with pytest.raises(UnsupportedConfigError, match="userbuffers.*CUDA graphs|CUDA graphs"):
        check_supported([bad])


def test_precision_aware_optimizer_is_refused_at_attach():
    """Its state accessors return copies: a restore would write into temporaries."""
    from types import SimpleNamespace as NS

    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    from megatron_deadpool.base.errors import UnsupportedConfigError
    from megatron_deadpool.adapters.support import check_supported, unsupported_optimizer

    def dist_opt(precision_aware):
        opt = DistributedOptimizer.__new__(DistributedOptimizer)  # only its config is read
        opt.config = NS(use_precision_aware_optimizer=precision_aware)
        return opt

    model = [NS(config=None, ddp_config=None)]
    chained = NS(chained_optimizers=[dist_opt(False), dist_opt(True)])
    assert unsupported_optimizer(dist_opt(False)) == []
    assert len(unsupported_optimizer(chained)) == 1
    check_supported(model, dist_opt(False))
    with pytest.raises(UnsupportedConfigError, match="precision-aware optimizer"):
        check_supported(model, chained)
