"""``deadpool sim``'s count law (issue 39): a recovery phase's time is its own constant plus
what each survivor does in it, counted, times what one unit of it costs:

    phase_s(W) = a_phase + sum over kinds k of  count_phase,k(W) x unit_s(k)

``count_phase,k(W)`` is the per-survivor count ``bench recovery --counts`` measured (exact
at each measured W, each fitted O(1), O(log W) or O(W): ``count_laws``); ``unit_s(k)`` is one
cost per kind for every phase (a connection costs the same in any phase), fitted with the
phase constants by non-negative least squares to the measured phase times at small W (each
divided by the run's CPU oversubscription, as sim.fit_phases does). So a projection to
100,000 GPUs grows only where a count grows, and by as much as that count does. Pure.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from ..base import scaling
from ..base.counts import KINDS
from ..base.errors import DeadpoolError
from ..base.vocabulary import PHASE_ORDER

RIDGE = 1e-10


def _solve(a: List[List[float]], b: List[float]) -> List[float]:
    """Gaussian elimination with partial pivoting; a tiny ridge keeps collinear counts
    (two kinds that grow alike) solvable."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    scale = max((abs(m[i][i]) for i in range(n)), default=1.0) or 1.0
    for i in range(n):
        m[i][i] += RIDGE * scale
    for c in range(n):
        p = max(range(c, n), key=lambda r: abs(m[r][c]))
        m[c], m[p] = m[p], m[c]
        if m[c][c] == 0:
            continue
        for r in range(n):
            if r != c and m[r][c]:
                f = m[r][c] / m[c][c]
                m[r] = [x - f * y for x, y in zip(m[r], m[c])]
    return [m[i][n] / m[i][i] if m[i][i] else 0.0 for i in range(n)]


def _lstsq(rows, ys, cols: List[int]) -> List[float]:
    """Least squares on the columns ``cols`` only (normal equations)."""
    ata = [[sum(r[i] * r[j] for r in rows) for j in cols] for i in cols]
    aty = [sum(r[i] * y for r, y in zip(rows, ys)) for i in cols]
    return _solve(ata, aty)


def nnls(rows: Sequence[Sequence[float]], ys: Sequence[float]) -> List[float]:
    """Non-negative least squares (Lawson and Hanson's active set), columns scaled to unit
    norm first: small problems only (here, about a dozen unknowns)."""
    n = len(rows[0]) if rows else 0
    norms = [sum(r[j] ** 2 for r in rows) ** 0.5 or 1.0 for j in range(n)]
    a = [[r[j] / norms[j] for j in range(n)] for r in rows]
    x, passive = [0.0] * n, []
    for _ in range(3 * n + 10):
        resid = [y - sum(v * xv for v, xv in zip(r, x)) for r, y in zip(a, ys)]
        grad = [sum(r[j] * e for r, e in zip(a, resid)) for j in range(n)]
        free = [j for j in range(n) if j not in passive and grad[j] > 1e-12]
        if not free:
            break
        passive.append(max(free, key=lambda j: grad[j]))
        while True:
            z = dict(zip(passive, _lstsq(a, ys, passive)))
            if all(v > 0 for v in z.values()):
                x = [z.get(j, 0.0) for j in range(n)]
                break
            step = min(x[j] / (x[j] - z[j]) for j in passive if z[j] <= 0 and x[j] != z[j]) \
                if any(z[j] <= 0 and x[j] != z[j] for j in passive) else 0.0
            x = [x[j] + step * (z.get(j, 0.0) - x[j]) if j in passive else 0.0
                 for j in range(n)]
            passive = [j for j in passive if x[j] > 1e-15]
            if not passive:
                break
    return [max(0.0, v) / norms[j] for j, v in enumerate(x)]


def _design(runs: Sequence[Mapping]) -> Tuple[List[List[float]], List[float]]:
    rows, ys = [], []
    for r in runs:
        for i, ph in enumerate(PHASE_ORDER):
            c = (r.get("counts") or {}).get(ph, {})
            rows.append([1.0 if j == i else 0.0 for j in range(len(PHASE_ORDER))]
                        + [float(c.get(k, 0)) for k in KINDS])
            ys.append(r["phases_s"][ph] / r.get("oversub", 1.0))
    return rows, ys


@dataclass(frozen=True)
class UnitCosts:
    constants_s: Mapping[str, float]   # per phase
    unit_s: Mapping[str, float]        # per kind

    def phase_s(self, phase: str, counted: Mapping[str, float]) -> float:
        return self.constants_s[phase] + sum(self.unit_s[k] * counted.get(k, 0) for k in KINDS)

    def to_json(self) -> Dict:
        return {"constants_s": {k: round(v, 6) for k, v in self.constants_s.items()},
                "unit_s": {k: float(f"{v:.4g}") for k, v in self.unit_s.items()}}


def fit_units(runs: Sequence[Mapping], measured: Optional[Mapping[str, float]] = None
              ) -> UnitCosts:
    """The phase constants and the per-kind unit costs, from runs that carry counts.
    ``measured``: the unit costs ``deadpool bench units`` timed one by one; then only the
    phase constants are fitted (each the mean of what the counted work leaves, at least 0).
    Without it the unit costs are fitted too (non-negative least squares)."""
    if not runs or any(not r.get("counts") for r in runs):
        raise DeadpoolError("the count law needs every run measured with `deadpool bench "
                            "recovery --counts`")
    p = len(PHASE_ORDER)
    rows, ys = _design(runs)
    if measured is None:
        x = nnls(rows, ys)
        return UnitCosts(dict(zip(PHASE_ORDER, x[:p])), dict(zip(KINDS, x[p:])))
    unit = [float(measured.get(k, 0.0)) for k in KINDS]
    left: Dict[int, List[float]] = {}
    for row, y in zip(rows, ys):
        left.setdefault(row[:p].index(1.0), []).append(
            y - sum(c * u for c, u in zip(row[p:], unit)))
    return UnitCosts({ph: max(0.0, sum(left[i]) / len(left[i])) for i, ph in
                      enumerate(PHASE_ORDER)}, dict(zip(KINDS, unit)))


@dataclass(frozen=True)
class CountLaw:
    """One phase's law: ``__call__(W)`` like scaling.Law, from the count laws."""

    phase: str
    units: UnitCosts
    counts: Mapping[str, scaling.Law]   # kind -> its per-survivor count against W

    form = "counts x unit costs"

    def counted(self, w: float) -> Dict[str, float]:
        return {k: max(0.0, law(w)) for k, law in self.counts.items()}

    def __call__(self, w: float) -> float:
        return self.units.phase_s(self.phase, self.counted(w))

    def to_json(self) -> Dict:
        return {"form": self.form, "constant_s": round(self.units.constants_s[self.phase], 6),
                "counts": {k: law.to_json() for k, law in self.counts.items()},
                "unit_s": {k: float(f"{self.units.unit_s[k]:.4g}") for k in self.counts}}


def count_laws(runs: Sequence[Mapping]) -> Dict[str, Dict[str, scaling.Law]]:
    """Per phase and kind, the count fitted against W (exact counts: no noise penalty)."""
    ws = [r["world_size"] for r in runs]
    out: Dict[str, Dict[str, scaling.Law]] = {}
    for ph in PHASE_ORDER:
        kinds = sorted({k for r in runs for k in (r["counts"].get(ph) or {})})
        out[ph] = {k: scaling.fit(ws, [float(r["counts"].get(ph, {}).get(k, 0)) for r in runs],
                                  exact=True) for k in kinds}
    return out


def phase_laws(runs: Sequence[Mapping], measured: Optional[Mapping[str, float]] = None
               ) -> Dict[str, CountLaw]:
    units = fit_units(runs, measured)
    return {ph: CountLaw(ph, units, {k: law for k, law in laws.items() if k in KINDS})
            for ph, laws in count_laws(runs).items()}  # (counts.DETAIL: parts, no cost)


def validate(runs: Sequence[Mapping], within: float,
             measured_units: Optional[Mapping[str, float]] = None) -> List[Dict]:
    """Per measured W: each phase predicted from its measured counts, with unit costs fitted
    on the other world sizes (leave-one-out) and on all (in sample), against the measured
    phase totals (the CPU's oversubscription put back)."""
    out = []
    full = fit_units(runs, measured_units)
    for w in sorted({r["world_size"] for r in runs}):
        mine = [r for r in runs if r["world_size"] == w]
        others = [r for r in runs if r["world_size"] != w]
        loo = fit_units(others, measured_units) \
            if len({r["world_size"] for r in others}) >= 2 else full
        k = mine[0].get("oversub", 1.0)
        e = {"world_size": w, "method": "leave-one-out", "oversubscription": round(k, 3)}
        for tag, units in (("", loo), ("in_sample_", full)):
            e.update({f"{tag}{key}": v for key, v in predicted(mine, units, within).items()
                      if key != "measured_total_s"})
        e["measured_total_s"] = predicted(mine, full, within)["measured_total_s"]
        out.append(e)
    return out


def predicted(mine: Sequence[Mapping], units: UnitCosts, within: float) -> Dict:
    """The runs of one W: their measured total (mean) against the total ``units`` predict
    from their counts (the CPU's oversubscription put back)."""
    k = mine[0].get("oversub", 1.0)
    measured = sum(sum(r["phases_s"].values()) for r in mine) / len(mine)
    pred = k * sum(units.phase_s(ph, mine[0]["counts"].get(ph, {})) for ph in PHASE_ORDER)
    err = (pred - measured) / measured if measured > 0 else float("inf")
    return {"measured_total_s": round(measured, 4), "predicted_total_s": round(pred, 4),
            "rel_error": round(err, 4), "within_25pct": abs(err) <= within}


def has_counts(runs: Sequence[Mapping]) -> bool:
    return bool(runs) and all(r.get("counts") for r in runs)


def per_phase_forms(laws: Mapping[str, CountLaw]) -> Dict[str, Dict[str, Optional[str]]]:
    """Per phase, each count's form: what a projection's growth comes from."""
    return {ph: {k: law.form for k, law in cl.counts.items()} for ph, cl in laws.items()}
