"""Two plans of one model side by side: the cells where they take different options, and whether their KLs, measured
on the same documents (:func:`loopkv.planning.evaluate.measure_kl`), differ by more than the evaluation's noise. For
plans solved from two profiles of one model (measured two ways, or on other documents), or a plan and its edit."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from loopkv.cells import Cell, CellLayout


def differing_cells(a: Any, b: Any) -> list[tuple[Cell, str, str]]:
    """(cell, ``a``'s option, ``b``'s option) of every cell where plans ``a`` and ``b`` differ, in cell order."""
    if (a.loops, a.layers) != (b.loops, b.layers):
        raise ValueError(f"plans of {a.loops}x{a.layers} and {b.loops}x{b.layers} cells: compare plans of one model")
    layout = CellLayout(loops=a.loops, layers=a.layers)
    return [(layout.cell(i), x, y) for i, (x, y) in enumerate(zip(a.options, b.options, strict=True)) if x != y]


def standard_error(values: Sequence[float]) -> float:
    """The standard error of the mean of ``values`` (sample standard deviation over sqrt(n); n >= 2)."""
    n = len(values)
    if n < 2:
        raise ValueError(f"a standard error needs 2 or more values, got {n}")
    mean = sum(values) / n
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1)) / math.sqrt(n)


def kl_verdict(base: Any, other: Any) -> dict:
    """``other``'s measured KL against ``base``'s (each a :class:`~loopkv.planning.evaluate.KLResult`, or anything with
    its ``kl`` and ``per_document``, on the same documents): within the eval's noise when they differ by less than
    ``base``'s standard error over documents (or not at all). Also the paired standard error of the per-document
    differences and each difference over its standard error."""
    d = other.kl - base.kl
    se = standard_error(base.per_document)
    paired = standard_error([y - x for x, y in zip(base.per_document, other.per_document, strict=True)])
    return {"kl_difference": d, "relative_difference": d / base.kl if base.kl else None,
            "eval_standard_error": se, "difference_over_se": abs(d) / se if se > 0 else None,
            "paired_standard_error": paired, "difference_over_paired_se": abs(d) / paired if paired > 0 else None,
            "within_eval_noise": d == 0 or abs(d) < se}
