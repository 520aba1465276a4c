"""A chunk of new tokens on one row, each read with the served semantics, in one op (docs/design.md, "The decode step").

``chunk_attention(q [S, Hq, D], sink_k, sink_v [H, NS, D], tail_k, tail_v [H, T, D], held, ring, page_table [P], pool,
bits, tau, scale) -> [S, Hq, D]``: the row holds ``held`` tokens before the chunk and ``held + S`` after it (the chunk
is already written: sink, pages, lengths). Token ``i`` (position ``held + i``; the row holds ``n = held + i + 1``
tokens when it reads) attends to what a decode read of the row at length ``n`` attends to (``cell_attention``): the
sink positions ``[0, min(n, SINK))``, history pages ``[0, n_pages(n))`` dequantized (with the INT4 cold rule from its
own scores, ``m_ref = max(sink max, page max)``) and the exact positions ``[SINK + PAGE * n_pages(n), n)``. Those last
come from the *exact tail* ``tail_k, tail_v``: positions ``[ws, held + S)`` with ``ws = SINK + PAGE *
n_pages(held)``, in the cache's dtype (the ring before the chunk, then the chunk's tokens past the sink), so
``T = max(0, held + S - ws)``. ``ring``: the row's ring slots (``RING``, or a short cache's
``loopkv.format.exact_slots``), the shape of the decode read the reference reproduces. ``bits`` and the pool are what
a decode of the row reads (a ``share`` cell: its source's); bits 0 reads no history.

Order: ``chunk_attention_reference`` (the CPU kernel) reads each token as a *virtual row* of one
``torch.ops.loopkv.cell_attention`` call, with length ``n``, the row's sink and page table, and a ring gathered from
the exact tail so that each slot holds what decoding to length ``n`` would have left there: one semantics, the decode
op's, and on the CPU a chunk equals that many decode steps bit for bit. Then the registered op, whose fake (meta)
implementation checks every shape (:func:`check_chunk_args`). The Triton kernel (``loopkv/ops/triton_chunk.py``)
registers itself as the op's CUDA kernel: it reads the row's pages once per block of the chunk's queries.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from loopkv.format import PAGE, RING, SINK, exact_slots, n_pages
from loopkv.ops.cell_attention import check_pool_args  # (and registers torch.ops.loopkv.cell_attention)

_VIRTUAL_ROW_BYTES = 1 << 28  # sink and ring copies (K and V) one block of virtual rows holds: 256 MiB


def window_start(held: int) -> int:
    """The first exact window position of a row holding ``held`` tokens: where the exact tail starts."""
    return SINK + PAGE * n_pages(held)


def tail_length(held: int, new: int) -> int:
    """Positions in the exact tail of a chunk of ``new`` tokens after ``held``: ``[window_start(held), held + new)``."""
    return max(0, held + new - window_start(held))


def chunk_attention_reference(
    q: Tensor, sink_k: Tensor, sink_v: Tensor, tail_k: Tensor, tail_v: Tensor, held: int, ring: int,
    page_table: Tensor, k_pages: Tensor, k_scale: Tensor, k_zero: Tensor, v_hi: Tensor, v_lo: Tensor,
    v_scale: Tensor, v_zero: Tensor, bits: int, tau: float, scale: float,
) -> Tensor:
    """Each query a virtual row of ``cell_attention`` (module docstring); q [S, Hq, D] -> [S, Hq, D]. Blocks of
    queries keep the per-query sink and ring copies within ``_VIRTUAL_ROW_BYTES``."""
    H, nsink, D = sink_k.shape
    per_query = 2 * H * (nsink + ring) * D * sink_k.element_size()  # its sink and ring, K and V
    block = max(1, _VIRTUAL_ROW_BYTES // per_query)
    ws = window_start(held)
    # a zero slot, then positions [ws, held + S), heads flattened: [H * (1 + T), D]
    flat_k, flat_v = (F.pad(t, (0, 0, 1, 0)).flatten(0, 1) for t in (tail_k, tail_v))
    S = q.shape[0]
    pool = (k_pages, k_scale, k_zero, v_hi, v_lo, v_scale, v_zero)
    out = []
    for lo in range(0, S, block):
        m = min(S, lo + block) - lo
        n = torch.arange(held + lo + 1, held + lo + m + 1, dtype=torch.int32, device=q.device)  # [m] tokens each reads
        index = _virtual_rings(n, ws, ring, H, tail_k.shape[1] + 1)  # [m, H, ring] into the flattened tail
        out.append(torch.ops.loopkv.cell_attention(
            q[lo:lo + m], sink_k.expand(m, -1, -1, -1).contiguous(), sink_v.expand(m, -1, -1, -1).contiguous(),
            flat_k[index], flat_v[index], n, page_table.expand(m, -1).contiguous(), *pool, bits, tau, scale,
        ))
    return torch.cat(out) if out else torch.empty_like(q)


def _virtual_rings(n: Tensor, ws: int, nring: int, heads: int, tail: int) -> Tensor:
    """The ring of each virtual row holding ``n`` [m] tokens, as indices [m, heads, nring] into the exact tail
    (positions ``[ws, ...)`` after one zero slot: ``tail`` slots per head, heads flattened). Slot ``s`` holds the last
    position ``p < n`` with ``(p - SINK) % RING == s``, as decoding to length ``n`` leaves it; a decode at ``n`` reads
    the positions ``[SINK + PAGE * n_pages(n), n)`` (fewer than ``RING``, each the last of its slot, all ``>= ws``),
    and a slot whose position is before the tail (read by no query) gets the zero slot."""
    last = n[:, None].long() - 1  # [m, 1]
    slot = torch.arange(nring, device=n.device)  # [nring]
    position = last - torch.remainder(last - SINK - slot, RING)  # [m, nring]
    head = torch.arange(heads, device=n.device)[None, :, None] * tail  # [1, heads, 1]
    return (position - ws + 1).clamp_min(0)[:, None, :] + head


@torch.library.custom_op("loopkv::chunk_attention", mutates_args=())
def chunk_attention(
    q: Tensor, sink_k: Tensor, sink_v: Tensor, tail_k: Tensor, tail_v: Tensor, held: int, ring: int,
    page_table: Tensor, k_pages: Tensor, k_scale: Tensor, k_zero: Tensor, v_hi: Tensor, v_lo: Tensor,
    v_scale: Tensor, v_zero: Tensor, bits: int, tau: float, scale: float,
) -> Tensor:
    """A chunk's attention on one row with the served semantics (module docstring); the reference serves every
    device."""
    return chunk_attention_reference(q, sink_k, sink_v, tail_k, tail_v, held, ring, page_table, k_pages, k_scale,
                                     k_zero, v_hi, v_lo, v_scale, v_zero, bits, tau, scale)


def check_chunk_args(q: Tensor, sink_k: Tensor, sink_v: Tensor, tail_k: Tensor, tail_v: Tensor, held: int, ring: int,
                     page_table: Tensor, pool: tuple[Tensor, ...], bits: int) -> None:
    """Shapes and dtypes of a chunk read (``torch._check``, so a compiled call fails as an eager one would). q [S, Hq,
    D]; sink [H, SINK, D] and ``ring`` = RING, or a short cache's ``loopkv.format.exact_slots`` with no pages; tail
    [H, tail_length(held, S), D]; page_table int32 [P] with the ``n_pages(held + S)`` pages the chunk reads; ``pool``
    the seven fields of ``loopkv.format.pool_field_shapes`` (bits 0: no pool read)."""
    torch._check(q.dim() == 3, lambda: f"q must be [S, Hq, D] (the chunk's queries), got {tuple(q.shape)}")
    torch._check(sink_k.dim() == 3, lambda: f"sink_k must be [H, sink slots, D] (one row's), got {tuple(sink_k.shape)}")
    S, Hq, D = q.shape
    H, nsink = sink_k.shape[0], sink_k.shape[1]
    short = (nsink, ring) != (SINK, RING)
    torch._check(not short or (nsink > 0 and (nsink, ring) == exact_slots(nsink + ring) and page_table.shape[-1] == 0),
                 lambda: f"sink_k has {nsink} slots and ring={ring}: a row has {SINK} and {RING}, or a short cache's "
                         f"loopkv.format.exact_slots with no pages (page_table [0], got {tuple(page_table.shape)})")
    torch._check(held >= 0 and (not short or held + S <= nsink + ring),
                 lambda: f"held={held} plus {S} new tokens do not fit a short row of {nsink} + {ring} slots")
    T = tail_length(held, S)
    for name, t, slots in (("sink_k", sink_k, nsink), ("sink_v", sink_v, nsink), ("tail_k", tail_k, T),
                           ("tail_v", tail_v, T)):
        torch._check(tuple(t.shape) == (H, slots, D),
                     lambda name=name, t=t, slots=slots: f"{name} must be [{H}, {slots}, {D}], got {tuple(t.shape)}"
                     + ("" if name.startswith("sink") else f" (positions [{window_start(held)}, {held + S}): "
                        "continuation._exact_tail builds it)"))
        torch._check(t.dtype == sink_k.dtype, lambda name=name, t=t: f"{name} is {t.dtype}, sink_k {sink_k.dtype}")
    torch._check(Hq % H == 0, lambda: f"q has {Hq} heads, not a multiple of the cache's {H} KV heads")
    torch._check(page_table.dtype == torch.int32 and page_table.dim() == 1,
                 lambda: f"page_table must be one row's, int32 [pages], got {page_table.dtype} "
                         f"{tuple(page_table.shape)}")
    check_pool_args(pool, bits, H, D)
    torch._check(bits == 0 or page_table.shape[0] >= n_pages(held + S),
                 lambda: f"page_table holds {page_table.shape[0]} pages; the chunk's last token reads "
                         f"n_pages({held + S}) = {n_pages(held + S)}: reserve the row's pages first")


@chunk_attention.register_fake
def _(q, sink_k, sink_v, tail_k, tail_v, held, ring, page_table, *rest):
    pool, bits = rest[:7], rest[7]
    check_chunk_args(q, sink_k, sink_v, tail_k, tail_v, held, ring, page_table, pool, bits)
    return torch.empty_like(q)


__all__ = ["check_chunk_args", "chunk_attention", "chunk_attention_reference", "tail_length", "window_start"]
