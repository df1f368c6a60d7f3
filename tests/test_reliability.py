"""The reliability matrix (tests/scenarios.py): every scenario, on every layout, either ends
bitwise-equal to the failure-free run or stops cleanly with one message naming the last
committed iteration (or, for a local error, fails fast without any recovery)."""

from __future__ import annotations

import pytest

from conftest import job_output, launch
from scenarios import LAYOUTS, SCENARIOS, judge, trainer_flags

pytestmark = [pytest.mark.slow]
_REF = {}


def _reference(layout, scenario, tmp_path_factory):
    """The failure-free run of ``layout`` that ``scenario`` is compared with: its
    iterations and trajectory flags (made once)."""
    iters, trajectory = key = scenario.reference_key()
    if (layout, key) not in _REF:
        d = tmp_path_factory.mktemp(f"ref-{layout}-{iters}")
        p, s = launch(d, trainer_flags(layout, trajectory, iters=iters), spares=1, name="ref")
        assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-2000:]
        _REF[(layout, key)] = s["final_state_sha256"]
    return _REF[(layout, key)]


def _cases():
    for layout in LAYOUTS:
        for s in SCENARIOS:
            marks = [pytest.mark.ci] if (s.ci and layout == "TP2.PP2.DP2") else []
            yield pytest.param(layout, s, id=f"{layout}-{s.name}", marks=marks)


@pytest.mark.parametrize("layout, scenario", list(_cases()))
def test_scenario(layout, scenario, tmp_path, tmp_path_factory):
    ref = _reference(layout, scenario, tmp_path_factory)
    p, s = launch(tmp_path, trainer_flags(layout, scenario.trajectory + scenario.flags,
                                          scenario.iters),
                  spares=scenario.spares,
                  inject=scenario.inject)
    verdict = judge(scenario, p.returncode, s, ref)
    assert not verdict.startswith("FAILED"), (verdict, job_output(p))
    if scenario.name == "local_error":
        assert "InjectedLocalError" in p.stdout + p.stderr  # its own traceback is shown
