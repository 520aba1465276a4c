"""Decode attention of one Ouro-1.4B cell (16 KV heads x 128, one query per KV head) on the GPU.

Default run (``readers``): the history readers of ``loopkv.ops.triton_attention.cell_attention`` against
cuDNN SDPA on dense BF16 K/V, at B in {1, 8, 32} x context in {8K, 16K, 32K}, for INT4 (tau = inf), INT4
with V precision (tau = 14, on data built so that ~1/6 of history tokens are hot; the same data at
tau = inf gives the V-precision gain) and INT2. Reader arms (``READERS``): ``dot`` (tensor cores, the
session-1 kernel) and ``cc_*`` (CUDA cores, ``loopkv/ops/triton_far.py``) at a few (num_warps, sub-tile
tokens, pages per iteration, splits, opt-in variants ``cc_opts``) configs. Each arm's output is checked
against the ``dot`` arm's.

``--full``: session 1's arm set (cuDNN / flash SDPA, dequantize-then-SDPA, loopkv BF16 pages, INT4, INT4
with V precision, INT2, a shared cell, the decode append) with the default reader.

Times are medians of ``triton.testing.do_bench`` over CUDA-graph replays; a graph holds one call per
input set, with enough sets that they do not fit in L2 together (do_bench also flushes L2 before each
replay). Bytes are those the arm must read (codes, scales, exact sink/window; V precision subtracts the lo
plane of cold tokens); effective TB/s = bytes / time.

Usage: PYTHONPATH=. python benchmarks/bench_cell_attention.py [--full] [--quick] [--smoke] [--out FILE.json|DIR]
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
import time

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

from loopkv.ops import codec, layout
from loopkv.ops import triton_attention as ta
from loopkv.ops import triton_quant as tq
from loopkv.ops.cell_attention import cell_attention_reference

H, D = 16, 128
DEVICE = "cuda"  # --smoke: "cpu" under TRITON_INTERPRET=1 with 2 heads, to check this script without a GPU
TAU = 14.0
HOT = 1.0 / 6.0


def pool_bytes_per_page(bits: int) -> int:
    """Bytes one page of one head occupies (and a reader must read), per docs/storage-layout.md."""
    if bits == 16:
        return 2 * 32 * D * 2
    kv_codes = 32 * D * bits // 8 * 2
    return kv_codes + 2 * D * 2 + 2 * 32 * (D // 32) * 2


def make_dense(B: int, ctx: int, *, seed: int, hot: bool = False) -> dict:
    """q [B, H, D] and dense K, V [B, H, ctx, D] (bf16). hot=True: history scores 12 +- 1 for a 1/6
    fraction of tokens and -2 +- 1 for the rest, sink scores 12 (so m_ref ~ 12-14 and tau = 14 marks
    the others cold); otherwise K with per-channel offsets and spreads like real keys."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    q = torch.randn(B, H, D, device=DEVICE, generator=g)
    v = torch.randn(B, H, ctx, D, device=DEVICE, generator=g, dtype=torch.bfloat16)
    if hot:
        u = q / q.norm(dim=-1, keepdim=True)
        target = torch.where(torch.rand(B, H, ctx, device=DEVICE, generator=g) < HOT, 12.0, -2.0)
        target += torch.randn(B, H, ctx, device=DEVICE, generator=g)
        target[:, :, :32] = 12.0
        k = torch.randn(B, H, ctx, D, device=DEVICE, generator=g)
        k -= (k * u[:, :, None]).sum(-1, keepdim=True) * u[:, :, None]
        # score = scale * q . k = target: k's component along u is target / (scale * |q|)
        k += (target / (D**-0.5 * q.norm(dim=-1, keepdim=True)))[..., None] * u[:, :, None]
        k = k.to(torch.bfloat16)
    else:
        k = torch.randn(B, H, ctx, D, device=DEVICE, generator=g) * (0.5 + torch.rand(1, H, 1, D, device=DEVICE))
        k = (k + torch.randn(1, H, 1, D, device=DEVICE, generator=g)).to(torch.bfloat16)
    return {"q": q.to(torch.bfloat16), "k": k, "v": v}


def make_cell(dense: dict, bits: int, capacity: int | None = None) -> list:
    """Cell storage (the op's argument order after q) holding the dense context; ``capacity`` (tokens): a page table
    (and pool) for rows of that length, as a cache built with ``max_cache_len=capacity`` has (the launcher chooses
    its split count from the table's width)."""
    k, v = dense["k"], dense["v"]
    B, _, ctx, _ = k.shape
    npg = layout.n_pages(ctx)
    maxp = max(npg, layout.max_pages(capacity) if capacity else 0, 1)
    sink_k, sink_v = k[:, :, :32].contiguous(), v[:, :, :32].contiguous()
    win_k = torch.zeros(B, H, layout.RING, D, device=DEVICE, dtype=k.dtype)
    win_v = torch.zeros_like(win_k)
    start = 32 + 32 * npg
    slots = (torch.arange(start, ctx, device=DEVICE) - 32) % layout.RING
    win_k[:, :, slots] = k[:, :, start:]
    win_v[:, :, slots] = v[:, :, start:]
    lengths = torch.full((B,), ctx, dtype=torch.int32, device=DEVICE)
    table = torch.arange(B * maxp, dtype=torch.int32, device=DEVICE).view(B, maxp)
    pool = pool_tensors(bits, B * maxp)
    hist_k = k[:, :, 32:start].unflatten(2, (npg, 32)).permute(0, 2, 1, 3, 4).reshape(B * npg, H, 32, D)
    hist_v = v[:, :, 32:start].unflatten(2, (npg, 32)).permute(0, 2, 1, 3, 4).reshape(B * npg, H, 32, D)
    pages = (torch.arange(B, device=DEVICE)[:, None] * maxp + torch.arange(npg, device=DEVICE)).flatten()
    tq.write_pages(hist_k.contiguous(), hist_v.contiguous(), pages, *pool, bits)
    return [sink_k, sink_v, win_k, win_v, lengths, table, *pool]


def pool_tensors(bits: int, n: int) -> list:
    f16 = dict(dtype=torch.float16, device=DEVICE)
    u8 = dict(dtype=torch.uint8, device=DEVICE)
    if bits == 16:
        e = torch.empty(0, **f16)
        full = dict(dtype=torch.bfloat16, device=DEVICE)
        return [torch.empty(n, H, 32, D, **full), e, e, torch.empty(n, H, 32, D, **full),
                torch.empty(0, **u8), e, e]
    return [torch.empty(n, H, 32, D * bits // 8, **u8), torch.empty(n, H, D, **f16), torch.empty(n, H, D, **f16),
            torch.empty(n, H, 32, D // 4, **u8),
            torch.empty(n, H, 32, D // 4, **u8) if bits == 4 else torch.empty(0, **u8),
            torch.empty(n, H, 32, D // 32, **f16), torch.empty(n, H, 32, D // 32, **f16)]


def dequant_sdpa(q, cell):
    """What a dequantize-then-attend cache does: INT4 pages -> BF16 K/V, concatenated, cuDNN SDPA."""
    sink_k, sink_v, win_k, win_v, lengths, table = cell[:6]
    pool = codec.PageCodes(*cell[6:])
    B = q.shape[0]
    idx = table.long().flatten()
    pages = codec.PageCodes(*[t[idx] for t in pool])
    kh = codec.decode_k(pages, 4).to(torch.bfloat16).view(B, -1, H, 32, D).permute(0, 2, 1, 3, 4).flatten(2, 3)
    vh = codec.decode_v(pages, 4).to(torch.bfloat16).view(B, -1, H, 32, D).permute(0, 2, 1, 3, 4).flatten(2, 3)
    k = torch.cat([sink_k, kh, win_k], dim=2)  # window order does not matter for one query
    v = torch.cat([sink_v, vh, win_v], dim=2)
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        return F.scaled_dot_product_attention(q[:, :, None], k, v, scale=D**-0.5)[:, :, 0]


def hot_fraction(q, cell, tau, rows: int = 4) -> float:
    """Fraction of history (token, head) pairs the kernel reads hot, by the op's rule, from stored codes
    (first ``rows`` rows)."""
    B = min(q.shape[0], rows)
    pool = codec.PageCodes(*cell[6:])
    table = cell[5]
    hot = total = 0
    scale = D**-0.5
    for b in range(B):
        npg = layout.n_pages(int(cell[4][b]))  # the row's pages (the table may hold more entries)
        pages = codec.PageCodes(*[t[table[b, :npg].long()] for t in pool])
        kk = codec.decode_k(pages, 4)  # [P, H, 32, D]
        s = torch.einsum("hd,phtd->pht", q[b].float(), kk) * scale
        sink = (torch.einsum("hd,htd->ht", q[b].float(), cell[0][b].float()) * scale).amax(-1)  # [H]
        m_ref = torch.maximum(sink[None], s.amax(-1))  # [P, H]
        hot += int((s >= (m_ref - tau * math.log(2))[..., None]).sum())
        total += s.numel()
    return hot / total if total else math.nan  # no history pages (a context under 320 tokens)


def bench_graph(make_call, n_sets: int) -> float:
    """Median ms of one call: a CUDA graph holds one call per input set; do_bench times its replays."""
    calls = [make_call(i) for i in range(n_sets)]
    if DEVICE == "cpu":
        t = time.perf_counter()
        for c in calls:
            c()
        return (time.perf_counter() - t) * 1e3 / n_sets
    for c in calls:
        c()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    ms = triton.testing.do_bench(graph.replay, warmup=20, rep=100, return_mode="median")
    return ms / n_sets


def n_sets_for(nbytes: int) -> int:
    if DEVICE == "cpu":
        return 1
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    return int(min(8, max(1, math.ceil(3 * l2 / max(nbytes, 1)))))


def history_bytes(B: int, ctx: int, bits: int, cold_fraction: float = 0.0) -> int:
    npg = layout.n_pages(ctx)
    exact = B * H * (ctx - 32 * npg) * D * 2 * 2  # sink + window, K and V
    pages = B * H * npg * pool_bytes_per_page(bits)
    # lo plane skipped per cold (token, head); no pages: nothing skipped (the hot fraction is NaN there)
    cold = B * H * npg * 32 * cold_fraction * (D // 4) if npg else 0
    return int(exact + pages - cold)


def run_shape(B: int, ctx: int, rows: list, cfg: dict) -> None:
    dense_bytes = B * H * ctx * D * 2 * 2
    int4_bytes = history_bytes(B, ctx, 4)
    sets_dense = n_sets_for(dense_bytes)
    sets_q = n_sets_for(int4_bytes)
    dense = [make_dense(B, ctx, seed=s) for s in range(max(sets_dense, sets_q))]
    qs = [d["q"] for d in dense]
    scale = D**-0.5
    res = {"batch": B, "context": ctx, "history_pages": layout.n_pages(ctx)}

    def record(name, ms, nbytes, **extra):
        res[name] = {"ms": ms, "bytes": nbytes, "tb_s": nbytes / ms / 1e9, **extra}

    for name, backend in (("cudnn_bf16", SDPBackend.CUDNN_ATTENTION), ("flash_bf16", SDPBackend.FLASH_ATTENTION)):
        def make(i, backend=backend, dense=dense):
            q4, k, v = dense[i]["q"][:, :, None], dense[i]["k"], dense[i]["v"]

            def call():
                with sdpa_kernel(backend):
                    F.scaled_dot_product_attention(q4, k, v, scale=scale)
            return call
        try:
            record(name, bench_graph(make, sets_dense), dense_bytes)
        except Exception as e:  # noqa: BLE001  (a backend may be unavailable for this shape)
            res[name] = {"error": repr(e)[:200]}
    for bits, name in ((4, "loopkv_int4"), (2, "loopkv_int2"), (16, "loopkv_bf16")):
        cells = [make_cell(dense[i], bits) for i in range(sets_q if bits != 16 else sets_dense)]
        kw = cfg.get(bits, {})

        def make(i, cells=cells, bits=bits, kw=kw):
            return lambda: ta.cell_attention(qs[i], *cells[i], bits, math.inf, scale, **kw)
        record(name, bench_graph(make, len(cells)), history_bytes(B, ctx, bits))
        if bits == 4:
            # correctness against the reference (same stored state), and the quantization error vs BF16
            out = ta.cell_attention(qs[0], *cells[0], 4, math.inf, scale, **kw).float()
            if B * ctx <= 8 * 16384:
                ref = cell_attention_reference(qs[0].float(), *[t.float() if t.dtype == torch.bfloat16 else t
                                                                 for t in cells[0]], 4, math.inf, scale)
                res["int4_vs_reference_max_abs"] = float((out - ref).abs().max())
            dense_out = F.scaled_dot_product_attention(qs[0][:, :, None].float(), dense[0]["k"].float(),
                                                       dense[0]["v"].float(), scale=scale)[:, :, 0]
            res["int4_vs_bf16_rel"] = float((out - dense_out).norm() / dense_out.norm())

            def make_shared(i, cells=cells, kw=kw):
                shared = list(cells[i])
                shared[5] = torch.roll(cells[i][5], 1, dims=0).contiguous()  # rows read other rows' pages
                return lambda: ta.cell_attention(qs[i], *shared, 4, math.inf, scale, **kw)
            record("loopkv_shared", bench_graph(make_shared, len(cells)), history_bytes(B, ctx, 4))
            try:
                ms = triton.testing.do_bench(lambda cells=cells: dequant_sdpa(qs[0], cells[0]), warmup=5, rep=60,
                                             return_mode="median")
                npg = layout.n_pages(ctx)
                record("dequant_sdpa", ms, int4_bytes + 2 * B * H * npg * 32 * D * 2 * 2)
            except Exception as e:  # noqa: BLE001  (out of memory at the largest shapes; no GPU in --smoke)
                res["dequant_sdpa"] = {"error": repr(e)[:200]}
            # decode append: the plain step (lengths advance each replay; 1 replay in 32 quantizes, the
            # median is a plain step) and the step where every row quantizes a page (lengths reset by a
            # copy inside the graph; the copy alone is timed and subtracted)
            cell = cells[0]
            kv = torch.randn(B, H, 1, D, device=DEVICE, dtype=torch.bfloat16)
            exit_len = torch.full((B,), layout.QUANTIZE_LENGTH - 1 + 32 * 3, dtype=torch.int32, device=DEVICE)
            cell[4].fill_(layout.QUANTIZE_LENGTH + 32 * 3)
            record("append_plain", bench_graph(lambda i, cell=cell, kv=kv: (
                lambda: tq.append(kv, kv, *cell[:6], *cell[6:], 4)), 1), 0)
            copy_ms = bench_graph(lambda i, cell=cell, e=exit_len: (lambda: cell[4].copy_(e)), 1)
            for nw in (4, 8):
                ms = bench_graph(lambda i, cell=cell, kv=kv, nw=nw, e=exit_len: (lambda: (
                    cell[4].copy_(e), tq.append(kv, kv, *cell[:6], *cell[6:], 4, num_warps=nw))), 1)
                record(f"append_exit_w{nw}", ms - copy_ms, 0)
            res["append_exit"] = dict(res["append_exit_w4"])
            cell[4].fill_(ctx)
    vp = [make_dense(B, ctx, seed=100 + s, hot=True) for s in range(sets_q)]
    vcells = [make_cell(d, 4) for d in vp]
    frac = hot_fraction(vp[0]["q"], vcells[0], TAU)
    kw = cfg.get("vp", cfg.get(4, {}))
    for tau, name in ((math.inf, "loopkv_int4_vpdata"), (TAU, "loopkv_int4_vp")):
        def make(i, tau=tau, vp=vp, vcells=vcells):
            return lambda: ta.cell_attention(vp[i]["q"], *vcells[i], 4, tau, scale, **kw)
        cold = 0.0 if tau == math.inf else 1 - frac
        record(name, bench_graph(make, len(vcells)), history_bytes(B, ctx, 4, cold), hot_fraction=frac)
    cudnn = res.get("cudnn_bf16", {}).get("ms")
    for val in res.values():
        if isinstance(val, dict) and "ms" in val and cudnn:
            val["speedup_vs_cudnn"] = cudnn / val["ms"]
    rows.append(res)


# reader arms: name -> cell_attention keyword arguments (splits None: the launcher's heuristic)
CC3 = ("qk", "vg", "f24")
CC4 = (*CC3, "i32")
READERS = {
    "dot": {"far_impl": "dot"},  # session 1's tensor-core reader (comparison point)
    "cc_w1_t8": {"far_impl": "cc", "num_warps": 1, "sub_tokens": 8, "cc_opts": (), "maxnreg": 0},  # session 2's
    # the launcher's choice (session 3: cc, 1 warp, cc_opts qk,vg,f24, INT4 maxnreg 128; INT2 from B x H >= 64:
    # 16-token sub-tiles)
    "default": {},
    # measured in session 3 without a register cap (cell_attention_2026-11-29_session3.json; the single options'
    # arms are dropped)
    "cc_w1_t8_qk_vg_f24": {"far_impl": "cc", "num_warps": 1, "sub_tokens": 8, "cc_opts": CC3, "maxnreg": 0},
    "cc_w1_t16_qk_vg_f24": {"far_impl": "cc", "num_warps": 1, "sub_tokens": 16, "cc_opts": CC3, "maxnreg": 0},
    "cc_w2_t16_qk_vg_f24": {"far_impl": "cc", "num_warps": 2, "sub_tokens": 16, "cc_opts": CC3, "maxnreg": 0},
    # session 3: the default with a register cap (ptxas, sm_90, Triton 3.6: 183 registers uncapped = 11 warps per
    # SM; 168 -> 12, no spills, +25 instructions per page; 128 -> 16, 200 B stack, no spill in the page loop;
    # 112 -> 18, 7 spill loads per page)
    "r168": {"maxnreg": 168},
    "r128": {"maxnreg": 128},  # INT4's default since this measurement (INT2: no gain measured, stays uncapped)
    "r112": {"maxnreg": 112},
    # session 15: the k16 default (before "ff") under lower caps (static, sm_90, Triton 3.9, probe_page_loop.py
    # --maxnreg): at 120 (17 programs per SM) INT4 859 instructions per page-head and 1 spill load (128: 862, 4),
    # V precision 870 and 0 (870, 0), INT2 715 and 0 (711, 0); at 112 (18 per SM) INT4 877 and 19, V precision 878
    # and 8, INT2 717 and 2. Measured slower than 128 at every shape (cell_attention_2026-11-30_session15_caps_*)
    "r120": {"maxnreg": 120},
    # session 15, after r120 and r112 measured slower than 128 at every shape (cell_attention_2026-11-30_session15_
    # caps_*.json): higher caps, fewer programs per SM (static, as above: INT4 136 -> 857 instructions, 0 spill loads,
    # 15 per SM; 144 -> 846, 0, 14; 152 -> 843, 0, 13; INT2 711, 706, 706)
    "r136": {"maxnreg": 136},
    "r144": {"maxnreg": 144},
    "r152": {"maxnreg": 152},
    # session 15: every history program launched before the near programs (far_first; bit-identical output). At
    # B = 32 x 16K the default's time is about 0.35 ms proportional to the pages plus 0.06 ms that is not
    # (cell_attention_2026-11-30_session15_b32_contexts.json: 1344-16384 tokens); part of the latter is the end of
    # the launch, where the last long history programs run while other SMs idle. Measured: B = 32 x 16K INT4 0.395 vs
    # 0.407 ms, V precision 0.379 vs 0.418, INT2 0.292 vs 0.324 (cell_attention_2026-11-30_session15_ff_*.json); the
    # default since (triton_config.FAR_FIRST), so today "ff" runs what "default" runs; "nf" is the old order
    "ff": {"far_first": True},
    "nf": {"far_first": False},
    # session 16: with history first, the near programs run last and fill the end of the launch. 32-slot near
    # programs (10 per row-head) were chosen before the register cap, when 64-slot tiles set the kernel's
    # registers (112 vs 89, uncapped); under the cap of 128 both fit. 64 slots: half the near programs (each one
    # prologue, one partial, one counter add); 16: twice as many, shorter ones for the end of the launch. Measured
    # (cell_attention_2026-12-01_session16_nb_splits.json): 64 slots 18-38% slower (its variants report 326-348
    # spills under the cap), 16 level; 24-48 splits no better than the heuristic. The defaults stay
    "nb64": {"near_block": 64},
    "nb16": {"near_block": 16},
    "split28": {"splits": 28},
    # session 16, for the next GPU run: the launch's fixed 0.06 ms at B = 32 x 16K (session 15) split into its parts.
    # A context of 300 tokens has no history pages (near programs, merge and launch only); at 1,344 tokens (32 pages)
    # 1 split against 32 changes the merge from 11 to 42 partials per (row, KV head) for the same pages
    "split1": {"splits": 1},
    "split8": {"splits": 8},
    # session 17: that run and a timeline of every program (probe_timeline.py) showed a history program costs its SM
    # slot a few microseconds no page pays back (3 us for one with no pages), so rows with few pages want fewer
    # programs: at B = 32 x 1,344 tokens 8 splits ran 0.065 ms, the heuristic's 32 0.082. The kernel now gives a row
    # chunks of at least ceil(sqrt(chunk_coef * B*H * pages)) pages (triton_config.CHUNK_COEF; "splitN" arms pass
    # splits and so keep the even split); these arms try other coefficients, "coef0" is the even split
    "coef0": {"chunk_coef": 0.0},
    "coef1": {"chunk_coef": 0.001},
    "coef4": {"chunk_coef": 0.004},
    "coef8": {"chunk_coef": 0.008},
    "split4": {"splits": 4},
    "split12": {"splits": 12},
    "split14": {"splits": 14},
    # session 18, measured and removed (cell_attention_2026-12-01_session18_b32_16k.json, _b1_b8.json; the diff is
    # benchmarks/results/l2x2_near_lead_attempt_2026-12-01_session18.patch): "l2x2", the L2 prefetch two pages ahead
    # instead of one (INT4 at B = 32 x 16K 0.439 vs 0.389 ms, slower at every shape), and "leadN", N near programs
    # launched before the history programs against the lockstep first wave (N = 1,056 / 2,112 / 4,224: 0.390 /
    # 0.392 / 0.395 vs 0.389 ms)
    # session 18, measured and removed (cell_attention_2026-12-01_session18_nl2_*.json; the diff is
    # benchmarks/results/near_l2_attempt_2026-12-01_session18.patch): "nl2", each near program asking L2 for its
    # slots' V rows before its scores (at B = 32 x 300 in a 32K-wide table 0.046 vs 0.043 ms; level at 16K; the
    # token path's page loop gained 3 spill loads, static)
    # INT2 with 8-token sub-tiles under the cap (static: 128 registers, 804 instructions per page-head and no
    # spill in the page loop); measured in session 4: B=32 x 16K 0.399 ms vs 0.472 for the 16-token default of
    # then, and the INT2 default from B x H >= 64 since (cell_attention_2026-11-29_session4_quick.json). INT4: the
    # default. (Session 4 also ran "la", V precision's lo plane one page ahead: 0.80x of the default's V
    # precision speed; the variant was removed)
    "t8_r128": {"sub_tokens": 8, "maxnreg": 128},
    # session 4, not measured: history offsets in int32 (static, sm_90, Triton 3.6, at the cap: INT4 861 instructions
    # per page-head vs 907, V precision 892 vs 935, INT2 784 vs 804; no spill); predicted 4-5% faster INT4
    "i32": {"cc_opts": CC4},
    # with 32-bit offsets the loop needs fewer registers (static, sm_90, Triton 3.6): at maxnreg 120, 17 programs
    # per SM, INT4 867 instructions per page-head and INT2 784 with no spill in the loop (V precision: 5 spill
    # loads); at 112, 18 programs, INT2 still spill-free, INT4 3 spill loads, V precision 15 spill operations
    "i32_r120": {"cc_opts": CC4, "maxnreg": 120},
    "i32_r112": {"cc_opts": CC4, "maxnreg": 112},
    # INT2 only (INT4 spills 8 loads per page here): 19 programs per SM, 795 instructions per page-head, 3 spill loads
    "i32_r104": {"cc_opts": CC4, "maxnreg": 104},
    # session 5 (cell_attention_2026-11-30_session5.json): the next page prefetched to L2 (inline
    # `prefetch.global.L2`) is INT4's default since ("l2": V precision 0.454 vs 0.468 ms) and, with "i32", INT2's
    # ("i32_l2": 0.349 vs 0.396 ms). (Its arms i32_p2, i32_p2_nocap and i32_p3, Triton's cp.async pipeliner on the
    # page loop, lost in every mode; the option was removed)
    "i32_l2": {"cc_opts": (*CC4, "l2")},
    "l2": {"cc_opts": (*CC3, "l2")},
    # session 6 (cell_attention_2026-11-30_session6_splits.json, _b24.json): the split count. 32 (the heuristic's
    # choice at B = 32 x 16K) stayed best there; at B = 1 x 8K and B = 8 x 16K 48 won (INT4 0.018 vs 0.021 ms, 0.131
    # vs 0.133); at B = 24 the new heuristic's 43 ran as 32. MAX_SPLITS is 48 since (triton_config)
    "split16": {"splits": 16},
    "split24": {"splits": 24},
    "split32": {"splits": 32},
    "split48": {"splits": 48},
    "split64": {"splits": 64},
    # session 12: the split count at the end-to-end peaks' shapes (LoopKV-M: B = 36 x 16 KV heads, heuristic 29;
    # KIVI-4: B = 24, heuristic 43), with 2,112 one-warp slots on 132 SMs (16 per SM at the register cap), where a
    # split count that fills whole waves of far programs might beat the heuristic's 124 programs per SM
    "split20": {"splits": 20},
    "split22": {"splits": 22},
    "split26": {"splits": 26},
    "split29": {"splits": 29},
    "split33": {"splits": 33},
    "split36": {"splits": 36},
    "split40": {"splits": 40},
    "split43": {"splits": 43},
    # session 12, static only (sm_90, Triton 3.9, B = 32 x 16K): K's field work in packed fp16 pairs ("k16",
    # loopkv/ops/triton_far.py): page loop INT4 966 -> 862 instructions (spill loads 19 -> 4), V precision 974 -> 870,
    # INT2 (with "i32") 804 -> 711. "l2_pt_k16" is INT4's default plus k16, "i32_l2_pt_k16" INT2's; each mode is
    # checked against "dot" like every arm (k16's own fp16 rounding: tests/tolerances.py)
    "l2_pt_k16": {"cc_opts": (*CC3, "l2", "pt", "k16")},
    "i32_l2_pt_k16": {"cc_opts": (*CC4, "l2", "pt", "k16")},
    # session 13 (cell_attention_2026-11-30_session13_k16_peaks.json): at B = 36 x 16K "l2_pt_k16" ran INT4 in 0.453
    # vs 0.470 ms and V precision in 0.466 vs 0.492; "i32_l2_pt_k16" INT2 in 0.361 vs 0.384. "k16" is the default for
    # 16-bit inputs since (triton_config); the arms "l2_pt" and "i32_l2_pt" (below) are the defaults up to session 12
    # session 6, not measured: the next page's page-table entry ("pt") and scales ("sc") carried one iteration
    # ahead. Nsight Compute's source view of the INT4 default (ncu_2026-11-30_session6_int4_source.json) put 8% of
    # the page loop's stall samples on the R2UR that waits for the page index and 17% on the first use of the page's
    # scales. Static (sm_90, Triton 3.6, cap 128, no spill): INT4 951 / 943 instructions per page-head vs 959,
    # V precision 971 / 964 vs 977, INT2 (with i32) 804 / 803 vs 810
    "l2_pt": {"cc_opts": (*CC3, "l2", "pt")},
    "l2_sc": {"cc_opts": (*CC3, "l2", "sc")},
    "i32_l2_pt": {"cc_opts": (*CC4, "l2", "pt")},
    "i32_l2_sc": {"cc_opts": (*CC4, "l2", "sc")},
}
MODES = (("int4", 4, math.inf, False), ("int4_vpdata", 4, math.inf, True), ("int4_vp", 4, TAU, True),
         ("int2", 2, math.inf, False))  # name, bits, tau, V-precision data


def run_readers(B: int, ctx: int, rows: list, capacity: int | None = None) -> None:
    """cuDNN BF16 and every reader arm in every mode at one shape; outputs checked against ``dot``. ``capacity``:
    the cells' page tables are sized for rows of that many tokens (``make_cell``)."""
    dense_bytes = B * H * ctx * D * 2 * 2
    sets = n_sets_for(history_bytes(B, ctx, 4))
    sets_dense = n_sets_for(dense_bytes)
    scale = D**-0.5
    res = {"batch": B, "context": ctx, "history_pages": layout.n_pages(ctx), "arms": {}, "check": {}}
    if capacity:
        res["capacity"] = capacity

    def record(name, ms, nbytes, **extra):
        res["arms"][name] = {"ms": ms, "bytes": nbytes, "tb_s": nbytes / ms / 1e9, **extra}

    dense = [make_dense(B, ctx, seed=s) for s in range(max(sets, sets_dense))]

    def make_sdpa(i):
        q4, k, v = dense[i]["q"][:, :, None], dense[i]["k"], dense[i]["v"]
        if DEVICE == "cpu":
            return lambda: F.scaled_dot_product_attention(q4, k, v, scale=scale)

        def call():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                F.scaled_dot_product_attention(q4, k, v, scale=scale)
        return call
    record("cudnn_bf16", bench_graph(make_sdpa, sets_dense), dense_bytes)
    hot = [make_dense(B, ctx, seed=100 + s, hot=True) for s in range(sets)]
    for mode, bits, tau, vpdata in MODES:
        data = hot if vpdata else dense[:sets]
        cells = [make_cell(d, bits, capacity) for d in data]
        qs = [d["q"] for d in data]
        cold = 0.0
        if mode == "int4_vp":
            frac = hot_fraction(qs[0], cells[0], tau)
            res["hot_fraction"] = frac
            cold = 1.0 - frac
        nbytes = history_bytes(B, ctx, bits, cold)
        base = None
        for name, kw in READERS.items():
            arm = f"{mode}_{name}"
            try:
                out = ta.cell_attention(qs[0], *cells[0], bits, tau, scale, **kw).float()
                if base is None:
                    base = out
                res["check"][arm] = float((out - base).abs().max())
                ms = bench_graph(lambda i, kw=kw, cells=cells, qs=qs, bits=bits, tau=tau: (
                    lambda: ta.cell_attention(qs[i], *cells[i], bits, tau, scale, **kw)), len(cells))
                record(arm, ms, nbytes)
            except Exception as e:  # noqa: BLE001  (keep the other arms' numbers)
                res["arms"][arm] = {"error": repr(e)[:300]}
        del cells
    cudnn = res["arms"]["cudnn_bf16"]["ms"]
    for val in res["arms"].values():
        if "ms" in val:
            val["speedup_vs_cudnn"] = cudnn / val["ms"]
    rows.append(res)


def print_readers(result: dict) -> None:
    """ms (speedup vs cuDNN BF16) per shape, mode and reader; the V-precision gain vs the same data at tau=inf."""
    names = list(READERS)
    print(f"{'B':>3} {'ctx':>6} {'mode':<12} " + " ".join(f"{n:>19}" for n in names) + "   cudnn_bf16 ms",
          "(ms, speedup vs cudnn)")
    for r in result["rows"]:
        if "arms" not in r:
            print(f"{r['batch']:>3} {r['context']:>6} error: {r.get('error', '?')[:100]}")
            continue
        arms = r["arms"]
        for mode, *_ in MODES:
            cells = []
            for n in names:
                v = arms.get(f"{mode}_{n}", {})
                cells.append(f"{v['ms']:.3f} ({v['speedup_vs_cudnn']:.2f}x)" if "ms" in v else "err")
            print(f"{r['batch']:>3} {r['context']:>6} {mode:<12} " + " ".join(f"{c:>19}" for c in cells)
                  + f"   {arms['cudnn_bf16']['ms']:.3f}")
        gains = []
        for n in names:
            a, b = arms.get(f"int4_vp_{n}", {}), arms.get(f"int4_vpdata_{n}", {})
            gains.append(f"{b['ms'] / a['ms']:.2f}x" if "ms" in a and "ms" in b else "-")
        worst = max(r["check"].values()) if r["check"] else float("nan")
        print(f"{'':>11}{'vp gain':<12} " + " ".join(f"{g:>19}" for g in gains)
              + f"   hot={r.get('hot_fraction', float('nan')):.3f} max|arm-dot|={worst:.1e}")


def kernel_resources() -> list:
    """Registers, spills and shared memory of every compiled variant of the fused kernel."""
    out = []
    try:
        for caches in ta._cell_attn_kernel.device_caches.values():
            for k in caches[0].values():
                md = k.metadata
                out.append({"num_warps": md.num_warps, "num_stages": md.num_stages, "shared": md.shared,
                            "n_regs": k.n_regs, "n_spills": k.n_spills,
                            "constants": {str(a): str(b) for a, b in getattr(md, "constants", {}).items()}})
    except Exception as e:  # noqa: BLE001  (internal Triton structures differ across versions)
        out.append({"error": repr(e)[:200]})
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--full", action="store_true", help="session 1's arm set with the default reader")
    ap.add_argument("--quick", action="store_true", help="only B=32 x 16K, B=1 x 8K and B=8 x 16K")
    ap.add_argument("--batches", type=int, nargs="*", default=[1, 8, 32])
    ap.add_argument("--contexts", type=int, nargs="*", default=[8192, 16384, 32768])
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"),
                    help="a .json file, or a directory (cell_attention_<date>.json in it)")
    ap.add_argument("--smoke", action="store_true", help="tiny CPU run under TRITON_INTERPRET=1 (script check)")
    ap.add_argument("--capacity", type=int, default=None,
                    help="page tables sized for rows of this many tokens (a cache's max_cache_len; default: the "
                         "context): the split count follows it, the rows hold the context")
    ap.add_argument("--readers", default=None,
                    help="comma-separated reader arms to run (default: all of READERS; 'dot' is always run, as the "
                         "reference every arm is checked against)")
    args = ap.parse_args()
    if args.capacity and args.full:
        ap.error("--capacity sizes the reader arms' page tables (the default run); --full's arms do not take it")
    if args.readers is not None:
        names = ["dot"] + [r for r in args.readers.split(",") if r and r != "dot"]
        unknown = [r for r in names if r not in READERS]
        if unknown:
            ap.error(f"--readers: unknown arm(s) {unknown}; choose from {sorted(READERS)}")
        for r in list(READERS):
            if r not in names:
                del READERS[r]
    if args.smoke:
        global DEVICE, H
        DEVICE, H = "cpu", 2
        args.batches, args.contexts = [1], [288 + 32 * 4 + 7]
    t0 = time.time()
    result = {
        "device": torch.cuda.get_device_name(0) if DEVICE == "cuda" else "cpu (smoke)",
        "torch": torch.__version__, "triton": triton.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "shape": {"kv_heads": H, "head_dim": D, "q_heads_per_kv": 1, "dtype": "bfloat16", "tau": TAU},
        "config": {"waves": ta.WAVES, "max_splits": ta.MAX_SPLITS, "chunk_coef": ta.triton_config.CHUNK_COEF,
                   "capacity": args.capacity, "mode": "full" if args.full else "readers",
                   "readers": READERS},
        "rows": [],
    }
    if args.out.endswith(".json"):
        path = args.out
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    else:
        os.makedirs(args.out, exist_ok=True)
        path = os.path.join(args.out, f"cell_attention_{datetime.date.today().isoformat()}.json")

    def save():  # after every stage, so a run cut short still leaves its numbers
        with open(path, "w") as f:
            json.dump(result, f, indent=1)

    shapes = [(b, c) for b in args.batches for c in args.contexts]
    first = [(32, 16384), (1, 8192), (8, 16384)]  # the headline shapes first: a cut-short run keeps them
    shapes = [x for x in first if x in shapes] + [x for x in shapes if x not in first]
    if args.quick:
        shapes = first
    for B, ctx in shapes:
        try:
            if args.full:
                run_shape(B, ctx, result["rows"], {})
            else:
                run_readers(B, ctx, result["rows"], args.capacity)
        except torch.OutOfMemoryError as e:
            result["rows"].append({"batch": B, "context": ctx, "error": repr(e)[:200]})
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
        print(f"done B={B} ctx={ctx} at {time.time() - t0:.0f}s", flush=True)
        save()
    result["kernels"] = kernel_resources()
    result["seconds"] = time.time() - t0
    save()
    print("wrote", path, f"in {time.time() - t0:.0f}s")
    if args.full:
        print_table(result)
    else:
        print_readers(result)


ARMS = ("cudnn_bf16", "flash_bf16", "dequant_sdpa", "loopkv_bf16", "loopkv_int4", "loopkv_int4_vpdata",
        "loopkv_int4_vp", "loopkv_int2", "loopkv_shared", "append_exit", "append_plain")


def print_table(result: dict) -> None:
    print(f"{'B':>3} {'ctx':>6} " + " ".join(f"{a[:12]:>12}" for a in ARMS) + "   (ms; x = speedup vs cudnn)")
    for r in result["rows"]:
        cells = []
        for a in ARMS:
            v = r.get(a, {})
            cells.append(f"{v['ms']:.3f}" if "ms" in v else "-")
        print(f"{r['batch']:>3} {r['context']:>6} " + " ".join(f"{c:>12}" for c in cells))
        sp = {a: r[a].get("speedup_vs_cudnn") for a in ARMS if isinstance(r.get(a), dict) and "ms" in r[a]}
        print("           " + " ".join(f"{(f'{sp[a]:.2f}x' if sp.get(a) else '-'):>12}" for a in ARMS))
        extra = {k: r[k] for k in ("int4_vs_reference_max_abs", "int4_vs_bf16_rel") if k in r}
        hot = r.get("loopkv_int4_vp", {}).get("hot_fraction")
        print(f"           hot_fraction={hot} {extra}")


if __name__ == "__main__":
    sys.exit(main())
