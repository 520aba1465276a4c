"""Tensor-core history readers of the fused cell attention, for code pages read by more than two query heads per KV
head or with fp32 inputs (``triton_config.TABLE``); and the exact-tile products that every program of the kernel
uses (``_dot``, ``_exact_scores``). docs/kernels.md explains the readers; docs/design.md the storage they read.
Two readers: ``far_dot`` with expanded rows (below) and ``far_gqa``, whose rows are the query heads alone (its
docstring says how it carries V's scale instead).

Query rows are *expanded*: tile row ``r`` is query head ``g = r // NGP`` of the KV head's group and V channel group
``gr = r % NGP`` (``NGP`` = padded ``head_dim // 32``). So one ``tl.dot`` computes all query heads' scores, and the
value product folds V's per-token, per-group scale into the weights: ``A[r, t] = p[r, t] * v_scale[t, gr]``,
``o[g, c] += sum_t A[r, t] * code[t, c]`` for ``c`` in group ``gr``, plus ``sum_t p[r, t] * v_zero[t, gr]``. K's
per-channel scale is folded into the query once per page: ``s = (q * k_scale) . code + q . k_zero``. Codes are read
in their packed order (channel ``per * j + i`` in tile ``i``), so no unpacking shuffle is needed.

V precision (INT4, finite ``tau``): token ``t`` of a page is cold iff ``s < m_ref - tau`` (log2 units) for every
query head of the group, with ``m_ref = max(sink max, page max)``; each program computes the sink maximum itself
(32 exact keys), so the result is deterministic and independent of the split. A cold token's lo plane is not loaded
(masked load) and its value is ``4 * hi + 1.5``: the ``1.5 * v_scale`` goes into the zero term.

Precision: with bf16/fp16 inputs (``SUBNORMAL``) the products run on tensor cores with fp16 operands and fp32
accumulation: codes are exact in fp16, made from the packed bytes with one AND as subnormal fp16
``2**-24 * 2**s * code`` (no shift, no integer-to-float conversion); ``q * k_scale`` and ``p * v_scale`` are rounded
to fp16 (relative 2**-11). With fp32 inputs every product is fp32 (``input_precision="ieee"``).
"""

from __future__ import annotations

import triton
import triton.language as tl


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
def _field(x, SHIFT: tl.constexpr, WIDTH: tl.constexpr, SUBNORMAL: tl.constexpr, DT: tl.constexpr):
    """Bit field ``[SHIFT, SHIFT + WIDTH)`` of the bytes ``x`` as an operand of the products: SUBNORMAL, the masked
    bits as a subnormal fp16, i.e. ``2**(SHIFT - 24) * field`` exactly, from one AND (callers fold the power of two
    into the other operand or the result); else the integer field in DT (fp32 inputs)."""
    if SUBNORMAL:
        return (x & (((1 << WIDTH) - 1) << SHIFT)).to(tl.int16).to(tl.float16, bitcast=True)
    else:
        return ((x >> SHIFT) & ((1 << WIDTH) - 1)).to(DT)


@triton.jit
def _q_tile(q_ptr, rvalid, F: tl.constexpr, BITS: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
            DT: tl.constexpr, SUBNORMAL: tl.constexpr):
    """Query channels ``PER * j + F`` [rows, DP // PER] in DT (rows: q_ptr's); SUBNORMAL pre-scales by
    ``2**-(BITS * F)`` (exact) to undo the unshifted field's ``2**(BITS * F)``."""
    PER: tl.constexpr = 8 // BITS
    j = tl.arange(0, DP // PER)
    qi = tl.load(q_ptr[:, None] + (j * PER + F)[None, :], mask=rvalid[:, None] & (j < D // PER)[None, :], other=0.0)
    if SUBNORMAL:
        return (qi.to(tl.float32) * (1.0 / (1 << (BITS * F)))).to(tl.float16)
    else:
        return qi.to(DT)


@triton.jit
def _score_part(s, qa, codes, page, k_scale, F: tl.constexpr, BITS: tl.constexpr, D: tl.constexpr,
                DP: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr, SUBNORMAL: tl.constexpr):
    """Add field F's product ``(q * k_scale) . code`` to the scores s [RP, 32]."""
    PER: tl.constexpr = 8 // BITS
    j = tl.arange(0, DP // PER)
    ks = tl.load(k_scale + page * D + j * PER + F, mask=j < D // PER, other=0.0)
    if SUBNORMAL:
        qk = qa * ks[None, :]  # fp16 x fp16: one rounding, like the fp32 product rounded to fp16
    else:
        qk = qa * ks.to(DT)[None, :]
    return tl.dot(qk, tl.trans(_field(codes, BITS * F, BITS, SUBNORMAL, DT)), s, input_precision=PREC)


@triton.jit
def _v_dot(acc, a, aq, hi, lo, K: tl.constexpr, BITS: tl.constexpr, SUBNORMAL: tl.constexpr, DT: tl.constexpr,
           PREC: tl.constexpr):
    """acc + a @ code_K for crumb K (channels 4 j + K) of the V planes (INT4: 4 hi + lo), up to a scale.

    SUBNORMAL: acc gathers ``a @ f_hi + (a / 4) @ f_lo`` (aq = a / 4) with ``f = 2**-24 * 4**K * crumb``; the caller
    scales acc by ``(4 if INT4 else 1) * 4**-K * 2**24``."""
    if SUBNORMAL:
        acc = tl.dot(a, _field(hi, 2 * K, 2, SUBNORMAL, DT), acc, input_precision=PREC)
        if BITS == 4:
            acc = tl.dot(aq, _field(lo, 2 * K, 2, SUBNORMAL, DT), acc, input_precision=PREC)
    else:
        code = _field(hi, 2 * K, 2, SUBNORMAL, DT)
        if BITS == 4:
            code = code * 4 + _field(lo, 2 * K, 2, SUBNORMAL, DT)
        acc = tl.dot(a, code, acc, input_precision=PREC)
    return acc


@triton.jit
def far_dot(
    q, sq_b, sq_h, b, h, H, MAXP, length, p0, p1, page_table, sink_k, k_pages, k_scale, k_zero, v_hi, v_lo,
    v_scale, v_zero, qk_scale, tau, ws_o, ws_ml, slot,
    G: tl.constexpr, GR: tl.constexpr, GP: tl.constexpr, NGP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
    BITS: tl.constexpr, VPREC: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr,
    SUBNORMAL: tl.constexpr,
):
    """History pages [p0, p1) of row b, KV head h, stored as INT4/INT2 codes -> partial (m, l, o) at ``slot``."""
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
    qa0 = _q_tile(q_rows, rvalid, 0, BITS, D, DP, DT, SUBNORMAL)
    qa1 = _q_tile(q_rows, rvalid, 1, BITS, D, DP, DT, SUBNORMAL)
    if BITS == 2:
        qa2 = _q_tile(q_rows, rvalid, 2, BITS, D, DP, DT, SUBNORMAL)
        qa3 = _q_tile(q_rows, rvalid, 3, BITS, D, DP, DT, SUBNORMAL)
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
        s = _score_part(s, qa0, codes, page, k_scale, 0, BITS, D, DP, DT, PREC, SUBNORMAL)
        s = _score_part(s, qa1, codes, page, k_scale, 1, BITS, D, DP, DT, PREC, SUBNORMAL)
        if BITS == 2:
            s = _score_part(s, qa2, codes, page, k_scale, 2, BITS, D, DP, DT, PREC, SUBNORMAL)
            s = _score_part(s, qa3, codes, page, k_scale, 3, BITS, D, DP, DT, PREC, SUBNORMAL)
        kz = tl.load(k_zero + page * D + c, mask=c < D, other=0.0).to(tl.float32)
        bias = tl.sum(qg * kz[None, :], 1)  # [GP]
        if SUBNORMAL:
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
        acc0 = _v_dot(acc0, a, aq, hi, lo, 0, BITS, SUBNORMAL, DT, PREC)
        acc1 = _v_dot(acc1, a, aq, hi, lo, 1, BITS, SUBNORMAL, DT, PREC)
        acc2 = _v_dot(acc2, a, aq, hi, lo, 2, BITS, SUBNORMAL, DT, PREC)
        acc3 = _v_dot(acc3, a, aq, hi, lo, 3, BITS, SUBNORMAL, DT, PREC)
    if SUBNORMAL:  # undo the fields' scale: 4**K and 2**24; INT4 hi weighs 4
        w: tl.constexpr = (4.0 if BITS == 4 else 1.0) * 16777216.0
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
def _prefetch_bytes(base, NBYTES: tl.constexpr):
    """``prefetch.global.L2`` of the ``NBYTES`` bytes from ``base`` (any pointer): one 128-byte line per lane of a warp,
    at most 32 lines (more are dropped: it is a hint)."""
    LINES: tl.constexpr = (NBYTES + 127) // 128
    ln = tl.minimum(tl.arange(0, 32), LINES - 1)
    ptr = base.to(tl.pointer_type(tl.int8)) + ln * 128
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptr], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def _dot2(x, y, acc, PREC: tl.constexpr):
    """``acc + x @ y`` for fp32 ``x`` and fp16 ``y``: ``x`` as two fp16 parts (its rounding and the remainder), so
    that the product keeps about 22 bits of ``x``."""
    xh = x.to(tl.float16)
    acc = tl.dot(xh, y, acc, input_precision=PREC)
    return tl.dot((x - xh.to(tl.float32)).to(tl.float16), y, acc, input_precision=PREC)


@triton.jit
def far_gqa(
    q, sq_b, sq_h, b, h, H, MAXP, length, p0, p1, page_table, sink_k, k_pages, k_scale, k_zero, v_hi, v_lo,
    v_scale, v_zero, qk_scale, tau, ws_o, ws_ml, slot,
    G: tl.constexpr, GR: tl.constexpr, GP: tl.constexpr, QR: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
    BITS: tl.constexpr, VPREC: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr, L2: tl.constexpr,
):
    """History pages [p0, p1) of row b, KV head h -> partial (m, l, o) at ``slot``: the tensor-core reader whose tile
    rows are the group's query heads alone (``QR``: their count padded to 16), for 16-bit inputs.

    The expanded reader (``far_dot``) gives every (query head, 32-channel group) a row so that V's per-(token, group)
    scale rides on the weights; at head_dim 256 that is 8 rows per head, each score computed 8 times and 7/8 of every
    value product thrown away. Here:

    * scores: one ``tl.dot`` per page, ``(q * k_scale) [QR, DP] @ codes^T [DP, 32]``, the codes as subnormal fp16
      fields joined back into channel order (field F's ``2**(BITS * F)`` folded into the query once);
    * values: one ``tl.dot`` per 32-channel group, ``(p * v_scale[:, grp]) [QR, 32] @ codes [32, 32]`` (INT4: the
      nibble ``4 hi + lo`` made bytewise, read as a subnormal fp16; the fields' powers of two undone per channel at
      the end); the weights are what is repeated per group, the codes are read once;
    * the zero term ``p @ v_zero [32, groups]`` as one more small product, with ``p`` in two fp16 parts (about 22
      bits), so it is as exact as an fp32 sum.

    V precision: as in ``far_dot`` (a cold token's lo plane is not loaded; its ``1.5 * v_scale`` goes into the zero
    term). L2: the next page is prefetched to L2 (inline PTX, CUDA only); the page-table entry is loaded one page
    ahead."""
    PER: tl.constexpr = 8 // BITS  # fields per byte
    KB: tl.constexpr = DP // PER
    KBD: tl.constexpr = D // PER
    VBD: tl.constexpr = D // 4  # bytes of a V plane per token
    NG: tl.constexpr = D // 32
    NGP: tl.constexpr = DP // 32
    r = tl.arange(0, QR)
    rv = r < G
    gq = tl.arange(0, GP)
    c = tl.arange(0, DP)
    cm = c < D
    t = tl.arange(0, 32)
    jk = tl.arange(0, KB)
    b64 = b.to(tl.int64)
    q_rows = q + b64 * sq_b + (h * G + r) * sq_h
    # the query over channel c = PER * j + F, times 2**(-BITS * F): field F's subnormal fp16 is 2**(BITS * F - 24) code
    fshift = (c % PER) * BITS
    qf = tl.load(q_rows[:, None] + c[None, :], mask=rv[:, None] & cm[None, :], other=0.0).to(tl.float32)
    qf = (qf * ((127 - fshift) << 23).to(tl.float32, bitcast=True)[None, :]).to(tl.float16)
    qd = tl.load(q + b64 * sq_b + (h * G + gq)[:, None] * sq_h + c[None, :], mask=(gq < G)[:, None] & cm[None, :],
                 other=0.0).to(tl.float32)
    expand = r[:, None] == gq[None, :]  # [QR, GP]
    j8 = tl.arange(0, 8)
    z16 = tl.arange(0, 16)
    m_i = tl.full([QR], float("-inf"), tl.float32)
    l_i = tl.zeros([QR], tl.float32)
    sink_max = tl.full([QR], float("-inf"), tl.float32)
    if VPREC:
        if p1 > p0:
            qx = tl.load(q_rows[:, None] + c[None, :], mask=rv[:, None] & cm[None, :], other=0.0)
            s_sink = _exact_scores(qx, sink_k + ((b64 * H + h) * 32 + t)[:, None] * D + c[None, :],
                                   t < tl.minimum(length, 32), cm, qk_scale, PREC, UPCAST)
            sink_max = tl.max(s_sink, 1)
    acc = ()
    for _g in tl.static_range(NGP):
        acc = acc + (tl.zeros([QR, 32], tl.float32),)
    zacc = tl.zeros([QR, 16], tl.float32)  # column grp: the zero term of group grp
    row = page_table + b64 * MAXP
    nidx = tl.load(row + p0, mask=p0 < p1, other=0)  # the page index is carried one page ahead
    for pg in range(p0, p1):
        page = nidx.to(tl.int64) * H + h
        nidx = tl.load(row + tl.minimum(pg + 1, p1 - 1))
        if L2:
            nxt = nidx.to(tl.int64) * H + h
            _prefetch_bytes(k_pages + nxt * (32 * KBD), 32 * KBD)
            _prefetch_bytes(v_hi + nxt * (32 * VBD), 32 * VBD)
            if BITS == 4 and not VPREC:
                _prefetch_bytes(v_lo + nxt * (32 * VBD), 32 * VBD)
            _prefetch_bytes(k_scale + nxt * D, 2 * D)
            _prefetch_bytes(k_zero + nxt * D, 2 * D)
            _prefetch_bytes(v_scale + nxt * (32 * NG), 64 * NG)
            _prefetch_bytes(v_zero + nxt * (32 * NG), 64 * NG)
        # ---- scores
        codes = tl.load(k_pages + page * (32 * KBD) + t[:, None] * KBD + jk[None, :], mask=(jk < KBD)[None, :],
                        other=0)
        if BITS == 4:
            kt = tl.join(_field(codes, 0, 4, True, tl.float16), _field(codes, 4, 4, True, tl.float16))
        else:
            kt = tl.join(tl.join(_field(codes, 0, 2, True, tl.float16), _field(codes, 4, 2, True, tl.float16)),
                         tl.join(_field(codes, 2, 2, True, tl.float16), _field(codes, 6, 2, True, tl.float16)))
        kt = tl.reshape(kt, [32, DP])  # channel PER * j + F
        ks = tl.load(k_scale + page * D + c, mask=cm, other=0.0)
        qk = qf * ks[None, :]  # fp16 x fp16: one rounding, like the fp32 product rounded to fp16
        s = tl.dot(qk, tl.trans(kt), input_precision=PREC) * 16777216.0  # 2**24: the subnormal fields' scale
        kz = tl.load(k_zero + page * D + c, mask=cm, other=0.0).to(tl.float32)
        bias = tl.sum(qd * kz[None, :], 1)  # [GP]
        s = (s + tl.sum(tl.where(expand, bias[None, :], 0.0), 1)[:, None]) * qk_scale
        m_page = tl.max(s, 1)
        if tl.max(m_page - m_i, 0) > 0:  # rescale only when a running maximum grows
            m_new = tl.maximum(m_i, m_page)
            alpha = tl.exp2(m_i - m_new)
            l_i *= alpha
            new = ()
            for k in tl.static_range(NGP):
                new = new + (acc[k] * alpha[:, None],)
            acc = new
            zacc *= alpha[:, None]
            m_i = m_new
        p = tl.exp2(s - m_i[:, None])
        l_i += tl.sum(p, 1)
        # ---- values, one 32-channel group at a time
        zoff = page * (32 * NG) + t[:, None] * NG + z16[None, :]  # [32, 16]: v_zero of group z16
        vz = tl.load(v_zero + zoff, mask=(z16 < NG)[None, :], other=0.0)
        if BITS == 4 and VPREC:
            m_ref = tl.maximum(sink_max, m_page)
            cold_r = (s < (m_ref - tau)[:, None]) | (~rv[:, None])
            cold = tl.min(cold_r.to(tl.int32), 0) > 0  # [32]: cold for every query head
            # a cold token's value is 4 hi + 1.5: its 1.5 * v_scale goes into the zero term
            vsz = tl.load(v_scale + zoff, mask=(z16 < NG)[None, :], other=0.0)
            zacc = _dot2(tl.where(cold[None, :], 1.5 * p, 0.0), vsz, zacc, PREC)
        zacc = _dot2(p, vz, zacc, PREC)
        new = ()
        for grp in tl.static_range(NGP):
            vs = tl.load(v_scale + page * (32 * NG) + t * NG + grp, mask=t < tl.where(grp < NG, 32, 0),
                         other=0.0).to(tl.float32)
            voff = page * (32 * VBD) + t[:, None] * VBD + grp * 8 + j8[None, :]  # [32, 8]
            gm = (j8 < tl.where(grp < NG, 8, 0))[None, :]
            hi = tl.load(v_hi + voff, mask=gm, other=0)
            if BITS == 4:
                if VPREC:
                    lo = tl.load(v_lo + voff, mask=gm & ~cold[:, None], other=0)
                else:
                    lo = tl.load(v_lo + voff, mask=gm, other=0)
                even = ((hi & 0x33) << 2) | (lo & 0x33)
                odd = (hi & 0xCC) | ((lo >> 2) & 0x33)
                vt = tl.join(tl.join(_field(even, 0, 4, True, tl.float16), _field(even, 4, 4, True, tl.float16)),
                             tl.join(_field(odd, 0, 4, True, tl.float16), _field(odd, 4, 4, True, tl.float16)))
            else:
                vt = tl.join(tl.join(_field(hi, 0, 2, True, tl.float16), _field(hi, 4, 2, True, tl.float16)),
                             tl.join(_field(hi, 2, 2, True, tl.float16), _field(hi, 6, 2, True, tl.float16)))
            vt = tl.reshape(vt, [32, 32])  # [token, channel 4 jj + K of the group]
            a = (p * vs[None, :]).to(tl.float16)
            new = new + (tl.dot(a, vt, acc[grp], input_precision=PREC),)
        acc = new
    # undo the fields' powers of two: INT4 channel 4 jj + K at bit 4 (K // 2) of its nibble byte, INT2 at bit 2 K
    i32c = tl.arange(0, 32)
    if BITS == 4:
        vshift = 4 * ((i32c % 4) // 2)
    else:
        vshift = 2 * (i32c % 4)
    unit = ((127 + 24 - vshift) << 23).to(tl.float32, bitcast=True)[None, :]
    for grp in tl.static_range(NGP):
        z = tl.sum(tl.where(z16[None, :] == grp, zacc, 0.0), 1)  # [QR]
        tl.store(ws_o + (slot * GR + r[:, None]) * DP + grp * 32 + i32c[None, :], acc[grp] * unit + z[:, None],
                 mask=rv[:, None])
    tl.store(ws_ml + (slot * GR + r) * 2, m_i, mask=rv)
    tl.store(ws_ml + (slot * GR + r) * 2 + 1, l_i, mask=rv)
