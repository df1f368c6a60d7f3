"""Scaling-law fit of one recovery phase's cost against world size W (pure, no I/O).

Three candidate forms, each with a non-negative growth coefficient b:

    O(1)      cost = a
    O(log W)  cost = a + b * log2(W)
    O(W)      cost = a + b * W

Each form is fitted by least squares. A form with a growth term pays a penalty of
``(PENALTY_REL * mean)**2`` added to its mean squared residual, so the constant wins unless
growth explains the data by more than a few percent of the phase's size (measurement noise
of the CPU benchmark is of that order). Between O(log W) and O(W) (same parameter count) the
smaller residual wins. With the growth slope forced non-negative, a decreasing trend fits as
a constant; a negative intercept is replaced by a fit through the origin (a >= 0), so an
extrapolation never goes below zero.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, Sequence, Tuple

from .errors import DeadpoolError

PENALTY_REL = 0.03
FORMS = ("O(1)", "O(log W)", "O(W)")


class FitError(DeadpoolError, ValueError):
    """Too few or invalid points to fit a scaling law."""


def _x(form: str, w: float) -> float:
    if form == "O(log W)":
        return math.log2(w)
    if form == "O(W)":
        return float(w)
    return 0.0


@dataclass(frozen=True)
class Law:
    """A fitted law: ``coef`` is [a] for O(1), [a, b] otherwise."""

    form: str
    coef: Tuple[float, ...]
    mse: float = 0.0

    def __call__(self, w: float) -> float:
        a = self.coef[0]
        b = self.coef[1] if len(self.coef) > 1 else 0.0
        return a + b * _x(self.form, w)

    def to_json(self) -> Dict:
        return {"form": self.form, "coef": [round(c, 9) for c in self.coef],
                "rms_residual_s": round(math.sqrt(self.mse), 6)}


def _mse(law: Law, ws: Sequence[float], ys: Sequence[float]) -> float:
    return sum((law(w) - y) ** 2 for w, y in zip(ws, ys)) / len(ys)


def _fit_form(form: str, ws: Sequence[float], ys: Sequence[float],
              through_origin_if_negative: bool = True) -> Law:
    mean_y = sum(ys) / len(ys)
    if form == "O(1)":
        law = Law(form, (mean_y,))
        return Law(form, law.coef, _mse(law, ws, ys))
    xs = [_x(form, w) for w in ws]
    mx = sum(xs) / len(xs)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - mean_y) for x, y in zip(xs, ys)) / sxx if sxx > 0 else 0.0
    b = max(b, 0.0)
    a = mean_y - b * mx
    if a < 0 and through_origin_if_negative:  # keep the law non-negative
        a, b = 0.0, sum(x * y for x, y in zip(xs, ys)) / sum(x * x for x in xs)
    law = Law(form, (a, b))
    return Law(form, law.coef, _mse(law, ws, ys))


def fit(ws: Sequence[float], ys: Sequence[float], penalty_rel: float = PENALTY_REL,
        exact: bool = False) -> Law:
    """The chosen law for costs ``ys`` (seconds) measured at world sizes ``ws``. ``exact``:
    counts, not times (no noise penalty, and a negative intercept is kept: W - 1
    connections is a + b W with a = -1)."""
    if exact:
        penalty_rel = 0.0
    if len(ws) != len(ys) or not ws:
        raise FitError("need the same, non-zero number of world sizes and costs")
    if any(w < 1 for w in ws) or any(y < 0 or math.isnan(y) for y in ys):
        raise FitError(f"world sizes must be >= 1 and costs >= 0 (got {ws}, {ys})")
    const = _fit_form("O(1)", ws, ys)
    if len(set(ws)) < 2:
        return const
    penalty = (penalty_rel * sum(ys) / len(ys)) ** 2
    best = const
    best_score = const.mse
    for form in FORMS[1:]:
        law = _fit_form(form, ws, ys, through_origin_if_negative=not exact)
        if law.coef[1] <= 0:
            continue
        score = law.mse + penalty
        if score < best_score:
            best, best_score = law, score
    return best
