"""A drain's direct state path (mirror/handoff.py), in-process: the draining rank's sealed
slot reaches the spare through the job's store from two different generations, is verified
and adopted as the spare's own; a copy that does not verify, or no sender at all, leaves
the spare with nothing adopted (the restore then takes the buddy's copy). End to end:
tests/test_planned_swaps.py."""

from datetime import timedelta

import torch
import torch.distributed as dist

from megatron_deadpool.mirror import handoff
from test_fallback import _FakeMirror

SECRET = "s" * 32


def _mirror(rank):
    """test_fallback's fake mirror (slots, layout, job), unpinned as on CPU."""
    m = _FakeMirror(rank)
    m.pin = False
    return m


def _stores():
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=30))
    # the draining process is in generation 3, the spare in generation 4: both reach the
    # handoff's namespace under the generation prefixes (world.py)
    return (server, dist.PrefixStore("gen3/", server),
            dist.PrefixStore("default/", dist.PrefixStore("gen4/", server)))


def test_the_spare_adopts_the_draining_ranks_own_slot():
    _, old, new = _stores()
    draining, spare = _mirror(5), _mirror(5)
    draining.seal(6)
    sender = handoff.Sender(draining, old, "127.0.0.1", SECRET, 4, 5, 6, timeout_s=20)
    got = handoff.receive(spare, new, "127.0.0.1", SECRET, 4, 5, timeout_s=20)
    assert sender.join(20) and sender.error is None and got == 6
    assert spare.own.iterations() == [6]
    assert torch.equal(spare.own.sealed(6), draining.own.sealed(6))
    assert sender.sent_bytes == draining.own.sealed(6).numel()


def test_a_slot_of_another_rank_is_refused_and_nothing_is_adopted(caplog):
    _, old, new = _stores()
    draining, spare = _mirror(4), _mirror(5)  # rank 4's state, sent as rank 5's
    draining.seal(6)
    sender = handoff.Sender(draining, old, "127.0.0.1", SECRET, 4, 5, 6, timeout_s=20)
    assert handoff.receive(spare, new, "127.0.0.1", SECRET, 4, 5, timeout_s=20) is None
    assert sender.join(20) and spare.own.iterations() == []
    assert "holds rank 4 iteration 6" in caplog.text and "buddy's copy" in caplog.text


def test_no_sender_ends_at_the_bound_with_nothing_adopted():
    _, _, new = _stores()
    spare = _mirror(5)
    assert handoff.receive(spare, new, "127.0.0.1", SECRET, 4, 5, timeout_s=0.5) is None
    assert spare.own.iterations() == []


def test_an_aborted_sender_stops():
    _, old, _ = _stores()
    draining = _mirror(5)
    draining.seal(6)
    sender = handoff.Sender(draining, old, "127.0.0.1", SECRET, 4, 5, 6, timeout_s=60)
    sender.abort()  # a newer plan: the spare never comes
    assert sender.join(10) and sender.sent_bytes is None and sender.error
