"""Fused decode attention of one cell in one launch (DESIGN.md §7, paper §3.3-3.4, Algorithm 1, Appendix E).

Grid ``(NNEAR + NSPLIT, B * H)``: for every (row b, KV head h), ``NNEAR`` *near* programs cover the
exact sink + window slots (``BN`` slots each, of the virtual array ``[sink 32 | ring 288]``) and
``NSPLIT`` *far* programs split the row's history pages (``n_pages(lengths[b])``, read on the device)
into contiguous chunks, flash-decoding style (chunks of at least ``ceil(sqrt(CHUNKC * B*H * pages))`` pages;
the far programs past the row's last chunk exit at once). Each other program writes a partial ``(m, l, o)``
in log2 units; the last of them to finish (an atomic counter that it resets to zero, so CUDA-graph
replays stay correct) merges the partials by log-sum-exp and writes ``out[b, h*G:(h+1)*G]``. By default
(``FAR_FIRST``, docs/design-decisions.md §14) the programs are renumbered so that the GPU starts every
history program before any near program: the short near programs fill the end of the launch.

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

Precision: with bf16/fp16 inputs the products run on tensor cores with fp16 operands and fp32
accumulation: codes are exact in fp16 (made from the packed bytes without shifts or int-to-float
conversions, see ``_field``: by default as subnormal fp16 ``2**-24 * 2**s * code``), ``q * k_scale`` and
``p * v_scale`` are rounded to fp16 (relative 2**-11). With fp32 inputs every product is fp32
(``input_precision="ieee"``), for profiling and tests.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from loopkv.ops import triton_config
from loopkv.ops.cell_attention import cell_attention_reference
from loopkv.ops.codec import GROUP, PAGE, SINK
from loopkv.ops.layout import RING, capacity
from loopkv.ops.triton_config import (  # noqa: F401  (constants re-exported for benchmarks and tests)
    CC_DEFAULT_OPTS,
    CC_NEAR_BLOCK,
    KERNEL_OPTIONS,
    MAX_SPLITS,
    NEAR_BLOCK,
    WAVES,
    _config,
    check_int32_offsets,
    choose_splits,
    int32_offset_overflow,
)
from loopkv.ops.triton_far import (
    CC_MAX_GROUP,
    CC_OPTS,
    OPT_ASM16,
    _dot,
    _exact_scores,
    cc_opt_bits,
    choose_far_impl,
    far_cc,
)
from loopkv.ops.triton_quant import _append_token
from loopkv.ops.triton_register import counters, warmup  # noqa: F401  (warmup re-exported here)

assert (SINK, PAGE, GROUP, RING) == (32, 32, 32, 288)  # spelled out as literals in the kernels
LOG2E = 1.0 / math.log(2.0)
# append_attention_: programs per part (K, V) that share the encoding of the page leaving the window (slices of
# 32 channels of K, 8 tokens of V; session 7: with 1 program per part the fused launch's encoder was 14,100 of its
# 17,800 instructions, one warp encoding a whole page, and the launch was 9 us slower per cell than the two ops)
APPEND_SLICES = 4
CC_DEFAULT = True  # the CUDA-core reader for <= 2 query heads per KV head (False: tensor-core reader always)


@triton.jit
def _online(s, m_i, l_i):
    """One online-softmax step in log2 units: returns (m_new, alpha, p, l_new); -inf rows stay finite."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    return m_new, alpha, p, l_i * alpha + tl.sum(p, 1)


@triton.jit
def _exact_values(p, vptr, valid, cm, PREC: tl.constexpr, UPCAST: tl.constexpr):
    v = tl.load(vptr, mask=valid[:, None] & cm[None, :], other=0.0)
    return _dot(p.to(v.dtype), v, PREC, UPCAST)


@triton.jit
def _field(x, SHIFT: tl.constexpr, WIDTH: tl.constexpr, FIELD: tl.constexpr, DT: tl.constexpr):
    """Bit field ``[SHIFT, SHIFT + WIDTH)`` of the bytes ``x`` as an operand of the products.

    FIELD 0: the integer field in DT (fp32 path). FIELD 1 (fp16): ``1024 + 2**SHIFT * field`` exactly, from
    one AND-OR on the unshifted byte (``0x6400`` is 1024.0): no shift, no integer-to-float conversion (a
    quarter-rate instruction on Hopper). FIELD 2 (fp16): the masked bits as a subnormal fp16, i.e.
    ``2**(SHIFT - 24) * field`` exactly, from one AND. Callers fold the power of two (and, for FIELD 1,
    the 1024 offset) into the other operand or the result.
    """
    if FIELD == 1:
        return ((x & (((1 << WIDTH) - 1) << SHIFT)).to(tl.int16) | 0x6400).to(tl.float16, bitcast=True)
    elif FIELD == 2:
        return (x & (((1 << WIDTH) - 1) << SHIFT)).to(tl.int16).to(tl.float16, bitcast=True)
    else:
        return ((x >> SHIFT) & ((1 << WIDTH) - 1)).to(DT)


@triton.jit
def _q_tile(q_ptr, rvalid, F: tl.constexpr, BITS: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
            DT: tl.constexpr, FIELD: tl.constexpr):
    """Query channels ``PER * j + F`` [rows, DP // PER] in DT (rows: q_ptr's); FIELD 1/2 pre-scale by
    ``2**-(BITS * F)`` (exact) to undo the unshifted field's ``2**(BITS * F)``."""
    PER: tl.constexpr = 8 // BITS
    j = tl.arange(0, DP // PER)
    qi = tl.load(q_ptr[:, None] + (j * PER + F)[None, :], mask=rvalid[:, None] & (j < D // PER)[None, :], other=0.0)
    if FIELD != 0:
        return (qi.to(tl.float32) * (1.0 / (1 << (BITS * F)))).to(tl.float16)
    else:
        return qi.to(DT)


@triton.jit
def _score_part(s, corr, qa, qv, codes, page, k_scale, F: tl.constexpr, BITS: tl.constexpr, D: tl.constexpr,
                DP: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr, FIELD: tl.constexpr):
    """Add field F's product ``(q * k_scale) . code`` to the scores s [RP, 32]; for FIELD 1, corr [GP]
    collects ``sum(q * k_scale)`` per query head for the 1024 offset (the same fp16 products as the tile's)."""
    PER: tl.constexpr = 8 // BITS
    j = tl.arange(0, DP // PER)
    ks = tl.load(k_scale + page * D + j * PER + F, mask=j < D // PER, other=0.0)
    if FIELD != 0:
        qk = qa * ks[None, :]  # fp16 x fp16: one rounding, like the fp32 product rounded to fp16
        if FIELD == 1:
            corr += tl.sum((qv * ks[None, :]).to(tl.float32), 1)
    else:
        qk = qa * ks.to(DT)[None, :]
    s = tl.dot(qk, tl.trans(_field(codes, BITS * F, BITS, FIELD, DT)), s, input_precision=PREC)
    return s, corr


@triton.jit
def _v_dot(acc, a, aq, hi, lo, K: tl.constexpr, BITS: tl.constexpr, FIELD: tl.constexpr, DT: tl.constexpr,
           PREC: tl.constexpr):
    """acc + a @ code_K for crumb K (channels 4 j + K) of the V planes (INT4: 4 hi + lo), up to a scale.

    FIELD 1/2: acc gathers ``a @ (f_hi) + (a / 4) @ (f_lo)`` (aq = a / 4) with ``f = 4**K * crumb`` (FIELD 1:
    the magic field minus 1024, exact in fp16) or ``2**-24 * 4**K * crumb`` (FIELD 2); the caller scales
    acc by ``(4 if INT4 else 1) * 4**-K`` (and 2**24). The offset is removed before the product: summed
    over thousands of tokens it would swamp the fp32 accumulator.
    """
    if FIELD != 0:
        fh = _field(hi, 2 * K, 2, FIELD, DT)
        if FIELD == 1:
            fh = fh - 1024.0
        acc = tl.dot(a, fh, acc, input_precision=PREC)
        if BITS == 4:
            fl = _field(lo, 2 * K, 2, FIELD, DT)
            if FIELD == 1:
                fl = fl - 1024.0
            acc = tl.dot(aq, fl, acc, input_precision=PREC)
    else:
        code = _field(hi, 2 * K, 2, FIELD, DT)
        if BITS == 4:
            code = code * 4 + _field(lo, 2 * K, 2, FIELD, DT)
        acc = tl.dot(a, code, acc, input_precision=PREC)
    return acc


@triton.jit
def _far_quant(
    q, sq_b, sq_h, b, h, H, MAXP, length, p0, p1, page_table, sink_k, k_pages, k_scale, k_zero, v_hi, v_lo,
    v_scale, v_zero, qk_scale, tau, ws_o, ws_ml, slot,
    G: tl.constexpr, GR: tl.constexpr, GP: tl.constexpr, NGP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
    BITS: tl.constexpr, VPREC: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr,
    FIELD: tl.constexpr,
):
    """History pages [p0, p1) of row b, KV head h, stored as INT4/INT2 codes -> partial (m, l, o)."""
    RP: tl.constexpr = GR * NGP
    NG: tl.constexpr = D // 32
    PER: tl.constexpr = 8 // BITS
    KB: tl.constexpr = DP // PER
    KBD: tl.constexpr = D // PER
    VB: tl.constexpr = DP // 4
    VBD: tl.constexpr = D // 4
    r = tl.arange(0, RP)
    g_r = r // NGP
    gr = r % NGP
    rvalid = g_r < G
    gvalid = gr < NG
    gq = tl.arange(0, GP)
    c = tl.arange(0, DP)
    t = tl.arange(0, 32)
    jk = tl.arange(0, KB)
    jv = tl.arange(0, VB)
    jm = (jv < VBD)[None, :]
    b64 = b.to(tl.int64)
    q_rows = q + b64 * sq_b + (h * G + g_r) * sq_h  # [RP]: the query head of every tile row
    q_heads = q + b64 * sq_b + (h * G + gq) * sq_h  # [GP]
    qg = tl.load(q_heads[:, None] + c[None, :], mask=(gq < G)[:, None] & (c < D)[None, :], other=0.0)
    qg = qg.to(tl.float32)
    expand = g_r[:, None] == gq[None, :]  # [RP, GP]: row r belongs to query head g
    # query tiles per field, hoisted out of the page loop (rows: A operand of the score product)
    qa0 = _q_tile(q_rows, rvalid, 0, BITS, D, DP, DT, FIELD)
    qa1 = _q_tile(q_rows, rvalid, 1, BITS, D, DP, DT, FIELD)
    qv0 = _q_tile(q_heads, gq < G, 0, BITS, D, DP, DT, FIELD)
    qv1 = _q_tile(q_heads, gq < G, 1, BITS, D, DP, DT, FIELD)
    if BITS == 2:
        qa2 = _q_tile(q_rows, rvalid, 2, BITS, D, DP, DT, FIELD)
        qa3 = _q_tile(q_rows, rvalid, 3, BITS, D, DP, DT, FIELD)
        qv2 = _q_tile(q_heads, gq < G, 2, BITS, D, DP, DT, FIELD)
        qv3 = _q_tile(q_heads, gq < G, 3, BITS, D, DP, DT, FIELD)
    m_i = tl.full([RP], float("-inf"), tl.float32)
    l_i = tl.zeros([RP], tl.float32)
    sink_max = tl.full([RP], float("-inf"), tl.float32)
    if VPREC:
        if p1 > p0:
            qx = tl.load(q_rows[:, None] + c[None, :], mask=rvalid[:, None] & (c < D)[None, :], other=0.0)
            ts = tl.arange(0, 32)
            s_sink = _exact_scores(
                qx, sink_k + ((b64 * H + h) * 32 + ts)[:, None] * D + c[None, :], ts < tl.minimum(length, 32),
                c < D, qk_scale, PREC, UPCAST,
            )
            sink_max = tl.max(s_sink, 1)
    acc0 = tl.zeros([RP, VB], tl.float32)
    acc1 = tl.zeros([RP, VB], tl.float32)
    acc2 = tl.zeros([RP, VB], tl.float32)
    acc3 = tl.zeros([RP, VB], tl.float32)
    zacc = tl.zeros([RP], tl.float32)
    for pg in range(p0, p1):
        page = tl.load(page_table + b64 * MAXP + pg).to(tl.int64) * H + h
        # ---- scores: (q * k_scale) . codes + q . k_zero, per field of the packed bytes
        codes = tl.load(k_pages + page * (32 * KBD) + t[:, None] * KBD + jk[None, :], mask=(jk < KBD)[None, :],
                        other=0)
        s = tl.zeros([RP, 32], dtype=tl.float32)
        corr = tl.zeros([GP], dtype=tl.float32)
        s, corr = _score_part(s, corr, qa0, qv0, codes, page, k_scale, 0, BITS, D, DP, DT, PREC, FIELD)
        s, corr = _score_part(s, corr, qa1, qv1, codes, page, k_scale, 1, BITS, D, DP, DT, PREC, FIELD)
        if BITS == 2:
            s, corr = _score_part(s, corr, qa2, qv2, codes, page, k_scale, 2, BITS, D, DP, DT, PREC, FIELD)
            s, corr = _score_part(s, corr, qa3, qv3, codes, page, k_scale, 3, BITS, D, DP, DT, PREC, FIELD)
        kz = tl.load(k_zero + page * D + c, mask=c < D, other=0.0).to(tl.float32)
        bias = tl.sum(qg * kz[None, :], 1) - 1024.0 * corr  # [GP]; corr is 0 unless FIELD 1
        if FIELD == 2:
            s = s * 16777216.0  # 2**24: the subnormal fields' scale
        s = (s + tl.sum(tl.where(expand, bias[None, :], 0.0), 1)[:, None]) * qk_scale
        m_page = tl.max(s, 1)
        if tl.max(m_page - m_i, 0) > 0:  # rescale only when a running maximum grows (rarely, after warm-up)
            m_new = tl.maximum(m_i, m_page)
            alpha = tl.exp2(m_i - m_new)
            l_i *= alpha
            zacc *= alpha
            acc0 *= alpha[:, None]
            acc1 *= alpha[:, None]
            acc2 *= alpha[:, None]
            acc3 *= alpha[:, None]
            m_i = m_new
        p = tl.exp2(s - m_i[:, None])
        l_i += tl.sum(p, 1)
        # ---- values: weights a = p * v_scale per (query head, channel group) row
        goff = page * (32 * NG) + t[None, :] * NG + gr[:, None]  # [RP, 32]
        vs = tl.load(v_scale + goff, mask=gvalid[:, None], other=0.0).to(tl.float32)
        vz = tl.load(v_zero + goff, mask=gvalid[:, None], other=0.0).to(tl.float32)
        voff = page * (32 * VBD) + t[:, None] * VBD + jv[None, :]
        hi = tl.load(v_hi + voff, mask=jm, other=0)
        if BITS == 4:
            if VPREC:
                m_ref = tl.maximum(sink_max, m_page)
                cold_r = (s < (m_ref - tau)[:, None]) | (~rvalid[:, None])
                cold = tl.min(cold_r.to(tl.int32), 0) > 0  # [32]: cold for every query head
                vz += tl.where(cold[None, :], 1.5 * vs, 0.0)
                lo = tl.load(v_lo + voff, mask=(~cold)[:, None] & jm, other=0)
            else:
                lo = tl.load(v_lo + voff, mask=jm, other=0)
        else:
            lo = hi  # INT2 has no lo plane (unused)
        zacc += tl.sum(p * vz, 1)
        a = (p * vs).to(DT)
        aq = a * 0.25
        acc0 = _v_dot(acc0, a, aq, hi, lo, 0, BITS, FIELD, DT, PREC)
        acc1 = _v_dot(acc1, a, aq, hi, lo, 1, BITS, FIELD, DT, PREC)
        acc2 = _v_dot(acc2, a, aq, hi, lo, 2, BITS, FIELD, DT, PREC)
        acc3 = _v_dot(acc3, a, aq, hi, lo, 3, BITS, FIELD, DT, PREC)
    if FIELD != 0:  # undo the fields' scale: 4**K (and 2**24 for subnormal fields); INT4 hi weighs 4
        w: tl.constexpr = (4.0 if BITS == 4 else 1.0) * (16777216.0 if FIELD == 2 else 1.0)
        acc0 = acc0 * w
        acc1 = acc1 * (w * 0.25)
        acc2 = acc2 * (w * 0.0625)
        acc3 = acc3 * (w * 0.015625)
    # partial: channel 4 j + K of query head g comes from row (g, group (4 j + K) // 32 = j // 8)
    first = gr == 0
    tl.store(ws_ml + (slot * GR + g_r) * 2, m_i, mask=first)
    tl.store(ws_ml + (slot * GR + g_r) * 2 + 1, l_i, mask=first)
    mine = (gr[:, None] == (jv // 8)[None, :]) & jm
    obase = ws_o + (slot * GR + g_r)[:, None] * DP + 4 * jv[None, :]
    tl.store(obase, acc0 + zacc[:, None], mask=mine)
    tl.store(obase + 1, acc1 + zacc[:, None], mask=mine)
    tl.store(obase + 2, acc2 + zacc[:, None], mask=mine)
    tl.store(obase + 3, acc3 + zacc[:, None], mask=mine)


@triton.jit
def _store_partial(ws_o, ws_ml, slot, g, gr, m_i, l_i, acc, c, GR: tl.constexpr, DP: tl.constexpr):
    """Store rows with ``gr == 0`` of (m, l, acc [RP, DP]) as the partial of their query head ``g``."""
    first = gr == 0
    tl.store(ws_ml + (slot * GR + g) * 2, m_i, mask=first)
    tl.store(ws_ml + (slot * GR + g) * 2 + 1, l_i, mask=first)
    tl.store(ws_o + (slot * GR + g)[:, None] * DP + c[None, :], acc, mask=first[:, None])


@triton.jit
def _clock(SM: tl.constexpr):
    """TIMELINE (CUDA only): ``%globaltimer`` (ns, one clock for all SMs) or, with SM, ``%smid``; int64."""
    if SM:
        return tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=tl.int32, is_pure=False,
                                         pack=1).to(tl.int64)
    else:
        return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False,
                                         pack=1)


@triton.jit
def _cell_attn_kernel(
    q, sq_b, sq_h, sink_k, sink_v, win_k, win_v, lengths, page_table,
    k_pages, k_scale, k_zero, v_hi, v_lo, v_scale, v_zero,
    ws_o, ws_ml, cnt, out, so_b, so_h,
    H, MAXP, NNEAR, NSPLIT, CHUNKC, qk_scale, tau,
    k_new, v_new, skn_b, skn_h, svn_b, svn_h, rcnt, CAP, own_k, own_hi, own_lo, tline,
    G: tl.constexpr, GR: tl.constexpr, GP: tl.constexpr, NGP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
    BITS: tl.constexpr, VPREC: tl.constexpr, BN: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr,
    UPCAST: tl.constexpr, FIELD: tl.constexpr, NPP: tl.constexpr, FAR: tl.constexpr, PPI: tl.constexpr,
    TS: tl.constexpr, PREFETCH: tl.constexpr, OPT: tl.constexpr, APPEND: tl.constexpr, OWN_BITS: tl.constexpr,
    NSL: tl.constexpr, FAR_FIRST: tl.constexpr, TIMELINE: tl.constexpr,
):
    """Program (i, b*H + h): near slots (i < NNEAR) or history split i - NNEAR of row b, KV head h.

    FAR_FIRST (not with APPEND 1): the programs are renumbered in launch order (``i`` fastest) so that every
    (b, h)'s history programs come first and all near programs after them: the GPU hands out programs in that
    order, so the short near programs fill the SMs that the long history programs leave idle at the end of the
    launch. Same programs, same partials, same merge: the output is bit-identical.

    APPEND 1 (``append_attention_``, docs/design-decisions.md §10): the cell's new token (k_new, v_new [B, H, 1, D],
    strides skn_*, svn_*) is appended in the same launch. Programs NNEAR + NSPLIT + 2 s and + 2 s + 1
    (s < NSL) write its K and V into sink or ring (s = 0) and encode slices s, s + NSL, ... of the page leaving the
    window into the cell's own pool (own_k / k_scale / k_zero / own_hi / own_lo / v_scale / v_zero at OWN_BITS; 0:
    a ``share`` cell, no pool). Every program reads with the appended length; the near program whose slot takes
    the token reads it from k_new / v_new, not from the ring it is being written to. The last of the row's H
    merges and 2 NSL H append programs (counter ``rcnt[b]``) stores ``lengths[b]``.
    APPEND 2 (``token_attention_``, docs/design-decisions.md §12): the same reads with the appended length and the
    same substitution, and no more programs: the near program whose slots hold the token writes its K and V there
    after reading them from k_new / v_new (session 12; session 11 had two more programs per (b, h) for it).
    ``lengths`` and the page leaving the window are left to ``advance_``.
    TIMELINE (diagnostics, CUDA only; ``cell_attention(timeline=...)``): each program writes ``(start ns, end ns,
    SM, program, row-head, history pages)`` at its launch-order index of ``tline`` (int64 [programs, 6])."""
    RP: tl.constexpr = GR * NGP
    pid = tl.program_id(0)
    bh = tl.program_id(1)
    if TIMELINE:
        t_start = _clock(False)
        t_slot = (bh * tl.num_programs(0) + pid).to(tl.int64) * 6  # launch order, before the renumbering
    if FAR_FIRST:  # the launcher sets it only with NSPLIT > 0
        lin = bh * (NNEAR + NSPLIT) + pid  # launch order
        nfar = NSPLIT * tl.num_programs(1)
        if lin < nfar:
            bh = lin // NSPLIT
            pid = NNEAR + lin % NSPLIT
        else:
            bh = (lin - nfar) // NNEAR
            pid = (lin - nfar) % NNEAR
    b = bh // H
    h = bh % H
    nprog = NNEAR + NSPLIT
    slot = bh.to(tl.int64) * nprog + pid  # this program's partial
    length = tl.load(lengths + b).to(tl.int32)
    pos = length
    is_app = False
    if APPEND:
        length = pos + (pos < CAP).to(tl.int32)  # the appended length (unchanged at capacity)
        is_app = pid >= nprog
    npg = tl.maximum(length - 288, 0) // 32  # history pages, n_pages(length)
    # pages per history program: an even split into NSPLIT chunks, but at least ceil(sqrt(CHUNKC * B*H * npg))
    # (0: no minimum) so that short rows take fewer programs (docs/kernel-notes.md, session 17). The programs past
    # the row's last chunk exit at once: no partial, no counter add; the merge waits for the nlive that have one
    chunk = tl.maximum((npg + NSPLIT - 1) // tl.maximum(NSPLIT, 1), 1)
    if CHUNKC > 0:
        want = (CHUNKC * tl.num_programs(1)) * npg.to(tl.float32)
        least = tl.sqrt_rn(want).to(tl.int32)  # its ceiling in integers (tl.ceil compiles to an ftz cvt)
        least += (least.to(tl.float32) * least.to(tl.float32) < want).to(tl.int32)
        chunk = tl.maximum(chunk, tl.minimum(least, npg))
    nlive = NNEAR + tl.minimum((npg + chunk - 1) // chunk, NSPLIT)
    r = tl.arange(0, RP)
    g_r = r // NGP
    gr = r % NGP
    rvalid = g_r < G
    c = tl.arange(0, DP)
    cm = c < D
    q_ptr = q + b.to(tl.int64) * sq_b + (h * G + g_r) * sq_h  # [RP] row starts
    bh64 = bh.to(tl.int64)
    m_i = tl.full([RP], float("-inf"), tl.float32)
    l_i = tl.zeros([RP], tl.float32)
    if pid < NNEAR:
        # ---- exact sink + window slots [pid * BN, pid * BN + BN) of [sink 32 | ring 288]
        qx = tl.load(q_ptr[:, None] + c[None, :], mask=rvalid[:, None] & cm[None, :], other=0.0).to(tl.float32)
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
        kptr = tl.where(in_sink, sink_k + s_off, win_k + w_off)
        vptr = tl.where(in_sink, sink_v + s_off, win_v + w_off)
        if APPEND:  # the new token's slot is read from the op's input (its ring / sink write may not be done)
            fresh = ((v == tl.where(pos < 32, pos, 32 + (pos - 32) % 288)) & (pos < CAP))[:, None]
            kptr = tl.where(fresh, k_new + b.to(tl.int64) * skn_b + h * skn_h + c[None, :], kptr)
            vptr = tl.where(fresh, v_new + b.to(tl.int64) * svn_b + h * svn_h + c[None, :], vptr)
        s = _exact_scores(qx, kptr, valid, cm, qk_scale, PREC, UPCAST)
        m_i, alpha, p, l_i = _online(s, m_i, l_i)
        acc = _exact_values(p, vptr, valid, cm, PREC, UPCAST)
        _store_partial(ws_o, ws_ml, slot, g_r, gr, m_i, l_i, acc, c, GR, DP)
        if APPEND == 2:  # the near program whose slots hold the token writes it (after its own reads of them)
            tslot = tl.where(pos < 32, pos, 32 + (pos - 32) % 288)
            if pid == tslot // BN:
                for part in tl.static_range(2):  # K, then V; BITS 0: the token only (at capacity: nothing)
                    _append_token(k_new, v_new, skn_b, skn_h, 1, svn_b, svn_h, 1, b, h, part, pos,
                                  sink_k, sink_v, win_k, win_v, page_table, H, MAXP, CAP,
                                  own_k, k_scale, k_zero, own_hi, own_lo, v_scale, v_zero, 0, D, DP)
    elif is_app:  # APPEND: K (even) or V (odd) of the new token, and a share of the page leaving the window
        if APPEND == 1:
            _append_token(k_new, v_new, skn_b, skn_h, 1, svn_b, svn_h, 1, b, h, (pid - nprog) % 2, pos,
                          sink_k, sink_v, win_k, win_v, page_table, H, MAXP, CAP,
                          own_k, k_scale, k_zero, own_hi, own_lo, v_scale, v_zero, OWN_BITS, D, DP, True,
                          (pid - nprog) // 2, NSL)
            tl.debug_barrier()  # every thread has read lengths[b]
            _row_done(rcnt, lengths, b, length, H, NSL)
    elif pid < nlive:
        p0 = (pid - NNEAR) * chunk
        p1 = tl.minimum(p0 + chunk, npg)
        t = tl.arange(0, 32)
        if BITS == 16:
            qx = tl.load(q_ptr[:, None] + c[None, :], mask=rvalid[:, None] & cm[None, :], other=0.0).to(tl.float32)
            acc = tl.zeros([RP, DP], tl.float32)
            for pg in range(p0, p1):
                page = tl.load(page_table + b.to(tl.int64) * MAXP + pg).to(tl.int64) * H + h
                off = (page * 32 + t)[:, None] * D + c[None, :]
                valid = t < 32
                s = _exact_scores(qx, k_pages + off, valid, cm, qk_scale, PREC, UPCAST)
                m_i, alpha, p, l_i = _online(s, m_i, l_i)
                acc = acc * alpha[:, None] + _exact_values(p, v_hi + off, valid, cm, PREC, UPCAST)
            _store_partial(ws_o, ws_ml, slot, g_r, gr, m_i, l_i, acc, c, GR, DP)
        elif FAR == 1:  # CUDA-core reader (loopkv/ops/triton_far.py); codes as int32 words
            far_cc(
                q, sq_b, sq_h, b, h, H, MAXP, length, p0, p1, page_table, sink_k, k_pages, k_scale, k_zero,
                v_hi, v_lo, v_scale, v_zero, qk_scale, tau, ws_o, ws_ml, slot, G, GR, GP, D, DP, BITS, VPREC, PPI,
                TS, PREFETCH, OPT,
            )
        elif BITS != 0:
            _far_quant(
                q, sq_b, sq_h, b, h, H, MAXP, length, p0, p1, page_table, sink_k, k_pages, k_scale, k_zero,
                v_hi, v_lo, v_scale, v_zero, qk_scale, tau, ws_o, ws_ml, slot,
                G, GR, GP, NGP, D, DP, BITS, VPREC, DT, PREC, UPCAST, FIELD,
            )
    # ---- the last program of (b, h) merges the partials by log-sum-exp
    if (not is_app) and pid < nlive:
        _merge(ws_o, ws_ml, cnt, out, so_b, so_h, rcnt, lengths, b, h, bh, bh64, nprog, nlive, length, H, c, cm, G,
               GR, DP, NPP, APPEND, NSL)
    if TIMELINE:
        far = (pid >= NNEAR) & (pid < nlive)
        p0_t = (pid - NNEAR) * chunk
        pages = tl.where(far, tl.maximum(tl.minimum(p0_t + chunk, npg) - p0_t, 0), 0)
        t_end = _clock(False)
        tl.store(tline + t_slot, t_start)
        tl.store(tline + t_slot + 1, t_end)
        tl.store(tline + t_slot + 2, _clock(True))
        tl.store(tline + t_slot + 3, pid.to(tl.int64))
        tl.store(tline + t_slot + 4, bh.to(tl.int64))
        tl.store(tline + t_slot + 5, pages.to(tl.int64))


@triton.jit
def _row_done(rcnt, lengths, b, length, H, NSL: tl.constexpr):
    """APPEND: count one of the row's (1 + 2 NSL) H finishing programs (H merges, 2 NSL H appends); the last
    stores the appended length, after every program of the row has read the old one, and resets the counter."""
    rdone = tl.atomic_add(rcnt + b, 1, sem="acq_rel")
    if rdone == (1 + 2 * NSL) * H - 1:
        tl.store(lengths + b, length.to(lengths.dtype.element_ty))
        tl.atomic_xchg(rcnt + b, 0)


@triton.jit
def _merge(ws_o, ws_ml, cnt, out, so_b, so_h, rcnt, lengths, b, h, bh, bh64, nprog, nlive, length, H, c, cm,
           G: tl.constexpr, GR: tl.constexpr, DP: tl.constexpr, NPP: tl.constexpr, APPEND: tl.constexpr,
           NSL: tl.constexpr):
    """The last of the ``nlive`` programs of (b, h) that have a partial (counter ``cnt[bh]``, reset by it) merges
    their partials (slots ``< nlive`` of the row-head's ``nprog``) by log-sum-exp."""
    tl.debug_barrier()
    done = tl.atomic_add(cnt + bh, 1, sem="acq_rel")
    if done == nlive - 1:
        k = tl.arange(0, NPP)
        kvalid = k < nlive
        for g in range(G):
            base = (bh64 * nprog + k) * GR + g  # [NPP] partial slots of query head g
            m_k = tl.load(ws_ml + base * 2, mask=kvalid, other=float("-inf"), cache_modifier=".cg")
            l_k = tl.load(ws_ml + base * 2 + 1, mask=kvalid, other=0.0, cache_modifier=".cg")
            m_all = tl.max(m_k, 0)
            m_safe = tl.where(m_all == float("-inf"), 0.0, m_all)
            l_all = tl.sum(l_k * tl.exp2(m_k - m_safe), 0)
            o = tl.zeros([DP], tl.float32)
            for c0 in tl.static_range(0, NPP, 16):  # 16 partials at a time, loads independent
                kk = c0 + tl.arange(0, 16)
                slots = (bh64 * nprog + kk) * GR + g
                wk = tl.exp2(tl.load(ws_ml + slots * 2, mask=kk < nlive, other=float("-inf"),
                                     cache_modifier=".cg") - m_safe)
                ok = tl.load(ws_o + slots[:, None] * DP + c[None, :], mask=(kk < nlive)[:, None], other=0.0,
                             cache_modifier=".cg")
                o += tl.sum(ok * wk[:, None], 0)
            res = tl.where(l_all > 0, o / tl.where(l_all > 0, l_all, 1.0), 0.0)
            optr = out + b.to(tl.int64) * so_b + (h * G + g) * so_h + c
            tl.store(optr, res.to(out.dtype.element_ty), mask=cm)
        tl.atomic_xchg(cnt + bh, 0)
        if APPEND == 1:
            _row_done(rcnt, lengths, b, length, H, NSL)


FIELD_MODE = {"offset": 1, "subnormal": 2}  # how fp16 code operands are made (see _field)
DEFAULT_FIELD_MODE = "subnormal"  # 7-12% faster than "offset" on the H200, same error against the reference


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def cell_attention(
    q: Tensor, sink_k: Tensor, sink_v: Tensor, win_k: Tensor, win_v: Tensor, lengths: Tensor,
    page_table: Tensor, k_pages: Tensor, k_scale: Tensor, k_zero: Tensor, v_hi: Tensor, v_lo: Tensor,
    v_scale: Tensor, v_zero: Tensor, bits: int, tau: float, scale: float, *, splits: int | None = None,
    num_warps: int | None = None, num_stages: int | None = None, field_mode: str | None = None,
    far_impl: str | None = None, pages_per_iter: int | None = None, sub_tokens: int | None = None,
    prefetch: bool | None = None, near_block: int | None = None, cc_opts: tuple | None = None,
    maxnreg: int | None = None, append: tuple | None = None, token: tuple | None = None,
    far_first: bool | None = None, chunk_coef: float | None = None, timeline: Tensor | None = None,
) -> Tensor:
    """Triton ``cell_attention``: q [B, Hq, D] -> [B, Hq, D] (shapes: docs/storage-layout.md).

    Storage tensors are the cache's contiguous buffers (others fall back to the reference).
    ``splits`` (history programs per row and KV head), ``num_warps``, ``num_stages``, ``far_impl``
    (``"cc"``: CUDA-core history reader, ``"dot"``: tensor-core reader; default by ``choose_far_impl``) and
    ``pages_per_iter`` (1 or 2), ``sub_tokens`` (tokens per sub-tile: 4..32, a power of two) and
    ``prefetch`` (loads one iteration ahead) (CUDA-core reader only) and ``near_block`` (sink + window
    slots per near program: 16, 32 or 64) override the fixed config. ``cc_opts``: variants of the
    CUDA-core reader, names of ``triton_far.CC_OPTS`` (None: ``triton_config.CC_DEFAULT_OPTS_BY_BITS``; ``()``:
    session 2's reader).
    ``maxnreg``: register cap per thread handed to ``ptxas`` (more programs per SM; CUDA only).
    ``chunk_coef``: each row's history pages go to as few of its ``splits`` programs as take at least
    ``ceil(sqrt(chunk_coef * B * H * pages))`` pages each (the rest exit at once); None: ``triton_config.CHUNK_COEF``
    for the CUDA-core reader unless ``splits`` is given, 0 otherwise (an even split into ``splits`` chunks).
    ``far_first``: launch every history program before the near programs (the kernel's ``FAR_FIRST``; None:
    ``triton_config.FAR_FIRST``); same output bit for bit. Not with ``append`` (whose extra programs keep the
    launch order).
    ``append``: ``(k_new, v_new, own_bits)``, used by ``append_attention`` (which checks them): the token is
    appended in the same launch. ``token``: ``(k_new, v_new)``, used by ``token_attention`` (which checks them): the
    token is read from them and written into sink or ring; ``lengths`` is not written.
    ``timeline`` (diagnostics, CUDA only: ``benchmarks/probe_timeline.py``): a zeroed contiguous int64 tensor of
    at least (programs x 6) elements (programs: near + history programs per row and KV head, times B * H; a
    buffer too small is refused with the count); each program writes ``(start ns, end ns, SM, program, row-head,
    history pages)`` at its launch-order index.
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
        if append is not None or token is not None:  # their callers run the references in that case
            raise ValueError("cell_attention(append=... / token=...) needs contiguous storage and a non-float64 "
                             "query")
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
    exact = q.dtype == torch.float32
    impl = choose_far_impl(bits, G, far_impl, cc_default=CC_DEFAULT, exact=exact)
    cfg = _config(bits, impl, B * H, G, exact)
    bn = near_block or cfg["near_block"]
    if bn not in (16, 32, 64):
        raise ValueError(f"near_block must be 16, 32 or 64, got {near_block}")
    nnear = -(-(SINK + RING) // bn)
    if bits == 0 or maxp == 0:
        nsplit = 0
    else:
        nsplit = choose_splits(B * H, maxp, q.device) if splits is None else int(splits)
    nprog = nnear + nsplit
    if chunk_coef is None:
        chunk_coef = triton_config.CHUNK_COEF if impl == "cc" and splits is None else 0.0
    chunk_coef = triton_config.check_chunk_coef(chunk_coef, "cell_attention")
    ws_o = torch.empty(B * H * nprog * GR * DP, dtype=torch.float32, device=q.device)
    ws_ml = torch.empty(B * H * nprog * GR * 2, dtype=torch.float32, device=q.device)
    cnt = counters(q.device, B * H, purpose="attention")
    vprec = bits == 4 and math.isfinite(tau)
    ppi = pages_per_iter or cfg["pages_per_iter"]
    if ppi not in (1, 2):
        raise ValueError(f"pages_per_iter must be 1 or 2, got {pages_per_iter}")
    nw = num_warps or cfg["num_warps"]
    ts = sub_tokens or cfg["sub_tokens"]
    if cc_opts and impl != "cc":
        raise ValueError(f"cc_opts {tuple(cc_opts)} configure the CUDA-core reader, but this call reads its history "
                         f"with {impl!r} (fp32 inputs, more than {CC_MAX_GROUP} query heads per KV head, or BF16 "
                         "pages): pass far_impl='cc' for code pages, or drop cc_opts")
    opt = cc_opt_bits(cfg["cc_opts"] if cc_opts is None else cc_opts) if impl == "cc" else 0
    if impl == "cc" and ts not in (4, 8, 16, 32):
        raise ValueError(f"sub_tokens must be 4, 8, 16 or 32, got {sub_tokens}")
    reg_cap = cfg.get("maxnreg") if maxnreg is None else maxnreg
    launch = {"maxnreg": int(reg_cap)} if reg_cap and q.device.type == "cuda" else {}
    own = (k_pages, v_hi, v_lo)  # the pools as stored (the append encodes into them)
    if append is not None and token is not None:
        raise ValueError("cell_attention takes append= (append_attention_) or token= (token_attention_), not both")
    mode, app_progs = 0, 0
    if append is None and token is None:  # placeholders: APPEND=0 compiles none of their uses
        k_new, v_new, own_bits, rcnt, cap = q, q, 0, cnt, 0
    elif append is not None:
        k_new, v_new, own_bits = append
        own_bits = own_bits if maxp else 0  # no pool: capacity(0) is below QUANTIZE_LENGTH
        rcnt, cap = counters(q.device, B, purpose="append_attention"), capacity(maxp)
        mode, app_progs = 1, 2 * APPEND_SLICES
    else:
        (k_new, v_new), own_bits, rcnt, cap = token, 0, cnt, capacity(maxp)
        mode, app_progs = 2, 0
    if impl == "cc":  # the CUDA-core reader reads codes as int32 words (rows are multiples of 4 bytes)
        k_pages, v_hi, v_lo = (t.view(torch.int32) if t.numel() else t.new_empty(0, dtype=torch.int32)
                               for t in (k_pages, v_hi, v_lo))
    pf = bool(cfg["prefetch"] if prefetch is None else prefetch) and impl == "cc"
    if cc_opts is None and (ppi != 1 or pf):  # the default's "pt" needs one page per iteration and no prefetch:
        opt &= ~CC_OPTS["pt"]  # an explicit pages_per_iter=2 / prefetch=True reads without it (same values)
    if opt & (CC_OPTS["pt"] | CC_OPTS["sc"]) and (ppi != 1 or pf):
        raise ValueError("cc_opts 'pt' and 'sc' carry the next page's index and scales across iterations of one "
                         f"page: they need pages_per_iter=1 and prefetch=False (got {ppi}, {pf})")
    if cc_opts is None and (exact or torch.version.hip):  # the default's "k16" (fp16 pairs) is for 16-bit inputs,
        opt &= ~CC_OPTS["k16"]  # whose own rounding is larger (triton_config), on CUDA (inline PTX); explicit: kept
    if opt & CC_OPTS["k16"] and not opt & CC_OPTS["qk"]:
        raise ValueError(f"cc_opts 'k16' (K's field work in fp16 pairs) builds on the 'qk' layout: got cc_opts "
                         f"{tuple(cc_opts or ())}; add 'qk'")
    if opt & CC_OPTS["k16"] and q.device.type == "cuda" and not torch.version.hip:
        opt |= OPT_ASM16  # the pairs' fp16x2 arithmetic in inline PTX (the interpreter: the same values in Triton)
    if q.device.type != "cuda" or torch.version.hip:  # "l2" is a prefetch hint in inline PTX, which neither the
        opt &= ~CC_OPTS["l2"]  # interpreter nor ROCm can run; without it the reader computes the same values
    if opt & CC_OPTS["i32"]:
        pools = {"k_pages": k_pages, "k_scale": k_scale, "k_zero": k_zero, "v_hi": v_hi, "v_lo": v_lo,
                 "v_scale": v_scale, "v_zero": v_zero}
        if cc_opts is not None:  # asked for: refuse a pool it cannot address
            check_int32_offsets(**pools)
        elif int32_offset_overflow(**pools):  # the default (INT2) on a pool this large: 64-bit offsets
            opt &= ~CC_OPTS["i32"]
    ff = bool(triton_config.FAR_FIRST if far_first is None else far_first)
    if ff and mode == 1:
        if far_first:
            raise ValueError("far_first=True reorders the programs of cell_attention and token_attention; "
                             "append_attention's launch keeps its order: leave far_first unset there")
        ff = False
    ff = ff and nsplit > 0  # nothing to reorder without history programs
    if timeline is not None:
        rows = (nprog + app_progs) * B * H
        if q.device.type != "cuda" or torch.version.hip:
            raise ValueError("cell_attention(timeline=...) reads the GPU's %globaltimer: CUDA only")
        if timeline.dtype != torch.int64 or not timeline.is_contiguous() or timeline.numel() < 6 * rows:
            raise ValueError(f"timeline must be a contiguous int64 tensor of at least {rows} x 6 elements (this "
                             f"launch's programs), got {timeline.dtype} with {timeline.numel()} elements")
    _cell_attn_kernel[(nprog + app_progs, B * H)](
        q, q.stride(0), q.stride(1), sink_k, sink_v, win_k, win_v, lengths, page_table,
        k_pages, k_scale, k_zero, v_hi, v_lo, v_scale, v_zero,
        ws_o, ws_ml, cnt, out, out.stride(0), out.stride(1),
        H, maxp, nnear, nsplit, chunk_coef, scale * LOG2E, float(tau) if vprec else 0.0,
        k_new, v_new, k_new.stride(0), k_new.stride(1), v_new.stride(0), v_new.stride(1), rcnt, cap, *own,
        cnt if timeline is None else timeline,
        G=G, GR=GR, GP=_next_pow2(G), NGP=NGP, D=D, DP=DP, BITS=bits if nsplit else 0, VPREC=vprec, BN=bn,
        DT=tl.float32 if exact else tl.float16, PREC="ieee" if exact else "tf32",
        UPCAST=q.device.type != "cuda" and q.dtype == torch.bfloat16,
        FIELD=0 if exact else FIELD_MODE[field_mode or DEFAULT_FIELD_MODE],
        NPP=max(16, _next_pow2(nprog)), FAR=1 if impl == "cc" and nsplit else 0, PPI=ppi, TS=ts if impl == "cc" else 0,
        PREFETCH=pf, OPT=opt,
        APPEND=mode, OWN_BITS=own_bits, NSL=APPEND_SLICES, FAR_FIRST=ff, TIMELINE=timeline is not None,
        num_warps=nw, num_stages=num_stages or cfg["num_stages"], **launch, **KERNEL_OPTIONS,
    )
    return out


def _token_in_launch(q: Tensor, k_new: Tensor, v_new: Tensor, *storage: Tensor) -> bool:
    """Whether the reader's launch can take the decode token (``append_attention`` / ``token_attention``): tokens in
    the cache's dtype with unit channel stride, contiguous storage, and not a float64 re-computation (which stays
    on the reference)."""
    return (k_new.dtype == v_new.dtype == storage[0].dtype and k_new.stride(3) == 1 and v_new.stride(3) == 1
            and q.dtype != torch.float64 and all(t.is_contiguous() for t in storage))


def append_attention(
    q: Tensor, k_new: Tensor, v_new: Tensor, sink_k: Tensor, sink_v: Tensor, win_k: Tensor, win_v: Tensor,
    lengths: Tensor, page_table: Tensor, k_pages: Tensor, k_scale: Tensor, k_zero: Tensor, v_hi: Tensor,
    v_lo: Tensor, v_scale: Tensor, v_zero: Tensor, bits: int, own_bits: int, tau: float, scale: float, **kwargs,
) -> Tensor:
    """Triton ``append_attention_``: ``append_`` of (k_new, v_new) [B, H, 1, D] at ``own_bits`` (0: a ``share``
    cell), then ``cell_attention`` of q at ``bits``, in one launch (docs/design-decisions.md §10). ``kwargs``:
    ``cell_attention``'s launch overrides. Tokens of another dtype than the cache's, strided tokens and what
    ``cell_attention`` leaves to the reference run as the two ops in turn (same result)."""
    B, H, D = q.shape[0], sink_k.shape[1], sink_k.shape[3]
    if k_new.shape != (B, H, 1, D) or v_new.shape != k_new.shape:
        raise ValueError(f"append_attention_ takes one token per row: k_new, v_new [B, H, 1, D] = [{B}, {H}, 1, {D}], "
                         f"got {tuple(k_new.shape)}, {tuple(v_new.shape)}")
    if own_bits not in (0, bits):
        raise ValueError(f"own_bits must be 0 (a share cell: no pool to write) or the read bits {bits}, got {own_bits}")
    fused = _token_in_launch(q, k_new, v_new, sink_k, sink_v, win_k, win_v, lengths, page_table, k_pages, k_scale,
                             k_zero, v_hi, v_lo, v_scale, v_zero)
    if not fused:
        from loopkv.ops import triton_quant

        triton_quant.append(k_new, v_new, sink_k, sink_v, win_k, win_v, lengths, page_table, k_pages, k_scale,
                            k_zero, v_hi, v_lo, v_scale, v_zero, own_bits)
        return cell_attention(q, sink_k, sink_v, win_k, win_v, lengths, page_table, k_pages, k_scale, k_zero,
                              v_hi, v_lo, v_scale, v_zero, bits, tau, scale, **kwargs)
    if B == 0:
        return torch.empty_like(q, memory_format=torch.contiguous_format)
    return cell_attention(q, sink_k, sink_v, win_k, win_v, lengths, page_table, k_pages, k_scale, k_zero,
                          v_hi, v_lo, v_scale, v_zero, bits, tau, scale, append=(k_new, v_new, own_bits), **kwargs)


def token_attention(
    q: Tensor, k_new: Tensor, v_new: Tensor, sink_k: Tensor, sink_v: Tensor, win_k: Tensor, win_v: Tensor,
    lengths: Tensor, page_table: Tensor, k_pages: Tensor, k_scale: Tensor, k_zero: Tensor, v_hi: Tensor,
    v_lo: Tensor, v_scale: Tensor, v_zero: Tensor, bits: int, tau: float, scale: float, **kwargs,
) -> Tensor:
    """Triton ``token_attention_`` (``loopkv/ops/step_ops.py``): write the token (k_new, v_new [B, H, 1, D]) into
    sink or ring and read the cell with it, in one launch; ``lengths`` is read only. ``kwargs``: ``cell_attention``'s
    launch overrides. Tokens of another dtype than the cache's, strided tokens and what ``cell_attention`` leaves
    to the reference run the reference (same result)."""
    from loopkv.ops.step_ops import token_attention_reference

    B, H, D = q.shape[0], sink_k.shape[1], sink_k.shape[3]
    if k_new.shape != (B, H, 1, D) or v_new.shape != k_new.shape:
        raise ValueError(f"token_attention_ takes one token per row: k_new, v_new [B, H, 1, D] = [{B}, {H}, 1, {D}], "
                         f"got {tuple(k_new.shape)}, {tuple(v_new.shape)}")
    fused = _token_in_launch(q, k_new, v_new, sink_k, sink_v, win_k, win_v, lengths, page_table, k_pages, k_scale,
                             k_zero, v_hi, v_lo, v_scale, v_zero)
    if not fused:
        return token_attention_reference(q, k_new, v_new, sink_k, sink_v, win_k, win_v, lengths, page_table, k_pages,
                                         k_scale, k_zero, v_hi, v_lo, v_scale, v_zero, bits, tau, scale)
    if B == 0:
        return torch.empty_like(q, memory_format=torch.contiguous_format)
    return cell_attention(q, sink_k, sink_v, win_k, win_v, lengths, page_table, k_pages, k_scale, k_zero,
                          v_hi, v_lo, v_scale, v_zero, bits, tau, scale, token=(k_new, v_new), **kwargs)
