"""Decode attention of one cell over its sink, history pages and window (paper §3.3-3.4, docs/design.md).

For query row ``q`` and head ``h``, with ``s_j = scale * q . k_j`` in fp32 over the sink (exact K), the
history pages (dequantized K: own pages, or the final loop's pages for a ``share`` cell) and the window
(exact K): ``out = sum_j softmax(s)_j * v_j``. History V is dequantized; with INT4 pages and finite
``tau``, token ``j`` of page ``p`` is *cold* for KV head ``h`` when ``s_j < loopkv.format.cold_threshold(m_ref,
tau)`` for every query head that reads ``h``, with ``m_ref = max(sink max, page p max)`` (a lower bound on the row
maximum, so Proposition 1 holds); a cold value decodes from its high plane only, as ``4 * hi + 1.5``.

Order: ``cell_attention_reference`` (plain PyTorch, the CPU kernel) -> the registered op
``torch.ops.loopkv.cell_attention``, whose fake (meta) implementation checks every shape and dtype
(:func:`check_cell_args`). The Triton kernel (``loopkv/ops/triton_attention.py``) registers itself as the op's
CUDA kernel.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from loopkv.format import PAGE, RING, SINK, cold_threshold, exact_slots, n_pages, pool_field_shapes
from loopkv.ops import codec


def _decode_pages(k_pages, k_scale, k_zero, v_hi, v_lo, v_scale, v_zero, phys, bits, cold_fn):
    """Gathered pages -> (K fp, V fp); phys: int64 [B, P]; returns [B, P, H, PAGE, D] each.

    ``cold_fn(k_hist)`` returns the cold mask [B, P, H, PAGE] (or None) once K is known, mirroring the
    kernel, which reads a page's keys before its values.
    """
    if bits == 16:
        k = k_pages[phys].float()
        return k, v_hi[phys].float()
    pages = codec.PageCodes(
        k_pages[phys], k_scale[phys], k_zero[phys], v_hi[phys],
        v_lo[phys] if bits == 4 else v_lo, v_scale[phys], v_zero[phys],
    )
    k = codec.decode_k(pages, bits)
    cold = cold_fn(k) if bits == 4 else None
    return k, codec.decode_v(pages, bits, cold)


def cell_attention_reference(
    q: Tensor, sink_k: Tensor, sink_v: Tensor, win_k: Tensor, win_v: Tensor, lengths: Tensor,
    page_table: Tensor, k_pages: Tensor, k_scale: Tensor, k_zero: Tensor, v_hi: Tensor, v_lo: Tensor,
    v_scale: Tensor, v_zero: Tensor, bits: int, tau: float, scale: float,
) -> Tensor:
    """Reference decode attention; shapes in ``loopkv.format``. q [B, Hq, D] -> [B, Hq, D].

    Computes in fp32, or in fp64 when ``q`` is fp64 (for float64 re-computations in tests).
    """
    B, Hq, D = q.shape
    H = sink_k.shape[1]
    g = Hq // H
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    dev = q.device
    qf = q.to(acc).view(B, H, g, D)  # query head h*g + i reads KV head h
    length = lengths.long()  # [B]
    npg = n_pages(length)  # [B]

    def scores(k):  # k [B, H, T, D] -> [B, H, g, T]
        return torch.einsum("bhgd,bhtd->bhgt", qf, k.to(acc)) * scale

    # sink: positions 0 .. min(length, SINK) - 1 (a short cache allocates fewer slots: loopkv.format.exact_slots)
    s_sink = scores(sink_k)
    sink_ok = torch.arange(sink_k.shape[2], device=dev) < length.clamp(max=SINK)[:, None]  # [B, SINK]
    s_sink = s_sink.masked_fill(~sink_ok[:, None, None, :], -math.inf)
    # window ring: slot r holds a live position iff (r - (ws - SINK)) mod RING < count (a short ring never wraps)
    ws = SINK + PAGE * npg  # first window position
    count = (length - ws).clamp_min(0)
    r = torch.arange(win_k.shape[2], device=dev)
    win_ok = torch.remainder(r[None, :] - (ws - SINK)[:, None], RING) < count[:, None]  # [B, RING]
    s_win = scores(win_k).masked_fill(~win_ok[:, None, None, :], -math.inf)

    # on the CPU, only the page slots some row holds: the cost follows the tokens held, not the table's width
    # (max_cache_len). Elsewhere (ROCm, older GPUs, float64 checks) the whole table: reading its maximum would be a
    # host sync, which a CUDA-graph capture forbids
    maxp = page_table.shape[1]
    if q.device.type == "cpu" and B:
        maxp = min(maxp, int(npg.max()))
    parts_s, parts_v = [s_sink, s_win], [sink_v.to(acc), win_v.to(acc)]
    if maxp > 0 and bits != 0:
        phys = page_table[:, :maxp].long()  # [B, P]
        page_ok = torch.arange(maxp, device=dev)[None, :] < npg[:, None]  # [B, P]
        sink_max = s_sink.amax(dim=-1)  # [B, H, g]; -inf only for empty rows

        def cold_fn(k_hist):  # [B, P, H, PAGE, D] -> [B, P, H, PAGE]
            if math.isinf(tau):
                return None
            s = torch.einsum("bhgd,bphtd->bphgt", qf, k_hist.to(acc)) * scale
            m_ref = torch.maximum(sink_max[:, None, :, :], s.amax(dim=-1))  # [B, P, H, g]
            cold_q = s < cold_threshold(m_ref, tau)[..., None]
            return cold_q.all(dim=3)  # cold only if cold for every query head of the group

        k_hist, v_hist = _decode_pages(
            k_pages, k_scale, k_zero, v_hi, v_lo, v_scale, v_zero, phys, bits, cold_fn
        )
        k_hist = k_hist.permute(0, 2, 1, 3, 4).reshape(B, H, maxp * PAGE, D)
        v_hist = v_hist.permute(0, 2, 1, 3, 4).reshape(B, H, maxp * PAGE, D)
        tok_ok = page_ok.repeat_interleave(PAGE, dim=1)  # [B, P*PAGE]
        parts_s.append(scores(k_hist).masked_fill(~tok_ok[:, None, None, :], -math.inf))
        parts_v.append(v_hist.to(acc))

    s = torch.cat(parts_s, dim=-1)  # [B, H, g, T]
    v = torch.cat(parts_v, dim=-2)  # [B, H, T, D]
    m = s.amax(dim=-1, keepdim=True)
    p = torch.exp(s - torch.where(torch.isinf(m), torch.zeros_like(m), m))
    denom = p.sum(dim=-1, keepdim=True)
    out = torch.einsum("bhgt,bhtd->bhgd", p, v) / denom.clamp_min(torch.finfo(acc).tiny)
    out = torch.where(length[:, None, None, None] > 0, out, torch.zeros_like(out))
    return out.reshape(B, Hq, D).to(q.dtype)


@torch.library.custom_op("loopkv::cell_attention", mutates_args=())
def cell_attention(
    q: Tensor, sink_k: Tensor, sink_v: Tensor, win_k: Tensor, win_v: Tensor, lengths: Tensor,
    page_table: Tensor, k_pages: Tensor, k_scale: Tensor, k_zero: Tensor, v_hi: Tensor, v_lo: Tensor,
    v_scale: Tensor, v_zero: Tensor, bits: int, tau: float, scale: float,
) -> Tensor:
    """Decode attention of one cell (see the module docstring); the reference serves every device."""
    return cell_attention_reference(
        q, sink_k, sink_v, win_k, win_v, lengths, page_table, k_pages, k_scale, k_zero,
        v_hi, v_lo, v_scale, v_zero, bits, tau, scale,
    )


def check_cell_args(q: Tensor, sink_k: Tensor, sink_v: Tensor, win_k: Tensor, win_v: Tensor, lengths: Tensor,
                    page_table: Tensor, pool: tuple[Tensor, ...], bits: int) -> None:
    """Shapes and dtypes of a cell read (``torch._check``: traced by the fake implementations, so a wrong call fails
    when compiled as it would eagerly). q [B, Hq, D]; the exact parts [B, H, SINK | RING, D], or a short cache's
    ``loopkv.format.exact_slots`` with no pages (its ring never wraps); lengths, page_table int32 [B], [B, P];
    ``pool`` the seven fields of ``loopkv.format.pool_field_shapes`` (bits 0: no pool read)."""
    torch._check(q.dim() == 3, lambda: f"q must be [B, Hq, D], got {tuple(q.shape)}")
    B, Hq, D = q.shape
    H = sink_k.shape[1]
    sink, ring = sink_k.shape[2], win_k.shape[2]
    short = (sink, ring) != (SINK, RING)
    torch._check(not short or (sink > 0 and (sink, ring) == exact_slots(sink + ring) and page_table.shape[-1] == 0),
                 lambda: f"sink_k, win_k have {sink} and {ring} slots: a cell has {SINK} and {RING}, or a short "
                         f"cache's loopkv.format.exact_slots with no pages (page_table [B, 0], got "
                         f"{tuple(page_table.shape)})")
    for name, t, slots in (("sink_k", sink_k, sink), ("sink_v", sink_v, sink), ("win_k", win_k, ring),
                           ("win_v", win_v, ring)):
        torch._check(tuple(t.shape) == (B, H, slots, D),
                     lambda name=name, t=t, slots=slots: f"{name} must be [{B}, {H}, {slots}, {D}], "
                                                         f"got {tuple(t.shape)}")
        torch._check(t.dtype == sink_k.dtype, lambda name=name, t=t: f"{name} is {t.dtype}, sink_k {sink_k.dtype}")
    torch._check(Hq % H == 0, lambda: f"q has {Hq} heads, not a multiple of the cache's {H} KV heads")
    torch._check(lengths.dtype == torch.int32 and tuple(lengths.shape) == (B,),
                 lambda: f"lengths must be int32 [{B}], got {lengths.dtype} {tuple(lengths.shape)}")
    torch._check(page_table.dtype == torch.int32 and page_table.dim() == 2 and page_table.shape[0] == B,
                 lambda: f"page_table must be int32 [{B}, pages], got {page_table.dtype} {tuple(page_table.shape)}")
    check_pool_args(pool, bits, H, D)


def check_pool_args(pool: tuple[Tensor, ...], bits: int, heads: int, head_dim: int) -> None:
    """``bits`` and the seven pool fields a read of ``heads`` KV heads of ``head_dim`` takes
    (``loopkv.format.pool_field_shapes``; bits 0: no pool read, the fields are not looked at). Shared by the fake
    implementations of ``cell_attention`` and ``chunk_attention``."""
    torch._check(bits in (16, 4, 2, 0), lambda: f"bits must be 16, 4, 2 or 0 (no history), got {bits}")
    if bits == 0:
        return
    want = pool_field_shapes(bits, pool[0].shape[0], heads, head_dim)
    for (name, shape), t in zip(want.items(), pool, strict=True):
        torch._check(tuple(t.shape) == shape or shape == (0,),
                     lambda name=name, t=t, shape=shape: f"{name} must be {shape} for bits {bits}, "
                                                         f"got {tuple(t.shape)}")


@cell_attention.register_fake
def _(q, sink_k, sink_v, win_k, win_v, lengths, page_table, *rest):
    pool, bits = rest[:7], rest[7]
    check_cell_args(q, sink_k, sink_v, win_k, win_v, lengths, page_table, pool, bits)
    return torch.empty_like(q)
