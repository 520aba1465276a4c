"""Planning: the Plan, the byte model, and (lazily) the profiler, the knapsack and KL evaluation.

``import loopkv.planning`` loads only :mod:`loopkv.planning.plan` and :mod:`loopkv.planning.bytes` (no torch);
``profile``, ``Profile``, ``solve``, ``solve_layerwise``, ``measure_kl``, ``generate_documents`` and the rest of
``_LAZY`` load on first access.
"""

from __future__ import annotations

import importlib
from typing import Any

from loopkv.planning.bytes import (
    BytesPerToken,
    ExactBytes,
    ModelShape,
    as_shape,
    exact_bytes,
    exact_bytes_per_request,
    lo_plane_kib,
    option_kib,
    unit_kib,
)
from loopkv.planning.plan import OPTIONS, Plan, PlanEnvironmentWarning

_LAZY = {
    "profile": ("loopkv.planning.profiler", "profile"),
    "Profile": ("loopkv.planning.profile_data", "Profile"),
    "solve": ("loopkv.planning.knapsack", "solve"),
    "solve_preset": ("loopkv.planning.knapsack", "solve_preset"),
    "solve_layerwise": ("loopkv.planning.knapsack", "solve_layerwise"),
    "measure_kl": ("loopkv.planning.evaluate", "measure_kl"),
    "additivity_report": ("loopkv.planning.evaluate", "additivity_report"),
    "random_plans": ("loopkv.planning.evaluate", "random_plans"),
    "generate_documents": ("loopkv.planning.generate", "generate_documents"),
}

__all__ = [
    "OPTIONS",
    "BytesPerToken",
    "ExactBytes",
    "ModelShape",
    "Plan",
    "PlanEnvironmentWarning",
    "as_shape",
    "exact_bytes",
    "exact_bytes_per_request",
    "lo_plane_kib",
    "option_kib",
    "unit_kib",
    *sorted(_LAZY),
]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'loopkv.planning' has no attribute {name!r}")
    module, attr = _LAZY[name]
    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value
    return value
