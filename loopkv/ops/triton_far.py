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

This module also holds the host-side choice between this reader and the tensor-core one (``"dot"``,
``_far_quant`` in ``loopkv/ops/triton_attention.py``): ``choose_far_impl``; and two helpers both use.
"""

from __future__ import annotations

import triton
import triton.language as tl

UNIT_IN = 96  # fields x 2**(96 - s) ...
UNIT_OUT = 53  # ... give products in units of 2**(96 - 149) = 2**-53


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
def _v_groups(page, t, wv, wvm, ok, NG: tl.constexpr, VWP: tl.constexpr, OPT: tl.constexpr):
    """Offsets and mask of V's per-token scale/zero for tokens t [1, TS, 1]: one per 32-channel group
    (OPT & OPT_VG: [.., VWP // 2]) or one per V word wv [1, 1, VWP] (the group of word wv)."""
    # one return after a constexpr if: Triton 3.6 rejects returns of different shapes in the two branches
    if OPT & 2:
        gv = tl.arange(0, VWP // 2)[None, None, :]
        off = page * (32 * NG) + t * NG + gv
        mask = gv < tl.where(ok, NG, 0)
    else:
        off = page * (32 * NG) + t * NG + wv // 2
        mask = wvm
    return off, mask


@triton.jit
def _page_block(page, H, h, OPT: tl.constexpr):
    """Block index ``page * H + h`` of a (physical page, KV head) in every pool: 64-bit, or 32-bit under OPT_I32
    (the launcher checks every pool fits int32 offsets)."""
    if not (OPT & 8):
        page = page.to(tl.int64)
    return page * H + h


@triton.jit
def _fetch_scales(page, ok, k_scale, k_zero, v_scale, v_zero, TS: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
                  PERW: tl.constexpr, WITH_V: tl.constexpr, OPT: tl.constexpr):
    """Issue the scale loads of page block ``page`` (masked off unless ``ok``): (k_scale per field, k_zero,
    v_scale, v_zero per sub-tile). OPT & OPT_QK: k_scale is one tile [1, KWP, PERW] (16-byte loads); OPT &
    OPT_VG: v_scale and v_zero are [1, TS, VWP // 2] tiles (one per 32-channel group). WITH_V False: V's are
    placeholders (loaded by ``_v_sub``)."""
    KW: tl.constexpr = D // PERW
    KWP: tl.constexpr = DP // PERW
    NG: tl.constexpr = D // 32
    VW: tl.constexpr = D // 16
    VWP: tl.constexpr = DP // 16
    w = tl.arange(0, KWP)[None, None, :]
    wm = w < tl.where(ok, KW, 0)  # (not `& ok`: the interpreter turns a scalar & into int32)
    ks = ()
    if OPT & 1:
        w2 = tl.arange(0, KWP)[None, :, None]
        j2 = tl.arange(0, PERW)[None, None, :]
        ks = (tl.load(k_scale + page * D + w2 * PERW + j2, mask=w2 < tl.where(ok, KW, 0), other=0.0),)
    else:
        for j in tl.static_range(PERW):
            ks = ks + (tl.load(k_scale + page * D + w * PERW + j, mask=wm, other=0.0),)
    c = tl.arange(0, DP)[None, :]
    kz = tl.load(k_zero + page * D + c, mask=c < tl.where(ok, D, 0), other=0.0)
    wv = tl.arange(0, VWP)[None, None, :]
    wvm = wv < tl.where(ok, VW, 0)
    vs = ()
    vz = ()
    for sb in tl.static_range(32 // TS):
        t = sb * TS + tl.arange(0, TS)[None, :, None]
        if WITH_V:
            goff, gvm = _v_groups(page, t, wv, wvm, ok, NG, VWP, OPT)
            vs = vs + (tl.load(v_scale + goff, mask=gvm, other=0.0),)
            vz = vz + (tl.load(v_zero + goff, mask=gvm, other=0.0),)
        else:
            vs = vs + (ok,)  # placeholders
            vz = vz + (ok,)
    return ks, kz, vs, vz


@triton.jit
def _fetch_codes(page, ok, k_words, v_hi, v_lo, TS: tl.constexpr, BITS: tl.constexpr, VPREC: tl.constexpr,
                 D: tl.constexpr, DP: tl.constexpr, WITH_V: tl.constexpr):
    """Issue the code loads of page block ``page`` (masked off unless ``ok``): (K words, hi, lo per sub-tile).
    Under V precision lo is a placeholder (``_v_sub`` loads it, masked by the cold test); WITH_V False: hi and
    lo are placeholders."""
    PERW: tl.constexpr = 32 // BITS
    KW: tl.constexpr = D // PERW
    KWP: tl.constexpr = DP // PERW
    VW: tl.constexpr = D // 16
    VWP: tl.constexpr = DP // 16
    w = tl.arange(0, KWP)[None, None, :]
    wm = w < tl.where(ok, KW, 0)
    wv = tl.arange(0, VWP)[None, None, :]
    wvm = wv < tl.where(ok, VW, 0)
    words = ()
    hi = ()
    lo = ()
    for sb in tl.static_range(32 // TS):
        t = sb * TS + tl.arange(0, TS)[None, :, None]
        words = words + (tl.load(k_words + page * (32 * KW) + t * KW + w, mask=wm, other=0),)
        if WITH_V:
            voff = page * (32 * VW) + t * VW + wv
            hi = hi + (tl.load(v_hi + voff, mask=wvm, other=0),)  # int32: crumb c at bits 2c = channel 16 w + c
            if BITS == 4 and not VPREC:
                lo = lo + (tl.load(v_lo + voff, mask=wvm, other=0),)
            else:
                lo = lo + (hi[sb],)  # placeholder (INT2: no lo plane; V precision: loaded after the cold test)
        else:
            hi = hi + (ok,)  # placeholders
            lo = lo + (ok,)
    return words, hi, lo


@triton.jit
def _fetch(page_table, b64, MAXP, H, h, pg, p1, k_words, k_scale, k_zero, v_hi, v_lo, v_scale, v_zero,
           TS: tl.constexpr, BITS: tl.constexpr, VPREC: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
           WITH_V: tl.constexpr, OPT: tl.constexpr):
    """Issue the loads of history page ``pg`` (masked off past ``p1``): (page, ok, k_scale per field, k_zero,
    K words per sub-tile, v_scale, v_zero, hi, lo per sub-tile); see ``_fetch_scales`` and ``_fetch_codes``."""
    ok = pg < p1
    page = _page_block(tl.load(page_table + b64 * MAXP + pg, mask=ok, other=0), H, h, OPT)
    ks, kz, vs, vz = _fetch_scales(page, ok, k_scale, k_zero, v_scale, v_zero, TS, D, DP, 32 // BITS, WITH_V, OPT)
    words, hi, lo = _fetch_codes(page, ok, k_words, v_hi, v_lo, TS, BITS, VPREC, D, DP, WITH_V)
    return page, ok, ks, kz, words, vs, vz, hi, lo


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
                   VPREC: tl.constexpr, D: tl.constexpr, SCALES: tl.constexpr):
    """OPT_L2: ask L2 for page block ``page``'s codes (and scales, if SCALES) one iteration before they are
    loaded, so that those loads wait for L2 instead of HBM. A page-head is contiguous in every pool (``page * H +
    h`` blocks); V precision leaves the lo plane to its masked load (prefetching it would read the bytes the
    cold test saves)."""
    PERW: tl.constexpr = 32 // BITS
    KW: tl.constexpr = D // PERW
    VW: tl.constexpr = D // 16
    NG: tl.constexpr = D // 32
    _prefetch_lines(k_words + page * (32 * KW), (32 * KW * 4 + 127) // 128)
    _prefetch_lines(v_hi + page * (32 * VW), (32 * VW * 4 + 127) // 128)
    if BITS == 4 and not VPREC:
        _prefetch_lines(v_lo + page * (32 * VW), (32 * VW * 4 + 127) // 128)
    if SCALES:  # scales are fp16: a line holds 64; int32 views keep the one-line stride of _prefetch_lines
        _prefetch_lines((k_scale + page * D).to(tl.pointer_type(tl.int32)), (D * 2 + 127) // 128)
        _prefetch_lines((k_zero + page * D).to(tl.pointer_type(tl.int32)), (D * 2 + 127) // 128)
        _prefetch_lines((v_scale + page * (32 * NG)).to(tl.pointer_type(tl.int32)), (32 * NG * 2 + 127) // 128)
        _prefetch_lines((v_zero + page * (32 * NG)).to(tl.pointer_type(tl.int32)), (32 * NG * 2 + 127) // 128)


@triton.jit
def _k_prep(qf, qd, ks, kz, GP: tl.constexpr, KWP: tl.constexpr, PERW: tl.constexpr, OPT: tl.constexpr):
    """Per page: ``qk[j]`` [GP, 1, KWP] = qf[j] * k_scale (field j of every word) and ``bias`` [GP, 1] =
    q . k_zero (qd [GP, DP]: the query in channel order, a compact layout: one reduction, not per field).
    OPT & OPT_QK: qf is one tile [GP, KWP, PERW] and ks[0] [1, KWP, PERW]: one product per channel, then
    split into fields."""
    qk = ()
    if OPT & 1:
        parts = _split_fields(qf * ks[0].to(tl.float32), GP, KWP, PERW)
        for j in tl.static_range(PERW):
            qk = qk + (parts[j][:, None, :],)
    else:
        for j in tl.static_range(PERW):
            qk = qk + (qf[j] * ks[j].to(tl.float32),)
    return qk, tl.sum(qd * kz.to(tl.float32), 1)[:, None]


@triton.jit
def _k_sub(qk, bias, words, ok, qk_scale, BITS: tl.constexpr, LIM: tl.constexpr):
    """Scores [GP, TS] (log2 units) of a sub-tile's K words [1, TS, KWP]; ``ok`` False -> -inf. Fields
    ``j < LIM`` are read in place, the others from ``words >> 16`` (shift ``BITS * j - 16``)."""
    PERW: tl.constexpr = 32 // BITS
    upper = words >> 16
    part = qk[0] * _sub(words, 0, BITS)
    for j in tl.static_range(1, PERW):
        if j < LIM:
            part += qk[j] * _sub(words, BITS * j, BITS)
        else:
            part += qk[j] * _sub(upper, BITS * j - 16, BITS)
    s = (tl.sum(part, 2) * 9007199254740992.0 + bias) * qk_scale  # 2**53
    return tl.where(ok, s, float("-inf"))


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
    """"k16", per page: the query-scale products of field pairs as packed fp16 (a tuple of PERW // 2 int32 tiles
    [GP, 1, KWP]: pair k is field k of a word's low half and of its high half) and ``unscale``. ``qf`` [GP, KWP,
    PERW] carries ``2**(24 - bit_j)`` per field (its bit in ``_k_sub16``), so every product ``qk * field`` is in the
    same unit; the page's largest ``|q * k_scale * 2**(24 - bit)|`` is scaled below ``2**15`` by an exact power of two
    ``2**(141 - e)`` (e: its biased fp32 exponent, at least 15), which ``unscale`` = ``2**(e - 141)`` undoes."""
    v = qf * ks[0].to(tl.float32)
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
    """"k16": ``_k_sub`` with the field work in fp16 pairs: per word, one shift and PERW // 2 mask + ``HFMA2``
    pairs (fp16 sums of PERW // 2 products per half), then each word's pair summed into fp32. Pair k is field k of
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
    # INT4 page loop 898 -> 862 instructions with 2 levels; INT2 723 -> 711 with 1, 861 with a second level that
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
def _v_sub(acc, zacc, p, hi, lo, vs, vz, v_hi, v_lo, v_scale, v_zero, page, sub, ok, cold, GP: tl.constexpr,
           TS: tl.constexpr, BITS: tl.constexpr, VPREC: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
           LOAD_V: tl.constexpr, OPT: tl.constexpr):
    """acc[j] [GP, TS, VWP] += p * v_scale * 2**96 * field j (channel 16 w + j) and zacc [GP, TS, VWP] +=
    p * v_zero (+ 1.5 * v_scale for cold tokens) for the sub-tile ``sub``; p [GP, TS], cold [TS]. LOAD_V:
    load hi, lo, v_scale, v_zero here (else they were prefetched). OPT & OPT_VG: v_scale, v_zero and zacc
    are per 32-channel group ([.., VWP // 2]); the weights reach the word tile by ``join`` + ``reshape``
    (each thread's two words of a group are in its registers: no gather, no duplicate loads)."""
    NG: tl.constexpr = D // 32
    VW: tl.constexpr = D // 16
    VWP: tl.constexpr = DP // 16
    t = sub * TS + tl.arange(0, TS)[None, :, None]
    wv = tl.arange(0, VWP)[None, None, :]
    wvm = wv < tl.where(ok, VW, 0)
    voff = page * (32 * VW) + t * VW + wv
    if LOAD_V:
        goff, gvm = _v_groups(page, t, wv, wvm, ok, NG, VWP, OPT)
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
    if OPT & 2:
        ag = p[:, :, None] * (vs * 79228162514264337593543950336.0)  # 2**96, per group
        a = tl.reshape(tl.join(ag, ag), [GP, TS, VWP])  # word w: group w // 2
    else:
        a = p[:, :, None] * (vs * 79228162514264337593543950336.0)  # 2**96
    VLIM: tl.constexpr = (32 // BITS) // 2 + ((OPT >> 2) & 1) * (24 // BITS - (32 // BITS) // 2)  # see far_cc
    new = ()
    for j in tl.static_range(16):
        if BITS == 4:  # nibble j // 2 of `even` (j even) or `odd`
            if j // 2 < VLIM:
                f = _sub(even if j % 2 == 0 else odd, 4 * (j // 2), 4)
            else:
                f = _sub(even_u if j % 2 == 0 else odd_u, 4 * (j // 2) - 16, 4)
        else:
            if j < VLIM:
                f = _sub(hi, 2 * j, 2)
            else:
                f = _sub(hi_u, 2 * j - 16, 2)
        new = new + (acc[j] + a * f,)
    zacc += p[:, :, None] * vz
    return new, zacc


@triton.jit
def _page_scores(qf, qd, ks, kz, words, ok, qk_scale, GP: tl.constexpr, KWP: tl.constexpr, BITS: tl.constexpr,
                 LIM: tl.constexpr, NSUB: tl.constexpr, OPT: tl.constexpr, TS: tl.constexpr):
    """Scores of a page's ``NSUB`` sub-tiles (a tuple of [GP, TS], log2 units) and the page maximum [GP]."""
    if OPT & 512:  # "k16"
        qk2, unscale = _k_prep16(qf, ks, GP, KWP, 32 // BITS, (OPT & 1024) != 0)
        bias = tl.sum(qd * kz.to(tl.float32), 1)[:, None]  # q . k_zero, as _k_prep
    else:
        qk, bias = _k_prep(qf, qd, ks, kz, GP, KWP, 32 // BITS, OPT)
    m_p = tl.full([GP], float("-inf"), tl.float32)
    ss = ()
    for sb in tl.static_range(NSUB):
        if OPT & 512:
            s = _k_sub16(qk2, unscale, bias, words[sb], ok, qk_scale, GP, TS, KWP, BITS, (OPT & 1024) != 0,
                         (1 if KWP * TS >= 64 else 0) + (1 if KWP * TS >= 128 else 0))
        else:
            s = _k_sub(qk, bias, words[sb], ok, qk_scale, BITS, LIM)
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
def far_cc(
    q, sq_b, sq_h, b, h, H, MAXP, length, p0, p1, page_table, sink_k, k_words, k_scale, k_zero, v_hi, v_lo,
    v_scale, v_zero, qk_scale, tau, ws_o, ws_ml, slot,
    G: tl.constexpr, GR: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, BITS: tl.constexpr,
    VPREC: tl.constexpr, PPI: tl.constexpr, TS: tl.constexpr, PREFETCH: tl.constexpr, OPT: tl.constexpr,
):
    """History pages [p0, p1) of row b, KV head h (codes as int32 words) -> partial (m, l, o) at ``slot``.

    Each iteration takes ``PPI`` pages, each as ``32 // TS`` sub-tiles of ``TS`` tokens (TS sets how many
    tokens a thread holds: the per-page scale work is shared by a thread's tokens). PREFETCH: each
    iteration issues the next iteration's loads before computing (one iteration of loads in flight, more
    registers). OPT: bit set of the variants (``CC_OPTS``; 0 is session 2's reader)."""
    PERW: tl.constexpr = 32 // BITS
    # fields j < LIM of a word are read in place, the rest from the word >> 16. A masked field below bit 24
    # read as fp32 is still exactly 2**-149 * bits (exponent field 0 or 1), so OPT & OPT_F24 reads 24 // BITS
    # fields in place (the default: the lower half)
    LIM: tl.constexpr = PERW // 2 + ((OPT >> 2) & 1) * (24 // BITS - PERW // 2)
    KWP: tl.constexpr = DP // PERW
    VWP: tl.constexpr = DP // 16
    NSUB: tl.constexpr = 32 // TS
    b64 = b.to(tl.int64)
    gq = tl.arange(0, GP)
    g3 = gq[:, None, None]
    wq = tl.arange(0, KWP)[None, None, :]
    if OPT & 1:  # one tile [GP, KWP, PERW] (channel PERW * w + j), times 2**(96 - s_j) (exact: built bitwise)
        w3 = tl.arange(0, KWP)[None, :, None]
        j3 = tl.arange(0, PERW)[None, None, :]
        q3k = tl.load(q + b64 * sq_b + (h * G + g3) * sq_h + w3 * PERW + j3, mask=(g3 < G) & (w3 * PERW + j3 < D),
                      other=0.0).to(tl.float32)
        if OPT & 512:  # "k16": 2**(24 - bit) of the field's fp16 subnormal (the bits of _k_sub16)
            kk = j3 % (16 // BITS)
            if BITS == 4:
                b3 = 4 * (kk % 2)
            else:
                b3 = tl.where(kk < 5, 2 * kk, 2 * kk - 8)
            qf = q3k * ((127 + 24 - b3) << 23).to(tl.float32, bitcast=True)
        else:
            s3 = tl.where(j3 < LIM, BITS * j3, BITS * j3 - 16)
            qf = q3k * ((127 + 96 - s3) << 23).to(tl.float32, bitcast=True)
    else:
        qf = ()  # field j of the query, times 2**(96 - s_j)
        for j in tl.static_range(PERW):
            qj = tl.load(q + b64 * sq_b + (h * G + g3) * sq_h + wq * PERW + j,
                         mask=(g3 < G) & (wq * PERW + j < D), other=0.0).to(tl.float32)
            qf = qf + (qj * (2.0 ** (96 - (BITS * j if j < LIM else BITS * j - 16))),)
    cq = tl.arange(0, DP)[None, :]
    qd = tl.load(q + b64 * sq_b + (h * G + gq[:, None]) * sq_h + cq, mask=(gq[:, None] < G) & (cq < D),
                 other=0.0).to(tl.float32)  # [GP, DP]
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
    l_t = tl.zeros([GP, TS], tl.float32)
    if OPT & 2:
        zacc = tl.zeros([GP, TS, VWP // 2], tl.float32)  # per 32-channel group
    else:
        zacc = tl.zeros([GP, TS, VWP], tl.float32)
    acc = ()
    for _j in tl.static_range(16):
        acc = acc + (tl.zeros([GP, TS, VWP], tl.float32),)
    no_cold = tl.zeros([TS], tl.int32) > 0
    row = page_table + b64 * MAXP
    AHEAD: tl.constexpr = (OPT & 384) != 0  # page index (and scales) carried one page ahead; PPI 1
    if AHEAD:
        nidx = tl.load(row + p0, mask=p0 < p1, other=0)
        if OPT & 256:
            nsc = _fetch_scales(_page_block(nidx, H, h, OPT), p0 < p1, k_scale, k_zero, v_scale, v_zero, TS, D, DP,
                                PERW, True, OPT)
    nxt = ()
    if PREFETCH:
        for pp in tl.static_range(PPI):
            nxt = nxt + (_fetch(page_table, b64, MAXP, H, h, p0 + pp, p1, k_words, k_scale, k_zero, v_hi, v_lo,
                                v_scale, v_zero, TS, BITS, VPREC, D, DP, True, OPT),)
    for pg in range(p0, p1, PPI):
        if AHEAD:  # this page's index (and scales) came from the previous iteration; issue the next page's
            page = _page_block(nidx, H, h, OPT)
            ok = pg < p1
            nidx = tl.load(row + tl.minimum(pg + 1, p1 - 1))
            if OPT & 256:
                sc = nsc
                nsc = _fetch_scales(_page_block(nidx, H, h, OPT), pg + 1 < p1, k_scale, k_zero, v_scale, v_zero,
                                    TS, D, DP, PERW, True, OPT)
            else:
                sc = _fetch_scales(page, ok, k_scale, k_zero, v_scale, v_zero, TS, D, DP, PERW, True, OPT)
            if OPT & 64:
                _prefetch_page(_page_block(nidx, H, h, OPT), k_words, k_scale, k_zero, v_hi, v_lo, v_scale, v_zero,
                               BITS, VPREC, D, not (OPT & 256))
            words, hi, lo = _fetch_codes(page, ok, k_words, v_hi, v_lo, TS, BITS, VPREC, D, DP, True)
            cur = ((page, ok, sc[0], sc[1], words, sc[2], sc[3], hi, lo),)
        else:
            if PREFETCH:  # this iteration's loads were issued by the previous one; issue the next iteration's
                cur = nxt
                nxt = ()
                first = pg + PPI
            else:
                cur = ()
                first = pg
            if OPT & 64:  # OPT_L2: the next iteration's pages to L2 while this one's loads are in flight
                for pp in tl.static_range(PPI):
                    nb = _page_block(tl.load(row + tl.minimum(pg + PPI + pp, p1 - 1)), H, h, OPT)
                    _prefetch_page(nb, k_words, k_scale, k_zero, v_hi, v_lo, v_scale, v_zero, BITS, VPREC, D, True)
            for pp in tl.static_range(PPI):
                fetched = _fetch(page_table, b64, MAXP, H, h, first + pp, p1, k_words, k_scale, k_zero, v_hi, v_lo,
                                 v_scale, v_zero, TS, BITS, VPREC, D, DP, PREFETCH, OPT)
                if PREFETCH:
                    nxt = nxt + (fetched,)
                else:
                    cur = cur + (fetched,)
        # ---- scores of every sub-tile of the PPI pages, then one maximum update
        ss = ()
        m_pages = ()
        m_top = m_i
        for pp in tl.static_range(PPI):
            s_pp, m_p = _page_scores(qf, qd, cur[pp][2], cur[pp][3], cur[pp][4], cur[pp][1], qk_scale, GP, KWP,
                                     BITS, LIM, NSUB, OPT, TS)
            ss = ss + s_pp
            m_pages = m_pages + (m_p,)
            m_top = tl.maximum(m_top, m_p)
        acc, zacc, l_t, m_i = _rescale(acc, zacc, l_t, m_i, m_top)
        # ---- values
        for pp in tl.static_range(PPI):
            for sb in tl.static_range(NSUB):
                s = ss[pp * NSUB + sb]
                p = tl.exp2(s - m_i[:, None])  # 0 for pages past p1
                l_t += p
                cold = no_cold
                if VPREC:
                    cold = _cold(s, m_pages[pp], sink_max, tau, G, GP)
                acc, zacc = _v_sub(acc, zacc, p, cur[pp][7][sb], cur[pp][8][sb], cur[pp][5][sb], cur[pp][6][sb],
                                   v_hi, v_lo, v_scale, v_zero, cur[pp][0], sb, cur[pp][1], cold, GP, TS, BITS,
                                   VPREC, D, DP, not PREFETCH, OPT)
    _store_partial_cc(acc, zacc, l_t, m_i, ws_o, ws_ml, slot, gq, G, GR, GP, DP, BITS, LIM, OPT)


@triton.jit
def _store_partial_cc(acc, zacc, l_t, m_i, ws_o, ws_ml, slot, gq, G: tl.constexpr, GR: tl.constexpr,
                      GP: tl.constexpr, DP: tl.constexpr, BITS: tl.constexpr, LIM: tl.constexpr, OPT: tl.constexpr):
    """Partial (m, l, o) at ``slot``: o[g, 16 w + j] = 2**(53 - s_j) * sum_t acc[j] + sum_t zacc."""
    VWP: tl.constexpr = DP // 16
    g2 = gq[:, None]
    w2 = tl.arange(0, VWP)[None, :]
    z = tl.sum(zacc, 1)  # [GP, VWP]
    if OPT & 2:  # [GP, VWP // 2] per group -> per word
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


FAR_IMPLS = ("cc", "dot")
# variants of the CUDA-core reader; qk, vg, f24 are on by default since session 3 (``triton_config.CC_DEFAULT_OPTS``;
# measured in docs/kernel-notes.md; ``cc_opts=()`` gives session 2's reader):
# "qk": q * k_scale once per channel and page on one [G, D/PERW, PERW] tile (16-byte k_scale loads), split into
# fields on register axes; "vg": V scale and zero per 32-channel group (one load each per token and group,
# the zero term per group, the weights widened to words by join + reshape, no layout conversion).
# "f24": fields below bit 24 read in place (6 of 8 nibbles, 12 of 16 crumbs; the default shifts half the
# fields of a word down by 16), which also spares the compiler's extra unsigned shift + SGXT per word
# "i32": history offsets in int32 (a pool's element count must be < 2**31; the launcher checks, and falls back
# for a default "i32"): 64-bit address arithmetic per load becomes one wide multiply-add. Measured in session 5:
# INT2 7% faster, INT4 5% slower (ptxas places the V loads later); on by default for INT2.
# "l2" (session 5): the next page's codes and scales prefetched to L2 (`prefetch.global.L2`, inline PTX, dropped
# under the interpreter and on ROCm): INT4 at par, V precision 3% faster, INT2 with "i32" 12% faster; on by default
# (triton_config.CC_DEFAULT_OPTS_BY_BITS).
# Measured and removed: session 3's "la" (V precision's lo plane one page ahead, 0.80x, session 4) and session 5's
# "p2" / "p3" (the page loop as `tl.range(num_stages=2|3)`, Triton's cp.async pipeliner: 0.45-0.94x in every
# mode, cell_attention_2026-11-30_session5.json); docs/kernel-notes.md.
# "pt" (session 6): the page-table entry of the next page loaded one iteration ahead and carried (ncu's source view
# of the INT4 reader put 8% of the page loop's stall samples on the R2UR that waits for the page index, before any
# of the page's loads can issue); "sc": also the next page's scales (k_scale, k_zero, v_scale, v_zero: 16 fp16
# values per lane at head_dim 128), carried in registers (17% of the stall samples were on the first use of the
# page's scales). Both need pages_per_iter 1 and no register prefetch. Not yet measured on the GPU.
# "k16" (session 12, not yet measured on a GPU): K's field work in packed fp16 pairs (``_k_sub16``): a word's two
# 16-bit halves hold channels PERW * w + k and PERW * w + PERW // 2 + k at the same bit, so one mask and one
# ``fma.rn.f16x2`` (inline PTX on CUDA) take a field of each; per word one shift (fields that would reach fp16's
# exponent bits are read from ``w >> 8``), PERW // 2 pairs, and the pair's sums widened to fp32. The page's
# query-scale products are scaled below 2**15 by an exact power of two. Needs "qk". Not bit-equal to the fp32
# reader: fp16 rounding of each product and of the sums of PERW // 2 of them (bound in tests/ops).
CC_OPTS = {"qk": 1, "vg": 2, "f24": 4, "i32": 8, "l2": 64, "pt": 128, "sc": 256, "k16": 512}
OPT_ASM16 = 1024  # not a cc_opts name: the launcher adds it to "k16" on CUDA (the pairs' work in inline PTX)


def cc_opt_bits(cc_opts) -> int:
    """The kernel's OPT bit set for a collection of ``CC_OPTS`` names (empty: the default reader)."""
    bits = 0
    for name in cc_opts or ():
        if name not in CC_OPTS:
            raise ValueError(f"cc_opts: unknown option {name!r}; choose from {sorted(CC_OPTS)}")
        bits |= CC_OPTS[name]
    return bits
CC_MAX_GROUP = 2  # query heads per KV head up to which the CUDA-core reader is the default


def choose_far_impl(bits: int, group: int, far_impl: str | None = None, *, cc_default: bool = True,
                    exact: bool = False) -> str:
    """History reader: ``"cc"`` (CUDA cores, ``triton_far``) for code pages read by <= 2 query heads per KV
    head (if ``cc_default``: the launcher passes ``triton_attention.CC_DEFAULT``), ``"dot"`` (tensor cores)
    otherwise; ``far_impl`` overrides (BF16 pages always use ``"dot"``). ``exact`` (fp32 inputs): ``"dot"``,
    launched with four warps (``triton_config._config``): the one-warp ``"cc"`` program's exact fp32 near part
    spills (static, sm_90: a 4 KB stack at head_dim 128; docs/kernel-notes.md, Session 6)."""
    if far_impl is not None and far_impl not in FAR_IMPLS:
        raise ValueError(f"far_impl must be one of {FAR_IMPLS} or None (automatic), got {far_impl!r}")
    if bits not in (4, 2):
        return "dot"
    if far_impl is None:
        return "cc" if group <= CC_MAX_GROUP and cc_default and not exact else "dot"
    return far_impl
