"""A plan mapped onto vLLM's KV cache: per cell, its vLLM layer, option, bytes per block and source (docs/vllm.md).

vLLM's Ouro (vllm/model_executor/models/ouro.py) builds one ``Attention`` per cell, named
``model.layers.{t * L + l}.self_attn.attn``: loopkv's flat cell index is vLLM's layer index. vLLM counts KV in
blocks of ``block_size`` tokens; loopkv's cells serve with ``block_size = PAGE`` (32), so one vLLM block of a cell is
one loopkv page, and the bytes of a cell's block are the bytes of its pool's page (:func:`loopkv.format.page_bytes`,
the format's one home; per token they equal the byte model's, :mod:`loopkv.planning.bytes`). A ``share`` cell
stores no blocks and reads its source's (the final loop's cell at the same layer).

One vLLM KV tensor holds every cell's blocks (docs/vllm.md, "One tensor for the plan"): the layer vLLM builds first
(:data:`HOLDER`, cell (0, 0)) declares a block of :func:`block_bytes` (all storing cells), the others share its
tensor, and each storing cell's pool is the region :func:`pool_refs` gives it.

Under tensor parallelism each rank holds ``max(1, kv_heads // tp)`` KV heads of every cell (as vLLM's
``OuroAttention`` splits them), so the bytes here are per rank. Pure: no vLLM import.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from loopkv.cells import Cell
from loopkv.format import BITS, page_bytes
from loopkv.planning.bytes import as_shape
from loopkv.planning.bytes import exact_bytes as _exact_bytes
from loopkv.planning.plan import Plan

LAYER_NAME = "model.layers.{index}.self_attn.attn"  # vLLM Ouro's attention layer of flat cell index t * L + l
HOLDER = LAYER_NAME.format(index=0)  # the layer vLLM builds first: its KV tensor holds every cell's blocks
_LAYER_RE = re.compile(r"^(?:.*\.)?model\.layers\.(\d+)\.self_attn\.attn$")


def layer_name(cell: Cell, layers: int) -> str:
    """vLLM Ouro's name for the attention layer of ``cell`` (``OuroAttention`` renames ``layers.{l}`` to
    ``layers.{t * L + l}``)."""
    if not 0 <= cell.layer < layers or cell.loop < 0:
        raise ValueError(f"cell {tuple(cell)} is outside a model of {layers} layers")
    return LAYER_NAME.format(index=cell.loop * layers + cell.layer)


def parse_layer_name(name: str, *, loops: int, layers: int) -> Cell:
    """The cell of a vLLM Ouro attention layer name (a prefix before ``model.`` is allowed)."""
    match = _LAYER_RE.match(name)
    if match is None:
        raise ValueError(f"{name!r} is not a vLLM Ouro attention layer name ({LAYER_NAME.format(index='i')})")
    index = int(match.group(1))
    if index >= loops * layers:
        raise ValueError(f"{name!r} is layer {index}, outside the {loops} x {layers} cells of the plan")
    return Cell(index // layers, index % layers)


@dataclass(frozen=True)
class CellKV:
    """One cell's KV cache in vLLM, on one tensor-parallel rank.

    cell: (loop, layer); layer_name: its vLLM attention layer; option: the plan's choice.
    kv_heads, head_dim: this rank's KV heads of the cell and their size.
    block_bytes: bytes of one block (``PAGE`` tokens) of the cell's own history, K and V with their scales and
        zeros; 0 for ``share``.
    source: the layer whose blocks the cell reads (itself, or the final loop's cell at its layer for ``share``).
    """

    cell: Cell
    layer_name: str
    option: str
    kv_heads: int
    head_dim: int
    block_bytes: int
    source: str

    @property
    def stores(self) -> bool:
        """Whether vLLM allocates blocks for this cell (a ``share`` cell has no KV spec of its own)."""
        return self.block_bytes > 0


def rank_kv_heads(kv_heads: int, tensor_parallel_size: int) -> int:
    """KV heads per rank as vLLM's ``OuroAttention`` splits (or replicates) them: ``max(1, kv_heads // tp)``."""
    if not isinstance(tensor_parallel_size, int) or tensor_parallel_size < 1:
        raise ValueError(f"tensor_parallel_size must be a positive int, got {tensor_parallel_size!r}")
    return max(1, kv_heads // tensor_parallel_size)


def kv_layout(plan: Plan, config: Any, *, tensor_parallel_size: int = 1, dtype_bytes: int = 2) -> tuple[CellKV, ...]:
    """Every cell of ``plan`` on one rank of vLLM serving the model of ``config``, in flat cell order.

    dtype_bytes: bytes per element of the exact (``bf16``) cells, the model's dtype (2 for BF16).
    """
    plan.validate_for(config)
    shape = as_shape(config)
    heads = rank_kv_heads(shape.kv_heads, tensor_parallel_size)
    cells = []
    for cell in plan.layout:
        option = plan.option(cell)
        size = 0 if option == "share" else page_bytes(BITS[option], heads, shape.head_dim, exact_bytes=dtype_bytes)
        cells.append(CellKV(cell=cell, layer_name=layer_name(cell, plan.layers), option=option, kv_heads=heads,
                            head_dim=shape.head_dim, block_bytes=size,
                            source=layer_name(plan.source(cell), plan.layers)))
    return tuple(cells)


def block_bytes(layout: tuple[CellKV, ...]) -> int:
    """Bytes one block (``PAGE`` tokens of one request) costs over all cells of a rank: the page of the one KV spec
    loopkv declares (:data:`HOLDER`'s), what vLLM's KV cache manager divides its memory by
    (vllm/v1/core/kv_cache_utils.py, ``get_kv_cache_config_from_groups``)."""
    return sum(c.block_bytes for c in layout)


@dataclass(frozen=True)
class PoolRef:
    """The pool a cell reads in the plan's KV tensor: its ``bits`` (16, 4, 2), where it starts in the plan's block
    (``offset``: the bytes per block of the storing cells before it, in flat cell order), its bytes per block
    (``size``) and the layer that writes it (``owner``: the cell itself, or a ``share`` cell's source). In a KV tensor
    of ``num_blocks`` blocks the pool is ``num_blocks * size`` bytes from ``num_blocks * offset`` on
    (:func:`loopkv.vllm.cells.cell_region`)."""

    bits: int
    offset: int
    size: int
    owner: str


def pool_refs(layout: tuple[CellKV, ...]) -> dict[str, PoolRef]:
    """Per cell (layer name), the pool it reads (:class:`PoolRef`)."""
    own, at = {}, 0
    for c in layout:
        if c.stores:
            own[c.layer_name] = PoolRef(bits=BITS[c.option], offset=at, size=c.block_bytes, owner=c.layer_name)
            at += c.block_bytes
    return {c.layer_name: own[c.source] for c in layout}


def exact_bytes_per_request(plan: Plan, config: Any, *, tensor_parallel_size: int = 1, dtype_bytes: int = 2) -> int:
    """Bytes of one request's exact sink and window over all cells of a rank (every cell keeps its own, shared
    cells included): K and V of the byte model's sink and ring slots (:func:`loopkv.planning.bytes.exact_bytes`'s
    ``kv``; the plugin's slots keep no lengths on the device and no padding), split over the ranks' heads."""
    plan.validate_for(config)
    shape = as_shape(config)
    total = _exact_bytes(shape, dtype_bytes=dtype_bytes).kv
    return total * rank_kv_heads(shape.kv_heads, tensor_parallel_size) // shape.kv_heads
