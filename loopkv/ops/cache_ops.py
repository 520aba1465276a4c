"""Cache-writing ops: the decode append with its window exit, and bulk page writes (docs/storage-layout.md).

* ``append_``: one token per row at position ``lengths[b]`` (sink slot or window-ring slot), then, if
  that append makes a page leave the window, quantize the page into the pool. Decided per row on the
  device, with no host sync, so the whole decode step stays one graph (DESIGN.md §6, §8).
* ``write_pages_``: encode whole pages and write them at given physical pages (prefill, in bulk).

Both are ``torch.library.custom_op``s that list every tensor they write in ``mutates_args`` and return
``None``. The references below are the CPU kernels; Triton kernels register as the CUDA kernels
(``loopkv/ops/triton_quant.py``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from loopkv.ops import codec
from loopkv.ops.codec import PAGE, SINK
from loopkv.ops.layout import QUANTIZE_LENGTH, RING, capacity

_POOL = ("k_pages", "k_scale", "k_zero", "v_hi", "v_lo", "v_scale", "v_zero")


def _store_pages(k: Tensor, v: Tensor, bits: int) -> tuple[Tensor, ...]:
    """[n, H, PAGE, D] exact pages -> the pool fields' values for those pages (bits 16, 4 or 2)."""
    if bits == 16:
        return (k, v)
    return tuple(codec.encode_pages(k, v, bits))


def _pool_fields(bits, k_pages, k_scale, k_zero, v_hi, v_lo, v_scale, v_zero):
    if bits == 16:
        return (k_pages, v_hi)
    return (k_pages, k_scale, k_zero, v_hi, v_lo, v_scale, v_zero)


def write_pages_reference(
    k: Tensor, v: Tensor, pages: Tensor, k_pages: Tensor, k_scale: Tensor, k_zero: Tensor,
    v_hi: Tensor, v_lo: Tensor, v_scale: Tensor, v_zero: Tensor, bits: int,
) -> None:
    """Encode ``k, v`` [n, H, PAGE, D] and write them at physical ``pages`` (int64 [n])."""
    if k.shape[0] == 0:
        return
    values = _store_pages(k, v, bits)
    fields = _pool_fields(bits, k_pages, k_scale, k_zero, v_hi, v_lo, v_scale, v_zero)
    for dst, val in zip(fields, values, strict=True):
        if dst.numel() and val.numel():
            dst.index_copy_(0, pages, val.to(dst.dtype))


def write_token_reference(
    k_new: Tensor, v_new: Tensor, sink_k: Tensor, sink_v: Tensor, win_k: Tensor, win_v: Tensor, lengths: Tensor,
    maxp: int,
) -> Tensor:
    """Write one token per row (k_new, v_new [B, H, 1, D]) at position ``lengths[b]`` (sink slot or ring slot);
    return the appended lengths (int64 [B]; rows at capacity are left unchanged). ``lengths`` is not written."""
    B = k_new.shape[0]
    rows = torch.arange(B, device=k_new.device)
    pos = lengths.long()  # [B]
    ok = pos < capacity(maxp)  # rows at capacity are left unchanged
    kn, vn = k_new[:, :, 0], v_new[:, :, 0]  # [B, H, D]

    in_sink = ok & (pos < SINK)
    slot = pos.clamp(max=SINK - 1)
    for buf, new in ((sink_k, kn), (sink_v, vn)):
        buf[rows, :, slot] = torch.where(in_sink[:, None, None], new.to(buf.dtype), buf[rows, :, slot])
    in_win = ok & (pos >= SINK)
    slot = torch.remainder(pos - SINK, RING)
    for buf, new in ((win_k, kn), (win_v, vn)):
        buf[rows, :, slot] = torch.where(in_win[:, None, None], new.to(buf.dtype), buf[rows, :, slot])
    return torch.where(ok, pos + 1, pos)


def advance_reference(
    win_k: Tensor, win_v: Tensor, lengths: Tensor, page_table: Tensor, k_pages: Tensor, k_scale: Tensor,
    k_zero: Tensor, v_hi: Tensor, v_lo: Tensor, v_scale: Tensor, v_zero: Tensor, bits: int,
) -> None:
    """Count the token already written at ``lengths[b]`` (``lengths[b] + 1``, unchanged at capacity) and quantize
    the page that this makes leave the window, from the ring into the pool (bits 0: no pool)."""
    B = lengths.shape[0]
    maxp = page_table.shape[1]
    rows = torch.arange(B, device=lengths.device)
    pos = lengths.long()
    ok = pos < capacity(maxp)
    new_len = torch.where(ok, pos + 1, pos)
    lengths.copy_(new_len.to(lengths.dtype))

    if bits == 0 or maxp == 0:
        return
    # the page this append quantizes (if any): p = (n - 319) // 32 at n = 319 + 32 p (layout.py says why)
    exits = ok & (new_len >= QUANTIZE_LENGTH) & (torch.remainder(new_len - QUANTIZE_LENGTH, PAGE) == 0)
    p = ((new_len - QUANTIZE_LENGTH) // PAGE).clamp(0, maxp - 1)
    phys = page_table.long()[rows, p]  # [B]
    slots = torch.remainder(PAGE * p, RING)[:, None] + torch.arange(PAGE, device=lengths.device)  # [B, PAGE]
    idx = slots[:, None, :, None].expand(B, win_k.shape[1], PAGE, win_k.shape[3])
    k_page = torch.gather(win_k, 2, idx)  # [B, H, PAGE, D]
    v_page = torch.gather(win_v, 2, idx)
    values = _store_pages(k_page, v_page, bits)
    fields = _pool_fields(bits, k_pages, k_scale, k_zero, v_hi, v_lo, v_scale, v_zero)
    for dst, val in zip(fields, values, strict=True):
        if not (dst.numel() and val.numel()):
            continue
        keep = exits.view((B,) + (1,) * (val.dim() - 1))
        dst[phys] = torch.where(keep, val.to(dst.dtype), dst[phys])


def append_reference(
    k_new: Tensor, v_new: Tensor, sink_k: Tensor, sink_v: Tensor, win_k: Tensor, win_v: Tensor,
    lengths: Tensor, page_table: Tensor, k_pages: Tensor, k_scale: Tensor, k_zero: Tensor,
    v_hi: Tensor, v_lo: Tensor, v_scale: Tensor, v_zero: Tensor, bits: int,
) -> None:
    """Append one token per row (k_new, v_new [B, H, 1, D]); quantize the page leaving the window."""
    write_token_reference(k_new, v_new, sink_k, sink_v, win_k, win_v, lengths, page_table.shape[1])
    advance_reference(win_k, win_v, lengths, page_table, k_pages, k_scale, k_zero, v_hi, v_lo, v_scale, v_zero,
                      bits)


_APPEND_MUTATES = ("sink_k", "sink_v", "win_k", "win_v", "lengths") + _POOL


@torch.library.custom_op("loopkv::append_", mutates_args=_APPEND_MUTATES)
def append_(
    k_new: Tensor, v_new: Tensor, sink_k: Tensor, sink_v: Tensor, win_k: Tensor, win_v: Tensor,
    lengths: Tensor, page_table: Tensor, k_pages: Tensor, k_scale: Tensor, k_zero: Tensor,
    v_hi: Tensor, v_lo: Tensor, v_scale: Tensor, v_zero: Tensor, bits: int,
) -> None:
    """Decode append with window exit (module docstring); the reference serves every device."""
    append_reference(
        k_new, v_new, sink_k, sink_v, win_k, win_v, lengths, page_table, k_pages, k_scale, k_zero,
        v_hi, v_lo, v_scale, v_zero, bits,
    )


@append_.register_fake
def _(*args, **kwargs) -> None:
    return None


@torch.library.custom_op("loopkv::write_pages_", mutates_args=_POOL)
def write_pages_(
    k: Tensor, v: Tensor, pages: Tensor, k_pages: Tensor, k_scale: Tensor, k_zero: Tensor,
    v_hi: Tensor, v_lo: Tensor, v_scale: Tensor, v_zero: Tensor, bits: int,
) -> None:
    """Encode whole pages and write them at physical ``pages``; the reference serves every device."""
    write_pages_reference(k, v, pages, k_pages, k_scale, k_zero, v_hi, v_lo, v_scale, v_zero, bits)


@write_pages_.register_fake
def _(*args, **kwargs) -> None:
    return None
