"""StallWatch: a member that does not take a newer generation's plan dumps its stacks once."""

from megatron_deadpool.recovery.stall import StallWatch


def _watch():
    t = [0.0]
    dumps = []
    w = StallWatch(10.0, clock=lambda: t[0], dump=lambda: dumps.append(t[0]))
    return w, t, dumps


def test_dumps_once_per_generation_after_the_delay():
    w, t, dumps = _watch()
    assert not w.observe(3, 2)          # generation 3 first seen at t=0
    t[0] = 9.9
    assert not w.observe(3, 2)
    t[0] = 10.0
    assert w.observe(3, 2)
    t[0] = 50.0
    assert not w.observe(3, 2)          # once per generation
    assert not w.observe(4, 2)          # generation 4 seen at t=50: a new delay
    t[0] = 60.0
    assert w.observe(4, 2)
    assert dumps == [10.0, 60.0]


def test_no_dump_once_the_plan_is_taken_or_without_a_plan():
    w, t, dumps = _watch()
    w.observe(3, 2)
    t[0] = 5.0
    assert not w.observe(3, 3)          # took generation 3: the clock resets
    t[0] = 20.0
    assert not w.observe(3, 3)
    assert not w.observe(5, None)       # a standby spare has no generation
    t[0] = 40.0
    assert not w.observe(5, None)
    assert dumps == []
