"""The recovery's work counts (base/counts.py, recovery/counting.py) and their fit against
the world size (apps/bench_recovery.py: count_laws)."""

import pytest

from megatron_deadpool.apps import bench_recovery as br
from megatron_deadpool.base import counts


def test_a_phase_gets_what_was_counted_while_it_ran():
    from megatron_deadpool.base.vocabulary import Phase
    from megatron_deadpool.recovery.phases import EventSink, PhaseTimer

    t = PhaseTimer(EventSink(None))
    t.start(Phase.ABORT)
    counts.add("connections", 3)
    t.start(Phase.REBUILD_GROUPS)
    counts.add("groups_created")
    counts.add("group_members", 4)
    t.stop()
    counts.add("bytes", 100)  # between phases: nobody's
    t.start(Phase.REBUILD_GROUPS)
    counts.add("groups_created")
    t.stop()
    assert t.counts == {"abort": {"connections": 3},
                        "rebuild_groups": {"groups_created": 2, "group_members": 4}}


def test_unknown_kind_and_delta():
    with pytest.raises(KeyError):
        counts.add("sockets")
    a = counts.snapshot()
    counts.add("messages", 2)
    assert counts.delta(a, counts.snapshot()) == {"messages": 2}


def test_per_phase_max_takes_the_busiest_rank_per_kind():
    reports = [{"rebuild_groups": {"connections": 7, "groups_created": 3}},
               {"rebuild_groups": {"connections": 9, "groups_created": 2},
                "restore_state": {"bytes": 5}}, {}]
    assert counts.per_phase_max(reports, ("abort", "rebuild_groups", "restore_state")) == {
        "rebuild_groups": {"connections": 9, "groups_created": 3},
        "restore_state": {"bytes": 5}}


def _run(w, conns, calls, bytes_):
    return {"world_size": w, "counts": {"rebuild_groups": {"connections": conns,
                                                           "new_group_calls": calls},
                                        "restore_state": {"bytes": bytes_}}}


def test_count_laws_name_each_counts_growth():
    runs = [_run(w, 5, 20 + 2 * w, 64 * w) for w in (4, 8, 16)]
    laws = br.count_laws(runs)
    assert laws["rebuild_groups"]["connections"]["form"] == "O(1)"
    assert laws["rebuild_groups"]["new_group_calls"]["form"] == "O(W)"
    assert laws["rebuild_groups"]["new_group_calls"]["law"]["coef"] == pytest.approx([20, 2])
    assert laws["restore_state"]["bytes"]["by_w"] == {"4": 256, "8": 512, "16": 1024}
    table = br.counts_table(laws)
    assert "rebuild_groups  connections      W=4:5 W=8:5 W=16:5  O(1)" in table
    log_runs = [_run(w, 3 + 2 * (w.bit_length() - 1), 1, 1) for w in (4, 8, 16, 32)]
    assert br.count_laws(log_runs)["rebuild_groups"]["connections"]["form"] == "O(log W)"


def test_aggregate_keeps_counts_and_says_whether_runs_agree():
    s = {"phases_s": {}, "total_s": 1.0, "wall_s": 1.0,
         "counts": {"abort": {"connections": 1}}, "counts_spare": {}}
    other = dict(s, counts={"abort": {"connections": 2}})
    assert br.aggregate(8, [s, s], 10)["counts_agree"] is True
    out = br.aggregate(8, [s, other], 10)
    assert out["counts"] == {"abort": {"connections": 1}} and out["counts_agree"] is False
    assert "counts" not in br.aggregate(8, [dict(s, counts=None)], 10)


def _counted_world(rank, port, q):
    import torch
    import torch.distributed as dist
    from datetime import timedelta

    from megatron_deadpool.recovery import counting

    counting.install()
    counting.count_store_ops()
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0,
                          timeout=timedelta(seconds=60))
    before = counts.snapshot()
    dist.init_process_group("gloo", store=dist.PrefixStore("gen0/", counting.generation_store(
        store)), rank=rank, world_size=2, timeout=timedelta(seconds=60))
    counting.count_group("gloo", 2)
    world = counts.delta(before, counts.snapshot())
    before = counts.snapshot()
    pair = dist.new_group([0, 1])
    dist.new_group([0])  # rank 1 is not a member: it calls, it creates nothing
    t = torch.ones(2)
    dist.all_reduce(t, group=pair)
    q.put((rank, world, counts.delta(before, counts.snapshot()), t.tolist()))
    dist.destroy_process_group()


def test_group_creation_is_counted_on_a_real_gloo_world():
    import multiprocessing as mp

    from megatron_deadpool.launch.options import free_port

    ctx = mp.get_context("spawn")
    q, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_counted_world, args=(r, port, q)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict((r, (w, g, t)) for r, w, g, t in (q.get(timeout=120) for _ in procs))
    for p in procs:
        p.join(30)
    for rank, (world, groups, t) in got.items():
        assert t == [2.0, 2.0]
        assert world["groups_created"] == 1 and world["connections"] == 1
        assert world["store_ops"] > 0  # gloo's rendezvous went through the counted store
        assert groups["new_group_calls"] == 2 and groups["store_ops"] > 0
    assert got[0][1]["groups_created"] == 2 and got[0][1]["group_members"] == 3
    assert got[1][1]["groups_created"] == 1 and got[1][1]["group_members"] == 2
    assert got[0][1]["connections"] == got[1][1]["connections"] == 1


def test_the_memberships_operations_on_the_jobs_store_are_counted_apart(monkeypatch):
    """The membership's main connection (plan reads, the barriers) lands on the job's one
    store: counted as control_store_ops when the work is counted (--deadpool-count-work),
    apart from the groups' store_ops, and not at all otherwise."""
    import socket

    from megatron_deadpool.membership import store as st
    from megatron_deadpool.membership.member import Member
    from megatron_deadpool.recovery import counting

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = st.connect("127.0.0.1", port, 10, is_master=True)  # noqa: F841 - serves
    secret = "s" * 32

    def ops(member):
        before = counts.snapshot()
        member.current_gen()
        member.membership_moved(0)
        return counts.delta(before, counts.snapshot())

    monkeypatch.setattr(counting, "_store_ops", False)
    off = Member(0, 0, "127.0.0.1", port, secret, 0.5, 10, counted=counting.main_connection)
    assert ops(off) == {}
    monkeypatch.setattr(counting, "_store_ops", True)
    on = Member(1, 0, "127.0.0.1", port, secret, 0.5, 10, counted=counting.main_connection)
    got = ops(on)
    assert got.get("control_store_ops", 0) >= 2 and "store_ops" not in got, got


def test_the_busiest_survivors_rebuild_is_split_at_the_dead_ranks_groups():
    """Issue 57: what a survivor did outside the dead ranks' own groups is what must not
    grow with the world; the busiest survivor is the one with the most connections."""
    from megatron_deadpool.apps.bench_recovery import busiest_line

    reports = [
        {"rank": 0, "counts": {"rebuild_groups": {  # the dead ranks' two groups only
            "connections": 13, "store_ops": 30, "dead_groups": 2, "dead_group_members": 15,
            "dead_group_connections": 13, "dead_group_store_ops": 26}}},
        {"rank": 5, "counts": {"rebuild_groups": {  # an unsettled group: outside them
            "connections": 3, "store_ops": 8}}},
        {"rank": 6, "counts": {}},
    ]
    b = counts.busiest(reports)
    assert (b["rank"], b["dead_groups"], b["dead_group_members"]) == (0, 2, 15)
    assert b["outside_dead_groups"] == {"connections": 0, "store_ops": 4}
    assert b["outside_dead_groups_most"] == {"connections": 3, "store_ops": 8}
    assert "outside them 0 and 4 (most by any survivor: 3 and 8)" in busiest_line(b)
    assert counts.busiest([{"rank": 1, "counts": {}}]) == {}
