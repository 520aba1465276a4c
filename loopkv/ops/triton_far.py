"""CUDA-core history reader of the fused cell attention, for small query groups (``G = Hq // H <= 2``).

The tensor-core reader (``_far_quant`` in ``loopkv/ops/triton_attention.py``) pads one query head per
KV head to 16-row MMA tiles; at one query per KV head it ran at 255 registers with spills and 8 warps
per SM, latency-bound (docs/kernel-notes.md). This path does both products with fp32 FMAs on CUDA
cores, with every tensor indexed ``(query head g, token t, word w, field j)``:

* Codes are read as int32 *words*, in their packed order: field ``j`` of word ``w`` of a token is
  channel ``(32 // bits) * w + j`` (K nibbles or crumbs), so the query is laid out to match and the
  output comes out in channel order (``16 w + j`` for V). No unpacking shuffle.
* A field becomes an fp32 operand with one AND: the masked bits ``field << s`` (``s < 23``) read as
  an fp32 **subnormal** are exactly ``2**(s - 149) * field``. The ``2**(149 - s)`` is folded into the
  other factor (``2**96`` there, ``2**53`` on the result), so a field costs one AND and one FMA. The
  upper 16 bits of a word are shifted down once per word. This needs denormals kept (no ftz; checked
  in the compiled PTX, docs/kernel-notes.md).
* Scores: ``s[g, t] = sum_{w,j} (q * k_scale * 2**(96 - s_j)) * field + q . k_zero`` (K's per-channel
  scale and zero fold per page, Appendix E).
* Values: INT4's two crumb planes are merged into nibbles first, word-wide (``4 * hi + lo`` with two
  logic ops per 16 channels), then ``acc[g, t, w, j] += p * v_scale * 2**96 * field``: per token slot
  accumulators (no reduction in the page loop), summed over tokens once at the end; the zero term
  ``sum_t p * v_zero`` likewise.
* Softmax: one running maximum per query head for the program (lazy rescale: only when it grows),
  per token slot sums. ``PPI`` pages per iteration share one maximum update.
* V precision: ``m_ref = max(sink max, page max)`` per query head (the program computes the sink
  maximum itself: deterministic, independent of the split); a token cold for every query head of the
  group skips its lo-plane load (masked) and gets ``1.5 * v_scale`` in the zero term.

Partials ``(m, l, o)`` are written in the dot path's format (log2 units) for the launcher's merge.
"""

from __future__ import annotations

import triton
import triton.language as tl

UNIT_IN = 96  # fields x 2**(96 - s) ...
UNIT_OUT = 53  # ... give products in units of 2**(96 - 149) = 2**-53


@triton.jit
def _sub(x, SHIFT, WIDTH: tl.constexpr):
    """Bits ``[SHIFT, SHIFT + WIDTH)`` of int32 ``x`` as fp32 ``2**(SHIFT - 149) * field`` (a subnormal)."""
    return (x & (((1 << WIDTH) - 1) << SHIFT)).to(tl.float32, bitcast=True)


@triton.jit
def _cc_scores(qf, q4, k_words, k_scale, k_zero, page, ok, qk_scale,
               BITS: tl.constexpr, D: tl.constexpr, DP: tl.constexpr):
    """Scores [GP, 32] (log2 units) of one page's 32 tokens; qf [GP, 1, KWP, PERW] is the query in field
    order times ``2**(96 - s_j)``, q4 the plain query in the same order. ``ok`` False -> all -inf."""
    PERW: tl.constexpr = 32 // BITS
    HALF: tl.constexpr = PERW // 2
    KW: tl.constexpr = D // PERW
    KWP: tl.constexpr = DP // PERW
    t = tl.arange(0, 32)[None, :, None, None]
    w = tl.arange(0, KWP)[None, None, :, None]
    j = tl.arange(0, PERW)[None, None, None, :]
    wm = w < tl.where(ok, KW, 0)  # (not `& ok`: the interpreter turns a scalar & into int32)
    words = tl.load(k_words + page * (32 * KW) + t * KW + w, mask=wm, other=0)  # [1, 32, KWP, 1]
    ks = tl.load(k_scale + page * D + w * PERW + j, mask=wm, other=0.0).to(tl.float32)  # [1, 1, KWP, PERW]
    kz = tl.load(k_zero + page * D + w * PERW + j, mask=wm, other=0.0).to(tl.float32)
    src = tl.where(j >= HALF, words >> 16, words)
    f = _sub(src, BITS * (j % HALF), BITS)  # [1, 32, KWP, PERW]
    dot = tl.sum(tl.sum((qf * ks) * f, 3), 2)  # [GP, 32]
    bias = tl.sum(tl.sum(q4 * kz, 3), 2)  # [GP, 1]
    s = (dot * 9007199254740992.0 + bias) * qk_scale  # 2**53
    return tl.where(ok, s, float("-inf"))


@triton.jit
def _cc_values(acc, zacc, p, v_hi, v_lo, v_scale, v_zero, page, ok, cold,
               BITS: tl.constexpr, VPREC: tl.constexpr, D: tl.constexpr, DP: tl.constexpr):
    """acc [GP, 32, VWP, 16] += p * v_scale * 2**96 * field (channel 16 w + j), zacc [GP, 32, VWP, 1] +=
    p * v_zero (+ 1.5 * v_scale for cold tokens); p [GP, 32], cold [32] (VPREC only)."""
    NG: tl.constexpr = D // 32
    VW: tl.constexpr = D // 16
    VWP: tl.constexpr = DP // 16
    t = tl.arange(0, 32)[None, :, None, None]
    w = tl.arange(0, VWP)[None, None, :, None]
    j = tl.arange(0, 16)[None, None, None, :]
    wm = w < tl.where(ok, VW, 0)
    goff = page * (32 * NG) + t * NG + w // 2  # [1, 32, VWP, 1]: the 32-channel group of word w
    vs = tl.load(v_scale + goff, mask=wm, other=0.0).to(tl.float32)
    vz = tl.load(v_zero + goff, mask=wm, other=0.0).to(tl.float32)
    voff = page * (32 * VW) + t * VW + w
    hi = tl.load(v_hi + voff, mask=wm, other=0)  # [1, 32, VWP, 1] int32: crumb c at bits 2c = channel 16 w + c
    if BITS == 4:
        if VPREC:
            cold4 = cold[None, :, None, None]
            vz += tl.where(cold4, 1.5 * vs, 0.0)
            lo = tl.load(v_lo + voff, mask=wm & (~cold4), other=0)
        else:
            lo = tl.load(v_lo + voff, mask=wm, other=0)
        # nibble k of `even` is 4 hi + lo of crumb 2k (channel 2k), of `odd` of crumb 2k + 1
        even = ((hi & 0x33333333) << 2) | (lo & 0x33333333)
        odd = (hi & -0x33333334) | ((lo >> 2) & 0x33333333)  # -0x33333334 == 0xCCCCCCCC
        nib = tl.where(j % 2 == 0, even, odd)
        k = j // 2
        f = _sub(tl.where(k >= 4, nib >> 16, nib), 4 * (k % 4), 4)  # [1, 32, VWP, 16]
    else:
        f = _sub(tl.where(j >= 8, hi >> 16, hi), 2 * (j % 8), 2)
    p4 = p[:, :, None, None]
    acc += (p4 * (vs * 79228162514264337593543950336.0)) * f  # 2**96
    zacc += p4 * vz
    return acc, zacc


@triton.jit
def _cold(s, m_page, sink_max, tau, G: tl.constexpr, GP: tl.constexpr):
    """[32]: token cold for every query head of the group (s [GP, 32] log2 units, m_page/sink_max [GP])."""
    g = tl.arange(0, GP)
    m_ref = tl.maximum(sink_max, m_page)
    cold_r = (s < (m_ref - tau)[:, None]) | (g >= G)[:, None]
    return tl.min(cold_r.to(tl.int32), 0) > 0


@triton.jit
def far_cc(
    q, sq_b, sq_h, b, h, H, MAXP, length, p0, p1, page_table, sink_k, k_words, k_scale, k_zero, v_hi, v_lo,
    v_scale, v_zero, qk_scale, tau, ws_o, ws_ml, slot,
    G: tl.constexpr, GR: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, BITS: tl.constexpr,
    VPREC: tl.constexpr, PPI: tl.constexpr,
):
    """History pages [p0, p1) of row b, KV head h (codes as int32 words) -> partial (m, l, o) at ``slot``."""
    PERW: tl.constexpr = 32 // BITS
    HALF: tl.constexpr = PERW // 2
    KWP: tl.constexpr = DP // PERW
    VWP: tl.constexpr = DP // 16
    b64 = b.to(tl.int64)
    g4 = tl.arange(0, GP)[:, None, None, None]
    ch = tl.arange(0, KWP)[None, None, :, None] * PERW + tl.arange(0, PERW)[None, None, None, :]
    q4 = tl.load(q + b64 * sq_b + (h * G + g4) * sq_h + ch, mask=(g4 < G) & (ch < D), other=0.0).to(tl.float32)
    jq = tl.arange(0, PERW)[None, None, None, :]
    qf = q4 * tl.exp2((96 - BITS * (jq % HALF)).to(tl.float32))  # [GP, 1, KWP, PERW]
    gq = tl.arange(0, GP)
    sink_max = tl.full([GP], float("-inf"), tl.float32)
    if VPREC:
        if p1 > p0:
            c = tl.arange(0, DP)
            ts = tl.arange(0, 32)
            q3 = tl.load(q + b64 * sq_b + (h * G + gq)[:, None, None] * sq_h + c[None, None, :],
                         mask=(gq < G)[:, None, None] & (c < D)[None, None, :], other=0.0).to(tl.float32)
            sk = tl.load(sink_k + ((b64 * H + h) * 32 + ts)[None, :, None] * D + c[None, None, :],
                         mask=(c < D)[None, None, :], other=0.0).to(tl.float32)
            s_sink = tl.sum(q3 * sk, 2) * qk_scale  # [GP, 32]
            s_sink = tl.where((ts < tl.minimum(length, 32))[None, :], s_sink, float("-inf"))
            sink_max = tl.max(s_sink, 1)
    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_t = tl.zeros([GP, 32], tl.float32)
    acc = tl.zeros([GP, 32, VWP, 16], tl.float32)
    zacc = tl.zeros([GP, 32, VWP, 1], tl.float32)
    cold_a = tl.zeros([32], tl.int32) > 0
    cold_b = cold_a
    for pg in range(p0, p1, PPI):
        page_a = tl.load(page_table + b64 * MAXP + pg).to(tl.int64) * H + h
        s_a = _cc_scores(qf, q4, k_words, k_scale, k_zero, page_a, pg < p1, qk_scale, BITS, D, DP)
        m_a = tl.max(s_a, 1)
        m_top = m_a
        if PPI == 2:
            ok_b = pg + 1 < p1
            page_b = tl.load(page_table + b64 * MAXP + pg + 1, mask=ok_b, other=0).to(tl.int64) * H + h
            s_b = _cc_scores(qf, q4, k_words, k_scale, k_zero, page_b, ok_b, qk_scale, BITS, D, DP)
            m_b = tl.max(s_b, 1)
            m_top = tl.maximum(m_a, m_b)
        if tl.max(m_top - m_i, 0) > 0:  # rescale only when a running maximum grows
            m_new = tl.maximum(m_i, m_top)
            alpha = tl.exp2(m_i - m_new)
            l_t *= alpha[:, None]
            acc *= alpha[:, None, None, None]
            zacc *= alpha[:, None, None, None]
            m_i = m_new
        p_a = tl.exp2(s_a - m_i[:, None])
        l_t += p_a
        if VPREC:
            cold_a = _cold(s_a, m_a, sink_max, tau, G, GP)
        acc, zacc = _cc_values(acc, zacc, p_a, v_hi, v_lo, v_scale, v_zero, page_a, pg < p1, cold_a,
                               BITS, VPREC, D, DP)
        if PPI == 2:
            p_b = tl.exp2(s_b - m_i[:, None])  # 0 where page b is past p1
            l_t += p_b
            if VPREC:
                cold_b = _cold(s_b, m_b, sink_max, tau, G, GP)
            acc, zacc = _cc_values(acc, zacc, p_b, v_hi, v_lo, v_scale, v_zero, page_b, ok_b, cold_b,
                                   BITS, VPREC, D, DP)
    # ---- partial: o[g, 16 w + j] = 2**(53 - s_j) * sum_t acc + sum_t zacc
    g3 = tl.arange(0, GP)[:, None, None]
    w3 = tl.arange(0, VWP)[None, :, None]
    j3 = tl.arange(0, 16)[None, None, :]
    if BITS == 4:
        vshift = 4 * ((j3 // 2) % 4)
    else:
        vshift = 2 * (j3 % 8)
    o = tl.sum(acc, 1) * tl.exp2((53 - vshift).to(tl.float32)) + tl.sum(zacc, 1)  # [GP, VWP, 16]
    tl.store(ws_o + (slot * GR + g3) * DP + 16 * w3 + j3, o, mask=g3 < G)
    l_i = tl.sum(l_t, 1)
    tl.store(ws_ml + (slot * GR + gq) * 2, m_i, mask=gq < G)
    tl.store(ws_ml + (slot * GR + gq) * 2 + 1, l_i, mask=gq < G)
