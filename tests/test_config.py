import argparse
import re

import pytest

from megatron_deadpool.base.config import DeadpoolConfig
from megatron_deadpool.flags import add_deadpool_args
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


def test_choices_are_enum_members_parsed_once():
    """Each choice is held as its enum's member, from keywords and from argparse alike; a
    member equals its value (a ``str`` enum)."""
    from megatron_deadpool.base.config import Audit, DrainSource, OnNoSpare

    c = DeadpoolConfig(audit="full", on_no_spare="wait", mirror_transport="gloo",
                       drain_source="direct")
    assert (c.audit, c.on_no_spare, c.mirror_transport, c.drain_source) == (
        Audit.FULL, OnNoSpare.WAIT, "gloo", DrainSource.DIRECT)
    assert c.audit is Audit.FULL and c.audit == "full" and f"{c.audit}" == "full"
    assert c.decider().spare_wait_s == c.spare_wait_timeout_s
    p = add_deadpool_args(argparse.ArgumentParser())
    d = DeadpoolConfig.from_args(p.parse_args(["--deadpool-drain-source", "direct"]))
    assert d.drain_source is DrainSource.DIRECT and d.audit is Audit.WALK
    assert d.on_no_spare is OnNoSpare.FAIL and d.decider().spare_wait_s == 0.0
    with pytest.raises(SystemExit):
        p.parse_args(["--deadpool-mirror-transport", "carrier-pigeon"])
    with pytest.raises(ConfigError, match=r"--deadpool-on-no-spare must be one of \('fail', "
                       r"'wait'\), got 'retry'"):
        DeadpoolConfig(on_no_spare="retry")


def test_the_transport_flag_is_the_registrys():
    """``--deadpool-mirror-transport``'s choices and help are the transport registry's
    entries (mirror/transport.py), in registration order; a name it does not hold is refused
    naming the flag."""
    from megatron_deadpool.control.link import MirrorSettings
    from megatron_deadpool.mirror import transport

    entries = list(transport._ENTRIES.values())  # the registry, in registration order
    p = add_deadpool_args(argparse.ArgumentParser())
    flag = next(a for a in p._actions if "--deadpool-mirror-transport" in a.option_strings)
    assert flag.choices == tuple(e.name for e in entries) and flag.default == "socket"
    assert {"socket", "gloo"} <= set(flag.choices)  # today's two; a third is one entry
    assert flag.help.startswith("how snapshots reach the buddies: 'socket', a TCP connection "
                                "per (rank, buddy) pair, ")
    assert all(f"'{e.name}', {e.help}" in flag.help for e in entries)
    for name in flag.choices:
        args = p.parse_args(["--deadpool-mirror-transport", name])
        assert DeadpoolConfig.from_args(args).mirror_transport == name
        assert MirrorSettings(transport=name).transport_name == name
    assert MirrorSettings(replicas=0).transport_name == "gloo"  # no buddies: the gloo group
    with pytest.raises(ConfigError, match=r"--deadpool-mirror-transport must be one of "
                       + re.escape(repr(flag.choices)) + ", got 'carrier-pigeon'"):
        MirrorSettings(transport="carrier-pigeon")


@pytest.mark.parametrize("call,why", [
    ({"k": 1}, None),
    ({"k": 0}, None),
    ({"k": -1}, "--deadpool-replicas must be an integer >= 0, got -1"),
    ({"k": True}, "must be an integer"),
    ({"k": 0, "spare_nodes": 1}, "--deadpool-replicas 0 keeps only"),
    ({"k": 0, "nodes": 1}, None),
    ({"k": 2, "nodes": 3}, None),
    ({"k": 2, "nodes": 2}, "2 replica(s) need at least 3 nodes"),
    ({"k": 0, "name": "replicas", "least": 1}, "replicas must be an integer >= 1, got 0"),
    ({"k": 3, "name": "--replicas", "least": 1, "most": 2}, "--replicas must be an integer "
                                                             "in 1..2, got 3"),
])
def test_the_replicas_rule(call, why):
    """One rule of K: an integer >= 0; 0 takes no spares; K >= 1 needs K + 1 nodes."""
    from megatron_deadpool.base.config import replicas_refusal

    got = replicas_refusal(**call)
    assert got is None if why is None else why in got


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


def test_the_flags_defaults_are_plain_values():
    """Megatron-LM saves its parsed args into every checkpoint and core_v0.16.1 loads them
    with torch.load(weights_only=True), which refuses any class of ours: a default must be
    a plain str/int/float/bool/None, as a value given on the command line is."""
    import argparse

    from megatron_deadpool import add_deadpool_args

    p = argparse.ArgumentParser()
    add_deadpool_args(p)
    odd = {k: type(v) for k, v in vars(p.parse_args([])).items()
           if v is not None and type(v) not in (str, int, float, bool)}
    assert odd == {}


def test_keeping_unbroken_groups_is_the_default():
    """A gloo recovery keeps the groups a failure did not break unless
    ``--deadpool-rebuild-all-groups`` is given (issue 57: no environment switch)."""
    p = add_deadpool_args(argparse.ArgumentParser())
    assert not DeadpoolConfig.from_args(p.parse_args([])).rebuild_all_groups
    assert DeadpoolConfig.from_args(
        p.parse_args(["--deadpool-rebuild-all-groups"])).rebuild_all_groups
    assert "--deadpool-rebuild-all-groups" in p.format_help()


def test_grad_stats_default_to_megatrons_group_of_every_rank_and_staged_is_a_choice():
    """``--deadpool-grad-stats``: 'world' by default (bitwise to the unpatched script),
    'staged' a choice in --help; anything else is refused naming the flag."""
    from megatron_deadpool.base.config import GradStats

    p = add_deadpool_args(argparse.ArgumentParser())
    assert DeadpoolConfig.from_args(p.parse_args([])).grad_stats is GradStats.WORLD
    got = DeadpoolConfig.from_args(p.parse_args(["--deadpool-grad-stats", "staged"]))
    assert got.grad_stats is GradStats.STAGED
    assert "--deadpool-grad-stats" in p.format_help()
    with pytest.raises(ConfigError, match="--deadpool-grad-stats"):
        DeadpoolConfig(grad_stats="all")
