"""The warm local restart (membership/local_restart.py): a rank that crashes on a healthy
node is taken by that node's warm standby, started with the job, at once, and a new standby
is started in the background; a standby never takes a dead node's ranks; without an idle
standby the crashed rank's replacement starts cold, as before. Against an in-memory store,
no processes; the whole job is tests/test_spare_policies.py and the soak."""

import torch.distributed as dist

from megatron_deadpool.base.config import DeadpoolConfig, DeciderConfig
from megatron_deadpool.launch.options import LaunchOptions, worker_specs
from megatron_deadpool.membership import store as st
from megatron_deadpool.membership.decider import Decider, Proc


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def _decider(standby=True, spare_nodes=1):
    """4 nodes x 2, one spare node (lids 8, 9), one warm standby per active node
    (lids 10..13 on nodes 0..3) as ``deadpool launch`` starts them."""
    opts = LaunchOptions(nodes=4, procs_per_node=2, spare_nodes=spare_nodes)
    specs = worker_specs(opts, with_spares=True, standbys=1 if standby else 0)
    procs = {s.lid: Proc(lid=s.lid, node=s.node, role=s.role, rank=s.rank, standby=s.standby)
             for s in specs}
    store, cmds, clock = dist.HashStore(), [], Clock()
    d = Decider(store=store, procs=procs, world_size=8, token="secret",
                send_command=lambda node, cmd: cmds.append((node, cmd)),
                config=DeciderConfig(heartbeat_timeout_s=5.0, heartbeat_interval_s=0.1,
                                     grace_s=0.0, max_local_restarts=1),
                log=lambda m: None, clock=clock)
    d.publish_initial_plan()
    c = st.Coordinator(store, "secret")
    for lid in procs:
        c.push_event("join", lid=lid, nonce=f"n{lid}")
    for node in range(5):
        c.agent_beat(node, 1)
    d.step()
    return d, c, cmds


def test_the_standbys_are_one_per_active_node_after_the_spares():
    specs = worker_specs(LaunchOptions(nodes=4, procs_per_node=2, spare_nodes=1), True, 1)
    assert [(s.lid, s.node, s.local_rank) for s in specs if s.standby] == \
        [(10, 0, 2), (11, 1, 2), (12, 2, 2), (13, 3, 2)]
    assert DeadpoolConfig(enabled=True).standbys_per_node == 0  # only with local restarts
    assert DeadpoolConfig(enabled=True, max_local_restarts=1).standbys_per_node == 1
    assert DeadpoolConfig(enabled=True, max_local_restarts=1,
                          local_standby=0).standbys_per_node == 0


def test_a_crash_on_a_healthy_node_is_taken_by_its_warm_standby_at_once():
    d, c, cmds = _decider()
    c.push_event("exit", lid=5, code=-9, node=2)
    d.step()
    d.step()
    assert d.gen == 1  # no wait for a process to start
    plan = c.get_plan(1)
    assert plan.spare_of_rank == {5: 12} and plan.node_of_rank[5] == 2
    (node, cmd), = [x for x in cmds if x[1]["op"] == "spawn"]
    assert node == 2 and cmd["standby"] is True and cmd["replaces"] == 12  # the refill
    assert d.procs[cmd["lid"]].standby and d.procs[cmd["lid"]].rank is None
    (rec,) = d.local.records
    assert rec["warm"] is True and rec["lid"] == 12 and rec["generation"] == 1


def test_a_dead_nodes_ranks_never_take_a_standby():
    d, c, _ = _decider()
    for lid in (2, 3):
        c.push_event("exit", lid=lid, code=-9, node=1)
    d.step()
    d.step()
    assert c.get_plan(1).spare_of_rank == {2: 8, 3: 9}
    d, c, _ = _decider(spare_nodes=0)  # standbys 8..11, no spare node
    for lid in (2, 3):
        c.push_event("exit", lid=lid, code=-9, node=1)
    d.step()
    d.step()
    assert d.gen == 0 and d.failed_reason and "no spare" in d.failed_reason


def test_without_a_standby_the_replacement_starts_cold():
    d, c, cmds = _decider(standby=False)
    c.push_event("exit", lid=5, code=-9, node=2)
    d.step()
    d.step()
    assert d.gen == 0  # waits for the process it started
    (node, cmd), = [x for x in cmds if x[1]["op"] == "spawn"]
    assert node == 2 and "standby" not in cmd and cmd["replaces"] == 5
    assert d.local.records[0]["warm"] is False


def test_the_refilled_standby_takes_the_next_crash_on_its_node():
    d, c, cmds = _decider()
    c.push_event("exit", lid=5, code=-9, node=2)
    d.step()
    d.step()
    (_, refill), = [x for x in cmds if x[1]["op"] == "spawn"]
    c.push_event("join", lid=refill["lid"], nonce="nrefill")
    d.step()
    c.push_event("exit", lid=4, code=-9, node=2)
    d.step()
    d.step()
    assert d.gen == 2 and c.get_plan(2).spare_of_rank == {4: refill["lid"]}
    assert [r["warm"] for r in d.local.records] == [True, True]


def test_a_crash_before_the_refill_is_up_is_taken_by_an_idle_spare_at_once():
    """Issue 58: two crashes on node 2 one iteration apart; the second came before the
    refill was up and waited 11.5 s for its start. An idle spare takes it at once now."""
    d, c, cmds = _decider()
    c.push_event("exit", lid=5, code=-9, node=2)
    d.step()
    d.step()
    c.push_event("exit", lid=4, code=-9, node=2)  # the refill has not joined yet
    d.step()
    d.step()
    assert d.gen == 2 and c.get_plan(2).spare_of_rank == {4: 8}  # no wait for a start
    assert [r["warm"] for r in d.local.records] == [True]  # no second local restart
    assert len([x for x in cmds if x[1]["op"] == "spawn"]) == 1  # the first one's refill


def test_with_no_idle_spare_a_crash_before_the_refill_is_up_waits_for_it():
    d, c, cmds = _decider(spare_nodes=0)  # standbys 8..11 on nodes 0..3
    c.push_event("exit", lid=5, code=-9, node=2)
    d.step()
    d.step()
    (_, refill), = [x for x in cmds if x[1]["op"] == "spawn"]
    c.push_event("exit", lid=4, code=-9, node=2)  # the refill has not joined yet
    d.step()
    d.step()
    assert d.gen == 1  # waits for the refill
    spawns = [x[1] for x in cmds if x[1]["op"] == "spawn"]
    assert len(spawns) == 2 and spawns[1]["standby"] and spawns[1]["replaces"] == refill["lid"]
    c.push_event("join", lid=refill["lid"], nonce="nrefill")
    d.step()
    d.step()
    assert d.gen == 2 and c.get_plan(2).spare_of_rank == {4: refill["lid"]}
    assert [r["warm"] for r in d.local.records] == [True, False]
