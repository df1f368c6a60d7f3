"""The decider against an in-memory store: admission by token, plans on failure, fencing,
lost nodes, and the no-spare stop. No processes are started."""

import json
import time

import pytest
import torch.distributed as dist

from megatron_deadpool.membership import store as st
from megatron_deadpool.membership.decider import Decider, DeciderConfig, Proc


def _decider(spares=2, hb_timeout=0.5):
    store = dist.HashStore()
    procs = {r: Proc(lid=r, node=r // 2, role="active", rank=r) for r in range(8)}
    for i in range(spares):
        procs[8 + i] = Proc(lid=8 + i, node=4 + i // 2, role="spare")
    cmds = []
    d = Decider(store=store, procs=procs, world_size=8, token="secret", faults=[],
                send_command=lambda node, cmd: cmds.append((node, cmd)),
                config=DeciderConfig(heartbeat_timeout_s=hb_timeout, heartbeat_interval_s=0.1,
                                     grace_s=0.0), log=lambda m: None)
    d.publish_initial_plan()
    return d, store, cmds


def _join(store, lid, token="secret"):
    store.set(st.k("join", lid), token)
    st.push_event(store, "join", lid=lid)


def _beat(store, lid, seq, iteration=1):
    store.set(st.k("hb", lid), json.dumps({"seq": seq, "iteration": iteration,
                                           "state": "ACTIVE", "committed": iteration - 1}))


def test_wrong_token_is_refused():
    d, store, _ = _decider()
    _join(store, 0)
    _join(store, 1, token="guess")
    d.step()
    assert store.get(st.k("admit", 0)) == b"ok"
    assert store.get(st.k("admit", 1)).startswith(b"refused")


def test_exit_produces_next_generation_plan():
    d, store, _ = _decider()
    for lid in range(10):
        _join(store, lid)
    d.step()
    st.push_event(store, "exit", lid=2, code=-9, node=1)
    st.push_event(store, "exit", lid=3, code=-9, node=1)
    d.step()
    d.step()
    assert st.current_gen(store) == 1
    plan = st.get_json(store, st.k("plan", 1))
    assert plan["failed_ranks"] == [2, 3] and plan["spare_ranks"] == {"2": 8, "3": 9}
    assert plan["rank_of"]["8"] == 2 and "2" not in plan["rank_of"]
    assert plan["node_of_rank"][2] == 4 and plan["prev_node_of_rank"][2] == 1


def test_stale_heartbeat_is_fenced_then_replaced():
    d, store, cmds = _decider(hb_timeout=1.0)
    for lid in range(10):
        _join(store, lid)
        _beat(store, lid, 1)
    d.step()
    for seq in range(2, 60):  # everyone but lid 5 keeps beating
        for lid in range(10):
            if lid != 5:
                _beat(store, lid, seq)
        time.sleep(0.05)
        d.step()
        if st.current_gen(store) == 1:
            break
    assert any(c == {"op": "signal", "signal": "SIGKILL", "lids": [5]} for _, c in cmds)
    plan = st.get_json(store, st.k("plan", 1))
    assert plan["failed_ranks"] == [5]


def test_no_spare_left_stops_with_committed_iteration():
    d, store, _ = _decider(spares=0)
    for lid in range(8):
        _join(store, lid)
        _beat(store, lid, 1, iteration=7)
    d.step()
    time.sleep(0.06)
    d.step()
    st.push_event(store, "exit", lid=6, code=-9, node=3)
    d.step()
    d.step()
    reason = store.get(st.k("shutdown")).decode()
    assert "no spare left" in reason and "last committed iteration 6" in reason
    assert d.finished and st.current_gen(store) == 0
