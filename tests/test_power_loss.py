"""A whole-node loss, as when a machine loses power: the node agent and its processes die
together, no exit is reported, and the heartbeats find it. The decider takes the whole node
in one plan even when one of its processes' heartbeats goes stale before the agent's does
(membership/procs.py ``scan``); the fault kind ``poweroff`` simulates it (base/faults.py,
launch/agent.py). The job itself is the fault matrix's ``node_power_loss`` cell."""

import pytest
import torch.distributed as dist

from megatron_deadpool.base.config import DeciderConfig
from megatron_deadpool.base.errors import ConfigError
from megatron_deadpool.base.faults import parse_fault
from megatron_deadpool.membership import store as st
from megatron_deadpool.membership.decider import Decider, Proc


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def _decider():
    procs = {r: Proc(lid=r, node=r // 2, role="active", rank=r) for r in range(8)}
    procs.update({8: Proc(lid=8, node=4, role="spare"), 9: Proc(lid=9, node=4, role="spare")})
    store, cmds, clock = dist.HashStore(), [], Clock()
    d = Decider(store=store, procs=procs, world_size=8, token="secret",
                send_command=lambda node, cmd: cmds.append((node, cmd)),
                config=DeciderConfig(heartbeat_timeout_s=2.0, heartbeat_interval_s=0.1,
                                     grace_s=0.0), log=lambda m: None, clock=clock)
    d.publish_initial_plan()
    return d, st.Coordinator(store, "secret"), cmds, clock


def test_a_silent_node_is_lost_whole_when_one_process_goes_stale_first():
    """Node 1's agent last beat 0.5 s after its process 3 did: when process 3's heartbeat
    is stale, the agent has been silent 1.6 s, short of its own timeout. Process 2 still
    beats, so the node is not silent as a whole (``node_silent``). Both ranks of the node
    go in one plan, with no fence (nobody is there to carry it out)."""
    d, c, cmds = _silence_node_1(procs_after=0, agent_after=5, seconds=2.2, lids=(3,))
    assert d.gen == 1
    plan = c.get_plan(1)
    assert plan.failed_ranks == (2, 3) and plan.spare_of_rank == {2: 8, 3: 9}
    assert not [x for x in cmds if x[1].get("signal") == "SIGKILL"]


def test_poweroff_targets_a_node_only():
    f = parse_fault("poweroff:node=2@iter=6", 0)
    assert f.node == 2 and f.kind == "poweroff"
    with pytest.raises(ConfigError, match="targets a node"):
        parse_fault("poweroff:rank=3@iter=6", 0)


def _silence_node_1(procs_after: int, agent_after: int, seconds: float,
                    section: str = "step", lids=(2, 3)):
    """Every process beats in ``section`` every 0.1 s; ``lids`` of node 1 (ranks 2 and 3)
    stop after step ``procs_after`` and its agent after step ``agent_after``. The decider,
    the store and the commands sent, after ``seconds``."""
    d, c, cmds, clock = _decider()
    for lid in range(10):
        c.push_event("join", lid=lid, nonce=f"n{lid}")
    for step in range(round(seconds * 10)):
        for lid in range(10):
            if not (lid in lids and step > procs_after):
                c.beat(lid, seq=step + 1, iteration=1, state="ACTIVE", committed=0, gen=0,
                       section=section, section_n=1)
        for node in range(5):
            if node != 1 or step <= agent_after:
                c.agent_beat(node, step + 1)
        d.step()
        clock.t += 0.1
    d.step()
    return d, c, cmds


def test_a_node_silent_as_a_whole_is_lost_before_any_heartbeat_timeout():
    """A power loss silences a node's agent and every process of it at once: after
    AGENT_SILENT_S (1 s) of that, the node is gone, well before its processes' heartbeat
    timeout (2 s here, 5 s by default) that the rule before waited for."""
    d, c, _ = _silence_node_1(5, 5, 1.8)  # silent 1.3 s: short of the 2 s timeout
    assert d.gen == 1
    assert c.get_plan(1).failed_ranks == (2, 3)


def test_a_whole_silent_node_in_a_gil_section_waits_for_the_timeouts():
    """In a section that may hold the GIL (a save, startup) a process may not beat, and a
    machine busy with it may starve the agent: the same silence is no proof there."""
    d, _, _ = _silence_node_1(5, 5, 1.8, section="save")
    assert d.gen == 0
