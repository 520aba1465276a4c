"""The additivity correction of paper Appendix D: a fitted factor on the sum of single-cell damages, one
per family of plans (with and without ``share`` cells).

The sum ``S`` of a plan's single-cell damages predicts its KL, but not without bias: on Ouro-1.4B the 25
plans without shared cells (5 of Table 12, 20 random) measure 0.65-0.94 S, and plans with shared cells
0.73-1.20 S (Table 12) and up to 1.37 S (random ones). A shared cell's error holds the systematic loop
difference and the source's rounding, which every reader of that source shares; Proposition 2 does not
cover it. The paper fits ``0.73 S`` (no shared cells) and ``0.97 S`` (shared cells) on its 14 planner and
hand-made plans, freezes the factors, and predicts 40 random plans with a
mean absolute error of 15%, against 28% for ``S`` itself (:data:`PAPER`).

:func:`fit` fits the two factors on measured plans: per family, the geometric mean of measured / S (the
least-squares fit of ``log measured = log factor + log S``, which weighs every plan's relative error the
same, as the paper's log-scale analysis does). A family without fitted plans keeps the fallback's factor.
:func:`errors` scores a correction on other plans (the paper's frozen-then-scored protocol: fit on one set,
score on plans drawn before any was measured).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

FAMILIES = ("own", "shared")


def family(plan: Any) -> str:
    """``"shared"`` for a plan with at least one ``share`` cell, else ``"own"``."""
    return "shared" if "share" in plan.options else "own"


@dataclass(frozen=True)
class Correction:
    """Factors on the summed damage: ``own`` for plans without ``share`` cells, ``shared`` for plans with.

    source: where the factors come from; n_own, n_shared: the plans each factor was fitted on (0: taken
    from the fallback).
    """

    own: float
    shared: float
    source: str
    n_own: int = 0
    n_shared: int = 0

    def __post_init__(self) -> None:
        for name in FAMILIES:
            value = getattr(self, name)
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            if not number or not (math.isfinite(value) and value > 0):
                raise ValueError(f"Correction.{name} must be a finite factor > 0, got {value!r}")

    def factor(self, plan: Any) -> float:
        return self.own if family(plan) == "own" else self.shared

    def predict(self, plan: Any, summed: float) -> float:
        """The corrected prediction of ``plan`` whose single-cell damages sum to ``summed``."""
        return self.factor(plan) * summed

    def to_dict(self) -> dict[str, Any]:
        return {"own": self.own, "shared": self.shared, "source": self.source, "n_own": self.n_own,
                "n_shared": self.n_shared}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Correction:
        if not isinstance(data, Mapping) or any(k not in data for k in FAMILIES):
            raise ValueError(f"a correction is a JSON object with {FAMILIES} factors (loopkv eval --json writes "
                             f"one under 'additivity' -> 'correction'), got {data!r}")
        return cls(float(data["own"]), float(data["shared"]), str(data.get("source", "file")),
                   int(data.get("n_own", 0)), int(data.get("n_shared", 0)))

    def describe(self) -> str:
        def one(name: str, n: int) -> str:
            return f"{getattr(self, name):.3g} S {'without' if name == 'own' else 'with'} shared cells" + (
                f" (fitted on {n} plan{'s' if n != 1 else ''})" if n else "")
        return f"{one('own', self.n_own)}, {one('shared', self.n_shared)}; {self.source}"


PAPER = Correction(0.73, 0.97, "paper Appendix D (Ouro-1.4B, fitted on its 14 Table-12 plans)")


def fit(plans: Sequence[Any], summed: Sequence[float], measured: Sequence[float], *,
        fallback: Correction = PAPER, source: str | None = None) -> Correction:
    """The two factors fitted on ``plans`` (module docstring); plans with a zero sum or measurement are
    skipped, and a family with no usable plan keeps ``fallback``'s factor."""
    if not len(plans) == len(summed) == len(measured):
        raise ValueError("plans, summed and measured must have one entry per plan")
    logs: dict[str, list[float]] = {name: [] for name in FAMILIES}
    for plan, s, m in zip(plans, summed, measured, strict=True):
        if s > 0 and m > 0:
            logs[family(plan)].append(math.log(m / s))
    factors = {name: math.exp(math.fsum(v) / len(v)) if v else getattr(fallback, name) for name, v in logs.items()}
    kept = [name for name in FAMILIES if not logs[name]]
    text = source or f"fitted on {len(plans)} measured plans"
    if kept:
        text += f" ({' and '.join(kept)} factor from {fallback.source})"
    return Correction(factors["own"], factors["shared"], text, len(logs["own"]), len(logs["shared"]))


def errors(predicted: Sequence[float], measured: Sequence[float]) -> dict[str, float]:
    """How ``predicted`` misses ``measured``: ``mae`` the mean of |predicted - measured| / measured,
    ``worst_factor`` the largest max(p/m, m/p); NaN without a usable pair."""
    pairs = [(p, m) for p, m in zip(predicted, measured, strict=True) if p > 0 and m > 0]
    if not pairs:
        return {"mae": math.nan, "worst_factor": math.nan, "plans": 0}
    return {"mae": math.fsum(abs(p - m) / m for p, m in pairs) / len(pairs),
            "worst_factor": max(max(p / m, m / p) for p, m in pairs), "plans": len(pairs)}
