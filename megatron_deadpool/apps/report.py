"""``deadpool report EVENTS.jsonl [--summary S.json] -o timeline.png``: one picture of a run.

    top     one row per rank: its iterations (alternating shades), the abort, each recovery
            phase, and the process that took the rank (a promoted spare starts its row
            segment at its promotion)
    bottom  the loss of this run over the failure-free run's (``reference_losses`` in a
            ``deadpool demo`` summary), the failures marked

``timeline()`` turns the events into drawable pieces (pure, tested without matplotlib);
``draw()`` needs matplotlib (``pip install megatron-deadpool[report]``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from ..base.vocabulary import RECOVERY_PHASES, Event, Phase

# one colour per recovery phase, by name; a phase without one is drawn in OTHER_PHASE_COLOR
PHASE_COLORS = {Phase.DETECT: "#d62728", Phase.ABORT: "#ff7f0e", Phase.RENDEZVOUS: "#bcbd22",
                Phase.REBUILD_GROUPS: "#9467bd", Phase.RESTORE_STATE: "#17becf",
                Phase.FIRST_STEP: "#2ca02c"}
OTHER_PHASE_COLOR = "#8c564b"


def phase_color(phase: Phase) -> str:
    return PHASE_COLORS.get(phase, OTHER_PHASE_COLOR)


@dataclass
class Timeline:
    t0: float
    steps: Dict[int, List[Tuple[float, float, int]]] = field(default_factory=dict)
    phases: Dict[int, List[Tuple[float, float, str]]] = field(default_factory=dict)
    promoted: List[Tuple[float, int, int]] = field(default_factory=list)  # (t, rank, lid)
    failures: List[float] = field(default_factory=list)


def read_events(path: str) -> List[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def timeline(events: List[dict], summary: Optional[dict] = None) -> Timeline:
    """Pure: per rank, (start, end, iteration) step segments and (start, end, phase)
    recovery segments, relative to the first event; promotions; failure instants (the
    summary's fault times, else each generation's first abort)."""
    if not events:
        raise ValueError("no events: run with --deadpool-events FILE")
    t0 = min(e["ts"] for e in events)
    tl = Timeline(t0=t0)
    last: Dict[int, float] = {}
    for e in sorted(events, key=lambda x: x["ts"]):
        t, r = e["ts"] - t0, e.get("rank")
        kind = Event(e["event"])
        if kind is Event.STEP:
            start = last.get(r, 0.0)
            tl.steps.setdefault(r, []).append((start, t, e["iteration"]))
            last[r] = t
        elif kind is Event.PHASE and Phase(e["phase"]) is not Phase.DETECT:
            tl.phases.setdefault(r, []).append((t - e["duration_s"], t, Phase(e["phase"])))
            last[r] = t
        elif kind is Event.PROMOTED:
            tl.promoted.append((t, r, e["lid"]))
    for f in (summary or {}).get("faults", []):
        if f.get("t"):
            tl.failures.append(f["t"] - t0)
    if not tl.failures:
        first_abort: Dict[int, float] = {}
        for e in events:
            if Event(e["event"]) is Event.ABORT:
                g = e.get("generation", 0)
                first_abort[g] = min(first_abort.get(g, e["ts"]), e["ts"])
        tl.failures = sorted(t - t0 for t in first_abort.values())
    return tl


def legend_phases(tl: Timeline) -> List[Phase]:
    """The phases drawn, in the recovery's order."""
    shown = {ph for segs in tl.phases.values() for _, _, ph in segs}
    return [ph for ph in RECOVERY_PHASES if ph in shown]


def draw(events_path: str, out_png: str, summary_path: Optional[str] = None) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    summary = json.load(open(summary_path)) if summary_path else None
    tl = timeline(read_events(events_path), summary)
    ranks = sorted(set(tl.steps) | set(tl.phases))
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(12, 3.5 + 0.45 * len(ranks)),
                                      gridspec_kw={"height_ratios": [max(2, len(ranks)), 3]})
    for y, r in enumerate(ranks):
        for a, b, it in tl.steps.get(r, []):
            top.barh(y, b - a, left=a, color="#c7c7c7" if it % 2 else "#8c8c8c", height=0.6)
        for a, b, ph in tl.phases.get(r, []):
            top.barh(y, b - a, left=a, color=phase_color(ph), height=0.8)
    for t, r, lid in tl.promoted:
        if r in ranks:
            top.annotate(f"spare {lid}", (t, ranks.index(r)), fontsize=7, va="center")
    for t in tl.failures:
        top.axvline(t, color="red", linestyle="--", linewidth=1)
    shown = legend_phases(tl)
    top.legend([Patch(color=phase_color(ph)) for ph in shown], [str(ph) for ph in shown],
               fontsize=7, loc="upper left", ncol=6)
    top.set_yticks(range(len(ranks)), [f"rank {r}" for r in ranks])
    top.set_xlabel("seconds (grey: iterations; colours: recovery phases; red: failure)")
    _losses(bottom, summary)
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    return out_png


def _losses(ax, summary: Optional[dict]) -> None:
    if not summary or not summary.get("losses"):
        ax.set_axis_off()
        return
    ax.plot(range(1, len(summary["losses"]) + 1), summary["losses"], label="this run",
            linewidth=2)
    if summary.get("reference_losses"):
        ax.plot(range(1, len(summary["reference_losses"]) + 1), summary["reference_losses"],
                "k:", label="failure-free run", linewidth=2)
    for f in summary.get("faults", []):
        if f.get("at_iter") is not None:
            ax.axvline(f["at_iter"], color="red", linestyle="--", linewidth=1)
    ax.set_xlabel("iteration (red: failure)")
    ax.set_ylabel("loss")
    ax.legend(fontsize=8)
