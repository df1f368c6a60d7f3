"""`deadpool soak`: a seeded random schedule of recoverable faults in one long job; dead
processes come back as standby spares; the end state is bitwise-equal to a fault-free run."""

import json

import pytest

from conftest import deadpool
from megatron_deadpool.apps.soak import recovery_percentiles, schedule


def test_schedule_is_seeded_and_spaced():
    a, b = schedule(25, 7, 10, 8), schedule(25, 7, 10, 8)
    assert a == b and len(a) == 25 and schedule(25, 8, 10, 8) != a
    iters = [int(s.split("@iter=")[1].split(",")[0]) for s in a]
    assert all(8 <= y - x <= 12 for x, y in zip(iters, iters[1:]))


def test_recovery_percentiles_interpolate_between_ranks():
    """The tail table's numbers (docs/reliability.md): p50 and p95 between the closest
    ranks, the max, and nothing from no recoveries."""
    assert recovery_percentiles([]) == {"n": 0}
    got = recovery_percentiles([4.0, 1.0, 3.0, 2.0, None])
    assert got == {"n": 4, "p50": 2.5, "p95": 3.85, "max": 4.0}


def _soak(tmp_path, failures, seed):
    out = tmp_path / "soak.json"
    p = deadpool(["soak", "--failures", str(failures), "--seed", str(seed),
                  "--summary-json", str(out)], cwd=tmp_path, timeout=1800)
    assert out.exists(), p.stdout[-4000:] + p.stderr[-3000:]
    s = json.loads(out.read_text())
    assert p.returncode == 0, (s["error"], p.stdout[-4000:])
    assert s["bitwise_equal"] is True and s["failures_injected"] == failures
    assert len(s["recoveries"]) == failures and len(s["table"]) == failures
    return s


@pytest.mark.slow
@pytest.mark.ci
def test_short_soak(tmp_path):  # CI: 2 successive failures (103 s with 3 in CI)
    _soak(tmp_path, 2, seed=3)


@pytest.mark.slow
def test_soak_25(tmp_path):
    _soak(tmp_path, 25, seed=7)
