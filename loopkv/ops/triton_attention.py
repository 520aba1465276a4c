"""Fused decode attention of one cell in one launch: the Triton kernels of ``cell_attention`` and
``token_attention_`` (docs/design.md for the op contract, docs/kernels.md for how the kernel works).

Grid ``(NNEAR + NSPLIT, B * H)``: for every (row b, KV head h), ``NNEAR`` *near* programs cover the exact sink +
window slots (``BN`` slots each, of the virtual array ``[sink 32 | ring 288]``) and ``NSPLIT`` *history* programs
split the row's history pages (``n_pages(lengths[b])``, read on the device) into contiguous chunks, flash-decoding
style (chunks of at least ``ceil(sqrt(CHUNKC * B*H * pages))`` pages; the programs past the row's last chunk exit at
once). Each other program writes a partial ``(m, l, o)`` in log2 units; the last of them to finish (an atomic counter
that it resets to zero, so CUDA-graph replays stay correct) merges the partials by log-sum-exp and writes
``out[b, h*G:(h+1)*G]``. The programs are numbered so that the GPU starts every history program before any near
program: the short near programs fill the end of the launch.

History readers (``triton_config.TABLE`` picks one per call): exact tiles for BF16 pages (here), the CUDA-core
code reader (``triton_far.far_cc``) and the tensor-core code reader (``triton_dot.far_dot``).

``token_attention_`` (``TOKEN``): the same reads with the token appended (length + 1, unless the row is at capacity);
the near program whose slot takes the token reads it from the op's input, then writes it into sink or ring.
``lengths`` and the page leaving the window are left to ``advance_`` (``triton_quant``).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from loopkv.format import GROUP, PAGE, RING, SINK, row_capacity
from loopkv.ops import triton_config
from loopkv.ops.cell_attention import cell_attention_reference
from loopkv.ops.triton_config import KERNEL_OPTIONS
from loopkv.ops.triton_counters import counters
from loopkv.ops.triton_dot import _dot, _exact_scores, far_dot, far_gqa
from loopkv.ops.triton_far import far_cc
from loopkv.ops.triton_quant import _write_token

assert (SINK, PAGE, GROUP, RING) == (32, 32, 32, 288)  # spelled out as literals in the kernels
LOG2E = 1.0 / math.log(2.0)


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
    H, MAXP, NNEAR, NSPLIT, CHUNKC, qk_scale, tau,
    k_new, v_new, skn_b, skn_h, svn_b, svn_h, CAP, NSINK, NRING,
    G: tl.constexpr, GR: tl.constexpr, GP: tl.constexpr, NGP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
    BITS: tl.constexpr, VPREC: tl.constexpr, BN: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr,
    UPCAST: tl.constexpr, SUBNORMAL: tl.constexpr, NPP: tl.constexpr, CC: tl.constexpr, L2: tl.constexpr,
    ASM: tl.constexpr, I32: tl.constexpr, TOKEN: tl.constexpr, FAR_FIRST: tl.constexpr, GQA: tl.constexpr,
    QR: tl.constexpr,
):
    """Program (i, b*H + h): near slots (i < NNEAR) or history split i - NNEAR of row b, KV head h.

    FAR_FIRST (whenever there are history programs): the programs are renumbered in launch order (``i`` fastest) so
    that every (b, h)'s history programs come first and all near programs after them: the GPU hands out programs in
    that order, so the short near programs fill the SMs that the long history programs leave idle at the end of the
    launch. Same programs, same partials, same merge: the order changes no output bit.

    TOKEN (``token_attention_``): every program reads with the appended length; the near program whose slot takes
    the token (k_new, v_new [B, H, 1, D], strides skn_*, svn_*) reads it from there, not from the ring it is being
    written to, and then writes it into sink or ring (nothing at capacity, ``CAP``).

    NSINK, NRING: the sink and ring slots allocated per (row, head), SINK and RING or a short cache's fewer
    (``loopkv.format.exact_slots``: no pages, so its ring never wraps and no history program runs). Slot arithmetic
    is the same; every slot a load or store touches is one that holds a position (masks from the lengths, which never
    pass ``CAP``), so it lies below NSINK / NRING."""
    RP: tl.constexpr = GR * NGP
    pid = tl.program_id(0)
    bh = tl.program_id(1)
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
    past = False  # a program past the grid: none exists (see the empty branch below)
    if TOKEN:
        length = pos + (pos < CAP).to(tl.int32)  # the appended length (unchanged at capacity)
        past = pid >= nprog
    npg = tl.maximum(length - 288, 0) // 32  # history pages, n_pages(length)
    # pages per history program: an even split into NSPLIT chunks, but at least ceil(sqrt(CHUNKC * B*H * npg))
    # (0: no minimum) so that short rows take fewer programs (triton_config.CHUNK_COEF). The programs past the row's
    # last chunk exit at once: no partial, no counter add; the merge waits for the nlive that have one
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
        s_off = (bh64 * NSINK + tl.minimum(v, NSINK - 1))[:, None] * D + c[None, :]
        w_off = (bh64 * NRING + tl.maximum(tl.minimum(ring, NRING - 1), 0))[:, None] * D + c[None, :]
        kptr = tl.where(in_sink, sink_k + s_off, win_k + w_off)
        vptr = tl.where(in_sink, sink_v + s_off, win_v + w_off)
        if TOKEN:  # the new token's slot is read from the op's input (its ring / sink write may not be done)
            fresh = ((v == tl.where(pos < 32, pos, 32 + (pos - 32) % 288)) & (pos < CAP))[:, None]
            kptr = tl.where(fresh, k_new + b.to(tl.int64) * skn_b + h * skn_h + c[None, :], kptr)
            vptr = tl.where(fresh, v_new + b.to(tl.int64) * svn_b + h * svn_h + c[None, :], vptr)
        s = _exact_scores(qx, kptr, valid, cm, qk_scale, PREC, UPCAST)
        m_i, alpha, p, l_i = _online(s, m_i, l_i)
        acc = _exact_values(p, vptr, valid, cm, PREC, UPCAST)
        _store_partial(ws_o, ws_ml, slot, g_r, gr, m_i, l_i, acc, c, GR, DP)
        if TOKEN:  # the near program whose slots hold the token writes it (after its own reads of them)
            tslot = tl.where(pos < 32, pos, 32 + (pos - 32) % 288)
            if pid == tslot // BN:
                _write_token(k_new, v_new, skn_b, skn_h, svn_b, svn_h, b, h, pos, sink_k, sink_v, win_k, win_v, H,
                             CAP, NSINK, NRING, D, DP)
    elif past:  # never taken. The token path's page loop was measured compiled with this test in place; without
        pass  # it ptxas schedules that loop differently (same registers, static sm_90 comparison): measure first
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
        elif CC:  # CUDA-core reader (triton_far); codes as int32 words
            far_cc(
                q, sq_b, sq_h, b, h, H, MAXP, length, p0, p1, page_table, sink_k, k_pages, k_scale, k_zero,
                v_hi, v_lo, v_scale, v_zero, qk_scale, tau, ws_o, ws_ml, slot, G, GR, GP, D, DP, BITS, VPREC, L2,
                ASM, I32,
            )
        elif GQA:  # tensor-core reader, rows = query heads (triton_dot.far_gqa)
            far_gqa(
                q, sq_b, sq_h, b, h, H, MAXP, length, p0, p1, page_table, sink_k, k_pages, k_scale, k_zero,
                v_hi, v_lo, v_scale, v_zero, qk_scale, tau, ws_o, ws_ml, slot, G, GR, GP, QR, D, DP, BITS, VPREC,
                PREC, UPCAST, L2,
            )
        elif BITS != 0:  # tensor-core reader, expanded rows (triton_dot.far_dot)
            far_dot(
                q, sq_b, sq_h, b, h, H, MAXP, length, p0, p1, page_table, sink_k, k_pages, k_scale, k_zero,
                v_hi, v_lo, v_scale, v_zero, qk_scale, tau, ws_o, ws_ml, slot,
                G, GR, GP, NGP, D, DP, BITS, VPREC, DT, PREC, UPCAST, SUBNORMAL,
            )
    # ---- the last program of (b, h) merges the partials by log-sum-exp
    if (not past) and pid < nlive:
        _merge(ws_o, ws_ml, cnt, out, so_b, so_h, b, h, bh, bh64, nprog, nlive, c, cm, G, GR, DP, NPP)


@triton.jit
def _merge(ws_o, ws_ml, cnt, out, so_b, so_h, b, h, bh, bh64, nprog, nlive, c, cm, G: tl.constexpr, GR: tl.constexpr,
           DP: tl.constexpr, NPP: tl.constexpr):
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


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _check(q: Tensor, sink_k: Tensor, bits: int) -> None:
    if bits not in (16, 4, 2, 0):
        raise ValueError(f"bits must be 16, 4, 2 or 0 (no history), got {bits}")
    _, Hq, D = q.shape
    if Hq % sink_k.shape[1]:
        raise ValueError(f"q has {Hq} heads, not a multiple of the cache's {sink_k.shape[1]} KV heads")


def _launch_config(q: Tensor, storage: tuple[Tensor, ...], bits: int) -> triton_config.Launch | None:
    """The table's launch for this call, or None where the reference runs instead: float64 queries (tests'
    re-computations), non-contiguous storage, ROCm (the kernels use inline PTX), a GPU the table has no entry for, a
    cell shape the kernels do not serve (``triton_config.serves``; warned once per shape)."""
    if q.dtype == torch.float64 or not all(t.is_contiguous() for t in storage) or torch.version.hip:
        return None
    G, D = q.shape[1] // storage[0].shape[1], q.shape[2]
    if not triton_config.serves(D, G):
        triton_config.warn_reference(D, G)
        return None
    return triton_config.launch_config(triton_config._capability(q.device), bits, G, D, q.dtype == torch.float32,
                                       q.shape[0] * storage[0].shape[1])


def cell_attention(
    q: Tensor, sink_k: Tensor, sink_v: Tensor, win_k: Tensor, win_v: Tensor, lengths: Tensor,
    page_table: Tensor, k_pages: Tensor, k_scale: Tensor, k_zero: Tensor, v_hi: Tensor, v_lo: Tensor,
    v_scale: Tensor, v_zero: Tensor, bits: int, tau: float, scale: float,
) -> Tensor:
    """Triton ``cell_attention`` (``loopkv/ops/cell_attention.py``): q [B, Hq, D] -> [B, Hq, D], reading the cell's
    storage (the cache's contiguous buffers; shapes in ``loopkv.format``). What ``_launch_config`` leaves to the
    reference runs the reference."""
    _check(q, sink_k, bits)
    storage = (sink_k, sink_v, win_k, win_v, lengths, page_table, k_pages, k_scale, k_zero, v_hi, v_lo, v_scale,
               v_zero)
    launch = _launch_config(q, storage, bits)
    if launch is None:
        return cell_attention_reference(q, *storage, bits, tau, scale)
    return _launch(q, storage, bits, tau, scale, launch, None)


def token_attention(
    q: Tensor, k_new: Tensor, v_new: Tensor, sink_k: Tensor, sink_v: Tensor, win_k: Tensor, win_v: Tensor,
    lengths: Tensor, page_table: Tensor, k_pages: Tensor, k_scale: Tensor, k_zero: Tensor, v_hi: Tensor,
    v_lo: Tensor, v_scale: Tensor, v_zero: Tensor, bits: int, tau: float, scale: float,
) -> Tensor:
    """Triton ``token_attention_`` (``loopkv/ops/step_ops.py``): write the token (k_new, v_new [B, H, 1, D]) into
    sink or ring and read the cell with it, in one launch; ``lengths`` is read only. Tokens of another dtype than the
    cache's, strided tokens and what ``_launch_config`` leaves to the reference run the reference (same result)."""
    from loopkv.ops.step_ops import token_attention_reference

    _check(q, sink_k, bits)
    B, H, D = q.shape[0], sink_k.shape[1], sink_k.shape[3]
    if k_new.shape != (B, H, 1, D) or v_new.shape != k_new.shape:
        raise ValueError(f"token_attention_ takes one token per row: k_new, v_new [B, H, 1, D] = [{B}, {H}, 1, {D}], "
                         f"got {tuple(k_new.shape)}, {tuple(v_new.shape)}")
    storage = (sink_k, sink_v, win_k, win_v, lengths, page_table, k_pages, k_scale, k_zero, v_hi, v_lo, v_scale,
               v_zero)
    launch = _launch_config(q, storage, bits)
    if launch is None or not (k_new.dtype == v_new.dtype == sink_k.dtype and k_new.stride(3) == 1
                              and v_new.stride(3) == 1):
        return token_attention_reference(q, k_new, v_new, *storage, bits, tau, scale)
    return _launch(q, storage, bits, tau, scale, launch, (k_new, v_new))


def _launch(q: Tensor, storage: tuple[Tensor, ...], bits: int, tau: float, scale: float,
            launch: triton_config.Launch, token: tuple[Tensor, Tensor] | None) -> Tensor:
    """One launch of ``_cell_attn_kernel`` as ``launch`` configures it (``token``: token_attention's k_new, v_new)."""
    sink_k, sink_v, win_k, win_v, lengths, page_table, k_pages, k_scale, k_zero, v_hi, v_lo, v_scale, v_zero = storage
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    B, Hq, D = q.shape
    if B == 0:
        return out
    q = q.contiguous()
    H = sink_k.shape[1]
    G, maxp, DP = Hq // H, page_table.shape[1], _next_pow2(D)
    NGP = DP // 32
    GR = max(_next_pow2(G), 16 // NGP)  # query-head rows padded so that RP = GR * NGP >= 16
    compiled = triton_config._capability(q.device) is not None  # else Triton's interpreter (CPU tensors)
    exact = q.dtype == torch.float32
    nnear = -(-(SINK + RING) // launch.near_block)
    nsplit = 0 if bits == 0 or maxp == 0 else triton_config.choose_splits(B * H, maxp, q.device)
    nprog = nnear + nsplit
    ws_o = torch.empty(B * H * nprog * GR * DP, dtype=torch.float32, device=q.device)
    ws_ml = torch.empty(B * H * nprog * GR * 2, dtype=torch.float32, device=q.device)
    cnt = counters(q.device, B * H, purpose="attention")
    vprec = bits == 4 and math.isfinite(tau)
    if launch.reader == "cc":  # the CUDA-core reader reads codes as int32 words (rows are multiples of 4 bytes)
        k_pages, v_hi, v_lo = (t.view(torch.int32) if t.numel() else t.new_empty(0, dtype=torch.int32)
                               for t in (k_pages, v_hi, v_lo))
    i32 = launch.i32 and triton_config.fits_int32(k_pages, k_scale, k_zero, v_hi, v_lo, v_scale, v_zero)
    k_new, v_new = token if token is not None else (q, q)  # placeholders without a token: TOKEN compiles no use
    nsink, nring = sink_k.shape[2], win_k.shape[2]  # SINK, RING, or a short cache's (loopkv.format.exact_slots)
    cap = row_capacity(maxp, nsink, nring) if token is not None else 0
    cc = launch.reader == "cc" and nsplit > 0
    gqa = launch.reader == "gqa" and nsplit > 0 and not exact  # fp32 inputs: the expanded reader's fp32 products
    options = {"maxnreg": launch.maxnreg} if launch.maxnreg and compiled else {}
    _cell_attn_kernel[(nprog, B * H)](
        q, q.stride(0), q.stride(1), sink_k, sink_v, win_k, win_v, lengths, page_table,
        k_pages, k_scale, k_zero, v_hi, v_lo, v_scale, v_zero,
        ws_o, ws_ml, cnt, out, out.stride(0), out.stride(1),
        H, maxp, nnear, nsplit, launch.chunk_coef, scale * LOG2E, float(tau) if vprec else 0.0,
        k_new, v_new, k_new.stride(0), k_new.stride(1), v_new.stride(0), v_new.stride(1), cap, nsink, nring,
        G=G, GR=GR, GP=_next_pow2(G), NGP=NGP, D=D, DP=DP, BITS=bits if nsplit else 0, VPREC=vprec,
        BN=launch.near_block, DT=tl.float32 if exact else tl.float16, PREC="ieee" if exact else "tf32",
        UPCAST=not compiled and q.dtype == torch.bfloat16, SUBNORMAL=not exact, NPP=max(16, _next_pow2(nprog)),
        CC=cc, L2=(cc or gqa) and compiled, ASM=cc and compiled, I32=cc and i32, TOKEN=token is not None,
        FAR_FIRST=nsplit > 0, GQA=gqa, QR=max(_next_pow2(G), 16), num_warps=launch.num_warps,
        num_stages=launch.num_stages, **options, **KERNEL_OPTIONS,
    )
    return out
