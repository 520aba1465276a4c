"""Fused decode attention of one cell in one launch (DESIGN.md §7, paper §3.3-3.4, Algorithm 1, Appendix E).

Grid ``(NNEAR + NSPLIT, B * H)``: for every (row b, KV head h), ``NNEAR`` *near* programs cover the
exact sink + window slots (``BN`` slots each, of the virtual array ``[sink 32 | ring 288]``) and
``NSPLIT`` *far* programs split the row's history pages (``n_pages(lengths[b])``, read on the device)
into contiguous chunks, flash-decoding style. Each program writes a partial ``(m, l, o)`` in log2
units; the last program of (b, h) to finish (an atomic counter that it resets to zero, so CUDA-graph
replays stay correct) merges the partials by log-sum-exp and writes ``out[b, h*G:(h+1)*G]``.

Query rows are *expanded*: tile row ``r`` is query head ``g = r // NGP`` of the KV head's group and V
channel group ``gr = r % NGP`` (``NGP`` = padded ``head_dim // 32``). So one ``tl.dot`` computes all
query heads' scores, and the value product folds V's per-token, per-group scale into the weights
(Appendix E): ``A[r, t] = p[r, t] * v_scale[t, gr]``, ``o[g, c] += sum_t A[r, t] * code[t, c]`` for
``c`` in group ``gr``, plus ``sum_t p[r, t] * v_zero[t, gr]``. K's per-channel scale is folded into
the query once per page: ``s = (q * k_scale) . code + q . k_zero``. Codes are read in their packed
order (channel ``per * j + i`` in tile ``i``), so no unpacking shuffle is needed.

V precision (INT4, finite ``tau``): token ``t`` of a page is cold iff ``s < m_ref - tau`` (log2 units,
i.e. ``tau * ln 2`` in natural units) for every query head of the group, with
``m_ref = max(sink max, page max)``; each far program computes the sink maximum itself (32 exact keys),
so the result is deterministic and independent of the split. A cold token's lo plane is not loaded
(masked load) and its value is ``4 * hi + 1.5``: the ``1.5 * v_scale`` goes into the zero term.

Precision: with bf16/fp16 inputs the products run on tensor cores with fp16 operands (codes are exact in
fp16; ``q * k_scale`` and ``p * v_scale`` are rounded to fp16) and fp32 accumulation; with fp32 inputs
every product is fp32 (``input_precision="ieee"``), for profiling and tests.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from loopkv.ops.cell_attention import cell_attention_reference
from loopkv.ops.codec import GROUP, PAGE, SINK
from loopkv.ops.layout import RING
from loopkv.ops.triton_register import counters

assert (SINK, PAGE, GROUP, RING) == (32, 32, 32, 288)  # spelled out as literals in the kernels
LOG2E = 1.0 / math.log(2.0)
NEAR_BLOCK = 64  # near slots per program: the 320 sink + ring slots take 5 programs


@triton.jit
def _online(s, m_i, l_i):
    """One online-softmax step in log2 units: returns (m_new, alpha, p, l_new); -inf rows stay finite."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    return m_new, alpha, p, l_i * alpha + tl.sum(p, 1)


@triton.jit
def _dot(a, b, PREC: tl.constexpr, UPCAST: tl.constexpr):
    """``a @ b`` in fp32; UPCAST runs bf16 operands as fp32 (Triton's interpreter mis-multiplies bf16)."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision=PREC)


@triton.jit
def _exact_scores(qx, kptr, valid, cm, qk_scale, PREC: tl.constexpr, UPCAST: tl.constexpr):
    """Scores [RP, BN] (log2 units) of exact keys at ``kptr`` [BN, DP]; invalid slots -> -inf."""
    k = tl.load(kptr, mask=valid[:, None] & cm[None, :], other=0.0)
    s = _dot(qx.to(k.dtype), tl.trans(k), PREC, UPCAST) * qk_scale
    return tl.where(valid[None, :], s, float("-inf"))


@triton.jit
def _exact_values(p, vptr, valid, cm, PREC: tl.constexpr, UPCAST: tl.constexpr):
    v = tl.load(vptr, mask=valid[:, None] & cm[None, :], other=0.0)
    return _dot(p.to(v.dtype), v, PREC, UPCAST)


@triton.jit
def _quant_scores(
    qx, q_ptr, rvalid, page, k_pages, k_scale, k_zero, qk_scale,
    BITS: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, RP: tl.constexpr, DT: tl.constexpr,
    PREC: tl.constexpr,
):
    """Scores [RP, PAGE] (log2 units) of one INT4/INT2 page: (q * k_scale) . codes + q . k_zero."""
    PER: tl.constexpr = 8 // BITS
    KB: tl.constexpr = DP // PER
    KBD: tl.constexpr = D // PER
    t = tl.arange(0, 32)
    j = tl.arange(0, KB)
    c = tl.arange(0, DP)
    kz = tl.load(k_zero + page * D + c, mask=c < D, other=0.0).to(tl.float32)
    s = tl.zeros([RP, 32], dtype=tl.float32) + tl.sum(qx * kz[None, :], 1)[:, None]
    codes = tl.load(k_pages + page * (32 * KBD) + t[:, None] * KBD + j[None, :], mask=(j < KBD)[None, :], other=0)
    MASK: tl.constexpr = (1 << BITS) - 1
    for i in tl.static_range(PER):
        ch = j * PER + i
        ks = tl.load(k_scale + page * D + ch, mask=j < KBD, other=0.0).to(tl.float32)
        qi = tl.load(q_ptr[:, None] + ch[None, :], mask=rvalid[:, None] & (j < KBD)[None, :], other=0.0)
        qk = (qi.to(tl.float32) * ks[None, :]).to(DT)
        ci = ((codes >> (BITS * i)) & MASK).to(DT)
        s += tl.dot(qk, tl.trans(ci), input_precision=PREC)
    return s * qk_scale


@triton.jit
def _store_partial(ws_o, ws_ml, slot, g, gr, m_i, l_i, acc, c, GR: tl.constexpr, DP: tl.constexpr):
    """Store rows with ``gr == 0`` of (m, l, acc [RP, DP]) as the partial of their query head ``g``."""
    first = gr == 0
    tl.store(ws_ml + (slot * GR + g) * 2, m_i, mask=first)
    tl.store(ws_ml + (slot * GR + g) * 2 + 1, l_i, mask=first)
    tl.store(ws_o + (slot * GR + g)[:, None] * DP + c[None, :], acc, mask=first[:, None])


@triton.jit
def _cell_attn_kernel(
    q, sq_b, sq_h, sink_k, sink_v, win_k, win_v, lengths, page_table,
    k_pages, k_scale, k_zero, v_hi, v_lo, v_scale, v_zero,
    ws_o, ws_ml, cnt, out, so_b, so_h,
    H, MAXP, NNEAR, NSPLIT, qk_scale, tau,
    G: tl.constexpr, GR: tl.constexpr, NGP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
    BITS: tl.constexpr, VPREC: tl.constexpr, BN: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Program (i, b*H + h): near slots (i < NNEAR) or history split i - NNEAR of row b, KV head h."""
    RP: tl.constexpr = GR * NGP
    NG: tl.constexpr = D // 32
    pid = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    nprog = NNEAR + NSPLIT
    slot = bh.to(tl.int64) * nprog + pid  # this program's partial
    length = tl.load(lengths + b).to(tl.int32)
    npg = tl.maximum(length - 288, 0) // 32  # history pages, n_pages(length)
    r = tl.arange(0, RP)
    g_r = r // NGP
    gr = r % NGP
    rvalid = g_r < G
    c = tl.arange(0, DP)
    cm = c < D
    q_ptr = q + b.to(tl.int64) * sq_b + (h * G + g_r) * sq_h  # [RP] row starts
    qx = tl.load(q_ptr[:, None] + c[None, :], mask=rvalid[:, None] & cm[None, :], other=0.0).to(tl.float32)
    bh64 = bh.to(tl.int64)
    m_i = tl.full([RP], float("-inf"), tl.float32)
    l_i = tl.zeros([RP], tl.float32)
    if pid < NNEAR:
        # ---- exact sink + window slots [pid * BN, pid * BN + BN) of [sink 32 | ring 288]
        v = pid * BN + tl.arange(0, BN)
        ws = 32 + 32 * npg  # first window position
        count = tl.maximum(length - ws, 0)
        ring = tl.maximum(v - 32, 0)
        d = ring - (ws - 32) % 288
        d = tl.where(d < 0, d + 288, d)
        valid = tl.where(v < 32, v < tl.minimum(length, 32), (d < count) & (v < 320))
        in_sink = (v < 32)[:, None]
        s_off = (bh64 * 32 + tl.minimum(v, 31))[:, None] * D + c[None, :]
        w_off = (bh64 * 288 + tl.minimum(ring, 287))[:, None] * D + c[None, :]
        s = _exact_scores(qx, tl.where(in_sink, sink_k + s_off, win_k + w_off), valid, cm, qk_scale, PREC, UPCAST)
        m_i, alpha, p, l_i = _online(s, m_i, l_i)
        acc = _exact_values(p, tl.where(in_sink, sink_v + s_off, win_v + w_off), valid, cm, PREC, UPCAST)
        _store_partial(ws_o, ws_ml, slot, g_r, gr, m_i, l_i, acc, c, GR, DP)
    else:
        chunk = (npg + NSPLIT - 1) // NSPLIT
        p0 = (pid - NNEAR) * chunk
        p1 = tl.minimum(p0 + chunk, npg)
        t = tl.arange(0, 32)
        if BITS == 16:
            acc = tl.zeros([RP, DP], tl.float32)
            for pg in range(p0, p1):
                page = tl.load(page_table + b.to(tl.int64) * MAXP + pg).to(tl.int64) * H + h
                off = (page * 32 + t)[:, None] * D + c[None, :]
                valid = t < 32
                s = _exact_scores(qx, k_pages + off, valid, cm, qk_scale, PREC, UPCAST)
                m_i, alpha, p, l_i = _online(s, m_i, l_i)
                acc = acc * alpha[:, None] + _exact_values(p, v_hi + off, valid, cm, PREC, UPCAST)
            _store_partial(ws_o, ws_ml, slot, g_r, gr, m_i, l_i, acc, c, GR, DP)
        elif BITS != 0:
            VB: tl.constexpr = DP // 4
            VBD: tl.constexpr = D // 4
            jv = tl.arange(0, VB)
            jm = (jv < VBD)[None, :]
            gvalid = gr < NG
            sink_max = tl.full([RP], float("-inf"), tl.float32)
            if VPREC:
                if p1 > p0:
                    ts = tl.arange(0, 32)
                    s_sink = _exact_scores(
                        qx, sink_k + (bh64 * 32 + ts)[:, None] * D + c[None, :], ts < tl.minimum(length, 32),
                        cm, qk_scale, PREC, UPCAST,
                    )
                    sink_max = tl.max(s_sink, 1)
            acc0 = tl.zeros([RP, VB], tl.float32)
            acc1 = tl.zeros([RP, VB], tl.float32)
            acc2 = tl.zeros([RP, VB], tl.float32)
            acc3 = tl.zeros([RP, VB], tl.float32)
            zacc = tl.zeros([RP], tl.float32)
            for pg in range(p0, p1):
                page = tl.load(page_table + b.to(tl.int64) * MAXP + pg).to(tl.int64) * H + h
                s = _quant_scores(qx, q_ptr, rvalid, page, k_pages, k_scale, k_zero, qk_scale,
                                  BITS, D, DP, RP, DT, PREC)
                m_i, alpha, p, l_i = _online(s, m_i, l_i)
                goff = page * (32 * NG) + t[None, :] * NG + gr[:, None]  # [RP, 32]: (row's group, token)
                vs = tl.load(v_scale + goff, mask=gvalid[:, None], other=0.0).to(tl.float32)
                vz = tl.load(v_zero + goff, mask=gvalid[:, None], other=0.0).to(tl.float32)
                voff = page * (32 * VBD) + t[:, None] * VBD + jv[None, :]
                hi = tl.load(v_hi + voff, mask=jm, other=0)
                if BITS == 4:
                    if VPREC:
                        m_ref = tl.maximum(sink_max, tl.max(s, 1))
                        cold_r = (s < (m_ref - tau)[:, None]) | (~rvalid[:, None])
                        cold = tl.min(cold_r.to(tl.int32), 0) > 0  # [32]: cold for every query head
                        vz += tl.where(cold[None, :], 1.5 * vs, 0.0)
                        lo = tl.load(v_lo + voff, mask=(~cold)[:, None] & jm, other=0)
                    else:
                        lo = tl.load(v_lo + voff, mask=jm, other=0)
                zacc = zacc * alpha + tl.sum(p * vz, 1)
                a = (p * vs).to(DT)
                if BITS == 4:
                    acc0 = acc0 * alpha[:, None] + tl.dot(a, ((hi & 3) * 4 + (lo & 3)).to(DT), input_precision=PREC)
                    acc1 = acc1 * alpha[:, None] + tl.dot(
                        a, (((hi >> 2) & 3) * 4 + ((lo >> 2) & 3)).to(DT), input_precision=PREC)
                    acc2 = acc2 * alpha[:, None] + tl.dot(
                        a, (((hi >> 4) & 3) * 4 + ((lo >> 4) & 3)).to(DT), input_precision=PREC)
                    acc3 = acc3 * alpha[:, None] + tl.dot(
                        a, (((hi >> 6) & 3) * 4 + ((lo >> 6) & 3)).to(DT), input_precision=PREC)
                else:
                    acc0 = acc0 * alpha[:, None] + tl.dot(a, (hi & 3).to(DT), input_precision=PREC)
                    acc1 = acc1 * alpha[:, None] + tl.dot(a, ((hi >> 2) & 3).to(DT), input_precision=PREC)
                    acc2 = acc2 * alpha[:, None] + tl.dot(a, ((hi >> 4) & 3).to(DT), input_precision=PREC)
                    acc3 = acc3 * alpha[:, None] + tl.dot(a, ((hi >> 6) & 3).to(DT), input_precision=PREC)
            # partial: channel 4 j + i of query head g comes from row (g, group (4 j + i) // 32 = j // 8)
            first = gr == 0
            tl.store(ws_ml + (slot * GR + g_r) * 2, m_i, mask=first)
            tl.store(ws_ml + (slot * GR + g_r) * 2 + 1, l_i, mask=first)
            mine = (gr[:, None] == (jv // 8)[None, :]) & jm
            obase = ws_o + (slot * GR + g_r)[:, None] * DP + 4 * jv[None, :]
            tl.store(obase, acc0 + zacc[:, None], mask=mine)
            tl.store(obase + 1, acc1 + zacc[:, None], mask=mine)
            tl.store(obase + 2, acc2 + zacc[:, None], mask=mine)
            tl.store(obase + 3, acc3 + zacc[:, None], mask=mine)
    # ---- the last program of (b, h) merges the partials by log-sum-exp
    tl.debug_barrier()
    done = tl.atomic_add(cnt + bh, 1, sem="acq_rel")
    if done == nprog - 1:
        gg = tl.arange(0, GR)
        m_run = tl.full([GR], float("-inf"), tl.float32)
        l_run = tl.zeros([GR], tl.float32)
        o_run = tl.zeros([GR, DP], tl.float32)
        for k in range(nprog):
            base = (bh64 * nprog + k) * GR + gg
            m_k = tl.load(ws_ml + base * 2, cache_modifier=".cg")
            l_k = tl.load(ws_ml + base * 2 + 1, cache_modifier=".cg")
            o_k = tl.load(ws_o + base[:, None] * DP + c[None, :], cache_modifier=".cg")
            m_new = tl.maximum(m_run, m_k)
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            a_run = tl.exp2(m_run - m_safe)
            a_k = tl.exp2(m_k - m_safe)
            l_run = l_run * a_run + l_k * a_k
            o_run = o_run * a_run[:, None] + o_k * a_k[:, None]
            m_run = m_new
        res = tl.where(l_run[:, None] > 0, o_run / tl.where(l_run > 0, l_run, 1.0)[:, None], 0.0)
        optr = out + b.to(tl.int64) * so_b + (h * G + gg)[:, None] * so_h + c[None, :]
        tl.store(optr, res.to(out.dtype.element_ty), mask=(gg < G)[:, None] & cm[None, :])
        tl.atomic_xchg(cnt + bh, 0)


WAVES = 8  # far programs per SM the split heuristic aims for
MAX_SPLITS = 64
_SM_COUNT: dict[int, int] = {}


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: any small number
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


def choose_splits(rows_heads: int, max_pages: int, device: torch.device) -> int:
    """History splits per (row, KV head): enough far programs for ``WAVES`` per SM, at most one per page."""
    if max_pages == 0:
        return 0
    want = -(-_num_sms(device) * WAVES // max(rows_heads, 1))
    return int(max(1, min(want, max_pages, MAX_SPLITS)))


def _config(bits: int, head_dim: int, rows: int) -> dict:
    """Fixed launch config per shape bucket (no autotuning: the op runs inside CUDA graphs)."""
    return {"num_warps": 4, "num_stages": 2}


def cell_attention(
    q: Tensor, sink_k: Tensor, sink_v: Tensor, win_k: Tensor, win_v: Tensor, lengths: Tensor,
    page_table: Tensor, k_pages: Tensor, k_scale: Tensor, k_zero: Tensor, v_hi: Tensor, v_lo: Tensor,
    v_scale: Tensor, v_zero: Tensor, bits: int, tau: float, scale: float, *, splits: int | None = None,
    num_warps: int | None = None, num_stages: int | None = None,
) -> Tensor:
    """Triton ``cell_attention``: q [B, Hq, D] -> [B, Hq, D] (shapes: docs/storage-layout.md).

    Storage tensors are the cache's contiguous buffers (others fall back to the reference).
    ``splits`` (history programs per row and KV head), ``num_warps`` and ``num_stages`` override the
    fixed per-bucket config (benchmarks, tests).
    """
    if bits not in (16, 4, 2, 0):
        raise ValueError(f"bits must be 16, 4, 2 or 0 (no history), got {bits}")
    B, Hq, D = q.shape
    H = sink_k.shape[1]
    if Hq % H:
        raise ValueError(f"q has {Hq} heads, not a multiple of the cache's {H} KV heads")
    if D % GROUP or D < 64:
        raise ValueError(f"head_dim={D}: the Triton reader needs a multiple of {GROUP} that is >= 64")
    storage = (sink_k, sink_v, win_k, win_v, lengths, page_table, k_pages, k_scale, k_zero, v_hi, v_lo,
               v_scale, v_zero)
    if q.dtype == torch.float64 or not all(t.is_contiguous() for t in storage):
        # float64 re-computations (tests) and non-contiguous storage stay on the reference
        return cell_attention_reference(
            q, sink_k, sink_v, win_k, win_v, lengths, page_table, k_pages, k_scale, k_zero,
            v_hi, v_lo, v_scale, v_zero, bits, tau, scale,
        )
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if B == 0:
        return out
    q = q.contiguous()
    G = Hq // H
    maxp = page_table.shape[1]
    DP = _next_pow2(D)
    NGP = DP // 32
    GR = max(_next_pow2(G), 16 // NGP)  # query-head rows padded so that RP = GR * NGP >= 16
    nnear = -(-(SINK + RING) // NEAR_BLOCK)
    if bits == 0 or maxp == 0:
        nsplit = 0
    else:
        nsplit = choose_splits(B * H, maxp, q.device) if splits is None else int(splits)
    nprog = nnear + nsplit
    ws_o = torch.empty(B * H * nprog * GR * DP, dtype=torch.float32, device=q.device)
    ws_ml = torch.empty(B * H * nprog * GR * 2, dtype=torch.float32, device=q.device)
    cnt = counters(q.device, B * H, purpose="attention")
    exact = q.dtype == torch.float32
    vprec = bits == 4 and math.isfinite(tau)
    cfg = _config(bits, D, B * H)
    _cell_attn_kernel[(nprog, B * H)](
        q, q.stride(0), q.stride(1), sink_k, sink_v, win_k, win_v, lengths, page_table,
        k_pages, k_scale, k_zero, v_hi, v_lo, v_scale, v_zero,
        ws_o, ws_ml, cnt, out, out.stride(0), out.stride(1),
        H, maxp, nnear, nsplit, scale * LOG2E, float(tau) if vprec else 0.0,
        G=G, GR=GR, NGP=NGP, D=D, DP=DP, BITS=bits if nsplit else 0, VPREC=vprec, BN=NEAR_BLOCK,
        DT=tl.float32 if exact else tl.float16, PREC="ieee" if exact else "tf32",
        UPCAST=q.device.type != "cuda" and q.dtype == torch.bfloat16,
        num_warps=num_warps or cfg["num_warps"], num_stages=num_stages or cfg["num_stages"],
    )
    return out
