"""The import path ``loopkv.planning``'s lazy ``profile`` attribute loads; the profiler lives in
:mod:`loopkv.planning.profiler`.

Import from ``loopkv.planning.profiler``, not from here: importing a submodule named ``profile`` binds
``loopkv.planning.profile`` to that module, shadowing the function ``loopkv.planning.profile(model, ...)``.
(Once ``loopkv/planning/__init__.py`` maps ``profile`` to ``loopkv.planning.profiler``, this file can go.)
"""

from loopkv.planning.profiler import profile

__all__ = ["profile"]
