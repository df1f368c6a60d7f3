"""The launcher as one agent per node (as under srun): three agent processes on this
machine, node 0 hosting the coordinator, node 2 a spare node; node 1 is killed."""

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO, layout_flags

from megatron_deadpool.launch.options import free_port_pair

pytestmark = [pytest.mark.slow]


def _two_nodes_and_a_spare(tmp_path, flags, ppn, inject):
    """One `deadpool launch --node-rank I` agent per node (2 nodes + 1 spare node), as srun
    starts them; returns node 0's summary and every agent's output."""
    port = free_port_pair()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), DEADPOOL_TOKEN="t0k")
    procs = []
    for node in range(3):
        args = [sys.executable, "-m", "megatron_deadpool.apps.cli", "launch", "--nodes", "2",
                "--procs-per-node", str(ppn), "--spare-nodes", "1", "--node-rank", str(node),
                "--master-addr", "127.0.0.1", "--master-port", str(port),
                "--results-dir", str(tmp_path / "res"), "--inject", inject,
                "--summary-json", str(tmp_path / f"node{node}.json"), "--",
                *flags, "--deadpool"]
        procs.append(subprocess.Popen(args, env=env, cwd=tmp_path, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    outs = [p.communicate(timeout=400)[0] for p in procs]
    assert procs[0].returncode == 0, outs[0][-4000:]
    return json.loads((tmp_path / "node0.json").read_text()), outs


@pytest.mark.ci
def test_one_agent_per_node_with_spare_node(tmp_path, reference):
    flags = layout_flags(1, 1, 8, world=2)
    ref = reference(flags, nodes=2, ppn=1)
    s, _ = _two_nodes_and_a_spare(tmp_path, flags, ppn=1, inject="kill:node=1@iter=4")
    assert s["final_state_sha256"] == ref["final_state_sha256"]
    (rec,) = s["recoveries"]
    assert rec["failed_ranks"] == [1] and rec["spare_of_rank"] == {"1": 2}
    assert not (tmp_path / "node1.json").exists()  # only node 0 writes the summary


def test_a_worker_failure_on_a_node_agent_leaves_its_other_workers_alone(tmp_path, reference):
    """Node 1's agent (no coordinator) sees rank 2 die: it must leave the decision to node
    0's decider, not stop the job or terminate rank 3 (its other worker): one recovery,
    rank 2 only."""
    flags = layout_flags(1, 2, 8, world=4)
    ref = reference(flags, nodes=2, ppn=2)
    s, outs = _two_nodes_and_a_spare(tmp_path, flags, ppn=2, inject="kill:rank=2@iter=4")
    assert s["final_state_sha256"] == ref["final_state_sha256"]
    (rec,) = s["recoveries"]
    assert rec["failed_ranks"] == [2] and set(rec["spare_of_rank"]) == {"2"}, rec
    assert "stopping the job" not in outs[1], outs[1][-3000:]
