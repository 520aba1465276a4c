"""CUDA-core history reader of the fused cell attention, for code pages read by one or two query heads per KV head
with 16-bit inputs (``triton_config.TABLE``; docs/kernels.md explains it, triton_config says what chose each part).

The tensor-core reader (``triton_dot``) pads one query head per KV head to 16-row MMA tiles, and at one query head
per KV head ran latency-bound at 255 registers with spills. This reader does both products on CUDA cores, one warp
per program (two above head_dim 128: each thread then holds what it holds at 128 on one), with every tensor indexed
``(query head g, token t, word w, field j)``:

* Codes are read as int32 *words*, in their packed order: field ``j`` of word ``w`` of a token is channel
  ``(32 // bits) * w + j`` (K nibbles or crumbs), so the query is laid out to match and the output comes out in
  channel order (``16 w + j`` for V). No unpacking shuffle.
* Scores: K's fields in packed fp16 pairs. A word's two 16-bit halves hold channels ``PERW * w + k`` and ``PERW * w
  + PERW // 2 + k`` at the same bit, so one mask and one ``fma.rn.f16x2`` (inline PTX on CUDA, ``ASM``; the same
  values in Triton arithmetic under the interpreter) take field ``k`` of both: a masked field below bit 10 read as
  fp16 is exactly ``2**(bit - 24) * field``. The query-scale products ``q * k_scale`` (per page, one tile) carry the
  ``2**(24 - bit)`` and are scaled below 2**15 by an exact power of two. A lane's pair sums stay in fp16 over 16
  products, then widen to fp32; ``q . k_zero`` is added per page (K's per-channel scale and zero fold per page).
* Values: INT4's two crumb planes are merged into nibbles word-wide (``4 * hi + lo`` with two logic ops per 16
  channels); a field becomes an fp32 operand with one AND: the masked bits ``field << s`` (``s < 24``) read as an fp32
  subnormal are exactly ``2**(s - 149) * field``, and the ``2**(149 - s)`` is folded into the weight (``2**96``
  there, ``2**53`` on the result). Fields below bit 24 are read in place, the top ones from the word ``>> 16``. Per
  token slot accumulators ``acc[g, t, w, j] += p * v_scale * 2**96 * field`` (no reduction in the page loop), summed
  over tokens once at the end; V's scale and zero are loaded per (token, 32-channel group), the zero term
  ``sum_t p * v_zero`` accumulated per group. Subnormals must be kept (no ftz; checked in the compiled PTX by
  tests/ops/test_sm90_compile.py).
* Softmax: one running maximum per query head for the program (lazy rescale: only when it grows), per token slot
  sums.
* Latency: the next page's page-table entry is loaded one page ahead, and on CUDA (``L2``) its codes and scales
  are prefetched to L2 while this page's loads are in flight. ``I32``: history offsets in 32 bits (the launcher
  checks that every pool fits).
* V precision: ``m_ref = max(sink max, page max)`` per query head (the program computes the sink maximum itself:
  deterministic, independent of the split); a token cold for every query head of the group skips its lo-plane load
  (masked) and gets ``1.5 * v_scale`` in the zero term.

Partials ``(m, l, o)`` are written in the tensor-core reader's format (log2 units) for the kernel's merge.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _sub(x, SHIFT: tl.constexpr, WIDTH: tl.constexpr):
    """Bits ``[SHIFT, SHIFT + WIDTH)`` of int32 ``x`` as fp32 ``2**(SHIFT - 149) * field`` (a subnormal)."""
    return (x & (((1 << WIDTH) - 1) << SHIFT)).to(tl.float32, bitcast=True)


@triton.jit
def _halves(parts, N: tl.constexpr):
    """Split each of the N tiles of ``parts`` on its last axis (size 2): (all [..., 0], then all [..., 1])."""
    lo = ()
    hi = ()
    for i in tl.static_range(N):
        e0, e1 = tl.split(parts[i])
        lo = lo + (e0,)
        hi = hi + (e1,)
    return lo + hi


@triton.jit
def _split_fields(x, GP: tl.constexpr, KWP: tl.constexpr, PERW: tl.constexpr):
    """x [GP, KWP, PERW] (channel PERW * w + j) -> tuple of PERW tiles [GP, KWP] (field j), by ``tl.split``
    on register axes (after level l the tuple index is the channel's low l + 1 bits)."""
    if PERW == 8:
        parts = _halves((tl.reshape(x, [GP, KWP, 2, 2, 2]),), 1)
        parts = _halves(parts, 2)
        parts = _halves(parts, 4)
    else:
        parts = _halves((tl.reshape(x, [GP, KWP, 2, 2, 2, 2]),), 1)
        parts = _halves(parts, 2)
        parts = _halves(parts, 4)
        parts = _halves(parts, 8)
    return parts


@triton.jit
def _page_block(page, H, h, I32: tl.constexpr):
    """Block index ``page * H + h`` of a (physical page, KV head) in every pool: 64-bit, or 32-bit under I32."""
    if not I32:
        page = page.to(tl.int64)
    return page * H + h


@triton.jit
def _k_scales(page, ok, k_scale, k_zero, D: tl.constexpr, DP: tl.constexpr, PERW: tl.constexpr):
    """K's scale of page block ``page`` as one tile [1, KWP, PERW] (channel PERW * w + j; 16-byte loads) and its zero
    [1, DP] in channel order, masked off unless ``ok``."""
    KW: tl.constexpr = D // PERW
    KWP: tl.constexpr = DP // PERW
    w2 = tl.arange(0, KWP)[None, :, None]
    j2 = tl.arange(0, PERW)[None, None, :]
    ks = tl.load(k_scale + page * D + w2 * PERW + j2, mask=w2 < tl.where(ok, KW, 0), other=0.0)
    c = tl.arange(0, DP)[None, :]  # (not `& ok` in masks: the interpreter turns a scalar & into int32)
    kz = tl.load(k_zero + page * D + c, mask=c < tl.where(ok, D, 0), other=0.0)
    return ks, kz


@triton.jit
def _k_words(page, ok, k_words, TS: tl.constexpr, BITS: tl.constexpr, D: tl.constexpr, DP: tl.constexpr):
    """K's code words of page block ``page``, one tile [1, TS, KWP] per sub-tile of TS tokens (masked off unless
    ``ok``)."""
    PERW: tl.constexpr = 32 // BITS
    KW: tl.constexpr = D // PERW
    KWP: tl.constexpr = DP // PERW
    w = tl.arange(0, KWP)[None, None, :]
    wm = w < tl.where(ok, KW, 0)
    words = ()
    for sb in tl.static_range(32 // TS):
        t = sb * TS + tl.arange(0, TS)[None, :, None]
        words = words + (tl.load(k_words + page * (32 * KW) + t * KW + w, mask=wm, other=0),)
    return words


@triton.jit
def _prefetch_lines(base, LINES: tl.constexpr):
    """``prefetch.global.L2`` of ``LINES`` (<= 32: more are dropped, it is a hint) 128-byte lines from int32
    pointer ``base``: one instruction per lane of a warp; lanes past ``LINES`` repeat the last line (head_dim 96
    makes regions of 12 or 3 lines, and ``tl.arange`` needs a power of two)."""
    ln = tl.minimum(tl.arange(0, 32), LINES - 1)
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [base + ln * 32],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _prefetch_page(page, k_words, k_scale, k_zero, v_hi, v_lo, v_scale, v_zero, BITS: tl.constexpr,
                   VPREC: tl.constexpr, D: tl.constexpr):
    """Ask L2 for page block ``page``'s codes and scales one iteration before they are loaded, so that those loads
    wait for L2 instead of HBM. A page-head is contiguous in every pool (``page * H + h`` blocks); V precision leaves
    the lo plane to its masked load (prefetching it would read the bytes the cold test saves)."""
    PERW: tl.constexpr = 32 // BITS
    KW: tl.constexpr = D // PERW
    VW: tl.constexpr = D // 16
    NG: tl.constexpr = D // 32
    _prefetch_lines(k_words + page * (32 * KW), (32 * KW * 4 + 127) // 128)
    _prefetch_lines(v_hi + page * (32 * VW), (32 * VW * 4 + 127) // 128)
    if BITS == 4 and not VPREC:
        _prefetch_lines(v_lo + page * (32 * VW), (32 * VW * 4 + 127) // 128)
    # scales are fp16: a line holds 64; int32 views keep the one-line stride of _prefetch_lines
    _prefetch_lines((k_scale + page * D).to(tl.pointer_type(tl.int32)), (D * 2 + 127) // 128)
    _prefetch_lines((k_zero + page * D).to(tl.pointer_type(tl.int32)), (D * 2 + 127) // 128)
    _prefetch_lines((v_scale + page * (32 * NG)).to(tl.pointer_type(tl.int32)), (32 * NG * 2 + 127) // 128)
    _prefetch_lines((v_zero + page * (32 * NG)).to(tl.pointer_type(tl.int32)), (32 * NG * 2 + 127) // 128)


@triton.jit
def _halves16(x):
    """int32 -> its bits 0-15 and 16-31 as fp16."""
    lo = (x & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True)
    hi = ((x >> 16) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True)
    return lo, hi


@triton.jit
def _pack16(lo, hi):
    """Two fp16 tiles -> one int32 tile (``lo`` in bits 0-15): the register layout of an ``f16x2``."""
    return (lo.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF) | (hi.to(tl.int16, bitcast=True).to(tl.int32) << 16)


@triton.jit
def _k16_pack(hi, lo, ASM: tl.constexpr):
    """fp32 tiles -> packed ``f16x2`` (int32 container; round to nearest even): one ``cvt.rn.f16x2.f32`` on CUDA."""
    if ASM:
        return tl.inline_asm_elementwise("cvt.rn.f16x2.f32 $0, $1, $2;", "=r,f,f", [hi, lo], dtype=tl.int32,
                                         is_pure=True, pack=1)
    else:
        return _pack16(lo.to(tl.float16), hi.to(tl.float16))


@triton.jit
def _k16_fma(acc, a, x, BIT: tl.constexpr, BITS: tl.constexpr, ASM: tl.constexpr):
    """``acc + a * subnormal(x & mask)`` on packed fp16 pairs (int32 containers): the mask takes the field at bit
    ``BIT`` of each half of ``x``, which read as fp16 is exactly ``field * 2**(BIT - 24)`` (below bit 10: exponent
    0 or 1). On CUDA one ``LOP3`` and one ``fma.rn.f16x2`` (inline PTX, no ftz: fp16 subnormals kept); elsewhere
    the same fields and one rounding of the fp32 ``acc + a * field`` per half."""
    MASK: tl.constexpr = (15 if BITS == 4 else 3) << BIT
    f = x & (MASK | (MASK << 16))  # the field of each half (an int32 AND: one LOP3 with the mask inline)
    if ASM:
        return tl.inline_asm_elementwise("fma.rn.f16x2 $0, $2, $3, $1;", "=r,r,r,r", [acc, a, f], dtype=tl.int32,
                                         is_pure=True, pack=1)
    else:
        f_lo, f_hi = _halves16(f)
        a_lo, a_hi = _halves16(a)
        c_lo, c_hi = _halves16(acc)
        n_lo = (c_lo.to(tl.float32) + a_lo.to(tl.float32) * f_lo.to(tl.float32)).to(tl.float16)
        n_hi = (c_hi.to(tl.float32) + a_hi.to(tl.float32) * f_hi.to(tl.float32)).to(tl.float16)
        return _pack16(n_lo, n_hi)


@triton.jit
def _k16_add(x, y, ASM: tl.constexpr):
    """Packed fp16 pairs (int32 containers): ``x + y`` per half, one ``add.rn.f16x2`` on CUDA."""
    if ASM:
        return tl.inline_asm_elementwise("add.rn.f16x2 $0, $1, $2;", "=r,r,r", [x, y], dtype=tl.int32, is_pure=True,
                                         pack=1)
    else:
        x_lo, x_hi = _halves16(x)
        y_lo, y_hi = _halves16(y)
        return _pack16((x_lo.to(tl.float32) + y_lo.to(tl.float32)).to(tl.float16),
                       (x_hi.to(tl.float32) + y_hi.to(tl.float32)).to(tl.float16))


@triton.jit
def _k16_sum(x, ASM: tl.constexpr):
    """Packed fp16 pair (int32 container) -> fp32 ``lo + hi``."""
    if ASM:
        return tl.inline_asm_elementwise(
            "{\n .reg .b16 l, h;\n .reg .f32 a, b;\n mov.b32 {l, h}, $1;\n cvt.f32.f16 a, l;\n cvt.f32.f16 b, h;\n"
            " add.f32 $0, a, b;\n}", "=f,r", [x], dtype=tl.float32, is_pure=True, pack=1)
    else:
        lo, hi = _halves16(x)
        return lo.to(tl.float32) + hi.to(tl.float32)


@triton.jit
def _k_prep16(qf, ks, GP: tl.constexpr, KWP: tl.constexpr, PERW: tl.constexpr, ASM: tl.constexpr):
    """Per page: the query-scale products of field pairs as packed fp16 (a tuple of PERW // 2 int32 tiles
    [GP, 1, KWP]: pair k is field k of a word's low half and of its high half) and ``unscale``. ``qf`` [GP, KWP,
    PERW] carries ``2**(24 - bit_j)`` per field (its bit in ``_k_sub16``), so every product ``qk * field`` is in the
    same unit; the page's largest ``|q * k_scale * 2**(24 - bit)|`` is scaled below ``2**15`` by an exact power of two
    ``2**(141 - e)`` (e: its biased fp32 exponent, at least 15), which ``unscale`` = ``2**(e - 141)`` undoes."""
    v = qf * ks.to(tl.float32)
    big = tl.max(tl.max(tl.max(tl.abs(v), 2), 1), 0)
    e = tl.maximum((big.to(tl.int32, bitcast=True) >> 23) & 255, 15)
    v = v * ((268 - e) << 23).to(tl.float32, bitcast=True)
    unscale = ((e - 14) << 23).to(tl.float32, bitcast=True)
    parts = _split_fields(v, GP, KWP, PERW)
    HALF: tl.constexpr = PERW // 2
    qk2 = ()
    for k in tl.static_range(HALF):
        qk2 = qk2 + (_k16_pack(parts[HALF + k], parts[k], ASM)[:, None, :],)
    return qk2, unscale


@triton.jit
def _k_sub16(qk2, unscale, bias, words, ok, qk_scale, GP: tl.constexpr, TS: tl.constexpr, KWP: tl.constexpr,
             BITS: tl.constexpr, ASM: tl.constexpr, PAIRS: tl.constexpr):
    """Scores [GP, TS] (log2 units) of a sub-tile's K words [1, TS, KWP]; ``ok`` False -> -inf. The field work in
    fp16 pairs: per word, one shift and PERW // 2 mask + ``HFMA2`` pairs (fp16 sums of PERW // 2 products per half),
    then each word's pair summed into fp32. Pair k is field k of
    each half; fields that would reach bit 10 (fp16's exponent) are read from ``w >> 8``: INT4 nibbles 0-1 in place
    at bits 0 and 4, nibbles 2-3 at bits 0 and 4 of ``w >> 8``; INT2 crumbs 0-4 in place at bits 0-8, crumbs 5-7 at
    bits 2, 4, 6 of ``w >> 8``."""
    HALF: tl.constexpr = 16 // BITS
    w8 = tl.broadcast_to(words >> 8, [GP, TS, KWP])
    w0 = tl.broadcast_to(words, [GP, TS, KWP])
    acc = tl.zeros([GP, TS, KWP], tl.int32)  # fp16 pairs, +0.0
    for k in tl.static_range(HALF):  # the bits in the docstring
        a = tl.broadcast_to(qk2[k], [GP, TS, KWP])
        if BITS == 4:
            if k < 2:
                acc = _k16_fma(acc, a, w0, 4 * k, BITS, ASM)
            else:
                acc = _k16_fma(acc, a, w8, 4 * (k - 2), BITS, ASM)
        else:
            if k < 5:
                acc = _k16_fma(acc, a, w0, 2 * k, BITS, ASM)
            else:
                acc = _k16_fma(acc, a, w8, 2 * k - 8, BITS, ASM)
    # PAIRS levels (the words a lane holds, log2, at most 2: one warp, [TS, KWP] tiles of 4 words per lane from
    # KWP * TS = 128 on): neighbouring words' pairs added in fp16 before widening, on register axes (static, sm_90:
    # INT4 page loop 898 -> 862 instructions with 2 levels; INT2 723 -> 711 with 1, 861 with a second level, which
    # crosses lanes)
    if PAIRS >= 1:
        a, b = tl.split(tl.reshape(acc, [GP, TS, KWP // 2, 2]))
        acc = _k16_add(a, b, ASM)
    if PAIRS >= 2:
        a, b = tl.split(tl.reshape(acc, [GP, TS, KWP // 4, 2]))
        acc = _k16_add(a, b, ASM)
    s = (tl.sum(_k16_sum(acc, ASM), 2) * unscale + bias) * qk_scale
    return tl.where(ok, s, float("-inf"))


@triton.jit
def _v_sub(acc, zacc, p, v_hi, v_lo, v_scale, v_zero, page, sub, ok, cold, GP: tl.constexpr, TS: tl.constexpr,
           BITS: tl.constexpr, VPREC: tl.constexpr, D: tl.constexpr, DP: tl.constexpr):
    """acc[j] [GP, TS, VWP] += p * v_scale * 2**96 * field j (channel 16 w + j) and zacc [GP, TS, VWP // 2] +=
    p * v_zero (+ 1.5 * v_scale for cold tokens) for the sub-tile ``sub``; p [GP, TS], cold [TS]. V's scale and zero
    are one per (token, 32-channel group); the weights reach the word tile by ``join`` + ``reshape`` (each thread's
    two words of a group are in its registers: no gather, no duplicate loads)."""
    NG: tl.constexpr = D // 32
    VW: tl.constexpr = D // 16
    VWP: tl.constexpr = DP // 16
    t = sub * TS + tl.arange(0, TS)[None, :, None]
    wv = tl.arange(0, VWP)[None, None, :]
    wvm = wv < tl.where(ok, VW, 0)
    voff = page * (32 * VW) + t * VW + wv
    gv = tl.arange(0, VWP // 2)[None, None, :]
    goff = page * (32 * NG) + t * NG + gv
    gvm = gv < tl.where(ok, NG, 0)
    vs = tl.load(v_scale + goff, mask=gvm, other=0.0)
    vz = tl.load(v_zero + goff, mask=gvm, other=0.0)
    hi = tl.load(v_hi + voff, mask=wvm, other=0)  # int32: crumb c at bits 2c is channel 16 w + c
    if BITS == 4 and not VPREC:
        lo = tl.load(v_lo + voff, mask=wvm, other=0)
    vs = vs.to(tl.float32)
    vz = vz.to(tl.float32)
    if BITS == 4:
        if VPREC:
            cold3 = cold[None, :, None]
            vz += tl.where(cold3, 1.5 * vs, 0.0)
            lo = tl.load(v_lo + voff, mask=wvm & (~cold3), other=0)
        # nibble k of `even` is 4 hi + lo of crumb 2k (channel 2k), of `odd` of crumb 2k + 1
        even = ((hi & 0x33333333) << 2) | (lo & 0x33333333)
        odd = (hi & -0x33333334) | ((lo >> 2) & 0x33333333)  # -0x33333334 == 0xCCCCCCCC
        even_u = even >> 16
        odd_u = odd >> 16
    else:
        hi_u = hi >> 16
    ag = p[:, :, None] * (vs * 79228162514264337593543950336.0)  # 2**96, per group
    a = tl.reshape(tl.join(ag, ag), [GP, TS, VWP])  # word w: group w // 2
    LIM: tl.constexpr = 24 // BITS  # fields below bit 24 are read in place
    new = ()
    for j in tl.static_range(16):
        if BITS == 4:  # nibble j // 2 of `even` (j even) or `odd`
            if j // 2 < LIM:
                f = _sub(even if j % 2 == 0 else odd, 4 * (j // 2), 4)
            else:
                f = _sub(even_u if j % 2 == 0 else odd_u, 4 * (j // 2) - 16, 4)
        else:
            if j < LIM:
                f = _sub(hi, 2 * j, 2)
            else:
                f = _sub(hi_u, 2 * j - 16, 2)
        new = new + (acc[j] + a * f,)
    zacc += p[:, :, None] * vz
    return new, zacc


@triton.jit
def _page_scores(qf, qd, ks, kz, words, ok, qk_scale, GP: tl.constexpr, TS: tl.constexpr, KWP: tl.constexpr,
                 BITS: tl.constexpr, ASM: tl.constexpr):
    """Scores of a page's sub-tiles (a tuple of [GP, TS], log2 units) and the page maximum [GP]."""
    qk2, unscale = _k_prep16(qf, ks, GP, KWP, 32 // BITS, ASM)
    bias = tl.sum(qd * kz.to(tl.float32), 1)[:, None]  # q . k_zero
    m_p = tl.full([GP], float("-inf"), tl.float32)
    ss = ()
    for sb in tl.static_range(32 // TS):
        s = _k_sub16(qk2, unscale, bias, words[sb], ok, qk_scale, GP, TS, KWP, BITS, ASM,
                     (1 if KWP * TS >= 64 else 0) + (1 if KWP * TS >= 128 else 0))
        m_p = tl.maximum(m_p, tl.max(s, 1))
        ss = ss + (s,)
    return ss, m_p


@triton.jit
def _rescale(acc, zacc, l_t, m_i, m_top):
    """Online softmax, lazily: rescale the accumulators to ``m_top`` only when a running maximum grows."""
    if tl.max(m_top - m_i, 0) > 0:
        alpha = tl.exp2(m_i - m_top)
        l_t *= alpha[:, None]
        zacc *= alpha[:, None, None]
        new = ()
        for j in tl.static_range(16):
            new = new + (acc[j] * alpha[:, None, None],)
        acc = new
        m_i = m_top
    return acc, zacc, l_t, m_i


@triton.jit
def _cold(s, m_page, sink_max, tau, G: tl.constexpr, GP: tl.constexpr):
    """[TS]: token cold for every query head of the group (s [GP, TS] log2 units, m_page/sink_max [GP])."""
    g = tl.arange(0, GP)
    m_ref = tl.maximum(sink_max, m_page)
    cold_r = (s < (m_ref - tau)[:, None]) | (g >= G)[:, None]
    return tl.min(cold_r.to(tl.int32), 0) > 0


@triton.jit
def _query(q, sq_b, sq_h, b64, h, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
           BITS: tl.constexpr):
    """The query as the score products read it: ``qf`` [GP, KWP, PERW] (channel PERW * w + j) times ``2**(24 -
    bit)`` of the field's fp16 subnormal in ``_k_sub16`` (exact: built bitwise), and ``qd`` [GP, DP] in channel
    order (for ``q . k_zero``)."""
    PERW: tl.constexpr = 32 // BITS
    KWP: tl.constexpr = DP // PERW
    gq = tl.arange(0, GP)
    g3 = gq[:, None, None]
    w3 = tl.arange(0, KWP)[None, :, None]
    j3 = tl.arange(0, PERW)[None, None, :]
    q3k = tl.load(q + b64 * sq_b + (h * G + g3) * sq_h + w3 * PERW + j3, mask=(g3 < G) & (w3 * PERW + j3 < D),
                  other=0.0).to(tl.float32)
    kk = j3 % (16 // BITS)
    if BITS == 4:
        b3 = 4 * (kk % 2)
    else:
        b3 = tl.where(kk < 5, 2 * kk, 2 * kk - 8)
    qf = q3k * ((127 + 24 - b3) << 23).to(tl.float32, bitcast=True)
    cq = tl.arange(0, DP)[None, :]
    qd = tl.load(q + b64 * sq_b + (h * G + gq[:, None]) * sq_h + cq, mask=(gq[:, None] < G) & (cq < D),
                 other=0.0).to(tl.float32)
    return qf, qd


@triton.jit
def _sink_max(q, sq_b, sq_h, b64, h, H, length, sink_k, qk_scale, G: tl.constexpr, GP: tl.constexpr,
              D: tl.constexpr, DP: tl.constexpr):
    """The largest sink score [GP] of each query head (log2 units): V precision's reference maximum."""
    gq = tl.arange(0, GP)
    c = tl.arange(0, DP)
    ts = tl.arange(0, 32)
    q3 = tl.load(q + b64 * sq_b + (h * G + gq)[:, None, None] * sq_h + c[None, None, :],
                 mask=(gq < G)[:, None, None] & (c < D)[None, None, :], other=0.0).to(tl.float32)
    sk = tl.load(sink_k + ((b64 * H + h) * 32 + ts)[None, :, None] * D + c[None, None, :],
                 mask=(c < D)[None, None, :], other=0.0).to(tl.float32)
    s_sink = tl.sum(q3 * sk, 2) * qk_scale  # [GP, 32]
    s_sink = tl.where((ts < tl.minimum(length, 32))[None, :], s_sink, float("-inf"))
    return tl.max(s_sink, 1)


@triton.jit
def far_cc(
    q, sq_b, sq_h, b, h, H, MAXP, length, p0, p1, page_table, sink_k, k_words, k_scale, k_zero, v_hi, v_lo,
    v_scale, v_zero, qk_scale, tau, ws_o, ws_ml, slot,
    G: tl.constexpr, GR: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, BITS: tl.constexpr,
    VPREC: tl.constexpr, L2: tl.constexpr, ASM: tl.constexpr, I32: tl.constexpr,
):
    """History pages [p0, p1) of row b, KV head h (codes as int32 words) -> partial (m, l, o) at ``slot``.

    Each iteration takes one page as 4 sub-tiles of 8 tokens (the tokens a thread holds share the per-page scale
    work). L2: prefetch the next page to L2 (inline PTX, CUDA only); ASM: the fp16 pairs in inline PTX (CUDA only);
    I32: 32-bit history offsets."""
    TS: tl.constexpr = 8  # tokens per sub-tile
    PERW: tl.constexpr = 32 // BITS
    KWP: tl.constexpr = DP // PERW
    VWP: tl.constexpr = DP // 16
    b64 = b.to(tl.int64)
    qf, qd = _query(q, sq_b, sq_h, b64, h, G, GP, D, DP, BITS)
    sink_max = tl.full([GP], float("-inf"), tl.float32)
    if VPREC:
        if p1 > p0:
            sink_max = _sink_max(q, sq_b, sq_h, b64, h, H, length, sink_k, qk_scale, G, GP, D, DP)
    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_t = tl.zeros([GP, TS], tl.float32)
    zacc = tl.zeros([GP, TS, VWP // 2], tl.float32)  # per 32-channel group
    acc = ()
    for _j in tl.static_range(16):
        acc = acc + (tl.zeros([GP, TS, VWP], tl.float32),)
    no_cold = tl.zeros([TS], tl.int32) > 0
    row = page_table + b64 * MAXP
    nidx = tl.load(row + p0, mask=p0 < p1, other=0)  # the page index is carried one page ahead
    for pg in range(p0, p1):
        page = _page_block(nidx, H, h, I32)
        ok = pg < p1
        nidx = tl.load(row + tl.minimum(pg + 1, p1 - 1))
        ks, kz = _k_scales(page, ok, k_scale, k_zero, D, DP, PERW)
        if L2:
            _prefetch_page(_page_block(nidx, H, h, I32), k_words, k_scale, k_zero, v_hi, v_lo, v_scale, v_zero,
                           BITS, VPREC, D)
        words = _k_words(page, ok, k_words, TS, BITS, D, DP)
        ss, m_p = _page_scores(qf, qd, ks, kz, words, ok, qk_scale, GP, TS, KWP, BITS, ASM)
        acc, zacc, l_t, m_i = _rescale(acc, zacc, l_t, m_i, tl.maximum(m_i, m_p))
        for sb in tl.static_range(32 // TS):
            s = ss[sb]
            p = tl.exp2(s - m_i[:, None])
            l_t += p
            cold = no_cold
            if VPREC:
                cold = _cold(s, m_p, sink_max, tau, G, GP)
            acc, zacc = _v_sub(acc, zacc, p, v_hi, v_lo, v_scale, v_zero, page, sb, ok, cold, GP, TS, BITS, VPREC, D,
                               DP)
    _store_partial_cc(acc, zacc, l_t, m_i, ws_o, ws_ml, slot, G, GR, GP, DP, BITS)


@triton.jit
def _store_partial_cc(acc, zacc, l_t, m_i, ws_o, ws_ml, slot, G: tl.constexpr, GR: tl.constexpr,
                      GP: tl.constexpr, DP: tl.constexpr, BITS: tl.constexpr):
    """Partial (m, l, o) at ``slot``: o[g, 16 w + j] = 2**(53 - s_j) * sum_t acc[j] + sum_t zacc."""
    VWP: tl.constexpr = DP // 16
    LIM: tl.constexpr = 24 // BITS  # as in _v_sub
    gq = tl.arange(0, GP)
    g2 = gq[:, None]
    w2 = tl.arange(0, VWP)[None, :]
    z = tl.sum(zacc, 1)  # [GP, VWP // 2] per group -> per word
    z = tl.reshape(tl.join(z, z), [GP, VWP])
    obase = ws_o + (slot * GR + g2) * DP + 16 * w2
    for j in tl.static_range(16):
        if BITS == 4:  # the shift of nibble j // 2 (as in _v_sub)
            unit = 2.0 ** (53 - (4 * (j // 2) if j // 2 < LIM else 4 * (j // 2) - 16))
        else:
            unit = 2.0 ** (53 - (2 * j if j < LIM else 2 * j - 16))
        tl.store(obase + j, tl.sum(acc[j], 1) * unit + z, mask=g2 < G)
    tl.store(ws_ml + (slot * GR + gq) * 2, m_i, mask=gq < G)
    tl.store(ws_ml + (slot * GR + gq) * 2 + 1, tl.sum(l_t, 1), mask=gq < G)
