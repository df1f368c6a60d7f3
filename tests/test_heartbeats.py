"""Heartbeats cannot be replayed: only a heartbeat whose (generation, sequence number) is
strictly newer than the last one taken is a sign of life. A local client of the store can
copy signed heartbeats back (it cannot forge new ones): that must not keep a hung process
alive. Pure: an in-memory store and the decider's injected clock."""

import torch.distributed as dist

from megatron_deadpool.base.config import DeciderConfig
from megatron_deadpool.membership import store as st
from megatron_deadpool.membership.decider import Decider, Proc
from megatron_deadpool.membership.procs import observe

from test_decider import Clock


def _job(logs):
    store = dist.HashStore()
    procs = {r: Proc(lid=r, node=r // 2, role="active", rank=r) for r in range(4)}
    procs[4] = Proc(lid=4, node=2, role="spare")
    cmds, clock = [], Clock()
    d = Decider(store=store, procs=procs, world_size=4, token="secret",
                send_command=lambda node, cmd: cmds.append((node, cmd)),
                config=DeciderConfig(heartbeat_timeout_s=1.0, heartbeat_interval_s=0.1,
                                     grace_s=0.0), log=logs.append, clock=clock)
    d.publish_initial_plan()
    coord = st.Coordinator(store, "secret")
    for lid in range(5):
        coord.push_event("join", lid=lid, nonce=f"n{lid}")
    return d, store, coord, cmds, clock


def _beat(coord, lid, seq, iteration, gen=0):
    coord.beat(lid, seq=seq, iteration=iteration, state="ACTIVE", committed=iteration - 1,
               gen=gen, section="step", section_n=1)


def test_alternating_two_captured_heartbeats_does_not_keep_a_hung_process_alive():
    logs = []
    d, store, coord, cmds, clock = _job(logs)
    captured = []
    for seq in (1, 2):  # rank 1 beats twice; a local client copies both signed records
        for lid in range(5):
            _beat(coord, lid, seq, iteration=seq)
        captured.append(store.get(st.k("hb", 1)))
        clock.advance(0.05)
        d.step()
    for i in range(80):  # rank 1 hangs; the copies are written back, alternating
        for lid in (0, 2, 3, 4):
            _beat(coord, lid, 3 + i, iteration=3 + i)
        store.set(st.k("hb", 1), captured[i % 2])
        clock.advance(0.05)
        d.step()
        if d.gen == 1:
            break
    assert any(c == {"op": "signal", "signal": "SIGKILL", "lids": [1]} for _, c in cmds)
    assert d.gen == 1 and d.plans[-1].failed_ranks == (1,)
    assert d.procs[1].hb_rejected >= 1
    assert sum("heartbeat of process 1" in m for m in logs) == 1  # logged once


def test_an_older_heartbeat_is_rejected_and_the_same_one_is_no_news():
    p = Proc(lid=0, node=0, role="active", rank=0)
    def hb(gen, seq, it):
        return {"gen": gen, "seq": seq, "iteration": it, "state": "ACTIVE",
                "committed": it - 1, "section": "step", "section_n": 1}

    assert observe(p, hb(0, 5, 3), now=10.0)
    assert observe(p, hb(0, 5, 3), now=20.0) and p.hb_change == 10.0  # read again: no news
    assert not observe(p, hb(0, 4, 9), now=30.0)  # older: a replay, not life, not progress
    assert (p.hb_change, p.progress_change, p.hb_iteration, p.hb_rejected) == (10.0, 10.0, 3, 1)
    assert observe(p, hb(1, 6, 3), now=40.0) and p.hb_change == 40.0  # next generation
    # a heartbeat of the previous generation, however high its sequence number: rejected
    assert not observe(p, hb(0, 99, 3), now=50.0) and p.hb_change == 40.0
    assert p.hb_rejected == 2


def test_alternating_two_captured_agent_heartbeats_does_not_keep_a_lost_node_alive():
    """The same for a node agent's heartbeat (a lost node is declared dead from it). Node
    1's processes keep beating here, so only the agent's heartbeat can find the loss."""
    logs = []
    d, store, coord, cmds, clock = _job(logs)
    captured = []
    for seq in (1, 2):
        for node in range(3):
            coord.agent_beat(node, seq)
        captured.append(store.get(st.k("agent_hb", 1)))
        for lid in range(5):
            _beat(coord, lid, seq, iteration=seq)
        clock.advance(0.05)
        d.step()
    for i in range(80):  # node 1's agent is gone; its copies are written back, alternating
        for node in (0, 2):
            coord.agent_beat(node, 3 + i)
        store.set(st.k("agent_hb", 1), captured[i % 2])
        for lid in range(5):
            _beat(coord, lid, 3 + i, iteration=3 + i)
        clock.advance(0.05)
        d.step()
    assert d.procs[2].state == d.procs[3].state == "dead"
    assert any("node 1 lost" in m for m in logs), logs
