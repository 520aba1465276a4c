"""Plan: one storage option per cell plus the codec parameters (paper §3.1; docs/design.md).

A plan is data: a frozen dataclass with an explicit option per (loop, layer) cell, written as versioned
JSON that a person can read and edit::

    {"_type": "loopkv.Plan", "_version": 1, "_metadata": {"loopkv": "0.1.0"},
     "_data": {"loops": 4, "layers": 24, "tau": "inf", ...,
               "cells": [["int4", "int4", ...],     <- loop 0, one entry per layer
                         ...
                         ["int4", "int4", ...]]}}   <- loop T-1, the final loop

Options: ``bf16`` (exact, in the cache's dtype), ``int4``, ``int2`` and ``share`` (store nothing and read
the final loop's history at the same layer). The final loop cannot share: it is the source shared cells
read. ``tau`` is one number for the whole plan, or a list with one entry per loop (``[10, 10, "inf",
"inf"]``); files that hold one number, every plan file before per-loop tau included, load unchanged, and
a plan whose loops all have the same tau is written with one number. A schema mismatch (type, version,
fields) is a ``ValueError``; an environment mismatch (another loopkv version wrote the file) is a
:class:`PlanEnvironmentWarning`.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from loopkv.cells import Cell, CellLayout
from loopkv.format import GROUP, OPTIONS, PAGE, QUANTIZED, SINK, WINDOW, check_head_dim
from loopkv.planning import bytes as _bytes
from loopkv.planning.frozen import FrozenMapping, _freeze, _thaw  # noqa: F401 (FrozenMapping re-exported)

PLAN_TYPE = "loopkv.Plan"
PLAN_VERSION = 1
# The codec parameters the kernels implement (the storage format, loopkv.format).
SUPPORTED_CODEC = {"sink": SINK, "window": WINDOW, "page": PAGE, "group": GROUP}
_DATA_KEYS = (
    "loops", "layers", "tau", "sink", "window", "page", "group", "kv_heads", "head_dim",
    "provenance", "predicted", "cells", "family",
)
DEFAULT_FAMILY = "ouro"  # plan files without "family" were made for Ouro-style models
# what a family's config calls the plan's loops and layers (for error messages and a profile's provenance)
SHAPE_NAMES = {
    "ouro": ("total_ut_steps", "num_hidden_layers"),
    "dory": ("n_recurrent_loops", "full-attention layers among n_recurrent_layers"),
    "huginn": ("mean_recurrence", "n_layers_in_recurrent_block"),
}


class PlanEnvironmentWarning(UserWarning):
    """A plan file was written by a different environment (e.g. another loopkv version)."""


def _loopkv_version() -> str:
    from loopkv import __version__

    return __version__


@dataclass(frozen=True)
class Plan:
    """One storage option per cell of a looped model, plus the codec parameters.

    loops, layers: T and L; the plan has ``T * L`` cells.
    options: ``tuple[str, ...]`` of length ``T * L``, indexed by the flat cell index ``t * L + l``; values
        in :data:`OPTIONS`. A ``share`` cell reads the final loop's history at its layer.
    tau: V precision threshold: an INT4 value whose attention weight is below ``2**-tau`` of the row's
        largest reads only its high plane; ``inf`` turns V precision off. One number for every loop, or
        one per loop (a sequence of ``loops`` numbers, e.g. ``(10, 10, inf, inf)``: V precision in loops 0
        and 1 only, as the paper's Table 14 sweeps). The threshold is the *reading* cell's: a ``share`` cell
        reads its source's INT4 pages at its own loop's tau. A per-loop sequence whose entries are all equal
        is stored as that one number, so ``tau`` is a float for every plan that does not vary it by loop;
        :meth:`tau_for` and :meth:`tau_of` give the threshold of a loop or a cell in either case.
    sink, window, page, group: codec parameters; only the storage format's (:mod:`loopkv.format`: 32 / 256 /
        32 / 32) are implemented.
    kv_heads, head_dim: the shape the plan was made for, if known (checked by :meth:`validate_for`).
    family: the model family the plan was made for (:mod:`loopkv.families`: ``"ouro"``, ``"dory"``); its
        ``loops x layers`` cells are that family's planned cells. Written to JSON when not ``"ouro"``.
    provenance: how the plan was made (solver, budgets, profile hash, ...), a read-only JSON mapping.
    predicted: what the planner predicts (damage, stored/read KiB, ...), a read-only JSON mapping.

    ``provenance`` and ``predicted`` take part in equality but not in the hash.
    """

    loops: int
    layers: int
    options: tuple[str, ...]
    tau: float | tuple[float, ...] = math.inf
    sink: int = SINK
    window: int = WINDOW
    page: int = PAGE
    group: int = GROUP
    kv_heads: int | None = None
    head_dim: int | None = None
    family: str = DEFAULT_FAMILY
    provenance: Mapping[str, Any] = field(default_factory=dict, hash=False)
    predicted: Mapping[str, Any] = field(default_factory=dict, hash=False)

    # ------------------------------------------------------------------ validation
    def __post_init__(self) -> None:
        for name in ("loops", "layers"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise ValueError(f"Plan.{name} must be an int >= 1, got {value!r}")
        if isinstance(self.options, str) or not isinstance(self.options, Sequence):
            raise ValueError(
                f"Plan.options must be a sequence of option names, got {type(self.options).__name__}"
            )
        object.__setattr__(self, "options", tuple(self.options))
        n = self.loops * self.layers
        if len(self.options) != n:
            raise ValueError(
                f"Plan.options has {len(self.options)} entries, but loops={self.loops} x "
                f"layers={self.layers} needs {n} (one per cell, flat index t*L + l)"
            )
        bad = sorted({repr(o) for o in self.options if o not in OPTIONS})
        if bad:
            raise ValueError(f"Plan.options has unknown option(s) {', '.join(bad)}; use one of {OPTIONS}")
        final = self.loops - 1
        shared_final = [
            layer for layer in range(self.layers) if self.options[final * self.layers + layer] == "share"
        ]
        if shared_final:
            raise ValueError(
                f"Plan.options puts 'share' in the final loop (loop {final}, layers {shared_final}); "
                "the final loop is the source shared cells read, so give those cells 'int4', 'int2' or 'bf16'"
            )
        object.__setattr__(self, "tau", _check_tau(self.tau, self.loops))
        self._check_codec()
        for name in ("kv_heads", "head_dim"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < 1):
                raise ValueError(f"Plan.{name} must be a positive int or None, got {value!r}")
        if self.head_dim is not None and self.quantized:
            check_head_dim(self.head_dim)
        if not isinstance(self.family, str) or not self.family:
            raise ValueError(f"Plan.family must be a model family name (e.g. 'ouro', 'dory'), got {self.family!r}")
        object.__setattr__(self, "provenance", _freeze(dict(self.provenance), "Plan.provenance"))
        object.__setattr__(self, "predicted", _freeze(dict(self.predicted), "Plan.predicted"))

    def _check_codec(self) -> None:
        for name in SUPPORTED_CODEC:
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise ValueError(f"Plan.{name} must be a positive int, got {value!r}")
        if self.window % self.page:
            raise ValueError(
                f"Plan.window={self.window} must be a multiple of Plan.page={self.page}: pages leave the "
                "window whole"
            )
        other = {k: getattr(self, k) for k, v in SUPPORTED_CODEC.items() if getattr(self, k) != v}
        if other:
            supported = ", ".join(f"{k}={v}" for k, v in SUPPORTED_CODEC.items())
            raise ValueError(
                f"the kernels implement only {supported}; this plan asks for "
                f"{', '.join(f'{k}={v}' for k, v in other.items())}. Leave the codec parameters at their "
                "defaults"
            )

    # ------------------------------------------------------------------ access
    @property
    def layout(self) -> CellLayout:
        return CellLayout(self.loops, self.layers)

    @property
    def quantized(self) -> bool:
        """Whether any cell stores INT4 or INT2 codes (then head_dim must be a multiple of 32)."""
        return any(o in QUANTIZED for o in self.options)

    def option(self, cell: Cell) -> str:
        """The option of ``cell``."""
        return self.options[self.layout.flat_index(cell)]

    def cells(self, option: str) -> list[Cell]:
        """The cells that take ``option``, in flat-index order."""
        if option not in OPTIONS:
            raise ValueError(f"option must be one of {OPTIONS}, got {option!r}")
        layout = self.layout
        return [layout.cell(i) for i, o in enumerate(self.options) if o == option]

    def grid(self) -> list[list[str]]:
        """The options as ``grid[loop][layer]``."""
        L = self.layers
        return [list(self.options[t * L : (t + 1) * L]) for t in range(self.loops)]

    @property
    def taus(self) -> tuple[float, ...]:
        """The V precision threshold of every loop, ``taus[t]`` for loop ``t``."""
        return self.tau if isinstance(self.tau, tuple) else (self.tau,) * self.loops

    def tau_for(self, loop: int) -> float:
        """The V precision threshold of the cells of ``loop`` (0-based); ``inf``: V precision off there."""
        if not _is_int(loop) or not 0 <= loop < self.loops:
            raise ValueError(f"loop must be an int in [0, {self.loops}), got {loop!r}")
        return self.taus[loop]

    def tau_of(self, cell: Cell) -> float:
        """The V precision threshold ``cell`` reads INT4 history with (its loop's; also for a ``share``
        cell, which reads its source's pages at its own threshold)."""
        self.layout.flat_index(cell)  # range check with a clear error
        return self.taus[cell.loop]

    @property
    def v_precision(self) -> bool:
        """Whether any loop has a finite ``tau`` (V precision on somewhere)."""
        return any(math.isfinite(t) for t in self.taus)

    def source(self, cell: Cell) -> Cell:
        """The cell whose history ``cell`` reads: itself, or the final loop's cell for a ``share`` cell."""
        return self.layout.source(cell) if self.option(cell) == "share" else cell

    def for_loops(self, loops: int) -> Plan:
        """The plan a call that runs ``loops`` of this plan's ``T`` loops serves (a model whose loop count is chosen
        per call, Huginn's ``num_steps``): loops ``0 .. loops-2`` as planned, and loop ``loops - 1``, the last the
        call runs, as this plan's final loop (its options and tau), so that a ``share`` cell reads loop
        ``loops - 1``'s pages. ``loops == T``: this plan. ``predicted`` is dropped (it was this plan's)."""
        if not _is_int(loops) or not 1 <= loops <= self.loops:
            raise ValueError(f"loops must be an int in [1, {self.loops}] (this plan has T={self.loops} loops), got "
                             f"{loops!r}; for more loops make a plan for them")
        if loops == self.loops:
            return self
        L, keep = self.layers, loops - 1
        options = self.options[: keep * L] + self.options[-L:]
        taus = self.taus[:keep] + self.taus[-1:]
        return replace(self, loops=loops, options=options, tau=taus, predicted={},
                       provenance={**_thaw(self.provenance), "for_loops_of": self.loops})

    # ------------------------------------------------------------------ presets
    @classmethod
    def from_grid(
        cls, grid: Sequence[Sequence[str]], *, tau: float | Sequence[float] = math.inf, **fields: Any
    ) -> Plan:
        """A plan from ``grid[loop][layer]`` (as :meth:`grid` returns); other fields by keyword."""
        if not grid or any(len(row) != len(grid[0]) for row in grid):
            raise ValueError(
                "grid must be a non-empty list of rows (one per loop) of equal length (one per layer)"
            )
        options = tuple(o for row in grid for o in row)
        return cls(loops=len(grid), layers=len(grid[0]), options=options, tau=tau, **fields)

    @classmethod
    def uniform(
        cls, *, loops: int, layers: int, option: str = "int4", tau: float | Sequence[float] = math.inf, **fields: Any
    ) -> Plan:
        """Every cell at ``option`` (``bf16``, ``int4`` or ``int2``): uniform INT4 is KIVI-4."""
        if option not in ("bf16", "int4", "int2"):
            raise ValueError(
                f"Plan.uniform option must be 'bf16', 'int4' or 'int2', got {option!r} (a uniform 'share' "
                "plan would share the final loop; use Plan.share_loop)"
            )
        _check_loops_layers(loops, layers)
        return cls(loops=loops, layers=layers, options=(option,) * (loops * layers), tau=tau, **fields)

    @classmethod
    def share_loop(
        cls,
        *,
        loops: int,
        layers: int,
        shared_loops: Sequence[int] | None = None,
        option: str = "int4",
        tau: float | Sequence[float] = math.inf,
        **fields: Any,
    ) -> Plan:
        """Loops ``shared_loops`` (0-based; default the loop before the final one) read the final loop's
        history, every other loop at ``option``. The paper's "INT4 + loop-3 sharing" is
        ``Plan.share_loop(loops=4, layers=24)``."""
        _check_loops_layers(loops, layers)
        if shared_loops is None:
            if loops < 2:
                raise ValueError(
                    f"share_loop needs loops >= 2 (a loop to share and a final loop), got {loops}"
                )
            shared_loops = (loops - 2,)
        shared = set()
        for t in shared_loops:
            if not _is_int(t) or not 0 <= t < loops - 1:
                raise ValueError(
                    f"shared_loops entries must be loops in [0, {loops - 1}) (0-based; the final loop "
                    f"{loops - 1} is the source), got {t!r}"
                )
            shared.add(t)
        if option not in ("bf16", "int4", "int2"):
            raise ValueError(f"share_loop option must be 'bf16', 'int4' or 'int2', got {option!r}")
        per_loop = ["share" if t in shared else option for t in range(loops)]
        return cls.from_loops(loops=loops, layers=layers, per_loop=per_loop, tau=tau, **fields)

    @classmethod
    def from_loops(
        cls, *, loops: int, layers: int, per_loop: Sequence[str], tau: float | Sequence[float] = math.inf, **fields: Any
    ) -> Plan:
        """One option per loop, e.g. ``["int4", "int2", "share", "int4"]`` (the paper's INT4/INT2 +
        sharing)."""
        _check_loops_layers(loops, layers)
        if isinstance(per_loop, str) or len(per_loop) != loops:
            raise ValueError(f"per_loop must list one option per loop ({loops}), got {per_loop!r}")
        options = tuple(o for o in per_loop for _ in range(layers))
        return cls(loops=loops, layers=layers, options=options, tau=tau, **fields)

    @classmethod
    def from_config(
        cls,
        config: Any,
        *,
        option: str = "int4",
        per_loop: Sequence[str] | None = None,
        shared_loops: Sequence[int] | None = None,
        tau: float | Sequence[float] = math.inf,
        **fields: Any,
    ) -> Plan:
        """A preset plan for a model config (T, L, KV heads, head_dim from ``config``).

        Uniform ``option`` by default; ``per_loop`` gives one option per loop (:meth:`from_loops`);
        ``shared_loops`` shares those loops and keeps the others at ``option`` (:meth:`share_loop`).
        """
        shape = _bytes.as_shape(config)
        kw = dict(loops=shape.loops, layers=shape.layers, tau=tau, kv_heads=shape.kv_heads,
                  head_dim=shape.head_dim, family=shape.family, **fields)
        if per_loop is not None and shared_loops is not None:
            raise ValueError("pass per_loop or shared_loops, not both")
        if per_loop is not None:
            return cls.from_loops(per_loop=per_loop, **kw)
        if shared_loops is not None:
            return cls.share_loop(shared_loops=shared_loops, option=option, **kw)
        return cls.uniform(option=option, **kw)

    # ------------------------------------------------------------------ model checks and bytes
    def validate_for(self, config: Any) -> None:
        """Raise ``ValueError`` naming every way this plan does not fit the model of ``config`` (a
        ``transformers`` config or a :class:`~loopkv.planning.bytes.ModelShape`)."""
        shape = _bytes.as_shape(config)
        if self.family != shape.family:
            raise ValueError(
                f"this plan was made for the {self.family} family and the model is of the {shape.family} family: "
                "their cells are different layers. Make a plan for this model (Plan.from_config(config) or re-solve "
                "its profile)"
            )
        diffs = []
        loops_name, layers_name = SHAPE_NAMES.get(shape.family, ("loops", "looped full-attention layers"))
        if self.loops != shape.loops:
            diffs.append(f"loops={self.loops} but the model has {loops_name}={shape.loops}")
        if self.layers != shape.layers:
            diffs.append(f"layers={self.layers} but the model has {layers_name}={shape.layers}")
        if self.kv_heads is not None and self.kv_heads != shape.kv_heads:
            diffs.append(f"kv_heads={self.kv_heads} but the model has num_key_value_heads={shape.kv_heads}")
        if self.head_dim is not None and self.head_dim != shape.head_dim:
            diffs.append(f"head_dim={self.head_dim} but the model has head_dim={shape.head_dim}")
        if self.quantized:
            try:
                check_head_dim(shape.head_dim)
            except ValueError as err:
                diffs.append(f"the plan quantizes cells but {err}")
        if diffs:
            raise ValueError(
                "this plan does not fit the model: " + "; ".join(diffs)
                + ". Make a plan for this model (e.g. Plan.from_config(config) or re-solve its profile)"
            )

    def bytes_per_token(
        self, config: Any = None, *, hot_fraction: float = 1.0, dtype_bytes: int = 2
    ) -> _bytes.BytesPerToken:
        """Stored and read KiB per history token, summed over cells and per cell (:mod:`loopkv.planning.bytes`).

        config: a ``transformers`` config or a :class:`~loopkv.planning.bytes.ModelShape`; ``None`` uses the
            plan's own ``kv_heads``/``head_dim`` (an error if the plan does not record them).
        hot_fraction: the fraction of history tokens an INT4 read with V precision reads in full, in
            ``[0, 1]``; only meaningful with a finite ``tau`` (1.0 otherwise).
        dtype_bytes: bytes per element of the cache's exact dtype (2 for BF16), the cost of ``bf16`` cells.
        """
        if config is None:
            if self.kv_heads is None or self.head_dim is None:
                raise ValueError(
                    "config=None needs a plan that records kv_heads and head_dim; pass the model config "
                    "(or a ModelShape) as config"
                )
            shape = _bytes.ModelShape(self.loops, self.layers, self.kv_heads, self.head_dim)
        else:
            shape = _bytes.as_shape(config)
            self.validate_for(shape)
        if not self.v_precision and hot_fraction != 1.0:
            raise ValueError(
                f"hot_fraction={hot_fraction} needs V precision, but the plan has tau=inf (off) in every loop; "
                "use a plan with a finite tau or hot_fraction=1.0"
            )
        per_loop = tuple(math.isfinite(t) for t in self.taus)
        return _bytes.per_token(self.options, self.layers, shape, v_precision=per_loop,
                                hot_fraction=hot_fraction, dtype_bytes=dtype_bytes)

    # ------------------------------------------------------------------ JSON
    def to_dict(self) -> dict[str, Any]:
        """The versioned, JSON-ready envelope ``{"_type", "_version", "_metadata", "_data"}``."""
        data = {
            "loops": self.loops,
            "layers": self.layers,
            "tau": _tau_json(self.tau),
            "sink": self.sink,
            "window": self.window,
            "page": self.page,
            "group": self.group,
            "kv_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "provenance": _thaw(self.provenance),
            "predicted": _thaw(self.predicted),
            "cells": self.grid(),
        }
        if self.family != DEFAULT_FAMILY:
            data["family"] = self.family
        return {
            "_type": PLAN_TYPE,
            "_version": PLAN_VERSION,
            "_metadata": {"loopkv": _loopkv_version()},
            "_data": data,
        }

    @classmethod
    def from_dict(cls, envelope: Mapping[str, Any]) -> Plan:
        """Inverse of :meth:`to_dict`. Schema mismatches raise ``ValueError``; a file written by another
        loopkv version warns (:class:`PlanEnvironmentWarning`)."""
        if not isinstance(envelope, Mapping):
            raise ValueError(f"a plan file holds a JSON object, got {type(envelope).__name__}")
        if envelope.get("_type") != PLAN_TYPE:
            raise ValueError(
                f"_type is {envelope.get('_type')!r}, expected {PLAN_TYPE!r}: not a loopkv plan file"
            )
        version = envelope.get("_version")
        if not _is_int(version) or version != PLAN_VERSION:  # JSON true and 1.0 equal 1 in Python
            raise ValueError(
                f"plan file _version {version!r} is not supported (this loopkv reads version "
                f"{PLAN_VERSION}); re-create the plan with this loopkv version"
            )
        data = envelope.get("_data")
        if not isinstance(data, Mapping):
            raise ValueError("plan file has no '_data' object")
        unknown = sorted(set(data) - set(_DATA_KEYS))
        if unknown:
            raise ValueError(
                f"plan file _data has unknown field(s) {unknown}; known fields: {list(_DATA_KEYS)}"
            )
        missing = [k for k in ("loops", "layers", "cells") if k not in data]
        if missing:
            raise ValueError(f"plan file _data lacks {missing}")
        metadata = envelope.get("_metadata") or {}
        written_by = metadata.get("loopkv") if isinstance(metadata, Mapping) else None
        if written_by is not None and written_by != _loopkv_version():
            warnings.warn(
                f"this plan was written by loopkv {written_by}, this is loopkv {_loopkv_version()}",
                PlanEnvironmentWarning,
                stacklevel=2,
            )
        cells = data["cells"]
        loops, layers = data["loops"], data["layers"]
        for name, value in (("loops", loops), ("layers", layers)):
            if not _is_int(value) or value < 1:
                raise ValueError(f"plan file '{name}' must be an integer >= 1 (a JSON number), got {value!r}")
        for name in ("provenance", "predicted"):
            value = data.get(name)
            if value is not None and not isinstance(value, Mapping):
                raise ValueError(f"plan file '{name}' must be a JSON object (or null), got a {type(value).__name__}")
        if (
            not isinstance(cells, list)
            or len(cells) != loops
            or any(not isinstance(row, list) or len(row) != layers for row in cells)
        ):
            raise ValueError(
                f"plan file 'cells' must be {loops} rows (one per loop) of {layers} options (one per layer), "
                f"matching 'loops' and 'layers'"
            )
        fields = {k: data[k] for k in _DATA_KEYS if k in data and k not in ("cells", "tau")}
        fields["provenance"] = fields.get("provenance") or {}
        fields["predicted"] = fields.get("predicted") or {}
        return cls(options=tuple(o for row in cells for o in row), tau=_parse_tau(data.get("tau")), **fields)

    def to_json_str(self) -> str:
        """The JSON text: indented, with the cell grid one loop per line."""
        envelope = self.to_dict()
        marker = "__loopkv_cells_grid__"
        envelope["_data"]["cells"] = marker
        text = json.dumps(envelope, indent=2, allow_nan=False)
        rows = ",\n      ".join(json.dumps(row) for row in self.grid())
        return text.replace(json.dumps(marker), "[\n      " + rows + "\n    ]", 1) + "\n"

    @classmethod
    def from_json_str(cls, text: str) -> Plan:
        try:
            envelope = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"plan file is not valid JSON: {err}") from err
        return cls.from_dict(envelope)

    def to_json(self, path: str | os.PathLike) -> None:
        """Write the plan to ``path`` (see :meth:`to_json_str`)."""
        with open(path, "w", encoding="utf-8") as f:
            f.write(self.to_json_str())

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> Plan:
        """Read a plan written by :meth:`to_json` (or edited by hand)."""
        with open(path, encoding="utf-8") as f:
            return cls.from_json_str(f.read())


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_loops_layers(loops: Any, layers: Any) -> None:
    for name, value in (("loops", loops), ("layers", layers)):
        if not _is_int(value) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")


def _check_tau(tau: Any, loops: int) -> float | tuple[float, ...]:
    """``tau`` as a float, or a tuple of one float per loop when the loops differ; ValueError otherwise."""
    if isinstance(tau, Sequence) and not isinstance(tau, str):
        if len(tau) != loops:
            raise ValueError(
                f"Plan.tau has {len(tau)} entries but the plan has {loops} loops; give one number for every "
                "loop or one per loop (math.inf: V precision off in that loop)"
            )
        values = tuple(_check_tau(t, loops) for t in tau)
        return values[0] if len(set(values)) == 1 else values
    if not isinstance(tau, (int, float)) or isinstance(tau, bool) or math.isnan(tau) or tau < 0:
        raise ValueError(f"Plan.tau must be a number >= 0 (math.inf turns V precision off), got {tau!r}")
    return float(tau)


def _tau_json(tau: float | tuple[float, ...]) -> Any:
    if isinstance(tau, tuple):
        return [_tau_json(t) for t in tau]
    return "inf" if math.isinf(tau) else tau


def _parse_tau(value: Any) -> float | tuple[float, ...]:
    if value is None or value == "inf":
        return math.inf
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, list) and value and all(not isinstance(v, list) for v in value):
        return tuple(_parse_tau(v) for v in value)
    raise ValueError(
        f"plan file 'tau' must be a number >= 0, \"inf\" or null (V precision off), or a list of those with "
        f"one entry per loop, got {value!r}"
    )
