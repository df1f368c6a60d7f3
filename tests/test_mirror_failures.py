"""Mirror failures are loud (issue 27, item 5): a copy that a holder rejects is reported and
commits nowhere, not even on its owner under the implicit commit, and a rank whose newest
committed iteration falls behind is reported UNPROTECTED."""

import json
from types import SimpleNamespace

import pytest
from torch.distributed import HashStore

from megatron_deadpool.base.errors import ConfigError
from megatron_deadpool.base.faults import parse_fault
from megatron_deadpool.launch.progress import format_iteration
from megatron_deadpool.launch.summary import mirror_failures
from megatron_deadpool.mirror.commit import CommitTracker, RejectionBoard
from megatron_deadpool.mirror.mirror import Mirror
from megatron_deadpool.recovery import alarms
from megatron_deadpool.control import attachment, link
from megatron_deadpool.base.worker_env import PROGRESS_PREFIX
from conftest import launch, layout_flags
from test_mirror_host import _Pair, _connect, _named


class _Dropping(_Pair):
    """``_Pair``, but what rank ``victim`` receives arrives damaged (no magic)."""

    def __init__(self, victim: int):
        super().__init__()
        self.victim = victim

    def end(self, rank):
        inner = super().end(rank)
        victim = self.victim

        class End:
            world_size = 2
            gather_from, all_ok = inner.gather_from, inner.all_ok

            def exchange(self, sends, recvs, timeout_s=None):
                inner.exchange(sends, recvs, timeout_s)
                if rank == victim:
                    for _, buf in recvs:
                        buf[:8].zero_()

        return End()


def _implicit_pair(transport, board):
    ms = [Mirror(r, replicas=1, meta_capacity=1 << 12, sources=_named) for r in (0, 1)]
    for r, m in enumerate(ms):
        _connect(m, transport.end(r), [1 - r])
        m.commits.implicit = True
        m.commits.board = board
    return ms


def _steps(ms, iterations):
    for it in iterations:
        for m in ms:
            m.begin(it, {"iteration": it})
        for m in ms:
            m.wait()


def test_an_owner_does_not_commit_a_copy_its_holder_rejected():
    """Rank 1 holds rank 0's copies and every one arrives damaged: rank 1 says so at the
    first one, and rank 0, whose own verify saw nothing wrong, commits nothing either."""
    ms = _implicit_pair(_Dropping(victim=1), RejectionBoard(HashStore()))
    seen = []
    ms[1].rejections.hook = lambda holder, owner, it, why: seen.append((holder, owner, it))
    try:
        _steps(ms, [0])
        assert seen == [(1, 0, 0)]  # within the iteration it happened
        _steps(ms, [1, 2, 3])
        assert seen == [(1, 0, it) for it in range(4)] and ms[1].rejections.count == 4
        assert [m.commits.committed for m in ms] == [-1, -1]
        assert [m.commits.failed for m in ms] == [3, 4]  # 3 settled on rank 0 so far
    finally:
        for m in ms:
            m.close()


def test_a_healthy_pair_still_commits_implicitly_with_a_board():
    ms = _implicit_pair(_Pair(), RejectionBoard(HashStore()))
    try:
        _steps(ms, [0, 1, 2])
        assert [m.commits.committed for m in ms] == [1, 1]
        assert [m.rejections.count for m in ms] == [0, 0]
    finally:
        for m in ms:
            m.close()


def test_an_iteration_posted_as_rejected_commits_nowhere():
    c = CommitTracker()
    c.implicit, c.board = True, RejectionBoard(HashStore())
    c.verified(5, True)
    c.board.post(5)  # a holder elsewhere
    assert c.settle(6) is None and c.committed == -1 and c.failed == 1
    c.verified(6, True)
    assert c.settle(7) == 6


def _protected(committed):
    events = []
    p = attachment.Attachment(link.MirrorSettings(create_timeout_s=1.0, op_timeout_s=1.0),
                            emit=lambda event, **f: events.append((event, f)))
    p.mirror = SimpleNamespace(rank=3)
    p.commits = SimpleNamespace(committed=committed)  # the mirror's commit tracker
    return p, events


def test_a_rank_whose_commit_lags_is_unprotected_on_every_progress_line(caplog):
    lag = alarms.UNPROTECTED_LAG
    p, events = _protected(committed=10)
    assert not p.progress(10 + lag)["unprotected"]  # the implicit commit's healthy lag
    for it in (11 + lag, 12 + lag):
        rec = p.progress(it)
        assert rec["unprotected"]
        assert "UNPROTECTED (newest committed iteration 10)" in format_iteration(
            {"iteration": it, "loss": 1.0, "step_s": 0.1, "generation": 0, **rec})
        p.alarms.step(3, it, 10)
    assert p.alarms.unprotected_steps == 2
    assert events == [("unprotected", {"rank": 3, "iteration": 11 + lag, "committed": 10})]
    assert sum("UNPROTECTED: rank 3" in r.message for r in caplog.records) == 2


def test_a_rejected_copy_is_a_warning_and_an_event(caplog):
    p, events = _protected(committed=4)
    p.alarms.copy_rejected(3, owner=2, iteration=5, why="bad magic")
    assert events == [("mirror_copy_rejected",
                       {"rank": 3, "owner": 2, "iteration": 5, "why": "bad magic"})]
    assert any("rejected the copy of rank 2, iteration 5" in r.message for r in caplog.records)


def test_the_summary_counts_mirror_failures():
    ranks = [{"rank": 0, "rejected_copies": 0, "failed_commits": 9, "unprotected_steps": 7},
             {"rank": 1, "rejected_copies": 9, "failed_commits": 9, "unprotected_steps": 7},
             {"rank": 2}]
    got = mirror_failures(ranks)
    assert {k: got[k] for k in ("rejected_copies", "failed_commits", "unprotected_ranks")} == {
        "rejected_copies": 9, "failed_commits": 9, "unprotected_ranks": [0, 1]}


def test_a_drop_fault_targets_one_rank_at_an_iteration():
    f = parse_fault("drop:rank=3@iter=2")
    assert (f.kind, f.rank, f.iteration) == ("drop", 3, 2)
    for bad in ("drop:node=1@iter=2", "drop:rank=1@t=3"):
        with pytest.raises(ConfigError, match="drop"):
            parse_fault(bad)


def test_a_holder_with_the_drop_fault_rejects_what_arrives():
    ms = _implicit_pair(_Pair(), RejectionBoard(HashStore()))
    ms[1].rejections.drop_arrivals(1)
    try:
        _steps(ms, [0, 1, 2])
        assert ms[1].rejections.count == 2 and ms[0].rejections.count == 0
        assert ms[1].held.iters[0] == [-1, -1] and ms[0].held.iters[1] == [2, 1]
    finally:
        for m in ms:
            m.close()


@pytest.mark.slow
@pytest.mark.ci
def test_a_run_whose_holder_drops_every_copy_says_so(tmp_path):
    """End to end: rank 3 rejects every copy from iteration 3 on. The run finishes (nothing
    failed) and says so: a ``mirror_copy_rejected`` event in iteration 3 itself, the
    UNPROTECTED progress lines, and the summary's counts."""
    events = tmp_path / "events.jsonl"
    p, s = launch(tmp_path, layout_flags(2, 2, 8) + ["--deadpool", "--deadpool-events",
                                                     str(events)],
                  inject=["drop:rank=3@iter=3"])
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    evs = [json.loads(x) for x in events.read_text().splitlines()]
    rejected = [e for e in evs if e["event"] == "mirror_copy_rejected"]
    assert rejected and rejected[0]["iteration"] == 3 and rejected[0]["rank"] == 3
    assert any(e["event"] == "unprotected" for e in evs)
    records = [json.loads(x.split(PROGRESS_PREFIX, 1)[1]) for x in p.stdout.splitlines()
               if PROGRESS_PREFIX in x]
    assert [r["iteration"] for r in records if r.get("unprotected")] == [5, 6, 7, 8]
    m = s["mirror"]
    assert m["rejected_copies"] >= 6 and m["failed_commits"] >= 5 and m["unprotected_ranks"]
