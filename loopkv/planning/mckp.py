"""The exact dynamic program behind the planner: a multiple-choice knapsack over groups with branches.

The problem, as :mod:`loopkv.planning.knapsack` builds it: items are cells, each picks one option with a
real damage and two non-negative integer costs, ``stored`` and ``read``. Items come in *groups* (one per
layer), and a group is solved as one of several *branches* (one per option of the layer's final-loop cell,
which decides what the layer's ``share`` cells read and cost). The DP minimises the objective resource
(``read`` or ``stored``) subject to ``sum damage <= max_damage`` and optional caps on either resource; ties
go to the least damage, then the least of the other resource, then the earlier branch and option.

State: ``best[S, X]`` = the least damage over the groups so far with ``S`` stored and ``X`` read units
(each divided by the gcd of its values). ``X`` counts either the read units or, when every branch of a
group holds as many items, ``read - stored - offset`` per item (``offset`` the least ``read - stored`` of
any option), whichever axis is shorter: for the usual menus only ``share`` cells read more than they
store, so the second axis counts little more than the shared cells. Exact for any damages.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import reduce

import numpy as np

DAMAGE_RTOL = 1e-9
OBJECTIVES = ("read", "stored")

Choice = tuple[float, int, int]  # (damage, stored units, read units) of one option
Item = Sequence[Choice]
Branch = Sequence[Item]
Group = Sequence[Branch]


class Infeasible(Exception):
    """No assignment meets the budgets. ``min_damage``: the least damage within the resource caps (None when
    no assignment fits the caps at all)."""

    def __init__(self, min_damage: float | None) -> None:
        super().__init__(min_damage)
        self.min_damage = min_damage


@dataclass(frozen=True)
class Solution:
    """Per group the branch taken and the option of each of its items; the totals."""

    branches: tuple[int, ...]
    options: tuple[tuple[int, ...], ...]
    damage: float
    stored: int
    read: int


@dataclass(frozen=True)
class _Axes:
    gs: int  # stored units per S step
    gx: int  # units per X step
    extra: bool  # X counts read - stored - offset per item, else read
    offset: int  # per item, when extra
    cap_s: int | None  # in S steps
    cap_x: int | None  # in X steps (only when X counts read)

    def coords(self, stored: int, read: int) -> tuple[int, int]:
        x = read - stored - self.offset if self.extra else read
        return stored // self.gs, x // self.gx


def _axes(groups: Sequence[Group], max_stored: int | None, max_read: int | None) -> _Axes:
    """The smaller of the two read axes (read, or read - stored - offset; the latter needs every branch of
    a group to hold as many items, so that the offsets add up to the same constant)."""
    choices = [c for g in groups for b in g for it in b for c in it]
    gs = reduce(math.gcd, (s for _, s, _ in choices), 0) or 1
    cap_s = None if max_stored is None else max_stored // gs
    axes = [_axis(groups, gs, cap_s, False, 0, max_read)]
    if all(len({len(b) for b in g}) <= 1 for g in groups):
        offset = min((r - s for _, s, r in choices), default=0)
        axes.append(_axis(groups, gs, cap_s, True, offset, None))
    return min(axes, key=lambda a: a[0])[1]


def _axis(groups, gs, cap_s, extra: bool, offset: int, max_read: int | None) -> tuple[int, _Axes]:
    """(the largest X an assignment reaches, the axes) of one read axis."""
    values = [(r - s - offset if extra else r) for g in groups for b in g for it in b for _, s, r in it]
    gx = reduce(math.gcd, values, 0) or 1
    axes = _Axes(gs, gx, extra, offset, cap_s, None if max_read is None or extra else max_read // gx)
    top = sum(max(sum(max(axes.coords(s, r)[1] for _, s, r in it) for it in b) for b in g) for g in groups if g)
    return (top if axes.cap_x is None else min(top, axes.cap_x)), axes


def _step(best: np.ndarray, item: Item, axes: _Axes) -> tuple[np.ndarray, np.ndarray]:
    """``best`` after one more item, and the option chosen per state (-1: unreachable)."""
    ns, nx = best.shape[0] - 1, best.shape[1] - 1
    coords = [axes.coords(s, r) for _, s, r in item]
    ok = [j for j, (s, x) in enumerate(coords)
          if (axes.cap_s is None or s <= axes.cap_s) and (axes.cap_x is None or x <= axes.cap_x)]
    hi_s = ns + max((coords[j][0] for j in ok), default=0)
    hi_x = nx + max((coords[j][1] for j in ok), default=0)
    hi_s = hi_s if axes.cap_s is None else min(hi_s, axes.cap_s)
    hi_x = hi_x if axes.cap_x is None else min(hi_x, axes.cap_x)
    new = np.full((hi_s + 1, hi_x + 1), np.inf)
    choice = np.full(new.shape, -1, dtype=np.int8)
    for j in ok:
        s, x = coords[j]
        rows, cols = min(ns, hi_s - s) + 1, min(nx, hi_x - x) + 1
        cand = best[:rows, :cols] + item[j][0]
        dst = new[s : s + rows, x : x + cols]
        better = cand < dst
        np.copyto(dst, cand, where=better)
        choice[s : s + rows, x : x + cols][better] = j
    return new, choice


def _merge(results: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    shape = tuple(max(r.shape[k] for r in results) for k in (0, 1))
    new = np.full(shape, np.inf)
    which = np.full(shape, -1, dtype=np.int8)
    for b, r in enumerate(results):
        dst = new[: r.shape[0], : r.shape[1]]
        better = r < dst
        np.copyto(dst, r, where=better)
        which[: r.shape[0], : r.shape[1]][better] = b
    return new, which


def solve(
    groups: Sequence[Group],
    *,
    objective: str = "read",
    max_damage: float = math.inf,
    max_stored: int | None = None,
    max_read: int | None = None,
) -> Solution:
    """The exact optimum (module docstring); raises :class:`Infeasible`."""
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
    axes = _axes(groups, max_stored, max_read)
    best = np.zeros((1, 1))
    trail = []  # per group: (branch per state, [option per state, per item] per branch)
    for group in groups:
        results, per_branch = [], []
        for branch in group:
            cur, choices = best, []
            for item in branch:
                cur, ch = _step(cur, item, axes)
                choices.append(ch)
            results.append(cur)
            per_branch.append(choices)
        best, which = _merge(results)
        trail.append((which, per_branch))
    n_items = sum(len(g[0]) for g in groups if g)  # the same in every branch when axes.extra
    s, x, damage = _select(best, axes, n_items, objective, max_damage, max_stored, max_read)
    return _backtrack(groups, trail, axes, s, x, damage)


def _select(best, axes: _Axes, n_items: int, objective, max_damage, max_stored, max_read) -> tuple[int, int, float]:
    S, X = np.indices(best.shape)
    stored = S * axes.gs
    read = X * axes.gx + (stored + n_items * axes.offset if axes.extra else 0)
    fits = np.isfinite(best)
    if max_stored is not None:
        fits &= stored <= max_stored
    if max_read is not None:
        fits &= read <= max_read
    if not fits.any():
        raise Infeasible(None)
    feasible = fits & (best <= max_damage * (1.0 + DAMAGE_RTOL))
    if not feasible.any():
        raise Infeasible(float(best[fits].min()))
    s, x = np.nonzero(feasible)
    key, other = (read[s, x], stored[s, x]) if objective == "read" else (stored[s, x], read[s, x])
    k = np.lexsort((other, best[s, x], key))[0]  # last key is primary: objective, damage, the other
    return int(s[k]), int(x[k]), float(best[s[k], x[k]])


def _backtrack(groups, trail, axes: _Axes, s: int, x: int, damage: float) -> Solution:
    branches, options = [], []
    stored = read = 0
    for group, (which, per_branch) in zip(reversed(groups), reversed(trail), strict=True):
        b = int(which[s, x])
        assert b >= 0, "backtracking reached an unreachable state"
        picks = []
        for item, ch in zip(reversed(group[b]), reversed(per_branch[b]), strict=True):
            j = int(ch[s, x])
            assert j >= 0, "backtracking reached an unreachable state"
            picks.append(j)
            ds, dx = axes.coords(item[j][1], item[j][2])
            s, x = s - ds, x - dx
            stored, read = stored + item[j][1], read + item[j][2]
        branches.append(b)
        options.append(tuple(reversed(picks)))
    assert (s, x) == (0, 0)
    return Solution(tuple(reversed(branches)), tuple(reversed(options)), damage, stored, read)
