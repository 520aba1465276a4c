"""Cache writes: bulk page writes (prefill) and the two halves of a decode token's write (docs/design.md).

* ``write_pages_`` (op): encode whole pages and write them at given physical pages (prefill, in bulk). It lists
  every tensor it writes in ``mutates_args`` and returns ``None``; the reference below is its CPU kernel, a Triton
  kernel registers as its CUDA kernel (``loopkv/ops/triton_quant.py``).
* ``write_token_reference``: one token per row at position ``lengths[b]`` (sink slot or window-ring slot); and
  ``advance_reference``: count it and, if that makes a page leave the window, quantize the page into the pool.
  They are the references of the decode ops in ``loopkv/ops/step_ops.py`` (``token_attention_`` writes the token
  inside the cell's read, ``advance_`` counts a whole step). Decided per row on the device, with no host sync,
  so the whole decode step stays one graph.
"""

from __future__ import annotations

import torch
from torch import Tensor

from loopkv import format as fmt
from loopkv.format import PAGE, POOL_FIELDS, QUANTIZE_LENGTH, RING, SINK, row_capacity
from loopkv.ops import codec


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
    return the appended lengths (int64 [B]; rows at capacity, ``loopkv.format.row_capacity`` of the shapes, are left
    unchanged). ``lengths`` is not written."""
    B = k_new.shape[0]
    rows = torch.arange(B, device=k_new.device)
    pos = lengths.long()  # [B]
    sink, ring = sink_k.shape[2], win_k.shape[2]  # fewer than SINK, RING in a short cache (loopkv.format)
    ok = pos < row_capacity(maxp, sink, ring)  # rows at capacity are left unchanged
    kn, vn = k_new[:, :, 0], v_new[:, :, 0]  # [B, H, D]

    in_sink = ok & (pos < SINK)
    slot = pos.clamp(max=sink - 1)
    for buf, new in ((sink_k, kn), (sink_v, vn)):
        buf[rows, :, slot] = torch.where(in_sink[:, None, None], new.to(buf.dtype), buf[rows, :, slot])
    if ring:  # a short ring never wraps: a row below capacity writes below its last slot
        in_win = ok & (pos >= SINK)
        slot = torch.remainder(pos - SINK, RING).clamp(max=ring - 1)
        for buf, new in ((win_k, kn), (win_v, vn)):
            buf[rows, :, slot] = torch.where(in_win[:, None, None], new.to(buf.dtype), buf[rows, :, slot])
    return torch.where(ok, pos + 1, pos)


def advance_reference(
    win_k: Tensor, win_v: Tensor, lengths: Tensor, page_table: Tensor, k_pages: Tensor, k_scale: Tensor,
    k_zero: Tensor, v_hi: Tensor, v_lo: Tensor, v_scale: Tensor, v_zero: Tensor, bits: int,
    capacity: int | None = None,
) -> None:
    """Count the token already written at ``lengths[b]`` (``lengths[b] + 1``, unchanged at ``capacity``) and
    quantize the page that this makes leave the window, from the ring into the pool (bits 0: no pool). ``capacity``:
    the cell's ``loopkv.format.row_capacity``; ``None`` for the whole sink and ring (``format.capacity``). Without
    pages the ring is not read (a short cache's ring has fewer slots)."""
    B = lengths.shape[0]
    maxp = page_table.shape[1]
    rows = torch.arange(B, device=lengths.device)
    pos = lengths.long()
    ok = pos < (fmt.capacity(maxp) if capacity is None else capacity)
    new_len = torch.where(ok, pos + 1, pos)
    lengths.copy_(new_len.to(lengths.dtype))

    if bits == 0 or maxp == 0:
        return
    # the page this token quantizes (if any): p = (n - 319) // 32 at n = 319 + 32 p (loopkv.format says why)
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


@torch.library.custom_op("loopkv::write_pages_", mutates_args=POOL_FIELDS)
def write_pages_(
    k: Tensor, v: Tensor, pages: Tensor, k_pages: Tensor, k_scale: Tensor, k_zero: Tensor,
    v_hi: Tensor, v_lo: Tensor, v_scale: Tensor, v_zero: Tensor, bits: int,
) -> None:
    """Encode whole pages and write them at physical ``pages``; the reference serves every device."""
    write_pages_reference(k, v, pages, k_pages, k_scale, k_zero, v_hi, v_lo, v_scale, v_zero, bits)


@write_pages_.register_fake
def _(k, v, pages, *pool_and_bits) -> None:
    bits = pool_and_bits[7]
    torch._check(k.dim() == 4 and k.shape == v.shape and k.shape[2] == PAGE,
                 lambda: f"k, v must be [n, H, {PAGE}, D] and alike, got {tuple(k.shape)}, {tuple(v.shape)}")
    torch._check(pages.dim() == 1 and pages.shape[0] == k.shape[0],
                 lambda: f"pages must be [n] = [{k.shape[0]}], got {tuple(pages.shape)}")
    torch._check(bits in (16, 4, 2), lambda: f"bits must be 16, 4 or 2, got {bits}")
    return None
