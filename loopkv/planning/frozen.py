"""Read-only JSON values for plans: ``_freeze`` (dicts -> :class:`FrozenMapping`, lists -> tuples) and
``_thaw`` (back to plain dicts and lists)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any


class FrozenMapping(Mapping):
    """A read-only mapping (unlike ``MappingProxyType``, it pickles and deep-copies, so a plan can be
    saved with ``torch.save`` or copied with the cache that holds it)."""

    __slots__ = ("_data",)

    def __init__(self, data: Mapping[str, Any] = MappingProxyType({})) -> None:
        self._data = dict(data)

    def __getitem__(self, key: str) -> Any:
        return self._data[key]

    def __iter__(self):
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __repr__(self) -> str:
        return repr(self._data)

    def __reduce__(self):
        return (FrozenMapping, (self._data,))


def _freeze(value: Any, where: str) -> Any:
    """A deep read-only copy of a JSON-like value: dicts -> FrozenMapping, lists -> tuples."""
    if isinstance(value, Mapping):
        out = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise ValueError(f"{where} keys must be str (JSON objects), got {key!r}")
            out[key] = _freeze(item, f"{where}[{key!r}]")
        return FrozenMapping(out)
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(item, f"{where}[{i}]") for i, item in enumerate(value))
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{where} is {value}; JSON has no inf/nan, store it as a string or leave it out")
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    raise ValueError(
        f"{where} is a {type(value).__name__}; provenance and predicted hold JSON values only "
        "(str, int, float, bool, None, lists and dicts of them)"
    )


def _thaw(value: Any) -> Any:
    """Inverse of :func:`_freeze`: plain dicts and lists, for JSON."""
    if isinstance(value, Mapping):
        return {k: _thaw(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return [_thaw(v) for v in value]
    return value
