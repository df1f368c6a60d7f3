"""``deadpool sim``'s measured input: the ``bench recovery --json`` file, each run as one
point (phase medians, counts, the CPU oversubscription it ran under), and the unit costs
``bench units`` timed, if any. Pure but for reading the files.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, Optional

from ..base.errors import DeadpoolError
from ..base.vocabulary import PHASE_ORDER


def load_measured(path, units: Optional[str] = None) -> Dict:
    """The ``bench recovery --json`` file; DeadpoolError naming the problem if unusable.
    ``unit_s``: the unit costs timed one by one (``bench units``): ``units``' file, else
    the ones the measured file carries (``bench recovery --counts``), else None.
    ``phases_missing``: recovery phases some run lacks (an older file), counted as 0 s."""
    p = Path(path)
    if not p.exists():
        raise DeadpoolError(f"measured recovery file {p} not found: run `deadpool bench "
                            f"recovery --json {p.name}` and pass it with --measured")
    try:
        data = json.loads(p.read_text())
        runs = [_run_point(r, data.get("cpu_cores")) for r in data["runs"]]
    except (ValueError, KeyError, TypeError) as exc:
        raise DeadpoolError(f"{p}: not a bench recovery result ({exc!r})") from None
    if len({r["world_size"] for r in runs}) < 2:
        raise DeadpoolError(f"{p}: need runs at >= 2 distinct world sizes to fit scaling")
    missing = sorted({ph for r in data["runs"] for ph in PHASE_ORDER
                      if ph not in r["phases_s"]}, key=PHASE_ORDER.index)
    return {"runs": runs, "placeholder": bool(data.get("placeholder")),
            "unit_s": _unit_costs(units, data), "phases_missing": missing}


def _unit_costs(units: Optional[str], data: Dict) -> Optional[Dict[str, float]]:
    src = data.get("unit_costs")
    if units:
        try:
            src = json.loads(Path(units).read_text())
        except (OSError, ValueError) as exc:
            raise DeadpoolError(f"--units {units}: not a `deadpool bench units --json` file "
                                f"({exc})") from None
    return dict(src["unit_s"]) if src and "unit_s" in src else None


def _run_point(r: Dict, cores: Optional[int]) -> Dict:
    """``oversub``: processes per CPU core during the run (>= 1). The CPU benchmark runs
    all W + spare processes on a few cores, so a CPU-bound phase's wall time grows with it;
    the laws are fitted to phase / oversub (a process with a core of its own)."""
    def med(v):
        return float(v["median"] if isinstance(v, dict) else v)

    # a phase the file lacks (measured before it existed) took no time then
    phases = {ph: med(r["phases_s"].get(ph, 0.0)) for ph in PHASE_ORDER}
    procs = r.get("processes")
    return {"world_size": int(r["world_size"]), "phases_s": phases, "counts": r.get("counts"),
            "total_s": float(r.get("total_s_median", sum(phases.values()))),
            "shard_bytes": r.get("shard_bytes_per_rank"),
            "oversub": max(1.0, procs / cores) if procs and cores else 1.0}
