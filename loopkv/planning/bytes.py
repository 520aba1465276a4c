"""The byte model: stored and read bytes per history token and cell (paper §2.2 and Appendix C).

Every cost comes from the storage format (:mod:`loopkv.format`). Per history token and cell, with
``E = 2 * kv_heads * head_dim`` K and V elements:

* ``bf16``: ``8 * dtype_bytes`` bits per element (the cache's own dtype; 16 bits for BF16),
* ``int4``: 5 bits per element (4 code bits + 1 bit of metadata: one fp16 scale and one fp16 zero per
  32 elements),
* ``int2``: 3 bits per element,
* ``share``: stores 0 and reads its source's bytes (the final loop's option at the same layer).

V precision (finite ``tau``): an INT4 read (own codes, or a ``share`` cell reading INT4 codes) skips the
V lo plane (2 bits per V element, ``kv_heads * head_dim * 2`` bits per token) for cold tokens, so it
reads ``hot_fraction`` of that plane. Ouro-1.4B (T=4, L=24, 16 KV heads x 128): 8 / 2.5 / 1.5 KiB per
token and cell, a lo plane of 0.5 KiB, 768 KiB BF16 and 240 KiB uniform INT4 per token over 96 cells.

The sink and the window (``SINK + WINDOW = 288`` tokens, the paper's 216 MiB per request for Ouro-1.4B) are exact
in every cell, shared cells included: a constant per request, not per token. What a cache allocates for them, the
*exact parts* of its rows, is :func:`exact_bytes` (one request alone: :func:`exact_bytes_per_request`), the one home
of that count: per cache index the ``SINK`` sink slots and the ``RING = WINDOW + PAGE`` ring slots (the window plus
the page being filled: 240 MiB for Ouro-1.4B; a short cache, the slots its tokens can fill,
``loopkv.format.exact_slots``) and an int32 length per row, each stacked cell's slice rounded up to 16 bytes
(``loopkv.format.aligned_bytes``); a sliding layer's slot is its window alone (``min(sliding_window,
max_cache_len)`` exact tokens per row, ``loopkv/cache/window.py``; no history, so no bytes per token here); a loop
that reads another loop's cache without an index of its own (Dory's ``last_loop``) holds nothing.

A model's fixed exact slots (:mod:`loopkv.families`: prelude/coda full-attention layers, never planned) are exact
cells: they store and read ``E * dtype_bytes`` per token each, whatever the plan
(:attr:`BytesPerToken.fixed_kib`, :func:`fixed_kib`), and keep a sink and window like every cell.

This module knows nothing of :class:`~loopkv.planning.plan.Plan`: it prices a sequence of options
(:func:`per_token`), and ``Plan.bytes_per_token`` calls it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from loopkv.format import (
    BITS,
    PAGE,
    QUANTIZED,
    RING,
    SINK,
    aligned_bytes,
    exact_slots,
    pool_field_shapes,
    stored_bits_per_element,
)

if TYPE_CHECKING:
    from loopkv.families import ModelLayout

# Bits per K/V element of a cell's own codes, metadata included (int4 5, int2 3).
CODE_BITS_PER_ELEMENT = {o: int(stored_bits_per_element(o)) for o in QUANTIZED}
# Bits per V element of the INT4 lo plane (2), the part V precision skips for a cold token.
_D = 128  # any multiple of the codec's group gives the same bits per element
LO_PLANE_BITS_PER_V_ELEMENT = 8 * math.prod(pool_field_shapes(BITS["int4"], 1, 1, _D)["v_lo"]) // (PAGE * _D)

KIB = 1024
LENGTH_BYTES = 4  # a row's token count in every cache index: int32 (loopkv/cache/storage.py, CellStorage.lengths)


@dataclass(frozen=True)
class ModelShape:
    """The shape of a looped model's KV cache: ``loops`` (T) x ``layers`` (L) planned cells of
    ``kv_heads`` x ``head_dim``, of the model ``family`` (:mod:`loopkv.families`; plans record it), and
    ``fixed`` exact cache slots outside the plan (prelude/coda full-attention layers): they store and
    read every token in the cache's dtype, whatever the plan."""

    loops: int
    layers: int
    kv_heads: int
    head_dim: int
    family: str = "ouro"
    fixed: int = 0

    def __post_init__(self) -> None:
        for name in ("loops", "layers", "kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ModelShape.{name} must be a positive int, got {value!r}")
        if not isinstance(self.fixed, int) or isinstance(self.fixed, bool) or self.fixed < 0:
            raise ValueError(f"ModelShape.fixed must be an int >= 0, got {self.fixed!r}")
        if not isinstance(self.family, str) or not self.family:
            raise ValueError(f"ModelShape.family must be a family name (e.g. 'ouro'), got {self.family!r}")

    @property
    def elements(self) -> int:
        """K and V elements per token and cell: ``E = 2 * kv_heads * head_dim``."""
        return 2 * self.kv_heads * self.head_dim

    @property
    def num_cells(self) -> int:
        return self.loops * self.layers

    @classmethod
    def from_config(cls, config: Any) -> ModelShape:
        """Read the family, T, L, KV heads and head_dim from a looped model's ``transformers`` config.

        T and L are the planned cells of the family's layout (:func:`loopkv.families.layout_of`; Ouro:
        ``total_ut_steps`` x ``num_hidden_layers``); ``num_key_value_heads`` falls back to
        ``num_attention_heads`` and ``head_dim`` to ``hidden_size // num_attention_heads``.
        """
        from loopkv.families import layout_of

        if getattr(config, "num_hidden_layers", None) is None:
            raise ValueError(
                f"config {type(config).__name__} has no num_hidden_layers; pass a looped-model config "
                "(Ouro: total_ut_steps, num_hidden_layers, num_key_value_heads, head_dim) or a ModelShape"
            )
        layout = layout_of(config)
        heads = getattr(config, "num_attention_heads", None)
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None)
        if head_dim is None and heads:
            head_dim = config.hidden_size // heads
        if kv_heads is None or head_dim is None:
            raise ValueError(
                f"config {type(config).__name__} gives neither num_key_value_heads/num_attention_heads nor "
                "head_dim/hidden_size; pass a ModelShape instead"
            )
        return cls(loops=layout.loops, layers=layout.layers, kv_heads=int(kv_heads), head_dim=int(head_dim),
                   family=layout.family, fixed=len(layout.fixed("exact")))


def as_shape(config: Any) -> ModelShape:
    """A :class:`ModelShape` from a ``ModelShape`` or a ``transformers`` config."""
    if isinstance(config, ModelShape):
        return config
    return ModelShape.from_config(config)


@dataclass(frozen=True)
class BytesPerToken:
    """Bytes per history token, summed over cells (KiB), and per cell.

    stored_kib: what the planned cells hold per history token.
    read_kib: what one decode step reads from them per history token (the expected value under ``hot_fraction``).
    per_cell: ``(stored_kib, read_kib)`` per cell, indexed by the flat cell index ``t * L + l``.
    fixed_kib: what the model's fixed exact slots (:attr:`ModelShape.fixed`) store, and a step reads, per
        token: the same for every plan, so not in ``stored_kib`` / ``read_kib`` (0 for Ouro).
    """

    stored_kib: float
    read_kib: float
    per_cell: tuple[tuple[float, float], ...] = field(repr=False)
    fixed_kib: float = 0.0


def _check_dtype_bytes(dtype_bytes: int) -> None:
    if not isinstance(dtype_bytes, int) or dtype_bytes < 1:
        raise ValueError(
            f"dtype_bytes must be a positive int (2 for bf16/fp16, 4 for fp32), got {dtype_bytes!r}"
        )


def _option_bits(option: str, shape: ModelShape, dtype_bytes: int) -> int:
    """Bits per token that one cell stores for its own history under ``option`` (``share``: 0)."""
    if option == "bf16":
        return shape.elements * 8 * dtype_bytes
    if option == "share":
        return 0
    if option in CODE_BITS_PER_ELEMENT:
        return shape.elements * CODE_BITS_PER_ELEMENT[option]
    raise ValueError(f"option must be one of 'bf16', 'int4', 'int2', 'share', got {option!r}")


def _fixed_bits(shape: ModelShape, dtype_bytes: int) -> int:
    """Bits per token the fixed exact slots store (and a step reads)."""
    return shape.fixed * _option_bits("bf16", shape, dtype_bytes)


def _lo_plane_bits(shape: ModelShape) -> int:
    return shape.kv_heads * shape.head_dim * LO_PLANE_BITS_PER_V_ELEMENT


def option_kib(option: str, config: Any, *, dtype_bytes: int = 2) -> float:
    """KiB per token one cell stores (and, reading its own codes, reads) under ``option``.

    ``share`` stores 0; what a shared cell reads depends on its source (see :func:`per_token`).
    Ouro-1.4B: bf16 8.0, int4 2.5, int2 1.5, share 0.0.
    """
    _check_dtype_bytes(dtype_bytes)
    return _option_bits(option, as_shape(config), dtype_bytes) / 8 / KIB


def lo_plane_kib(config: Any) -> float:
    """KiB per token and INT4 cell of the V lo plane, what V precision skips for a cold token (0.5 for
    Ouro-1.4B)."""
    return _lo_plane_bits(as_shape(config)) / 8 / KIB


def unit_kib(config: Any, *, dtype_bytes: int = 2) -> float:
    """The model's byte unit (KiB): the gcd of every option's cost and the V lo plane, so that every
    stored or read total of a plan (at ``hot_fraction`` 0 or 1) is an integer multiple of it. The
    knapsack's dynamic program counts bytes in this unit. Ouro-1.4B: 0.5 KiB."""
    _check_dtype_bytes(dtype_bytes)
    shape = as_shape(config)
    costs = [_option_bits(o, shape, dtype_bytes) for o in ("bf16", "int4", "int2")]
    costs.append(_lo_plane_bits(shape))
    return math.gcd(*costs) / 8 / KIB


@dataclass(frozen=True)
class ExactBytes:
    """Bytes the exact parts of a cache's rows allocate (:func:`exact_bytes`).

    kv: K and V of every sink and ring slot of every cache index (a sliding layer's: its window ring).
    lengths: the int32 token count of every row and cache index.
    padding: what the stacked buffers add to round each cell's slice of a field (all rows) up to 16 bytes
        (``loopkv.format.aligned_bytes``); the sliding layers' windows are not stacked and have none.
    """

    kv: int
    lengths: int
    padding: int

    @property
    def total(self) -> int:
        return self.kv + self.lengths + self.padding


def exact_bytes(config: Any, *, rows: int = 1, max_cache_len: int | None = None, dtype_bytes: int = 2,
                layout: ModelLayout | None = None) -> ExactBytes:
    """What the exact parts of ``rows`` request rows of a :class:`~loopkv.LoopKVCache` allocate: the bytes
    ``LoopKVCache.memory_report().exact`` measures from the cache's tensors, whatever its plan.

    Per cache index of the family's layout (``layout``, default :func:`loopkv.families.layout_of` of ``config``; a
    :class:`ModelShape` without one: ``T * L`` planned cells and ``fixed`` exact slots, no sliding layers): a planned
    cell (``share`` included) or fixed exact slot keeps K and V of the sink and ring slots of
    ``loopkv.format.exact_slots(max_cache_len)`` (``None``: a cache long enough to store pages, ``SINK + RING``) and
    an int32 length per row, each field's slice padded to 16 bytes in the stacked buffers; a sliding layer's slot keeps
    ``min(sliding_window, max_cache_len)`` ring slots and the lengths, unpadded; a loop reading another loop's cache
    (Dory's ``last_loop``) has no index and holds nothing. ``rows``: the cache's ``max_batch_size`` (the padding is
    per cell, so a row's share of it shrinks as rows are added). ``dtype_bytes``: the cache's exact dtype (2 for
    BF16). Ouro-1.4B, one BF16 row: 240 MiB of K/V (96 cells x 320 slots x 8 KiB), 384 bytes of lengths, 1,152 of
    padding.
    """
    _check_dtype_bytes(dtype_bytes)
    for name, value in (("rows", rows), ("max_cache_len", max_cache_len)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    shape = as_shape(config)
    if layout is None and not isinstance(config, ModelShape):
        from loopkv.families import layout_of

        layout = layout_of(config)
    if layout is None:
        stacked, windows, window_slots = shape.num_cells + shape.fixed, 0, 0
    else:
        windows = len(layout.fixed("window"))
        stacked = layout.num_indices - windows
        window_slots = min(layout.sliding_window, max_cache_len or layout.sliding_window) if windows else 0
    sink, ring = (SINK, RING) if max_cache_len is None else exact_slots(max_cache_len)

    def plane(slots: int) -> int:  # K or V of ``slots`` slots, every row
        return rows * shape.kv_heads * slots * shape.head_dim * dtype_bytes

    fields = (plane(sink), plane(sink), plane(ring), plane(ring), rows * LENGTH_BYTES)  # one stacked cell's
    return ExactBytes(
        kv=stacked * sum(fields[:4]) + windows * 2 * plane(window_slots),
        lengths=(stacked + windows) * rows * LENGTH_BYTES,
        padding=stacked * sum(aligned_bytes(f) - f for f in fields),
    )


def exact_bytes_per_request(config: Any, *, max_cache_len: int | None = None, dtype_bytes: int = 2) -> int:
    """Bytes the exact parts of one request take in a cache of one row (:func:`exact_bytes` of ``rows=1``, padding
    included; in a cache of ``B`` rows each takes ``exact_bytes(config, rows=B).total / B``, at most this).
    Ouro-1.4B in BF16: 240 MiB + 1,536 bytes."""
    return exact_bytes(config, max_cache_len=max_cache_len, dtype_bytes=dtype_bytes).total


def fixed_kib(config: Any, *, dtype_bytes: int = 2) -> float:
    """KiB per history token of the fixed exact slots (prelude/coda full-attention layers), stored and read
    alike: ``fixed * E * dtype_bytes``; 0 for Ouro."""
    _check_dtype_bytes(dtype_bytes)
    shape = as_shape(config)
    return _fixed_bits(shape, dtype_bytes) / 8 / KIB


def per_token(
    options: Sequence[str], layers: int, shape: ModelShape, *, v_precision: bool | Sequence[bool] = False,
    hot_fraction: float = 1.0, dtype_bytes: int = 2,
) -> BytesPerToken:
    """Stored and read KiB per history token of cells holding ``options`` (flat index ``t * L + l``, the
    last ``layers`` entries the final loop, which ``share`` cells read) on a model of ``shape``.

    v_precision: the reads of INT4 codes skip the V lo plane for the ``1 - hot_fraction`` cold tokens; one
        flag for every loop, or one per loop (the *reading* cell's loop decides: a ``share`` cell in a loop
        with V precision reads its INT4 source with it).
    dtype_bytes: bytes per element of the cache's exact dtype (2 for BF16), the cost of ``bf16`` cells.
    """
    _check_dtype_bytes(dtype_bytes)
    if not (isinstance(hot_fraction, (int, float)) and 0.0 <= hot_fraction <= 1.0):
        raise ValueError(f"hot_fraction must be a number in [0, 1], got {hot_fraction!r}")
    loops = len(options) // layers
    per_loop = _per_loop_flags(v_precision, loops)
    saving = (1.0 - hot_fraction) * _lo_plane_bits(shape)
    final = len(options) - layers
    per_cell = []
    for index, option in enumerate(options):
        read_option = options[final + index % layers] if option == "share" else option
        stored = _option_bits(option, shape, dtype_bytes)
        read = _option_bits(read_option, shape, dtype_bytes)
        if read_option == "int4" and per_loop[index // layers]:
            read -= saving
        per_cell.append((stored / 8 / KIB, read / 8 / KIB))
    return BytesPerToken(
        stored_kib=sum(s for s, _ in per_cell),
        read_kib=sum(r for _, r in per_cell),
        per_cell=tuple(per_cell),
        fixed_kib=_fixed_bits(shape, dtype_bytes) / 8 / KIB,
    )


def _per_loop_flags(v_precision: bool | Sequence[bool], loops: int) -> tuple[bool, ...]:
    if isinstance(v_precision, bool):
        return (v_precision,) * loops
    flags = tuple(v_precision)
    if len(flags) != loops or not all(isinstance(f, bool) for f in flags):
        raise ValueError(
            f"v_precision must be one bool or one bool per loop ({loops} loops), got {v_precision!r}"
        )
    return flags
