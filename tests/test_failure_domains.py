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

RACK_LOST = ("kill:node=0@iter=4", "kill:node=1@iter=4")


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
    assert s["placement"] == "by failure domain (blocks:2)"


@pytest.mark.slow
def test_a_rack_lost_at_once_takes_the_last_resort_with_the_ring(tmp_path):
    proc, s = launch(tmp_path, _flags(None), nodes=4, ppn=1, spares=2, inject=RACK_LOST)
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
