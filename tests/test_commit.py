"""The commit rule (mirror/commit.py) as pure logic, and the check that decides whether a
training step is a world-wide barrier (adapters/support.py: step_barrier)."""

from types import SimpleNamespace

import pytest

from megatron_deadpool.mirror.commit import CommitTracker


def test_collective_commit_follows_the_vote():
    c = CommitTracker()
    assert c.collective(3, True) and c.committed == 3
    assert not c.collective(4, False) and c.committed == 3 and c.failed == 1


def test_implicit_commit_waits_for_a_later_step():
    c = CommitTracker()
    c.implicit = True
    c.verified(5, True)
    assert c.committed == -1  # job 5 is done here; other ranks may still be in theirs
    assert c.settle(5) is None  # step 5 itself proves nothing about job 5
    assert c.settle(6) == 5 and c.committed == 5
    assert c.settle(7) is None and c.committed == 5  # nothing pending: no double commit


def test_a_copy_that_failed_its_verify_never_commits_implicitly():
    c = CommitTracker()
    c.implicit = True
    c.verified(5, True)
    assert c.settle(6) == 5
    c.verified(6, False)
    assert c.settle(7) is None and c.committed == 5 and c.failed == 1
    c.verified(7, True)
    assert c.settle(9) == 7  # steps with the mirror off between: still proven by step 9


def test_a_restore_drops_what_was_pending():
    c = CommitTracker()
    c.implicit = True
    c.verified(8, True)
    c.reset(6)
    assert c.committed == 6 and c.settle(9) is None


class _Opt:
    def __init__(self, clip, group_size):
        self.config = SimpleNamespace(clip_grad=clip)
        self._g = group_size

    def get_grad_stats_parallel_group(self):
        return self._g


@pytest.mark.parametrize("clip,group,world,why", [
    (1.0, 8, 8, None),
    (0.0, 8, 8, "gradient clipping is off"),
    (1.0, 4, 8, "reduced over 4 of 8 ranks"),
])
def test_step_barrier_needs_clipping_by_a_world_wide_norm(monkeypatch, clip, group, world, why):
    import torch.distributed as dist

    from megatron_deadpool.adapters import shard, support

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda g=None: world if g is None else g)
    monkeypatch.setattr(shard, "distributed_optimizers", lambda o: [o])
    got = support.step_barrier(_Opt(clip, group))
    assert got is None if why is None else why in got
