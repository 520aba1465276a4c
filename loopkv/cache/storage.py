"""Per-cell storage: preallocated, fixed-address tensors named as in ``loopkv.format`` (docs/design.md).

Plan once, run many: every tensor a cell reads or writes is allocated here, at construction, for
``max_batch_size`` rows and ``max_cache_len`` tokens, as slices of a few stacked buffers. Nothing is allocated per
step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch
from torch import Tensor

from loopkv.format import (
    BITS,
    POOL_FIELDS,
    aligned_bytes,
    exact_slots,
    max_pages,
    pool_field_kind,
    pool_field_shapes,
    row_capacity,
)


@dataclass(eq=False)
class CellStorage:
    """Every tensor of one cell. B = max_batch_size, H = KV heads, D = head_dim, P = pages per row.

    Own state (every cell, ``share`` cells included; model dtype unless said):
      sink_k, sink_v: [B, H, SINK, D]        exact sink
      win_k, win_v:   [B, H, RING, D]        exact window ring, slot = (position - SINK) % RING
      lengths:        int32 [B]              tokens stored per row
    (a short cache, one that never stores a page: the ``loopkv.format.exact_slots`` its tokens fill, no pages)
    History pool (own, or the source cell's for a ``share`` cell), N = B * P physical pages:
      page_table:     int32 [B, P]           physical page of (row, logical page)
      k_pages:        bits 16: [N, H, PAGE, D]; 4: uint8 [N, H, PAGE, D//2]; 2: uint8 [N, H, PAGE, D//4]
      k_scale, k_zero: fp16 [N, H, D]        (empty for bits 16)
      v_hi:           bits 16: [N, H, PAGE, D]; 4: uint8 hi plane; 2: uint8 codes  [N, H, PAGE, D//4]
      v_lo:           bits 4: uint8 lo plane [N, H, PAGE, D//4]; otherwise empty
      v_scale, v_zero: fp16 [N, H, PAGE, D//GROUP]  (empty for bits 16)
    ``own_bits`` is what this cell writes into a pool (0 for ``share``); ``read_bits`` what it reads.
    """

    option: str
    own_bits: int
    read_bits: int
    sink_k: Tensor
    sink_v: Tensor
    win_k: Tensor
    win_v: Tensor
    lengths: Tensor
    page_table: Tensor
    k_pages: Tensor
    k_scale: Tensor
    k_zero: Tensor
    v_hi: Tensor
    v_lo: Tensor
    v_scale: Tensor
    v_zero: Tensor

    def own_tensors(self) -> dict[str, Tensor]:
        """The tensors this cell allocated itself (a ``share`` cell's pool belongs to its source)."""
        names = [f.name for f in fields(self) if isinstance(getattr(self, f.name), Tensor)]
        if self.own_bits == 0:
            names = [n for n in names if n not in POOL_FIELDS and n != "page_table"]
        return {n: getattr(self, n) for n in names}

    def pool(self) -> tuple[Tensor, ...]:
        return tuple(getattr(self, n) for n in POOL_FIELDS)

    @property
    def capacity(self) -> int:
        """The most tokens a row holds (``loopkv.format.row_capacity`` of the allocated shapes)."""
        return row_capacity(self.page_table.shape[1], self.sink_k.shape[2], self.win_k.shape[2])


def _pool(bits: int, n: int, heads: int, head_dim: int, dtype: torch.dtype, device) -> dict[str, Tensor]:
    kinds = {"exact": dtype, "float16": torch.float16, "uint8": torch.uint8}
    return {name: torch.zeros(shape, dtype=kinds[pool_field_kind(bits, name)], device=device)  # (0,): placeholder
            for name, shape in pool_field_shapes(bits, n, heads, head_dim).items()}


def allocate_cell(
    option: str, *, batch: int, heads: int, head_dim: int, max_cache_len: int, dtype: torch.dtype,
    device, source: CellStorage | None = None, pool_pages: int | None = None,
) -> CellStorage:
    """Allocate one cell; a ``share`` cell takes ``source``'s page table and pool (its own sink/window).

    ``pool_pages``: ``None``, every row's pages reserved (``batch * max_pages(max_cache_len)``, the table the
    identity); else a shared pool of that many pages plus the trash page (``loopkv/cache/paging.py``), the table
    pointing at the trash page until pages are allocated. A short cache (no page can ever be stored) has no pages at
    all, and the sink and ring slots it can fill (``loopkv.format.exact_slots``)."""
    exact = dict(dtype=dtype, device=device)
    sink, ring = exact_slots(max_cache_len)
    own = dict(
        sink_k=torch.zeros(batch, heads, sink, head_dim, **exact),
        sink_v=torch.zeros(batch, heads, sink, head_dim, **exact),
        win_k=torch.zeros(batch, heads, ring, head_dim, **exact),
        win_v=torch.zeros(batch, heads, ring, head_dim, **exact),
        lengths=torch.zeros(batch, dtype=torch.int32, device=device),
    )
    if option == "share":
        if source is None or source.own_bits == 0:
            raise ValueError("a 'share' cell needs a source cell with its own pages (the final loop)")
        shared = {n: getattr(source, n) for n in POOL_FIELDS + ("page_table",)}
        return CellStorage(option=option, own_bits=0, read_bits=source.own_bits, **own, **shared)
    bits = BITS[option]
    pages = max_pages(max_cache_len)
    physical = batch * pages if pool_pages is None or not pages else pool_pages + 1
    table = torch.arange(batch * pages, dtype=torch.int32, device=device).view(batch, pages)
    if pool_pages is not None:
        table.fill_(pool_pages)
    pool = _pool(bits, physical, heads, head_dim, dtype, device)
    return CellStorage(option=option, own_bits=bits, read_bits=bits, page_table=table, **own, **pool)


OWN_FIELDS = ("sink_k", "sink_v", "win_k", "win_v", "lengths")


@dataclass(eq=False)
class CellStacks:
    """The cells' tensors as slices of a few stacked buffers (one per field and kind of pool).

    Every cell's ``CellStorage`` fields are views into these, so eager code sees one tensor per field as before.
    A compiled decode step instead indexes the buffers with constants (``LoopKVCache._rows``), so Dynamo lifts a few
    tensors instead of 5 per cell and 8 more per own pool: Dynamo's guards and argument handling grow with the
    inputs it lifts (0.6 ms per call for 1,310 inputs against 0.26 ms for 559, measured on CPU).

    own:     field -> buffer [cells, *the field's shape] for sink_k, sink_v, win_k, win_v, lengths (cell = layout
             index)
    pools:   own_bits -> field -> buffer [pools of that kind, *the field's shape] for page_table and the pool fields;
             an unused field is one shared empty tensor (``is_placeholder``), not a buffer
    pool_of: layout index -> (own_bits, index into that kind's buffers) of the pool the cell reads (a ``share``
             cell: its source's)
    A buffer's rows start at multiples of 16 bytes (``_buffer`` pads them), as Triton's launcher specializes
    pointers on that: one kernel binary for every cell. A cell's slice is ``buffer[i]``, a view whose shape is the
    buffer's: no size is read from anywhere else, so a compiled step sees only the static shapes of its inputs
    (sizes kept as Python ints became dynamic once caches of three lengths had reached one compiled function).
    Kernels that take 2-D row-contiguous stacks get :func:`rows2d` of a buffer.
    """

    own: dict[str, Tensor]
    pools: dict[int, dict[str, Tensor]]
    pool_of: list[tuple[int, int]]

    def tensors(self) -> list[Tensor]:
        return [*self.own.values(), *(t for pool in self.pools.values() for t in pool.values())]

    def own_slice(self, name: str, i: int) -> Tensor:
        return self.own[name][i]

    def pool_slice(self, bits: int, name: str, j: int) -> Tensor:
        t = self.pools[bits][name]
        return t if is_placeholder(t) else t[j]


def is_placeholder(t: Tensor) -> bool:
    """An unused pool field (``torch.empty(0)``: BF16 pages' scales, INT2's lo plane), shared, never stacked."""
    return t.dim() == 1 and t.numel() == 0


def rows2d(t: Tensor) -> Tensor:
    """A stacked buffer [n, *shape] as the 2-D [n, padded row] view of the same memory (placeholders as they are):
    what the step kernels take (``loopkv.ops.step_ops``). Its sizes come from the buffer's own strides."""
    if is_placeholder(t) or t.dim() == 2:
        return t
    if t.numel() == 0:  # a short cache's page storage: no pages
        return t.reshape(t.shape[0], 0)
    return t.as_strided((t.shape[0], t.stride(0)), (t.stride(0), 1))


def _buffer(n: int, shape: tuple[int, ...], dtype: torch.dtype, device) -> Tensor:
    """[n, *shape] of zeros whose rows start at multiples of 16 bytes (each row padded: ``aligned_bytes``)."""
    numel, size = math.prod(shape), torch.empty(0, dtype=dtype).element_size()
    flat = torch.zeros(n, aligned_bytes(numel * size) // size, dtype=dtype, device=device)
    return flat[:, :numel].unflatten(1, shape)


def stack_cells(templates: list[CellStorage], device, *, trash: int | None = None) -> CellStacks:
    """Allocate the cells' tensors as stacked buffers on ``device`` and point every cell's fields at its slices.

    ``templates`` are the cells from :func:`allocate_cell` on the ``meta`` device (shapes and dtypes, no memory):
    each buffer is allocated once, so building the cache never holds two copies. Every tensor starts at zero except
    the page tables, which map (row, logical page) to physical page ``row * P + page`` as ``allocate_cell``'s do, or
    all to the ``trash`` page of a shared pool. ``share`` cells follow their source's pool."""
    n = len(templates)
    own = {}
    for name in OWN_FIELDS:
        t = getattr(templates[0], name)
        own[name] = _buffer(n, tuple(t.shape), t.dtype, device)
    owners = [st for st in templates if st.own_bits]
    where = {}  # id of an owner's template k_pages (what its share cells hold too) -> (bits, index)
    pools: dict[int, dict[str, Tensor]] = {}
    for bits in sorted({st.own_bits for st in owners}):
        group = [st for st in owners if st.own_bits == bits]
        first = group[0]
        pools[bits] = {}
        for name in ("page_table", *POOL_FIELDS):
            t = getattr(first, name)
            if is_placeholder(t):
                pools[bits][name] = torch.zeros(0, dtype=t.dtype, device=device)
            else:
                pools[bits][name] = _buffer(len(group), tuple(t.shape), t.dtype, device)
        rows, per_row = first.page_table.shape
        table = torch.arange(rows * per_row, dtype=torch.int32, device=device).view(rows, per_row)
        if trash is not None:
            table.fill_(trash)
        pools[bits]["page_table"].copy_(table.expand(len(group), -1, -1))
        for j, st in enumerate(group):
            where[id(st.k_pages)] = (bits, j)
    stacks = CellStacks(own=own, pools=pools, pool_of=[where[id(st.k_pages)] for st in templates])
    views = {key: {name: stacks.pool_slice(key[0], name, key[1]) for name in pools[key[0]]}
             for key in set(stacks.pool_of)}  # one view object per pool: a share cell holds its source's tensors
    for i, st in enumerate(templates):
        for name in OWN_FIELDS:
            setattr(st, name, stacks.own_slice(name, i))
        for name, t in views[stacks.pool_of[i]].items():
            setattr(st, name, t)
    return stacks


def nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()
