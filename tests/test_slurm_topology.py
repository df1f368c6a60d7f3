"""Failure domains from Slurm's topology (launch/slurm_topology.py, issue 59): each node's
leaf switch, in node-rank order, as the JSON map --deadpool-failure-domains file: reads."""

import json

from megatron_deadpool.launch import slurm_topology as topo
from megatron_deadpool.mirror import placement

TOPOLOGY = """SwitchName=s0 Level=0 LinkSpeed=1 Nodes=nid[001-002]
SwitchName=s1 Level=0 LinkSpeed=1 Nodes=nid[003-004]
SwitchName=top Level=1 LinkSpeed=1 Nodes=nid[001-004] Switches=s[0-1]
"""
HOSTS = {"nid[001-002]": "nid001 nid002", "nid[003-004]": "nid003 nid004"}


def fake_scontrol(*args):
    if args == ("show", "topology"):
        return TOPOLOGY
    assert args[:2] == ("show", "hostnames")
    return HOSTS[args[2]]


def test_each_node_takes_its_leaf_switch_in_node_rank_order():
    assert topo.leaves(TOPOLOGY) == {"s0": "nid[001-002]", "s1": "nid[003-004]"}  # no "top"
    order = ["nid003", "nid001", "nid004", "nid002", "nid009"]  # the batch node first
    assert topo.from_slurm(order, run=fake_scontrol) == {0: "s1", 1: "s0", 2: "s1", 3: "s0"}


def test_the_written_map_places_each_ranks_buddy_under_another_switch(tmp_path, monkeypatch):
    monkeypatch.setattr(topo, "_scontrol", fake_scontrol)
    out = tmp_path / "domains.json"
    assert topo.main(["--nodes", "nid001 nid002 nid003 nid004", "--out", str(out)]) == 0
    assert json.loads(out.read_text()) == {"0": "s0", "1": "s0", "2": "s1", "3": "s1"}
    doms = placement.domains(f"file:{out}")
    nodes = [0, 0, 1, 1, 2, 2, 3, 3]  # 4 nodes x 2 ranks
    for owner, bs in enumerate(placement.buddies(nodes, 1, domain_of=doms)):
        assert all(doms.get(nodes[b]) != doms.get(nodes[owner]) for b in bs), (owner, bs)


def test_a_topology_with_one_switch_is_refused_in_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(topo, "_scontrol", lambda *a: "SwitchName=s0 Level=0 Nodes=nid[001-002]"
                        if a == ("show", "topology") else "nid001 nid002")
    assert topo.main(["--nodes", "nid001 nid002", "--out", str(tmp_path / "d.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "1 leaf switch" in err and not (tmp_path / "d.json").exists()
