"""Fault schedule (megatron_deadpool.base.faults): parsing, JSON, validation, targets."""

import dataclasses
import pathlib

import pytest

from megatron_deadpool.base.errors import ConfigError
from megatron_deadpool.base import faults as inject
from megatron_deadpool.base.faults import Fault


@pytest.mark.parametrize("spec,expected", [
    ("kill:node=1@iter=12", Fault("kill", 12, node=1)),
    ("kill:rank=5@iter=7,phase=optimizer", Fault("kill", 7, rank=5, phase="optimizer")),
    ("stop:rank=3@iter=9", Fault("stop", 9, rank=3)),
    ("stop:node=2@iter=4", Fault("stop", 4, node=2)),
    ("kill:rank=0@iter=1,phase=mirror", Fault("kill", 1, rank=0, phase="mirror")),
    ("  kill:node=0@iter=3,phase=forward_backward ", Fault("kill", 3, node=0)),
])
def test_parse_fault(spec, expected):
    assert inject.parse_fault(spec) == expected


def test_parse_fault_fields_and_index():
    f = inject.parse_fault("kill:rank=5@iter=7,phase=optimizer", 3)
    assert (f.kind, f.node, f.rank, f.iteration, f.phase, f.index) == (
        "kill", None, 5, 7, "optimizer", 3)
    f = inject.parse_fault("kill:node=1@iter=12")
    assert (f.kind, f.node, f.rank, f.iteration, f.phase, f.index) == (
        "kill", 1, None, 12, "forward_backward", 0)


@pytest.mark.parametrize("spec,why", [
    ("", "missing '@iter=N'"),
    ("kill:node=1", "missing '@iter=N'"),
    ("kill@iter=3", "missing ':'"),
    ("boom:node=1@iter=2", "kind must be one of kill, stop"),
    ("kill:host=1@iter=2", "target must be node=N, rank=N or domain=D"),
    ("kill:rank@iter=2", "target must be node=N, rank=N or domain=D"),
    ("kill:rank=x@iter=2", "rank must be a non-negative integer"),
    ("kill:rank=-1@iter=2", "rank must be a non-negative integer"),
    ("kill:node=1@iter=", "iter must be a non-negative integer"),
    ("kill:node=1@iter=2.5", "iter must be a non-negative integer"),
    ("kill:node=1@it=2", "unknown option 'it=2'"),
    ("kill:node=1@phase=optimizer", "missing 'iter=N'"),
    ("kill:node=1@iter=2,iter=3", "iter= given twice"),
    ("kill:rank=1@iter=2,phase=nope", "phase must be one of forward_backward, optimizer, mirror"),
    ("kill:rank=1@iter=2,when=now", "unknown option 'when=now'"),
])
def test_bad_specs_say_what_is_wrong(spec, why):
    with pytest.raises(ConfigError) as exc:
        inject.parse_fault(spec)
    msg = str(exc.value)
    assert why in msg
    assert repr(spec) in msg and inject.FORM in msg
    assert "\n" not in msg


def test_parse_schedule_indexes_by_position():
    sched = inject.parse_schedule(["kill:node=1@iter=3", "stop:rank=2@iter=5",
                                   "kill:node=1@iter=3"])
    assert [f.index for f in sched] == [0, 1, 2]
    assert sched[0] != sched[2]  # same fault twice is two faults
    assert inject.parse_schedule([]) == []


def test_json_round_trip():
    sched = inject.parse_schedule(["kill:node=1@iter=3", "stop:rank=2@iter=5,phase=mirror",
                                   "kill:rank=7@iter=9,phase=optimizer"])
    s = inject.to_json(sched)
    assert isinstance(s, str) and "\n" not in s
    back = inject.from_json(s)
    assert back == sched
    assert all(isinstance(f, Fault) for f in back)
    assert inject.from_json(inject.to_json([])) == []
    assert inject.from_json("") == [] and inject.from_json(None) == []


@pytest.mark.parametrize("bad", ["{not json", '{"kind": "kill"}', '[{"kind": "kill"}]',
                                 '[{"kind": "zap", "iteration": 1, "node": 0}]',
                                 '[{"kind": "kill", "iteration": 1, "node": 0, "x": 1}]'])
def test_from_json_rejects_garbage(bad):
    with pytest.raises(ConfigError):
        inject.from_json(bad)


def test_fault_is_frozen_and_checked():
    f = Fault("kill", 3, node=1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        f.iteration = 4
    with pytest.raises(ConfigError, match="exactly one of node, rank or domain"):
        Fault("kill", 3, node=1, rank=2)
    with pytest.raises(ConfigError, match="exactly one of node, rank or domain"):
        Fault("kill", 3)
    with pytest.raises(ConfigError, match="phase"):
        Fault("kill", 3, rank=1, phase="backward")
    with pytest.raises(ConfigError, match="iteration must be an integer"):
        Fault("kill", "3", rank=1)


def test_kinds_are_one_enum_described_once():
    """Every ``Kind`` is described in ``KINDS``; a fault holds the member, whatever it was
    given (a spec, JSON or a keyword), and the actions bind by it."""
    assert list(inject.KINDS) == list(inject.Kind)
    assert all(k is inject.KINDS[k].name for k in inject.Kind)
    f = inject.parse_fault("drain:node=2@iter=8")
    assert f.kind is inject.Kind.DRAIN and f.kind == "drain"
    assert inject.from_json(inject.to_json([f]))[0].kind is inject.Kind.DRAIN
    assert Fault("kill", 1, node=0).kind is inject.Kind.KILL
    assert '"kind":"drain"' in inject.to_json([f])


def test_describe_round_trips():
    for spec in ["kill:node=1@iter=12", "stop:rank=3@iter=9,phase=mirror"]:
        assert inject.parse_fault(spec).describe() == spec


def test_targets():
    node_fault = inject.parse_fault("kill:node=1@iter=12")
    assert node_fault.targets(rank=2, node=1) and node_fault.targets(rank=99, node=1)
    assert not node_fault.targets(rank=1, node=0)
    rank_fault = inject.parse_fault("stop:rank=5@iter=7")
    assert rank_fault.targets(rank=5, node=2) and rank_fault.targets(rank=5, node=4)
    assert not rank_fault.targets(rank=4, node=2) and not rank_fault.targets(rank=1, node=5)
    assert [r for r in range(8) if node_fault.targets(r, r // 2)] == [2, 3]


def test_validate_schedule_accepts_boundaries():
    sched = inject.parse_schedule(["kill:node=4@iter=1", "kill:rank=7@iter=10",
                                   "stop:node=0@iter=5"])
    inject.validate_schedule(sched, total_nodes=5, world_size=8, train_iters=10)  # no raise
    inject.validate_schedule([], total_nodes=1, world_size=1, train_iters=1)


@pytest.mark.parametrize("spec,match", [
    ("kill:node=5@iter=3", r"node 5 does not exist \(nodes are 0\.\.4\)"),
    ("kill:rank=8@iter=3", r"rank 8 does not exist \(ranks are 0\.\.7\)"),
    ("kill:rank=1@iter=0", r"iteration 0 is outside 1\.\.10"),
    ("stop:node=1@iter=11", r"iteration 11 is outside 1\.\.10"),
])
def test_validate_schedule_rejects(spec, match):
    sched = inject.parse_schedule(["kill:node=0@iter=2", spec])
    with pytest.raises(ConfigError, match=match) as exc:
        inject.validate_schedule(sched, total_nodes=5, world_size=8, train_iters=10)
    assert spec in str(exc.value)


def test_the_usage_doc_lists_the_kinds_of_KINDS():
    """docs/usage.md's list of the kinds is ``kinds_doc()``, the rendering of ``KINDS``."""
    text = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "usage.md").read_text()
    start = text.index("  The kinds:\n") + len("  The kinds:\n")
    listed = text[start:text.index("\n\n", start)]
    assert listed == inject.kinds_doc(), (
        "docs/usage.md's list of the kinds differs from KINDS (base/faults.py); put "
        "faults.kinds_doc() there:\n" + inject.kinds_doc())


def test_the_launch_help_gives_every_kind_from_its_entry():
    from megatron_deadpool.apps.cli import build_parser

    launch = build_parser()._subparsers._group_actions[0].choices["launch"]
    (help_text,) = [a.help for a in launch._actions if "--inject" in a.option_strings]
    assert all(f"{k.line()}." in help_text for k in inject.KINDS.values())


@pytest.mark.parametrize("spec,by_agent,commands", [
    ("kill:rank=1@iter=3", False, []),
    ("term:rank=1@iter=3,phase=optimizer", False, []),
    ("drop:rank=1@iter=3", False, []),
    ("kill:node=1@iter=3", True, [{"op": "signal", "signal": "SIGKILL", "lids": [1]}]),
    ("stop:rank=1@t=2", True, [{"op": "signal", "signal": "SIGSTOP", "lids": [1]}]),
    ("poweroff:node=1@iter=3", True,
     [{"op": "signal", "signal": "SIGKILL", "lids": [1], "power_off": True}]),
])
def test_the_launcher_sends_what_the_entry_says(spec, by_agent, commands):
    """A fault the victim cannot deliver alone goes through its agent: the entry's signals,
    and ``power_off`` with the last signal of a kind whose agent dies with its node."""
    import types

    from megatron_deadpool.launch.fault_driver import FaultDriver
    from megatron_deadpool.membership.procs import Proc

    f = inject.parse_fault(spec)
    assert f.by_agent is by_agent
    sent = []
    decider = types.SimpleNamespace(max_iteration=lambda: 3, procs={
        0: Proc(0, 0, "active", 0), 1: Proc(1, 1, "active", 1)})
    FaultDriver([f], decider, lambda node, cmd: sent.append((node, cmd)), log=lambda m: None,
                claim=lambda i: True).on_request({"index": 0, "t": 100.0})
    assert sent == [(1, c) for c in commands]
