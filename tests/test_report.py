"""deadpool report: events -> per-rank timeline pieces (pure), and a PNG."""

import json

import pytest

from megatron_deadpool.apps import cli
from megatron_deadpool.apps.report import timeline


def _events():
    ev = []
    for r in range(2):
        for it in range(1, 4):
            ev.append({"ts": 100.0 + it, "event": "step", "rank": r, "iteration": it})
    ev.append({"ts": 103.5, "event": "abort", "rank": 0, "generation": 0})
    ev.append({"ts": 103.6, "event": "phase", "phase": "abort", "duration_s": 0.1, "rank": 0})
    ev.append({"ts": 104.0, "event": "promoted", "rank": 1, "lid": 2, "generation": 1})
    ev.append({"ts": 104.5, "event": "phase", "phase": "restore_state", "duration_s": 0.2,
               "rank": 1})
    ev.append({"ts": 105.5, "event": "step", "rank": 1, "iteration": 3})
    return ev


def test_timeline_pieces():
    tl = timeline(_events())
    assert tl.t0 == 101.0
    assert tl.steps[0] == [(0.0, 0.0, 1), (0.0, 1.0, 2), (1.0, 2.0, 3)]
    assert tl.phases[0] == [pytest.approx((2.5, 2.6, "abort"))]
    assert tl.phases[1] == [pytest.approx((3.3, 3.5, "restore_state"))]
    assert tl.steps[1][-1] == pytest.approx((3.5, 4.5, 3))  # the redone step after restore
    assert tl.promoted == [(3.0, 1, 2)]
    assert tl.failures == [2.5]  # no summary: the first abort


def test_timeline_needs_events():
    with pytest.raises(ValueError, match="--deadpool-events"):
        timeline([])


def test_report_writes_a_png(tmp_path):
    events, summary = tmp_path / "e.jsonl", tmp_path / "s.json"
    events.write_text("".join(json.dumps(e) + "\n" for e in _events()))
    summary.write_text(json.dumps({"losses": [3.0, 2.5, 2.2], "reference_losses": [3.0, 2.5, 2.2],
                                   "faults": [{"at_iter": 3, "t": 103.4}]}))
    out = tmp_path / "t.png"
    assert cli.main(["report", str(events), "--summary", str(summary), "-o", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
