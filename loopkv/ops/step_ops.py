"""The decode step's cache writes in two parts: the token inside each cell's read, the rest once per step.

* ``token_attention_``: ``cell_attention`` of the cell *with* its new decode token (k_new, v_new [B, H, 1, D]),
  which it also writes into the sink or the ring at position ``lengths[b]``. ``lengths`` is read, not written:
  the op attends over ``lengths[b] + 1`` tokens (unchanged at capacity). The page that the token makes leave the
  window is not quantized here; it is not read as history before the next step (``loopkv.format.QUANTIZE_LENGTH``).
* ``advance_``: after every cell of the step has been read, one op per kind of pool: for each listed cell, count
  its token (``lengths[b] += 1``, unchanged at ``capacity``: the cells' ``loopkv.format.row_capacity``, by default
  ``format.capacity(max_pages)``, a whole sink and ring) and quantize the page that leaves the window into the
  cell's pool. It works on the cache's stacked tensors (``loopkv.cache.storage.CellStacks``): row ``c`` of
  ``lengths`` / ``win_k`` / ``win_v`` is cell ``c``, row ``j`` of the page table and the pool fields is pool ``j``;
  ``cells[i]`` and ``pools[i]`` name the i-th pair. A ``share`` cell (bits 0) only counts its token.

One launch per cell and step for the read, and 2-4 per step for the rest (one per kind of pool), instead of a
separate append launch per cell. The references below are built from ``cache_ops``' ``write_token_reference`` and
``advance_reference``; the Triton kernels (``triton_attention.token_attention``, ``triton_quant.advance``) register
as the CUDA kernels.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from loopkv.format import POOL_FIELDS, RING, pool_field_shapes
from loopkv.ops.cache_ops import advance_reference, write_token_reference
from loopkv.ops.cell_attention import cell_attention_reference, check_cell_args


def token_attention_reference(
    q: Tensor, k_new: Tensor, v_new: Tensor, sink_k: Tensor, sink_v: Tensor, win_k: Tensor, win_v: Tensor,
    lengths: Tensor, page_table: Tensor, k_pages: Tensor, k_scale: Tensor, k_zero: Tensor, v_hi: Tensor,
    v_lo: Tensor, v_scale: Tensor, v_zero: Tensor, bits: int, tau: float, scale: float,
) -> Tensor:
    """Write the token, then ``cell_attention`` over the appended lengths (module docstring)."""
    appended = write_token_reference(k_new, v_new, sink_k, sink_v, win_k, win_v, lengths, page_table.shape[1])
    return cell_attention_reference(q, sink_k, sink_v, win_k, win_v, appended.to(lengths.dtype), page_table, k_pages,
                                    k_scale, k_zero, v_hi, v_lo, v_scale, v_zero, bits, tau, scale)


@torch.library.custom_op("loopkv::token_attention_", mutates_args=("sink_k", "sink_v", "win_k", "win_v"))
def token_attention_(
    q: Tensor, k_new: Tensor, v_new: Tensor, sink_k: Tensor, sink_v: Tensor, win_k: Tensor, win_v: Tensor,
    lengths: Tensor, page_table: Tensor, k_pages: Tensor, k_scale: Tensor, k_zero: Tensor, v_hi: Tensor,
    v_lo: Tensor, v_scale: Tensor, v_zero: Tensor, bits: int, tau: float, scale: float,
) -> Tensor:
    """Decode attention of one cell with its new token, written into sink/ring; the reference serves every
    device."""
    return token_attention_reference(q, k_new, v_new, sink_k, sink_v, win_k, win_v, lengths, page_table, k_pages,
                                     k_scale, k_zero, v_hi, v_lo, v_scale, v_zero, bits, tau, scale)


@token_attention_.register_fake
def _(q, k_new, v_new, sink_k, sink_v, win_k, win_v, lengths, page_table, *rest):
    pool, bits = rest[:7], rest[7]
    check_cell_args(q, sink_k, sink_v, win_k, win_v, lengths, page_table, pool, bits)
    want = (q.shape[0], sink_k.shape[1], 1, sink_k.shape[3])
    torch._check(tuple(k_new.shape) == want and tuple(v_new.shape) == want,
                 lambda: f"k_new, v_new must be {list(want)} (one token per row), got {tuple(k_new.shape)}, "
                         f"{tuple(v_new.shape)}")
    return torch.empty_like(q)


def check_advance_args(cells: Tensor, pools: Tensor, batch: int, max_batch: int, bits: int) -> None:
    """Shape errors of ``advance_`` that the kernels cannot see (they index by the ints given)."""
    if bits not in (16, 4, 2, 0):
        raise ValueError(f"bits must be 16, 4, 2 or 0 (share cells: no pool), got {bits}")
    if cells.shape != pools.shape or cells.dim() != 1:
        raise ValueError(f"cells and pools must be 1-D and alike, got {tuple(cells.shape)}, {tuple(pools.shape)}")
    if not 0 <= batch <= max_batch:
        raise ValueError(f"batch={batch} must be in [0, max_batch={max_batch}]")


def advance_stacks_reference(
    cells: Tensor, pools: Tensor, lengths: Tensor, win_k: Tensor, win_v: Tensor, page_table: Tensor,
    k_pages: Tensor, k_scale: Tensor, k_zero: Tensor, v_hi: Tensor, v_lo: Tensor, v_scale: Tensor, v_zero: Tensor,
    batch: int, max_batch: int, heads: int, head_dim: int, max_pages: int, bits: int, capacity: int | None = None,
) -> None:
    """``advance_reference`` of the first ``batch`` rows of every (cell, pool) pair, on the stacked tensors."""
    check_advance_args(cells, pools, batch, max_batch, bits)
    ring = (max_batch, heads, RING if max_pages else 0, head_dim)  # no pages: the ring is not read (may be short)
    # physical pages per pool: every row's (max_batch * max_pages) or a shared pool's; a stacked row is padded by
    # less than one page, so the count is what fits
    physical = k_pages.shape[-1] // math.prod(pool_field_shapes(bits, 1, heads, head_dim)["k_pages"]) if bits else 0
    shapes = pool_field_shapes(bits or 4, physical, heads, head_dim)
    stacks = (k_pages, k_scale, k_zero, v_hi, v_lo, v_scale, v_zero)
    for c, j in zip(cells.tolist(), pools.tolist(), strict=True):
        wk, wv = (w[c, : math.prod(ring)].view(ring)[:batch] for w in (win_k, win_v))
        if bits:
            table = page_table[j, : max_batch * max_pages].view(max_batch, max_pages)[:batch]
            pool = [t[j, : math.prod(shapes[n])].view(shapes[n]) if t.numel() else t
                    for n, t in zip(POOL_FIELDS, stacks, strict=True)]
        else:  # a share cell: the capacity of its source's pool, nothing written there
            table = torch.zeros(batch, max_pages, dtype=torch.int32, device=lengths.device)
            pool = list(stacks)
        advance_reference(wk, wv, lengths[c, :batch], table, *pool, bits, capacity)


@torch.library.custom_op("loopkv::advance_", mutates_args=("lengths",) + POOL_FIELDS)
def advance_(
    cells: Tensor, pools: Tensor, lengths: Tensor, win_k: Tensor, win_v: Tensor, page_table: Tensor,
    k_pages: Tensor, k_scale: Tensor, k_zero: Tensor, v_hi: Tensor, v_lo: Tensor, v_scale: Tensor, v_zero: Tensor,
    batch: int, max_batch: int, heads: int, head_dim: int, max_pages: int, bits: int, capacity: int | None = None,
) -> None:
    """Count the step's token of every listed cell and quantize the pages that leave the window (module
    docstring); the reference serves every device."""
    advance_stacks_reference(cells, pools, lengths, win_k, win_v, page_table, k_pages, k_scale, k_zero, v_hi, v_lo,
                             v_scale, v_zero, batch, max_batch, heads, head_dim, max_pages, bits, capacity)


@advance_.register_fake
def _(cells, pools, lengths, win_k, win_v, *rest) -> None:
    batch, max_batch, bits = rest[8], rest[9], rest[13]  # rest: page_table, the 7 pool fields, then the ints
    torch._check(cells.dim() == 1 and cells.shape == pools.shape,
                 lambda: f"cells and pools must be 1-D and alike, got {tuple(cells.shape)}, {tuple(pools.shape)}")
    torch._check(lengths.dtype == torch.int32, lambda: f"lengths must be int32, got {lengths.dtype}")
    torch._check(0 <= batch <= max_batch, lambda: f"batch={batch} must be in [0, max_batch={max_batch}]")
    torch._check(bits in (16, 4, 2, 0), lambda: f"bits must be 16, 4, 2 or 0 (share cells), got {bits}")
    return None


__all__ = ["advance_", "advance_stacks_reference", "token_attention_", "token_attention_reference"]
