"""loopkv: loop-aware KV-cache compression for looped transformers.

``import loopkv`` initializes no CUDA, imports no Triton and patches nothing; heavy submodules load on
first attribute access, and transformers registrations happen in :func:`register` (called by
:class:`LoopKVCache` on construction).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_LAZY = {
    "Cell": ("loopkv.cells", "Cell"),
    "CellLayout": ("loopkv.cells", "CellLayout"),
    "Plan": ("loopkv.planning.plan", "Plan"),
    "LoopKVCache": ("loopkv.cache.loop_cache", "LoopKVCache"),
    "register": ("loopkv.cache.attention", "register"),
    "layer_devices": ("loopkv.cache.placement", "layer_devices"),
    "check_compile": ("loopkv.compile_check", "check_compile"),
    "planning": ("loopkv.planning", None),
    "ops": ("loopkv.ops", None),
    "models": ("loopkv.models", None),
}

__all__ = sorted(_LAZY) + ["__version__"]

if TYPE_CHECKING:
    from loopkv.cache.attention import register as register
    from loopkv.cache.loop_cache import LoopKVCache as LoopKVCache
    from loopkv.cache.placement import layer_devices as layer_devices
    from loopkv.cells import Cell as Cell
    from loopkv.cells import CellLayout as CellLayout
    from loopkv.compile_check import check_compile as check_compile
    from loopkv.planning.plan import Plan as Plan


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'loopkv' has no attribute {name!r}")
    module, attr = _LAZY[name]
    mod = importlib.import_module(module)
    value = mod if attr is None else getattr(mod, attr)
    globals()[name] = value
    return value
