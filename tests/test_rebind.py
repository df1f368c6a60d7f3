"""Slot walk, rebind (including tuples and __slots__) and the audits, on real gloo groups."""

import gc
import os
import socket
from collections import namedtuple

import pytest
import torch
import torch.distributed as dist

from megatron_deadpool.base.errors import RebindAuditError
from megatron_deadpool.recovery import rebind


def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


Pair = namedtuple("Pair", "a b")


class Slotted:
    __slots__ = ("grp", "x")


class Holder(torch.nn.Module):
    def __init__(self, tp, dp):
        super().__init__()
        self.tp_group = tp
        self.groups = {"dp": dp, "n": 1}
        self.lst = [1, dp]
        self.tup = (tp, (dp, 3))
        self.pair = Pair(tp, dp)
        s = Slotted()
        s.grp, s.x = dp, 2
        self.slotted = s
        self.lin = torch.nn.Linear(2, 2)


@pytest.fixture
def world():
    from megatron.core import parallel_state as ps

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    ps.initialize_model_parallel(1, 1)
    yield ps
    ps.destroy_model_parallel()
    dist.destroy_process_group()


def _rebuild(ps):
    ps.destroy_model_parallel()
    dist.destroy_process_group()
    os.environ["MASTER_PORT"] = str(_port())
    dist.init_process_group("gloo", rank=0, world_size=1)
    ps.initialize_model_parallel(1, 1)


def test_rebind_every_slot_kind_and_audit(world):
    ps = world
    h = Holder(ps.get_tensor_model_parallel_group(), ps.get_data_parallel_group())
    slots = rebind.GroupSlots([h])
    assert len(slots) == 8 and not slots.unknown
    roles = {s.role for s in slots.slots}
    assert any("TENSOR_MODEL_PARALLEL_GROUP" in r for r in roles)
    old = rebind.weak_groups([h.tp_group, h.groups["dp"]])
    _rebuild(ps)
    with pytest.raises(RebindAuditError, match="old process group"):
        slots.audit()
    assert slots.rebind() == 8
    slots.audit()
    assert h.tp_group is ps.get_tensor_model_parallel_group()
    assert h.tup[1][0] is ps.get_data_parallel_group()
    assert isinstance(h.pair, Pair) and h.pair.b is ps.get_data_parallel_group()
    assert h.slotted.grp is ps.get_data_parallel_group()
    assert rebind.heap_audit(old) == []


def test_heap_audit_names_a_hidden_holder(world):
    ps = world
    class Box:
        pass

    hidden = Box()
    hidden.secret = ps.get_data_parallel_group()  # not reachable from any attached root
    old = rebind.weak_groups([ps.get_data_parallel_group()])
    _rebuild(ps)
    leaks = rebind.heap_audit(old)
    assert leaks and "Box" in leaks[0]
    del hidden
    gc.collect()
    assert rebind.heap_audit(old) == []


def test_heap_audit_names_a_running_thread_and_waits_for_one_letting_go(world):
    """A thread in the middle of an old-generation call holds the group in its frame's
    locals, which no heap scan sees (a CI run's audit said "group held by ?"): the audit
    names the thread and function; a thread that lets go within the grace is no leak."""
    import threading

    ps = world
    old = rebind.weak_groups([ps.get_data_parallel_group()])
    held, go = threading.Event(), threading.Event()

    def old_call(group):
        held.set()
        go.wait(10)

    t = threading.Thread(target=old_call, args=(ps.get_data_parallel_group(),),
                         name="old-generation-call")
    t.start()
    held.wait(10)
    _rebuild(ps)
    leaks = rebind.heap_audit(old)
    assert leaks and "thread old-generation-call in old_call" in leaks[0], leaks
    threading.Timer(0.3, go.set).start()
    assert rebind.heap_audit(old, grace_s=5.0) == []
    t.join(10)


def test_release_unsets_every_slot_and_the_groups_die_on_the_reaper_thread(world):
    """The old groups' last references leave the main thread: destroying a gloo group waits
    for its event loop's ticks (reaper.py), which must not hold up rebuild_groups."""
    import threading

    from megatron_deadpool.recovery.reaper import Reaper

    ps = world
    h = Holder(ps.get_tensor_model_parallel_group(), ps.get_data_parallel_group())
    slots = rebind.GroupSlots([h])
    died_on = []
    groups = {id(h.tp_group): h.tp_group, id(h.groups["dp"]): h.groups["dp"]}
    refs = [__import__("weakref").ref(g, lambda _: died_on.append(threading.current_thread().name))
            for g in groups.values()]
    del groups
    _rebuild(ps)  # megatron's globals and torch's registry let go of the old groups
    held = slots.release()
    assert len(held) == len({id(g) for g in held}) == len(refs)  # distinct
    assert h.tp_group is None and h.groups["dp"] is None and h.tup == (None, (None, 3))
    assert isinstance(h.pair, Pair) and h.pair == (None, None) and h.slotted.grp is None
    slots.audit()  # an unset slot is not an old group
    gc.collect()
    assert died_on == []  # ``held`` is their last holder
    reaper = Reaper()
    reaper.drop(held)
    del held
    assert reaper.wait(30)
    assert died_on == ["deadpool-reaper"] * len(refs)
    assert slots.rebind() == 8
    assert h.tp_group is ps.get_tensor_model_parallel_group()
