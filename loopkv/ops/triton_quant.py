"""Triton kernels of the cache-writing ops: ``write_pages_`` (a prompt's pages) and ``advance_`` (a decode step's
count and the page leaving the window); and ``_write_token``, the token write of ``token_attention_``'s kernel.

Both ops produce exactly the codes of the reference codec (``loopkv/ops/codec.py``), bit for bit:

* fp16 ``zero = min`` and ``scale = max(max - min, EPS) / (2**b - 1)`` from fp32 minima and maxima;
* ``code = clamp(rne((x - zero) / scale), 0, 2**b - 1)`` from the *stored* fp16 values, with IEEE
  division (``div_rn``) and round-half-to-even done by the fp32 magic constant ``1.5 * 2**23``
  (``(y + C) - C`` rounds ``|y| < 2**22`` to the nearest integer, ties to even, in the FPU's default mode);
* packing as in :func:`loopkv.ops.codec.pack`: channel ``per * j + i`` of a byte at bit ``bits * i``.

An encoding program handles one page of one KV head, K or V. Channels are processed in their packed order: the
tile ``x_i [PAGE, DP // per]`` holds channels ``per * j + i``, so packing is a shift-or of ``per`` tiles, and K's
per-channel statistics are plain reductions over the token axis. ``head_dim`` that is not a power of two (96) is
padded to ``DP`` with masked loads and stores. ``advance_`` decides on the device, per row, whether the step's token
completes a page for the pool (``length + 1 = QUANTIZE_LENGTH + 32 p``, ``loopkv.format``), with no host sync.
Launchers are plain functions that also run on CPU tensors under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from loopkv import format as fmt
from loopkv.format import GROUP, PAGE, QUANTIZE_LENGTH, RING, SINK, WINDOW
from loopkv.ops.cache_ops import write_pages_reference
from loopkv.ops.codec import EPS, FP16_MAX
from loopkv.ops.triton_config import HEAD_DIMS, KERNEL_OPTIONS
from loopkv.ops.triton_counters import counters

# The kernels spell these constants out (Triton wants literals); fail loudly if the format moves.
assert (SINK, WINDOW, PAGE, GROUP, RING, QUANTIZE_LENGTH) == (32, 256, 32, 32, 288, 319)
assert EPS == 2.0**-10
assert FP16_MAX == 65504.0


@triton.jit
def _rne_codes(x, zero, scale, LEVELS: tl.constexpr):
    """Codes ``clamp(rne((x - zero) / scale), 0, LEVELS)`` as int32; zero and scale are the stored fp16."""
    y = tl.math.div_rn(x - zero.to(tl.float32), scale.to(tl.float32))
    y = tl.minimum(tl.maximum(y, -1.0), LEVELS + 1.0)  # keeps |y| small for the magic rounding
    r = (y + 12582912.0) - 12582912.0  # 1.5 * 2**23: round half to even for |y| < 2**22
    r = tl.minimum(tl.maximum(r, 0.0), LEVELS * 1.0)
    return r.to(tl.int32)


@triton.jit
def _qparams(xmin, xmax, LEVELS: tl.constexpr):
    """fp16 (scale, zero) as in codec._qparams."""
    zero = tl.minimum(tl.maximum(xmin, -65504.0), 65504.0).to(tl.float16)
    rng = tl.maximum(xmax - xmin, 0.0009765625)  # EPS = 2**-10
    scale = tl.minimum(tl.math.div_rn(rng, LEVELS * 1.0), 65504.0).to(tl.float16)
    return scale, zero


@triton.jit
def _encode_k(k_src, sk_t, sk_d, page, k_pages, k_scale, k_zero, BITS: tl.constexpr, D: tl.constexpr,
              DP: tl.constexpr):
    """K of one page: the packed bytes of every token (channel KPER * j + i at bits BITS * i of byte j), with their
    per-channel statistics over the page's tokens."""
    LEVELS: tl.constexpr = (1 << BITS) - 1
    KPER: tl.constexpr = 8 // BITS
    KBD: tl.constexpr = D // KPER
    KS: tl.constexpr = DP // KPER  # packed bytes per token (padded)
    t = tl.arange(0, 32)  # PAGE
    j = tl.arange(0, KS)
    jm = (t[:, None] < 32) & (j[None, :] < KBD)
    packed = tl.zeros([32, KS], dtype=tl.int32)
    for i in tl.static_range(KPER):
        ch = j * KPER + i  # [KS]
        x = tl.load(k_src + t[:, None] * sk_t + ch[None, :] * sk_d, mask=jm, other=0.0)
        x = x.to(tl.float32)
        scale, zero = _qparams(tl.min(x, axis=0), tl.max(x, axis=0), LEVELS)  # [KS]
        q = _rne_codes(x, zero[None, :], scale[None, :], LEVELS)
        packed = packed | (q << (BITS * i))
        tl.store(k_scale + page * D + ch, scale, mask=j < KBD)
        tl.store(k_zero + page * D + ch, zero, mask=j < KBD)
    tl.store(k_pages + page * (32 * KBD) + t[:, None] * KBD + j[None, :], packed.to(tl.uint8), mask=jm)


@triton.jit
def _encode_v(v_src, sv_t, sv_d, page, v_hi, v_lo, v_scale, v_zero, BITS: tl.constexpr, D: tl.constexpr,
              DP: tl.constexpr):
    """V of one page, per token in groups of 32 channels (tiles by crumb position, channel 4 * j + i)."""
    LEVELS: tl.constexpr = (1 << BITS) - 1
    VB: tl.constexpr = DP // 4
    VBD: tl.constexpr = D // 4
    NGP: tl.constexpr = DP // 32
    NG: tl.constexpr = D // 32
    jv = tl.arange(0, VB)
    g = tl.arange(0, NGP)
    ts = tl.arange(0, 32)
    vm = (ts[:, None] < 32) & (jv[None, :] < VBD)
    vptr = v_src + ts[:, None] * sv_t + (jv[None, :] * 4) * sv_d
    x0 = tl.load(vptr, mask=vm, other=0.0).to(tl.float32)
    x1 = tl.load(vptr + sv_d, mask=vm, other=0.0).to(tl.float32)
    x2 = tl.load(vptr + 2 * sv_d, mask=vm, other=0.0).to(tl.float32)
    x3 = tl.load(vptr + 3 * sv_d, mask=vm, other=0.0).to(tl.float32)
    mn = tl.minimum(tl.minimum(x0, x1), tl.minimum(x2, x3))  # [32, VB]; a group = 8 bytes of j
    mx = tl.maximum(tl.maximum(x0, x1), tl.maximum(x2, x3))
    gmin = tl.min(tl.reshape(mn, [32, NGP, 8]), axis=2)  # [32, NGP]
    gmax = tl.max(tl.reshape(mx, [32, NGP, 8]), axis=2)
    vscale, vzero = _qparams(gmin, gmax, LEVELS)  # [32, NGP] fp16
    gm = (ts[:, None] < 32) & (g[None, :] < NG)
    goff = page * (32 * NG) + ts[:, None] * NG + g[None, :]
    tl.store(v_scale + goff, vscale, mask=gm)
    tl.store(v_zero + goff, vzero, mask=gm)
    s_b = tl.reshape(tl.broadcast_to(vscale[:, :, None], [32, NGP, 8]), [32, VB])
    z_b = tl.reshape(tl.broadcast_to(vzero[:, :, None], [32, NGP, 8]), [32, VB])
    c0 = _rne_codes(x0, z_b, s_b, LEVELS)
    c1 = _rne_codes(x1, z_b, s_b, LEVELS)
    c2 = _rne_codes(x2, z_b, s_b, LEVELS)
    c3 = _rne_codes(x3, z_b, s_b, LEVELS)
    voff = page * (32 * VBD) + ts[:, None] * VBD + jv[None, :]
    if BITS == 4:
        hi = (c0 >> 2) | ((c1 >> 2) << 2) | ((c2 >> 2) << 4) | ((c3 >> 2) << 6)
        lo = (c0 & 3) | ((c1 & 3) << 2) | ((c2 & 3) << 4) | ((c3 & 3) << 6)
        tl.store(v_hi + voff, hi.to(tl.uint8), mask=vm)
        tl.store(v_lo + voff, lo.to(tl.uint8), mask=vm)
    else:
        codes = c0 | (c1 << 2) | (c2 << 4) | (c3 << 6)
        tl.store(v_hi + voff, codes.to(tl.uint8), mask=vm)


@triton.jit
def _encode_page(
    k_src, v_src, sk_t, sk_d, sv_t, sv_d, phys, h, H, part,
    k_pages, k_scale, k_zero, v_hi, v_lo, v_scale, v_zero,
    BITS: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
):
    """Encode K (part 0) or V (part 1) of one page of one head (token t, channel c at ``src + t * s_t + c * s_d``)
    into physical page ``phys``: BITS 16, an exact copy into k_pages / v_hi [N, H, PAGE, D]; BITS 4 / 2, codes as in
    ``codec.encode_pages``. K and V go to two programs: half the latency."""
    page = phys.to(tl.int64) * H + h  # (page, head) index into the pool's first two dims
    if BITS == 16:
        t = tl.arange(0, 32)  # PAGE
        c = tl.arange(0, DP)
        m = (t[:, None] < 32) & (c[None, :] < D)
        dst = page * (32 * D) + t[:, None] * D + c[None, :]
        if part == 0:
            kx = tl.load(k_src + t[:, None] * sk_t + c[None, :] * sk_d, mask=m)
            tl.store(k_pages + dst, kx.to(k_pages.dtype.element_ty), mask=m)
        else:
            vx = tl.load(v_src + t[:, None] * sv_t + c[None, :] * sv_d, mask=m)
            tl.store(v_hi + dst, vx.to(v_hi.dtype.element_ty), mask=m)
    elif part == 0:
        _encode_k(k_src, sk_t, sk_d, page, k_pages, k_scale, k_zero, BITS, D, DP)
    else:
        _encode_v(v_src, sv_t, sv_d, page, v_hi, v_lo, v_scale, v_zero, BITS, D, DP)


@triton.jit
def _write_pages_kernel(
    k, v, pages, sk_n, sk_h, sk_t, sk_d, sv_n, sv_h, sv_t, sv_d, H,
    k_pages, k_scale, k_zero, v_hi, v_lo, v_scale, v_zero,
    BITS: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
):
    """Program (n, h, part): encode ``k[n, h]`` (part 0) or ``v[n, h]`` (part 1), [PAGE, D], into ``pages[n]``."""
    n = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    phys = tl.load(pages + n)
    _encode_page(
        k + n * sk_n + h * sk_h, v + n * sv_n + h * sv_h, sk_t, sk_d, sv_t, sv_d, phys, h, H, tl.program_id(2),
        k_pages, k_scale, k_zero, v_hi, v_lo, v_scale, v_zero, BITS, D, DP,
    )


@triton.jit
def _write_token(k_new, v_new, sk_b, sk_h, sv_b, sv_h, b, h, pos, sink_k, sink_v, win_k, win_v, H, CAP, NSINK,
                 NRING, D: tl.constexpr, DP: tl.constexpr):
    """The token of head h of row b (k_new, v_new: unit channel stride) at position ``pos`` into sink or window
    ring (NSINK, NRING slots per row and head: SINK, RING, or a short cache's fewer); nothing at capacity
    (``pos >= CAP``, which keeps a short cache's slots in bounds: its ring never wraps)."""
    c = tl.arange(0, DP)
    cm = c < D
    bh = b.to(tl.int64) * H + h
    pos_c = tl.zeros([DP], dtype=tl.int32) + pos  # per-lane copy: masks stay tensors
    in_sink = cm & (pos_c < CAP) & (pos_c < 32)  # SINK
    in_win = cm & (pos_c < CAP) & (pos_c >= 32)
    s_off = (bh * NSINK + tl.minimum(pos, 31)) * D + c
    w_off = (bh * NRING + tl.maximum(pos - 32, 0) % 288) * D + c  # RING = 288
    kn = tl.load(k_new + b.to(tl.int64) * sk_b + h * sk_h + c, mask=cm)
    tl.store(sink_k + s_off, kn.to(sink_k.dtype.element_ty), mask=in_sink)
    tl.store(win_k + w_off, kn.to(win_k.dtype.element_ty), mask=in_win)
    vn = tl.load(v_new + b.to(tl.int64) * sv_b + h * sv_h + c, mask=cm)
    tl.store(sink_v + s_off, vn.to(sink_v.dtype.element_ty), mask=in_sink)
    tl.store(win_v + w_off, vn.to(win_v.dtype.element_ty), mask=in_win)


@triton.jit
def _advance_kernel(
    cells, pools, lengths, s_len, win_k, win_v, s_win, page_table, s_pt,
    k_pages, s_kp, k_scale, s_ks, k_zero, s_kz, v_hi, s_vh, v_lo, s_vl, v_scale, s_vs, v_zero, s_vz,
    cnt, B, H, MAXP, CAP, NS,
    BITS: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
):
    """Program (i, b, s): ``advance_`` of row b of the pair (``cells[i]``, ``pools[i]``) on the stacks (row stride
    ``s_*`` each). At a window exit the row's 2 H encode tasks (head, K or V) are spread over its NS programs (task
    t to program t % NS); the last of them (counter ``cnt[i * B + b]``, reset by it) stores ``lengths + 1``."""
    i = tl.program_id(0)
    b = tl.program_id(1)
    s = tl.program_id(2)
    c = tl.load(cells + i).to(tl.int64)
    pos = tl.load(lengths + c * s_len + b).to(tl.int32)
    ok = pos < CAP  # rows at capacity are left unchanged
    new_len = pos + ok.to(tl.int32)
    if BITS != 0:
        exits = ok & (new_len >= 319) & ((new_len - 319) % 32 == 0)  # QUANTIZE_LENGTH
        if exits:
            j = tl.load(pools + i).to(tl.int64)
            p = (new_len - 319) // 32
            phys = tl.load(page_table + j * s_pt + b.to(tl.int64) * MAXP + p)
            for t in range(s, 2 * H, NS):
                h = t // 2
                row0 = c * s_win + ((b.to(tl.int64) * H + h) * 288 + (32 * p) % 288) * D  # RING = 288
                _encode_page(
                    win_k + row0, win_v + row0, D, 1, D, 1, phys, h, H, t % 2,
                    k_pages + j * s_kp, k_scale + j * s_ks, k_zero + j * s_kz, v_hi + j * s_vh, v_lo + j * s_vl,
                    v_scale + j * s_vs, v_zero + j * s_vz, BITS, D, DP,
                )
    if NS == 1:
        tl.store(lengths + c * s_len + b, new_len.to(lengths.dtype.element_ty))
    else:
        tl.debug_barrier()  # every thread has read lengths before this program counts itself done
        done = tl.atomic_add(cnt + i * B + b, 1, sem="acq_rel")
        if done == NS - 1:
            tl.store(lengths + c * s_len + b, new_len.to(lengths.dtype.element_ty))
            tl.atomic_xchg(cnt + i * B + b, 0)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _check_bits(bits: int, allowed: tuple[int, ...]) -> None:
    if bits not in allowed:
        raise ValueError(f"bits must be one of {allowed}, got {bits}")


def _all_contiguous(*tensors: Tensor) -> bool:
    return all(t.is_contiguous() for t in tensors)


def write_pages(
    k: Tensor, v: Tensor, pages: Tensor, k_pages: Tensor, k_scale: Tensor, k_zero: Tensor,
    v_hi: Tensor, v_lo: Tensor, v_scale: Tensor, v_zero: Tensor, bits: int, *, num_warps: int = 4,
) -> None:
    """Triton ``write_pages_``: encode ``k, v`` [n, H, PAGE, D] into physical ``pages`` (int [n]).

    Pool tensors are the cache's contiguous storage; non-contiguous ones, and a head_dim the kernels do not serve
    (``triton_config.HEAD_DIMS``), fall back to the reference.
    """
    _check_bits(bits, (16, 4, 2))
    n, H, P, D = k.shape
    if P != PAGE or v.shape != k.shape:
        raise ValueError(f"k and v must be [n, H, {PAGE}, D] alike, got {tuple(k.shape)}, {tuple(v.shape)}")
    if n == 0:
        return
    if not _all_contiguous(k_pages, k_scale, k_zero, v_hi, v_lo, v_scale, v_zero) or D not in HEAD_DIMS:
        write_pages_reference(k, v, pages, k_pages, k_scale, k_zero, v_hi, v_lo, v_scale, v_zero, bits)
        return
    _write_pages_kernel[(n, H, 2)](
        k, v, pages, *k.stride(), *v.stride(), H,
        k_pages, k_scale, k_zero, v_hi, v_lo, v_scale, v_zero,
        BITS=bits, D=D, DP=_next_pow2(D), num_warps=num_warps, **KERNEL_OPTIONS,
    )


def advance_programs(pairs: int, batch: int, heads: int, bits: int) -> int:
    """Programs per (cell, row) of ``advance_``: all 2 H encode tasks in parallel while the grid is small (batch 1:
    a window exit's latency is one page's encoding), fewer as it grows (at most about 16K programs, most of which
    only count a token)."""
    if bits == 0:
        return 1
    return max(1, min(2 * heads, (1 << 14) // max(1, pairs * batch)))


def advance(
    cells: Tensor, pools: Tensor, lengths: Tensor, win_k: Tensor, win_v: Tensor, page_table: Tensor,
    k_pages: Tensor, k_scale: Tensor, k_zero: Tensor, v_hi: Tensor, v_lo: Tensor, v_scale: Tensor, v_zero: Tensor,
    batch: int, max_batch: int, heads: int, head_dim: int, max_pages: int, bits: int, capacity: int | None = None,
    *, num_warps: int = 4,
) -> None:
    """Triton ``advance_`` (``loopkv/ops/step_ops.py``): one launch for every (cell, pool) pair listed, predicated per
    row on the device. The stacks are 2-D and row-contiguous (``CellStacks``); others, and a head_dim the kernels do
    not serve (``triton_config.HEAD_DIMS``), run the reference. Without pages the ring is not read."""
    from loopkv.ops.step_ops import advance_stacks_reference, check_advance_args

    check_advance_args(cells, pools, batch, max_batch, bits)
    n = cells.shape[0]
    if n == 0 or batch == 0:
        return
    stacks = (lengths, win_k, win_v, page_table, k_pages, k_scale, k_zero, v_hi, v_lo, v_scale, v_zero)
    if not all(t.numel() == 0 or (t.dim() == 2 and t.stride(1) == 1) for t in stacks) or cells.stride(0) != 1 \
            or pools.stride(0) != 1 or win_k.stride(0) != win_v.stride(0) or head_dim not in HEAD_DIMS:
        advance_stacks_reference(cells, pools, lengths, win_k, win_v, page_table, k_pages, k_scale, k_zero, v_hi,
                                 v_lo, v_scale, v_zero, batch, max_batch, heads, head_dim, max_pages, bits,
                                 capacity)
        return
    if max_pages == 0:
        bits = 0  # no page is ever quantized: capacity(0) is below QUANTIZE_LENGTH
    ns = advance_programs(n, batch, heads, bits)
    cnt = counters(lengths.device, n * batch, purpose="advance")

    def row(t: Tensor) -> int:
        return t.stride(0) if t.numel() else 0

    _advance_kernel[(n, batch, ns)](
        cells, pools, lengths, row(lengths), win_k, win_v, row(win_k), page_table, row(page_table),
        k_pages, row(k_pages), k_scale, row(k_scale), k_zero, row(k_zero), v_hi, row(v_hi), v_lo, row(v_lo),
        v_scale, row(v_scale), v_zero, row(v_zero), cnt, batch, heads, max_pages,
        fmt.capacity(max_pages) if capacity is None else capacity, ns,
        BITS=bits, D=head_dim, DP=_next_pow2(head_dim), num_warps=num_warps, **KERNEL_OPTIONS,
    )
