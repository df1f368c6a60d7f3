"""Regenerate docs/reliability.md: run every scenario of tests/scenarios.py on the given
layouts (default: all) and write the scenario x layout table.

    python scripts/fault_matrix.py [--layouts TP2.PP2.DP2,...] [--scenarios a,b] [--out F]
                                   [--work-dir D]
"""

from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from conftest import launch  # noqa: E402
from scenarios import BITWISE, LAYOUTS, SCENARIOS, judge, trainer_flags  # noqa: E402
from megatron_deadpool.apps.soak import percentile  # noqa: E402

# Cells that wait by design (issue 38's exceptions to the 3 s tail goal): a hang is found
# by the heartbeat timeout, a local restart pays a cold start, a slow spare build is slow on
# purpose, a SIGSTOP in a save waits out the save's section timeout.
WAITS_BY_DESIGN = {"hang_sigstop", "sigstop_in_save", "local_restart", "slow_spare_build"}
TAIL_GOAL_S = 3.0


def tail_lines(scenarios, layouts, totals) -> list:
    """p50/p95/max of every recovery's total_s, over the unplanned-failure cells and over
    all; and the unplanned cells whose longest recovery is over the goal."""
    unplanned = [s.name for s in scenarios if s.expect == BITWISE and s.recoveries
                 and s.name not in WAITS_BY_DESIGN]
    rows = []
    for label, names in (("unplanned-failure cells", unplanned),
                         ("every cell", [s.name for s in scenarios])):
        xs = [t for n in names for lay in layouts for t in totals.get((n, lay), [])]
        if xs:
            rows.append(f"| {label} | {len(xs)} | {percentile(xs, 0.5):.2f} | "
                        f"{percentile(xs, 0.95):.2f} | {max(xs):.2f} |")
    over = sorted(f"{n} ({lay}: {max(totals[(n, lay)]):.2f} s)" for n in unplanned
                  for lay in layouts if totals.get((n, lay)) and
                  max(totals[(n, lay)]) > TAIL_GOAL_S)
    return (["", "Recovery time (`total_s` of every recovery, superseded ones left out):", "",
             "| cells | recoveries | p50 s | p95 s | max s |", "|---|---|---|---|---|", *rows,
             "", f"Unplanned-failure cells over {TAIL_GOAL_S:g} s: "
             + (", ".join(over) if over else "none") + " (waiting by design, not counted: "
             + ", ".join(f"`{n}`" for n in sorted(WAITS_BY_DESIGN)) + ")."])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    ap.add_argument("--scenarios", default=",".join(s.name for s in SCENARIOS))
    ap.add_argument("--out", default=str(REPO / "docs" / "reliability.md"))
    ap.add_argument("--work-dir", help="where each run's summary and worker output "
                    "(<layout>-<scenario>.log) go; default: a new temporary directory")
    ap.add_argument("--extra-flags", default="", metavar="'FLAGS'", help="more trainer flags "
                    "for every scenario's run (not the failure-free references), e.g. "
                    "'--deadpool-mirror-transport gloo'")
    a = ap.parse_args()
    extra = tuple(a.extra_flags.split())
    layouts = a.layouts.split(",")
    names = a.scenarios.split(",")
    unknown = [x for x in layouts if x not in LAYOUTS] + [
        x for x in names if x not in {s.name for s in SCENARIOS}]
    if unknown:
        print(f"fault_matrix: unknown layout/scenario: {unknown}", file=sys.stderr)
        return 2
    scenarios = [s for s in SCENARIOS if s.name in names]
    cells, total_s, totals = {}, {}, {}
    work = Path(a.work_dir) if a.work_dir else Path(tempfile.mkdtemp(prefix="fault-matrix-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"fault_matrix: runs in {work}", flush=True)
    for layout in layouts:
        refs = {}
        for n, key in enumerate(sorted({s.reference_key() for s in scenarios})):
            iters, trajectory = key
            p, ref = launch(work, trainer_flags(layout, trajectory, iters=iters), spares=1,
                            name=f"ref-{layout}-{iters}-{n}")
            if p.returncode != 0:
                print(f"reference run failed for {layout}:\n{p.stdout[-3000:]}",
                      file=sys.stderr)
                return 1
            refs[key] = ref["final_state_sha256"]
        for s in scenarios:
            t0 = time.time()
            try:
                p, summary = launch(work, trainer_flags(layout, s.trajectory + s.flags + extra,
                                                        s.iters),
                                    spares=s.spares, inject=s.inject, name=f"{layout}-{s.name}")
                cells[(s.name, layout)] = judge(s, p.returncode, summary,
                                                refs[s.reference_key()])
                output = p.stdout + p.stderr
            except subprocess.TimeoutExpired as e:  # a hung cell is a failed cell, not the end
                summary, output = None, _text(e.stdout) + _text(e.stderr)
                cells[(s.name, layout)] = f"FAILED (no exit in {e.timeout:.0f} s)"
            (work / f"{layout}-{s.name}.log").write_text(output)  # for a post-mortem
            recs = [r for r in (summary or {}).get("recoveries", []) if not r.get("superseded")]
            totals[(s.name, layout)] = [r["total_s"] for r in recs]
            total_s[(s.name, layout)] = max(totals[(s.name, layout)], default=None)
            print(f"{layout:12s} {s.name:28s} {cells[(s.name, layout)]} "
                  f"({time.time() - t0:.0f}s)", flush=True)
    failed = [k for k, v in cells.items() if v.startswith("FAILED")]
    lines = [
        "# Reliability matrix",
        "",
        "Generated by `scripts/fault_matrix.sh` (`python scripts/fault_matrix.py "
        f"--layouts {','.join(layouts)}"
        + (f" --extra-flags '{a.extra_flags}'" if extra else "")
        + f"`) on {datetime.date.today().isoformat()}, "
        f"{os.cpu_count()} CPU cores. Each cell is one real multiprocess job (4 nodes x 2 "
        "processes, CPU/gloo, reference trainer, 12 iterations (unstaged_kill: 40), warmup + "
        "cosine LR), judged by `tests/scenarios.py: judge`:",
        "",
        "- `recovered, bitwise`: exit 0, every injected fault fired, at most one iteration "
        "redone, and the final fingerprint (params, main params, Adam moments and step, RNG "
        "states, iteration, consumed samples, scheduler) equals the failure-free run's;",
        "- `stopped cleanly at iteration N`: non-zero exit with one message naming the last "
        "committed iteration N (the state is not in memory anywhere);",
        "- `failed fast`: a local error stops the job with its own traceback, no recovery "
        "starts.",
        "",
        "The same cases run as `tests/test_reliability.py` (the `ci` subset in CI). In "
        "brackets: the longest recovery's total seconds.",
        "",
        "| scenario | what | " + " | ".join(layouts) + " |",
        "|---|---|" + "---|" * len(layouts),
    ]
    for s in scenarios:
        row = []
        for layout in layouts:
            t = total_s[(s.name, layout)]
            row.append(cells[(s.name, layout)] + (f" ({t:.2f} s)" if t is not None else ""))
        lines.append(f"| `{s.name}` | {s.what} | " + " | ".join(row) + " |")
    lines += ["", f"FAILED cells: {len(failed)}." + (f" {failed}" if failed else "")]
    lines += tail_lines(scenarios, layouts, totals)
    Path(a.out).write_text("\n".join(lines) + "\n")
    print(f"wrote {a.out}; FAILED cells: {len(failed)}")
    return 1 if failed else 0



def _text(out) -> str:
    """A timed-out run's captured output (bytes, str or None) as text."""
    return out.decode(errors="replace") if isinstance(out, bytes) else (out or "")


if __name__ == "__main__":
    sys.exit(main())
