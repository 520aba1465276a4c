"""The Triton kernel of ``chunk_attention`` (``loopkv/ops/chunk_attention.py``): a chunk's queries on one row read the
row's pages once per block of queries, flash-attention style, each query with the served semantics
(docs/kernels.md, "The chunk reader").

Grid ``(cdiv(S, BM), H, NSPLIT)`` (``(cdiv(S, BM), H)`` when NSPLIT is 1): a program holds ``BM`` consecutive tokens
of the chunk x the ``G`` query heads of one KV head as tile rows (row ``r``: token ``r // GP``, query head ``r % GP``;
``GP`` is ``G`` padded to a power of two), and runs one online softmax (fp32, log2 units) over its split's share of

* the sink: one tile of 32 exact slots, a row reading positions ``<= its own`` (and below the row's sink slots);
* history pages ``0 .. n_pages(n_last) - 1`` (``n_last``: what the block's last token holds), a row reading page
  ``p`` iff ``p < n_pages(n_i)``. Code pages: K's integer codes as a [32, D] tile in channel order and the scores
  ``(q * k_scale) . code + q . k_zero``; V dequantized into [32, D] tiles. INT4 with V precision: the cold rule per
  (token, page), ``m_ref = max(the row's sink max, the row's page max)``, a token cold for every query head of its
  group reading ``4 * hi + 1.5``: ``V = base + hot * delta`` with ``base = (4 hi + 1.5) v_scale + v_zero`` and
  ``delta = (lo - 1.5) v_scale``, so the value product is two ``tl.dot`` (the second with the hot weights only). BF16
  pages are exact tiles;
* the exact tail in tiles of ``BN`` positions, a row reading ``[SINK + PAGE * n_pages(n_i), held + i]``.

History splits (flash-decoding style; a short chunk otherwise has too few programs, each walking every page): split
``sp`` of a block reads pages ``[sp * per, min((sp + 1) * per, npg_last))``, ``per = cdiv(npg_last, NSPLIT)`` of the
block's own ``npg_last = n_pages(n_last)`` (a split past them reads none); every split scores the sink (the cold rule's
sink max is the row's), split 0 alone adds it to its softmax, and the last split reads the exact tail. Each split
stores its partial (m, l, acc; fp32, log2 units, unnormalized) to a workspace and ``_chunk_merge_kernel`` merges them
by log-sum-exp into ``out`` (a split that read nothing for a row, m = -inf, gets no weight). NSPLIT 1 stores ``out``
directly, no workspace. ``choose_splits`` picks NSPLIT on the host: programs ``cdiv(S, BM) * H * NSPLIT`` for
``SPLIT_WAVES`` (2) per SM, at least ``MIN_SPLIT_PAGES`` (4) pages a split of the last block's, at most
``MAX_SPLITS`` (16); under the interpreter the SM count is ``triton_config._num_sms``'s stand-in (4), so the tests'
small rows run NSPLIT 1 unless they force more.

Precision: exact tiles as the decode reader's (16-bit operands, fp32 accumulation; fp32 inputs in fp32). Code pages
with 16-bit inputs: K is dequantized in fp32 as the codec decodes it and multiplied as the sum of two (fp16) or three
(bf16) tiles of the queries' dtype (``_split_dot``: 22-24 bits of each key, exact products, fp32 sums), more precise
than the decode readers' fp16 ``q * k_scale``; dequantized V and the weights are fp16 (2**-11 relative). fp32
inputs: every product in fp32.

What runs the reference instead (``_launchable``): float64 queries, ROCm, a GPU below sm_80, non-contiguous pools or
page tables, and cell shapes outside ``triton_config.serves`` (warned once per shape).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from loopkv.format import GROUP, PAGE, SINK, WINDOW, n_pages
from loopkv.ops import triton_config
from loopkv.ops.chunk_attention import chunk_attention_reference, tail_length
from loopkv.ops.triton_attention import _online
from loopkv.ops.triton_config import KERNEL_OPTIONS
from loopkv.ops.triton_dot import _dot

assert (SINK, WINDOW, PAGE, GROUP) == (32, 256, 32, 32)  # spelled out as literals in the kernel
LOG2E = 1.0 / math.log(2.0)
ROWS = 64  # tile rows (tokens x padded query heads) per program; at least 16 (tl.dot's smallest M)
TAIL_BLOCK = 32  # exact tail positions per tile
# a code page's dequantized fp32 keys as the sum of this many tiles of the queries' dtype (_split_dot): 24 bits for
# bf16, 22 for fp16; fp32 queries take one fp32 product
KEY_PARTS = {torch.bfloat16: 3, torch.float16: 2, torch.float32: 1}
# the history split (choose_splits): programs per SM wanted, pages per split at least, splits at most
SPLIT_WAVES = 2
MIN_SPLIT_PAGES = 4
MAX_SPLITS = 16
MERGE_ROWS = 16  # (token, query head) rows per merge program


@triton.jit
def _unpack(x, BITS: tl.constexpr, DT: tl.constexpr):
    """Packed codes x [T, W] (uint8, ``8 // BITS`` codes per byte, code ``i`` of byte ``j`` = channel ``(8 // BITS) * j
    + i`` at bit ``BITS * i``) -> [T, W * 8 // BITS] in channel order, as DT (exact integers)."""
    if BITS == 4:
        y = tl.join(x & 15, x >> 4)
    else:  # join appends the new axis last: (j, b, a) -> channel 4 j + 2 b + a
        y = tl.join(tl.join(x & 3, (x >> 4) & 3), tl.join((x >> 2) & 3, x >> 6))
    return tl.reshape(y, [x.shape[0], x.shape[1] * (8 // BITS)]).to(DT)


@triton.jit
def _exact_tile(qx, acc, m_i, l_i, kptr, vptr, kmask, ok, qk_scale, PREC: tl.constexpr, UPCAST: tl.constexpr):
    """One online-softmax step over exact keys and values at kptr, vptr [N, DP] (loaded where kmask); ok [RM, N]: what
    each row reads.
    Returns (acc, m_i, l_i, the tile's scores)."""
    k = tl.load(kptr, mask=kmask, other=0.0)
    s = _dot(qx.to(k.dtype), tl.trans(k), PREC, UPCAST) * qk_scale
    s = tl.where(ok, s, float("-inf"))
    m_i, alpha, p, l_i = _online(s, m_i, l_i)
    v = tl.load(vptr, mask=kmask, other=0.0)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, PREC, UPCAST)
    return acc, m_i, l_i, s


@triton.jit
def _split_dot(qx, k, PARTS: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr):
    """``qx @ k^T`` [RM, 32] for fp32 keys k [32, DP], k as the sum of PARTS tiles of qx's dtype (each the rounding of
    what the previous ones leave): the products are exact and summed in fp32, so the scores keep about 8 * PARTS (bf16)
    or 11 * PARTS (fp16) bits of k. PARTS 1: fp32 queries, one fp32 product."""
    part = k.to(qx.dtype)
    s = _dot(qx, tl.trans(part), PREC, UPCAST)
    if PARTS > 1:
        rest = k - part.to(tl.float32)
        part = rest.to(qx.dtype)
        s += _dot(qx, tl.trans(part), PREC, UPCAST)
        if PARTS > 2:
            rest = rest - part.to(tl.float32)
            s += _dot(qx, tl.trans(rest.to(qx.dtype)), PREC, UPCAST)
    return s


@triton.jit
def _code_scores(qx, page, t, c, cm, k_pages, k_scale, k_zero, qk_scale, BITS: tl.constexpr, D: tl.constexpr,
                 DP: tl.constexpr, KPARTS: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr):
    """Scores [RM, 32] (log2 units) of a code page: K dequantized in fp32 (``code * k_scale + k_zero``, as the codec
    decodes it), then :func:`_split_dot`."""
    KBD: tl.constexpr = D * BITS // 8  # code bytes per token
    KB: tl.constexpr = DP * BITS // 8
    jk = tl.arange(0, KB)
    codes = tl.load(k_pages + page * (32 * KBD) + t[:, None] * KBD + jk[None, :], mask=(jk < KBD)[None, :], other=0)
    ks = tl.load(k_scale + page * D + c, mask=cm, other=0.0).to(tl.float32)
    kz = tl.load(k_zero + page * D + c, mask=cm, other=0.0).to(tl.float32)
    k = _unpack(codes, BITS, tl.float32) * ks[None, :] + kz[None, :]
    return _split_dot(qx, k, KPARTS, PREC, UPCAST) * qk_scale


@triton.jit
def _hot(s, sink_max, tau, gvalid, BM: tl.constexpr, GP: tl.constexpr):
    """[RM, 32]: whether each page token is hot for the row's token (the cold rule: cold iff below ``m_ref - tau`` for
    every query head of the token's group, ``m_ref = max(sink max, page max)`` per query head; padded heads count as
    cold)."""
    m_ref = tl.maximum(sink_max, tl.max(s, 1))
    cold = (s < (m_ref - tau)[:, None]) | (~gvalid)[:, None]
    if GP > 1:
        per_token = tl.min(tl.reshape(cold.to(tl.int32), [BM, GP, 32]), 1)  # [BM, 32]: cold for every head
        cold = tl.reshape(tl.broadcast_to(per_token[:, None, :], [BM, GP, 32]), [BM * GP, 32]) > 0
    return ~cold


@triton.jit
def _code_values(p, hot, page, t, c, cm, v_hi, v_lo, v_scale, v_zero, BITS: tl.constexpr, VPREC: tl.constexpr,
                 D: tl.constexpr, DP: tl.constexpr, EXACT: tl.constexpr):
    """``p @ V`` [RM, DP] for a code page, V dequantized (INT4 with V precision: ``base + hot * delta``)."""
    VBD: tl.constexpr = D // 4  # bytes of a V plane per token
    NG: tl.constexpr = D // 32
    jv = tl.arange(0, DP // 4)
    voff = page * (32 * VBD) + t[:, None] * VBD + jv[None, :]
    vm = (jv < VBD)[None, :]
    goff = page * (32 * NG) + t[:, None] * NG + (c // 32)[None, :]  # [32, DP]: each channel's group
    vs = tl.load(v_scale + goff, mask=cm[None, :], other=0.0).to(tl.float32)
    vz = tl.load(v_zero + goff, mask=cm[None, :], other=0.0).to(tl.float32)
    hi = _unpack(tl.load(v_hi + voff, mask=vm, other=0), 2, tl.float32)
    if BITS == 4:
        if VPREC:  # a lo plane no row reads hot is not loaded (its delta gets no weight)
            any_hot = tl.max(hot.to(tl.int32), 0) > 0
            lo = _unpack(tl.load(v_lo + voff, mask=vm & any_hot[:, None], other=0), 2, tl.float32)
            base = (4.0 * hi + 1.5) * vs + vz
            delta = (lo - 1.5) * vs
            ph = tl.where(hot, p, 0.0)
            if EXACT:
                o = tl.dot(p, base, input_precision="ieee")
                return tl.dot(ph, delta, o, input_precision="ieee")
            else:
                o = tl.dot(p.to(tl.float16), base.to(tl.float16))
                return tl.dot(ph.to(tl.float16), delta.to(tl.float16), o)
        lo = _unpack(tl.load(v_lo + voff, mask=vm, other=0), 2, tl.float32)
        val = (4.0 * hi + lo) * vs + vz
    else:
        val = hi * vs + vz
    if EXACT:
        return tl.dot(p, val, input_precision="ieee")
    else:
        return tl.dot(p.to(tl.float16), val.to(tl.float16))


@triton.jit
def _chunk_attn_kernel(
    q, sq_s, sq_h, sink_k, sink_v, tail_k, tail_v, page_table,
    k_pages, k_scale, k_zero, v_hi, v_lo, v_scale, v_zero, out, so_s, so_h, ws_acc, ws_m, ws_l,
    S, H, HELD, NSINK, T, qk_scale, tau,
    G: tl.constexpr, GP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
    BITS: tl.constexpr, VPREC: tl.constexpr, EXACT: tl.constexpr, KPARTS: tl.constexpr, PREC: tl.constexpr,
    UPCAST: tl.constexpr, NSPLIT: tl.constexpr,
):
    """Program (block of BM tokens, KV head h, split sp): the module docstring's three parts (split sp's share of
    them), then out[tokens, h*G:(h+1)*G] (NSPLIT 1) or the split's partial (m, l, acc) in the workspace."""
    RM: tl.constexpr = BM * GP
    blk = tl.program_id(0)
    h = tl.program_id(1)
    sp = tl.program_id(2)
    h64 = h.to(tl.int64)
    r = tl.arange(0, RM)
    i = blk * BM + r // GP  # the row's token
    g = r % GP
    gvalid = g < G
    rvalid = (i < S) & gvalid
    c = tl.arange(0, DP)
    cm = c < D
    pos = HELD + i  # the token's position: it reads n = pos + 1 tokens
    npg = tl.maximum(pos + 1 - 288, 0) // 32  # its history pages, n_pages(n)
    wsi = 32 + 32 * npg  # its first exact window position
    q_rows = q + i.to(tl.int64) * sq_s + (h * G + g) * sq_h
    qx = tl.load(q_rows[:, None] + c[None, :], mask=rvalid[:, None] & cm[None, :], other=0.0)
    m_i = tl.full([RM], float("-inf"), tl.float32)
    l_i = tl.zeros([RM], tl.float32)
    acc = tl.zeros([RM, DP], tl.float32)
    # ---- the sink: positions [0, min(n, NSINK)) (a short cache has fewer slots)
    t = tl.arange(0, 32)
    off = (h64 * NSINK + t)[:, None] * D + c[None, :]
    ok = rvalid[:, None] & (t[None, :] < NSINK) & (t[None, :] <= pos[:, None])
    kmask = (t < NSINK)[:, None] & cm[None, :]
    if NSPLIT == 1:
        acc, m_i, l_i, s = _exact_tile(qx, acc, m_i, l_i, sink_k + off, sink_v + off, kmask, ok, qk_scale, PREC,
                                       UPCAST)
        sink_max = tl.max(s, 1)
    else:  # every split scores the sink (the cold rule's sink max); split 0 alone adds it to its softmax
        k = tl.load(sink_k + off, mask=kmask, other=0.0)
        s = _dot(qx.to(k.dtype), tl.trans(k), PREC, UPCAST) * qk_scale
        s = tl.where(ok, s, float("-inf"))
        sink_max = tl.max(s, 1)
        own = (t * 0 + sp) == 0  # [32] (a scalar mask fails the interpreter)
        m_i, alpha, p, l_i = _online(tl.where(own[None, :], s, float("-inf")), m_i, l_i)
        v = tl.load(sink_v + off, mask=kmask & own[:, None], other=0.0)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, PREC, UPCAST)
    # ---- history pages [0, n_pages(n_last)), page pg read by the rows with pg < npg
    last = tl.minimum(blk * BM + BM, S) - 1
    npg_last = tl.maximum(HELD + last + 1 - 288, 0) // 32
    pg_lo = 0
    pg_hi = npg_last
    if NSPLIT > 1:  # split sp: pages [sp * per, (sp + 1) * per) of the block's, per = cdiv(npg_last, NSPLIT)
        per = (npg_last + NSPLIT - 1) // NSPLIT
        pg_lo = tl.minimum(sp * per, npg_last)
        pg_hi = tl.minimum(pg_lo + per, npg_last)
    if BITS != 0:
        for pg in range(pg_lo, pg_hi):
            page = tl.load(page_table + pg).to(tl.int64) * H + h
            reads = (rvalid & (pg < npg))[:, None]
            if BITS == 16:
                off = (page * 32 + t)[:, None] * D + c[None, :]
                acc, m_i, l_i, s = _exact_tile(qx, acc, m_i, l_i, k_pages + off, v_hi + off, cm[None, :], reads,
                                               qk_scale, PREC, UPCAST)
            else:
                s = _code_scores(qx, page, t, c, cm, k_pages, k_scale, k_zero, qk_scale, BITS, D, DP, KPARTS, PREC,
                                 UPCAST)
                s = tl.where(reads, s, float("-inf"))
                hot = reads
                if VPREC:
                    hot = _hot(s, sink_max, tau, gvalid, BM, GP)
                m_i, alpha, p, l_i = _online(s, m_i, l_i)
                acc = acc * alpha[:, None] + _code_values(p, hot, page, t, c, cm, v_hi, v_lo, v_scale, v_zero, BITS,
                                                          VPREC, D, DP, EXACT)
    # ---- the exact tail: positions ws + j, j in [0, T); row reads [wsi, pos]
    ws = 32 + 32 * (tl.maximum(HELD - 288, 0) // 32)  # the tail's first position, window_start(HELD)
    first = blk * BM
    j_lo = 32 + 32 * (tl.maximum(HELD + first + 1 - 288, 0) // 32) - ws  # the block's first token reads from here
    j_hi = HELD + last + 1 - ws
    if NSPLIT > 1:  # the last split reads the tail
        j_hi = tl.where(sp == NSPLIT - 1, j_hi, j_lo)
    for j0 in range(j_lo, j_hi, BN):
        j = j0 + tl.arange(0, BN)
        off = (h64 * T + j)[:, None] * D + c[None, :]
        at = ws + j
        ok = rvalid[:, None] & (at[None, :] >= wsi[:, None]) & (at[None, :] <= pos[:, None])
        acc, m_i, l_i, s = _exact_tile(qx, acc, m_i, l_i, tail_k + off, tail_v + off,
                                       ((j >= 0) & (j < T))[:, None] & cm[None, :], ok, qk_scale, PREC, UPCAST)
    if NSPLIT == 1:
        res = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        optr = out + i.to(tl.int64)[:, None] * so_s + (h * G + g)[:, None] * so_h + c[None, :]
        tl.store(optr, res.to(out.dtype.element_ty), mask=rvalid[:, None] & cm[None, :])
    else:  # the partial of row (split sp, token i, query head h*G+g): slot (sp * S + i) * H * G + h * G + g
        slot = (sp.to(tl.int64) * S + i) * (H * G) + h * G + g
        tl.store(ws_acc + slot[:, None] * D + c[None, :], acc, mask=rvalid[:, None] & cm[None, :])
        tl.store(ws_m + slot, m_i, mask=rvalid)
        tl.store(ws_l + slot, l_i, mask=rvalid)


@triton.jit
def _chunk_merge_kernel(ws_acc, ws_m, ws_l, out, R, D: tl.constexpr, DP: tl.constexpr, BR: tl.constexpr,
                        NSPLIT: tl.constexpr):
    """Rows ``[BR * pid, BR * (pid + 1))`` of out [R = S * Hq, D] (contiguous): the NSPLIT partials (m, l, acc; log2
    units) merged by log-sum-exp. A split that read nothing for a row (m = -inf, l = 0, acc = 0) gets no weight; a row
    no split read (none: every token reads itself) would be 0, not NaN."""
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    rm = r < R
    r64 = r.to(tl.int64)
    c = tl.arange(0, DP)
    mask = rm[:, None] & (c < D)[None, :]
    m = tl.full([BR], float("-inf"), tl.float32)
    for sp in tl.static_range(NSPLIT):
        m = tl.maximum(m, tl.load(ws_m + sp * R + r64, mask=rm, other=float("-inf")))
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    l_sum = tl.zeros([BR], tl.float32)
    acc = tl.zeros([BR, DP], tl.float32)
    for sp in tl.static_range(NSPLIT):
        w = tl.exp2(tl.load(ws_m + sp * R + r64, mask=rm, other=float("-inf")) - m_safe)
        l_sum += w * tl.load(ws_l + sp * R + r64, mask=rm, other=0.0)
        part = tl.load(ws_acc + (sp * R + r64)[:, None] * D + c[None, :], mask=mask, other=0.0)
        acc += w[:, None] * part
    res = acc / tl.where(l_sum > 0, l_sum, 1.0)[:, None]
    tl.store(out + r64[:, None] * D + c[None, :], res.to(out.dtype.element_ty), mask=mask)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def choose_splits(blocks: int, heads: int, pages: int, device: torch.device) -> int:
    """History splits per (block, KV head), NSPLIT: enough programs for ``SPLIT_WAVES`` per SM (``blocks * heads *
    NSPLIT``), at least ``MIN_SPLIT_PAGES`` pages per split of the last block's ``pages``, at most ``MAX_SPLITS``. 1:
    a single pass, no workspace. Under the interpreter ``triton_config._num_sms`` is a small stand-in."""
    if pages < 2 * MIN_SPLIT_PAGES:
        return 1
    want = -(-SPLIT_WAVES * triton_config._num_sms(device) // max(blocks * heads, 1))
    return int(max(1, min(want, pages // MIN_SPLIT_PAGES, MAX_SPLITS)))


def _launchable(q: Tensor, sink_k: Tensor, page_table: Tensor, pool: tuple[Tensor, ...]) -> bool:
    """Whether the kernel serves this call (module docstring); shapes it does not serve are warned once."""
    if q.dtype == torch.float64 or torch.version.hip:
        return False
    capability = triton_config._capability(q.device)  # None: Triton's interpreter (CPU tensors)
    if capability is not None and capability < (8, 0):
        return False
    if not (page_table.is_contiguous() and all(t.is_contiguous() for t in pool)):
        return False
    G, D = q.shape[1] // sink_k.shape[0], q.shape[2]
    if not triton_config.serves(D, G):
        triton_config.warn_reference(D, G)
        return False
    return True


def block_tokens(new: int, group: int) -> int:
    """Tokens per program: ``ROWS`` tile rows' worth, fewer for a short chunk, never under 16 rows (tl.dot)."""
    gp = _next_pow2(group)
    return max(16 // gp, min(ROWS // gp, _next_pow2(new)))


def warps(head_dim: int) -> int:
    """Warps per program: 4 at head_dim 64, else 8. Static (sm_90 build, Triton 3.9): INT4 with V precision at 128
    and 64 tile rows spills 16 B per thread on four warps and nothing on eight; at 256 eight warps still spill about
    0.5 KB. Not timed."""
    return 4 if _next_pow2(head_dim) <= 64 else 8


def chunk_attention(
    q: Tensor, sink_k: Tensor, sink_v: Tensor, tail_k: Tensor, tail_v: Tensor, held: int, ring: int,
    page_table: Tensor, k_pages: Tensor, k_scale: Tensor, k_zero: Tensor, v_hi: Tensor, v_lo: Tensor,
    v_scale: Tensor, v_zero: Tensor, bits: int, tau: float, scale: float,
) -> Tensor:
    """Triton ``chunk_attention`` (``loopkv/ops/chunk_attention.py``): q [S, Hq, D] -> [S, Hq, D]. What
    ``_launchable`` refuses runs the reference."""
    pool = (k_pages, k_scale, k_zero, v_hi, v_lo, v_scale, v_zero)
    S, Hq, D = q.shape
    H = sink_k.shape[0]
    if bits not in (16, 4, 2, 0):
        raise ValueError(f"bits must be 16, 4, 2 or 0 (no history), got {bits}")
    if Hq % H:
        raise ValueError(f"q has {Hq} heads, not a multiple of the cache's {H} KV heads")
    T = tail_length(held, S)
    if tuple(tail_k.shape) != (H, T, D) or tail_v.shape != tail_k.shape:
        raise ValueError(f"tail_k, tail_v must be [{H}, {T}, {D}] (positions from the window start to held + S), "
                         f"got {tuple(tail_k.shape)}, {tuple(tail_v.shape)}")
    if bits and page_table.shape[0] < n_pages(held + S):
        raise ValueError(f"page_table holds {page_table.shape[0]} pages; the chunk reads {n_pages(held + S)}")
    if not _launchable(q, sink_k, page_table, pool):
        return chunk_attention_reference(q, sink_k, sink_v, tail_k, tail_v, held, ring, page_table, *pool, bits, tau,
                                         scale)
    out = torch.empty(S, Hq, D, dtype=q.dtype, device=q.device)
    if S == 0:
        return out
    if q.stride(2) != 1:
        q = q.contiguous()
    sink_k, sink_v, tail_k, tail_v = (t.contiguous() for t in (sink_k, sink_v, tail_k, tail_v))
    G = Hq // H
    bm = block_tokens(S, G)
    exact = q.dtype == torch.float32
    compiled = triton_config._capability(q.device) is not None
    vprec = bits == 4 and math.isfinite(tau)
    blocks = triton.cdiv(S, bm)
    nsplit = choose_splits(blocks, H, n_pages(held + S) if bits else 0, q.device)
    if nsplit > 1:  # partials: acc [NSPLIT, S * Hq, D], m and l [NSPLIT, S * Hq] (fp32, log2 units)
        ws_acc = torch.empty(nsplit * S * Hq * D, dtype=torch.float32, device=q.device)
        ws_ml = torch.empty(2, nsplit * S * Hq, dtype=torch.float32, device=q.device)
        ws_m, ws_l = ws_ml[0], ws_ml[1]
    else:
        ws_acc = ws_m = ws_l = torch.empty(0, dtype=torch.float32, device=q.device)
    _chunk_attn_kernel[(blocks, H) if nsplit == 1 else (blocks, H, nsplit)](
        q, q.stride(0), q.stride(1), sink_k, sink_v, tail_k, tail_v, page_table,
        *pool, out, out.stride(0), out.stride(1), ws_acc, ws_m, ws_l,
        S, H, held, sink_k.shape[1], T, scale * LOG2E, float(tau) if vprec else 0.0,
        G=G, GP=_next_pow2(G), BM=bm, BN=TAIL_BLOCK, D=D, DP=_next_pow2(D), BITS=bits, VPREC=vprec, EXACT=exact,
        KPARTS=KEY_PARTS[q.dtype], PREC="ieee" if exact else "tf32", UPCAST=not compiled and q.dtype == torch.bfloat16,
        NSPLIT=nsplit, num_warps=warps(D), num_stages=1, **KERNEL_OPTIONS,
    )
    if nsplit > 1:
        _chunk_merge_kernel[(triton.cdiv(S * Hq, MERGE_ROWS),)](
            ws_acc, ws_m, ws_l, out, S * Hq, D=D, DP=_next_pow2(D), BR=MERGE_ROWS, NSPLIT=nsplit, num_warps=4,
            num_stages=1, **KERNEL_OPTIONS,
        )
    return out
