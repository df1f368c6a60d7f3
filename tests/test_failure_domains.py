"""Failure domains (issue 59): a rack of two nodes lost at once. With the buddies placed by
domain (``--deadpool-failure-domains blocks:2``) every copy of the rack's ranks is in the
other rack and the job recovers bitwise in one plan; with the node ring, node 0's only copy
was on node 1, in the same rack, and the job takes the last resort, naming why."""

import pytest

from conftest import assert_ok_and_bitwise, launch, layout_flags

from megatron_deadpool.base.config import DeadpoolConfig
from megatron_deadpool.base.errors import ConfigError
from megatron_deadpool.control.link import MirrorSettings
from megatron_deadpool.mirror import placement

RACK_LOST = ("kill:domain=0@iter=4",)  # rack 0 (nodes 0 and 1 with blocks:2) in one instant


def _flags(domains):
    flags = layout_flags(1, 1, 8, world=4) + ["--deadpool"]
    return flags + (["--deadpool-failure-domains", domains] if domains else [])


@pytest.mark.slow
@pytest.mark.ci
def test_a_rack_lost_at_once_recovers_with_placement_by_domain(tmp_path, reference):
    proc, s = launch(tmp_path, _flags("blocks:2"), nodes=4, ppn=1, spares=2, inject=RACK_LOST)
    assert_ok_and_bitwise(proc, s, reference(layout_flags(1, 1, 8, world=4), nodes=4, ppn=1))
    (rec,) = s["recoveries"]  # one plan for the whole rack
    assert sorted(rec["failed_ranks"]) == [0, 1], rec
    (fault,) = s["faults"]
    assert fault["domain"] == "0" and fault["nodes"] == [0, 1] and fault["ranks"] == [0, 1]
    assert s["placement"] == "by failure domain (blocks:2)"


@pytest.mark.slow
def test_a_rack_lost_at_once_takes_the_last_resort_with_the_ring(tmp_path):
    # the same rack, named by its nodes: the ring's placement has no domains to name it by
    lost = ("kill:node=0@iter=4", "kill:node=1@iter=4")
    proc, s = launch(tmp_path, _flags(None), nodes=4, ppn=1, spares=2, inject=lost)
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert "a rank and every buddy holding its copy failed together" in out, out[-3000:]
    assert s["placement"] == "node ring (no failure domains given)"


def test_a_bad_domain_spec_is_refused_before_the_job():
    for bad in ("racks", "blocks:0", "blocks:x", "file:"):
        with pytest.raises(ConfigError, match="--deadpool-failure-domains"):
            MirrorSettings(failure_domains=bad)
    assert DeadpoolConfig().failure_domains == ""
    assert placement.domains("blocks:2").get(5) == 2 and placement.domains("") is None


def test_a_domain_file_names_nodes_as_the_plan_does(tmp_path):
    f = tmp_path / "d.json"
    f.write_text('{"0": "rack-a", "1": "rack-a", "2": "rack-b"}')
    d = placement.domains(f"file:{f}")
    assert d.get(0) == d.get(1) == "rack-a" and d.get(3) is None
    f.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="not a JSON object"):
        placement.domains(f"file:{f}")


def test_a_domain_fault_names_the_nodes_of_its_domain():
    from megatron_deadpool.base import faults as F

    (f,) = F.resolve_domains(F.parse_schedule(["poweroff:domain=1@iter=3"]),
                             placement.domains("blocks:2").get, total_nodes=6)
    assert f.nodes == (2, 3) and f.by_agent and f.targets(rank=9, node=3)
    assert not f.targets(rank=0, node=1) and f.describe() == "poweroff:domain=1@iter=3"
    assert F.from_json(F.to_json([f])) == [f]  # the workers get the nodes
    assert f.where() == "domain 1 (nodes 2, 3)"
    with pytest.raises(ConfigError, match="needs --deadpool-failure-domains"):
        F.resolve_domains([f], None, total_nodes=6)
    with pytest.raises(ConfigError, match="no node is in domain '7'.*0, 1, 2"):
        F.resolve_domains(F.parse_schedule(["kill:domain=7@iter=3"]),
                          placement.domains("blocks:2").get, total_nodes=6)
    with pytest.raises(ConfigError, match="targets one rank"):
        F.parse_fault("drop:domain=0@iter=3")  # a rank-only kind
    with pytest.raises(ConfigError, match="domain must be a name"):
        F.parse_fault("kill:domain=a/b@iter=3")


def test_the_window_after_a_death_waits_for_the_rest_of_its_domain():
    from megatron_deadpool.base.config import DeciderConfig
    from megatron_deadpool.membership.procs import Proc, ProcState, Role, window_over

    procs = {lid: Proc(lid=lid, node=lid, role=Role.ACTIVE, rank=lid) for lid in range(4)}
    procs[0].state = ProcState.DEAD
    cfg, rack = DeciderConfig(grace_s=0.3), placement.domains("blocks:2").get
    assert window_over(procs, {0}, {0}, 0.0, cfg)  # no domains: node 0 is all dead
    assert not window_over(procs, {0}, {0}, 0.0, cfg, rack)  # node 1 is in its rack
    assert window_over(procs, {0}, {0}, 0.3, cfg, rack)  # ... for the grace at most
    procs[1].state = ProcState.DEAD
    assert window_over(procs, {0, 1}, {0, 1}, 0.0, cfg, rack)  # the whole rack: at once
