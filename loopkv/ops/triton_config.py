"""Fixed launch configs of the fused cell attention (``triton_attention.cell_attention``).

No autotuning: the op runs inside CUDA graphs, so every choice here is a function of static shapes, and
every number was measured on the H200 (docs/kernels.md, docs/kernel-notes.md).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Iterator

import torch

NEAR_BLOCK = 64  # near slots per program (dot reader): the 320 sink + ring slots take 5 programs
CC_NEAR_BLOCK = 32  # with the cc reader: 10 near programs; the kernel's registers are the max over its
# branches, and 64-slot near tiles alone set 112 of them (32: 89, sm_90, docs/kernel-notes.md)

# Measured on the H200 (benchmarks/results/cell_attention_2026-11-29.json, docs/kernel-notes.md): the
# reader is latency-bound, so it wants many far programs. Session 6 (cell_attention_2026-11-30_session6_splits.json,
# the CUDA-core reader, 16, 24, 32, 48 and 64 splits): at B*H = 512 (batch 32 x 16 KV heads, 16K) 32 splits were
# best (INT4 0.439 ms, 48: 0.451); at B*H = 16 (batch 1, 8K) and 128 (batch 8, 16K) 48 were (INT4 0.018 vs 0.021 ms
# and 0.131 vs 0.133; 64: 0.020 and 0.131). So: about 124 far programs per SM (on 132 SMs, B*H = 512 -> 32 splits,
# 576 -> 29 as before), at most 48 splits (was 32) for small batches. Session 12
# (cell_attention_2026-11-30_session12_splits_peaks.json): at the end-to-end peaks' shapes (B*H = 576 and 384, 16K)
# no split count from 20 to 43 was more than 1.6% faster than the heuristic in any mode (the run's noise is about
# 2%); below 26 or above 36 they were up to 9% slower.
# Session 17: with history programs first (FAR_FIRST, session 15) the near programs fill the end of the launch, so
# fewer, longer history programs no longer leave SMs idle there, and a timeline of every program
# (benchmarks/probe_timeline.py, timeline_2026-12-01_session17_run1_splits32.json) showed what each one costs beyond
# its pages: at B = 32 x 1,344 tokens a program with no pages took 3.1 us, with 2 pages 7.2. Measured in one run
# each (cell_attention_2026-12-01_session17_splits_b32.json, _splits_peaks.json, _fixed_cost.json):
# 16 splits at B = 32 (62 per SM) ran INT4 at 16K in 0.389 ms against 32 splits' 0.397 (8K: 0.219 vs 0.227; 32K:
# 0.740 vs 0.748), V precision 0.373 vs 0.382, INT2 0.282 vs 0.291; 12 to 24 splits were within 1% of 16. At B = 36
# and 24 (the 16K decode peaks; the heuristic now gives 15 and 22) 14 to 22 splits ran level with or up to 4.6% faster
# than 24 to 29 (INT4 at B = 36: 0.442 ms with 15, 0.441 with 29, 0.432 with 14). At B = 32 x 1,344 tokens 8 splits
# took 0.065 ms against 32's 0.082. B = 1 and 8 keep MAX_SPLITS. The 16K decode peaks under graph
# capture: LoopKV-M's step 53.93 vs 54.41 ms, KIVI-4's 44.06 vs 44.97 (decode_2026-12-01_session17_graph_16k_peaks.json
# against session 16's run).
WAVES = 62  # far programs per SM the split heuristic aims for (124 up to session 16)
MAX_SPLITS = 48
# Session 17: rows shorter than the page table (a cache sized for ``max_cache_len`` early in its decode) need
# fewer programs than the table's width gives them. The kernel gives a row of ``pages`` history pages chunks of at
# least ceil(sqrt(CHUNK_COEF * B*H * pages)) pages (this minimizes programs x their fixed cost + the last program's
# length, with the fixed cost and per-page cost the timeline measured; ``cell_attention(chunk_coef=...)``), and the
# programs past a row's last chunk exit at once (no partial, no counter add: 1 us instead of 3). It is read on the
# device, so it follows the rows' lengths inside a CUDA graph. Measured with 32 splits at B = 32
# (cell_attention_2026-12-01_session17_coef_*.json): 1,344 tokens 0.075 vs 0.078 ms without the minimum (the same
# with the page table sized for 16K); 0, 0.001 and 0.002 within 1% of each other at 4K and 16K, 0.004 and 0.008 up to
# 3% and 6% slower at 16K. At batch 1 and 8 (48 splits; cell_attention_2026-12-01_session17_b1_b8.json) level with
# no minimum at 8K-32K but for one point, V precision at B = 8 x 8K (0.076 vs 0.073 ms).
CHUNK_COEF = 0.002


def check_chunk_coef(value: float, where: str) -> float:
    """``value`` as a minimum-chunk coefficient (a finite number >= 0; 0: no minimum), or a ValueError naming
    ``where`` it was given."""
    if not (value >= 0 and math.isfinite(value)):
        raise ValueError(f"{where}: chunk_coef must be a finite number >= 0 (0: no minimum chunk), got {value!r}")
    return float(value)
_SM_COUNT: dict[int, int] = {}


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


# The CUDA-core reader's variants on by default (``triton_far.CC_OPTS``). Session 3 on the H200
# (benchmarks/results/cell_attention_2026-11-29_session3.json): with all three the one-warp reader ran INT4 at
# B=32 x 16K in 0.597 ms (1.61x cuDNN BF16; 0.785 without them) and beat cuDNN at all 9 shapes, batch 1 included.
CC_DEFAULT_OPTS = ("qk", "vg", "f24")
# Session 5 (cell_attention_2026-11-30_session5.json, ncu_2026-11-30_session5.json): "l2" (the next page prefetched to
# L2) ran INT4 at par (B=32 x 16K 0.438 vs 0.437 ms; B=1 x 8K 0.021 vs 0.022) and INT4 with V precision 3% faster
# (0.454 vs 0.468; 0.138 vs 0.144 at B=8); INT2 with "i32" and "l2" ran 0.349 vs 0.396 ms (2.76x cuDNN), 0.107 vs
# 0.122 at B=8, 0.018 vs 0.020 at B=1. "i32" alone slowed INT4 (0.459 ms; ncu: more long-scoreboard stalls), so
# INT4 keeps 64-bit offsets.
# Session 7 (cell_attention_2026-11-30_session7_pagehead.json): "pt" (the next page's page-table entry loaded one
# iteration ahead; ncu, session 6: 8.4% of the page loop's stall samples waited on it) ran INT4 at B=32 x 16K in
# 0.426 vs 0.435 ms (2.26x cuDNN), 0.128 vs 0.131 at B=8 x 16K, 0.018 vs 0.018 at B=1 x 8K; V precision 0.441 vs
# 0.451; INT2 (with "i32") 0.344 vs 0.351, 0.103 vs 0.105, 0.016 vs 0.016. One run; every arm within 4.9e-4 of
# the tensor-core reader. "sc" (the next page's scales carried in registers too) was slower everywhere (INT4
# 0.463, INT2 0.389 at B=32), so it stays an opt-in variant.
# Session 13 (cell_attention_2026-11-30_session13_k16_peaks.json, decode_2026-11-30_session13_graph_16k_k16.json):
# "k16" (K's code fields worked in packed fp16 pairs, triton_far._k_sub16) ran INT4 at B=36 x 16K in 0.453 vs
# 0.470 ms, V precision 0.466 vs 0.492, INT2 (with "i32") 0.361 vs 0.384; at the 16K decode peaks (graph capture)
# M's step took 58.67 vs 61.51 ms and KIVI-4's 45.58 vs 46.83. Its fp16 rounding is 76-244x below the codes' own
# error (k16_error_2026-11-30_session12_cpu.json; tests/tolerances.py ATTN_K16_*), so it is on by default for
# 16-bit inputs; the launcher drops it from the default for fp32 inputs (which ask for fp32 arithmetic) and on ROCm
# (no PTX). Served small model (CPU, the kernels under Triton's interpreter, LoopKV-M, 16 decode steps;
# served_quality_2026-11-30_session13_interpret_m.json): its logits are as far from the reader without it (KL
# 2.03e-4) as the tensor-core reader's are (2.04e-4). On the H200 (session 14, served_quality_2026-11-30_session14.json:
# all five arms, 8 documents x 448 decode steps) the KL from the reader without it is 3.0-3.7e-4, the tensor-core
# reader's 3.3-3.5e-4 (docs/design-decisions.md §13). To read without it: cc_options(drop=("k16",)) below.
CC_DEFAULT_OPTS_BY_BITS = {4: (*CC_DEFAULT_OPTS, "l2", "pt", "k16"), 2: (*CC_DEFAULT_OPTS, "i32", "l2", "pt", "k16")}
# Launch every (row, KV head)'s history programs before the near programs (``cell_attention(far_first=...)``,
# ``_cell_attn_kernel``'s FAR_FIRST): the short near programs then fill the end of the launch instead of the last
# long history programs. Same output bits. Session 15 on the H200 (cell_attention_2026-11-30_session15_ff_*.json,
# same run as cuDNN): B = 32 x 16K INT4 0.395 vs 0.407 ms, V precision 0.379 vs 0.418, INT2 0.292 vs 0.324; B = 8 x
# 16K INT4 5%, V precision 8%, INT2 11% faster; B = 1 x 8K level (INT4 0.0176 vs 0.0174, V precision 0.0205 vs
# 0.0199). At the 16K decode peaks (graph capture, decode_2026-11-30_session15_graph_16k_ff.json) LoopKV-M's step
# 54.3 vs 58.6 ms, KIVI-4's 44.9 vs 45.7; batch 1 x 8K 15.28 vs 15.23 ms. append_attention's launch (APPEND 1) keeps
# the launch order.
FAR_FIRST = True
# The CUDA-core reader's register cap per thread (``maxnreg``, handed to ptxas) with one query head per KV head:
# 65536 registers per SM / (32 * cap) one-warp programs fit per SM (128: 16). See ``_config``. Session 15 remeasured
# it with "k16" (cell_attention_2026-11-30_session15_caps_*.json): 112, 120, 136, 144 and 152 were all slower than
# 128 at B = 32 and 8 x 16K and at the peaks' shapes (120: INT4 0.425 vs 0.408 ms at B = 32 with the same page loop,
# 859 vs 862 instructions; 136: 0.427), and so were the decode peaks (decode_2026-11-30_session15_graph_16k_caps*).
CC_REG_CAP = 128


@contextlib.contextmanager
def cc_options(add: Iterable[str] = (), drop: Iterable[str] = (), reg_cap: int | None = None,
               far_first: bool | None = None, chunk_coef: float | None = None,
               waves: int | None = None) -> Iterator[None]:
    """Within the block, the CUDA-core reader's default variants (``CC_DEFAULT_OPTS_BY_BITS``) gain ``add`` and lose
    ``drop`` (names of ``triton_far.CC_OPTS``), and, if given, its register cap is ``reg_cap`` (``CC_REG_CAP``) and
    the launch order ``far_first`` (``FAR_FIRST``), the minimum-chunk coefficient ``chunk_coef`` (``CHUNK_COEF``) and
    the history programs per SM the split heuristic aims for ``waves`` (``WAVES``), for A/B runs of whole models
    (benchmarks). The launcher reads them at every launch, so a CUDA graph captured inside the block keeps them; they
    are restored on exit."""
    from loopkv.ops.triton_far import CC_OPTS

    add, drop = tuple(add), tuple(drop)
    unknown = sorted(set(add + drop) - set(CC_OPTS))
    if unknown:
        raise ValueError(f"cc_options: unknown reader variant(s) {unknown}; choose from {sorted(CC_OPTS)}")
    if reg_cap is not None and not (isinstance(reg_cap, int) and 32 <= reg_cap <= 255):
        raise ValueError(f"cc_options: reg_cap must be an int in [32, 255] (registers per thread), got {reg_cap!r}")
    if chunk_coef is not None:
        chunk_coef = check_chunk_coef(chunk_coef, "cc_options")
    if waves is not None and (isinstance(waves, bool) or not isinstance(waves, int) or waves < 1):
        raise ValueError(f"cc_options: waves must be an int >= 1 (history programs per SM), got {waves!r}")
    knobs = {"CC_REG_CAP": reg_cap, "FAR_FIRST": None if far_first is None else bool(far_first),
             "CHUNK_COEF": chunk_coef, "WAVES": waves}  # module settings the launcher reads; None: unchanged
    saved, saved_knobs = dict(CC_DEFAULT_OPTS_BY_BITS), {name: globals()[name] for name in knobs}
    CC_DEFAULT_OPTS_BY_BITS.update({b: tuple(o for o in opts if o not in drop) + tuple(a for a in add if a not in opts)
                                    for b, opts in saved.items()})
    globals().update({name: value for name, value in knobs.items() if value is not None})
    try:
        yield
    finally:
        CC_DEFAULT_OPTS_BY_BITS.update(saved)
        globals().update(saved_knobs)


# Launch options every loopkv kernel passes. Fused multiply-adds: the kernels were measured and their codes
# checked bit for bit with fp fusion on, Triton's default up to 3.9; Triton 3.9 warns that 3.10 turns it off by
# default, which would split the reader's one FFMA per code field into FMUL + FADD and could change the
# quantizer's rounding. Asked for explicitly, it stays on (the interpreter ignores the option).
KERNEL_OPTIONS = {"enable_fp_fusion": True}
# "i32" computes history offsets in 32 bits; from this many elements in a pool the launcher drops a default "i32"
# (same values, 64-bit offsets) and refuses an explicit one
INT32_OFFSET_LIMIT = 2**31


def _config(bits: int, far_impl: str, rows_heads: int = 1, group: int = 1, exact: bool = False) -> dict:
    """Fixed launch config per reader (no autotuning: the op runs inside CUDA graphs).

    Measured on the H200 (docs/kernel-notes.md): the tensor-core code reader is latency-bound and runs
    best as one warp per program with three pipeline stages; exact BF16 pages as four warps. The CUDA-core
    reader (``triton_far``): one warp, 8-token sub-tiles, one page per iteration, 32-slot near programs and
    the ``CC_DEFAULT_OPTS_BY_BITS`` variants (session 5: plus the L2 prefetch, and 32-bit offsets for INT2;
    session 7: plus the page-table entry loaded a page ahead). The
    ``CC_DEFAULT_OPTS`` variants were the fastest of the ten reader configs at every INT4 shape of the
    session-3 sweep. INT4 runs with ``maxnreg=128`` (``ptxas`` fits the uncapped 183 registers into 128 with a
    200-byte stack and no spill in the page loop: 16 one-warp programs per SM instead of 11): B=32 x 16K 0.437 ms
    (2.15x cuDNN; 0.601 uncapped), B=8 x 16K 1.87x, B=1 x 8K 1.18x (uncapped 1.21x)
    (``cell_attention_2026-11-29_session3_regs.json``). INT2 runs with the same cap from ``rows_heads`` (B x KV
    heads) >= 64 on (with 8-token sub-tiles: 128 registers, no spill in the page loop): B=32 x 16K 0.399 ms
    (2.36x; 0.472 with the uncapped 16-token sub-tiles it replaced), B=8 x 16K 0.123 (0.134); at B=1 x 8K the cap
    cost 0.001 ms (0.022 vs 0.021), so batch 1 stays uncapped (``cell_attention_2026-11-29_session4_quick.json``).
    Measured with one query head per KV head only: with two (``group``) the reader needs 255 registers and the
    cap would put 152 spill operations into the page loop (static, sm_90), so groups > 1 stay uncapped until
    measured.

    ``exact`` (fp32 inputs: ``ieee`` products): code pages take the tensor-core reader with four warps and one
    stage, like BF16 pages. Static only (sm_90, Triton 3.6; docs/kernel-notes.md, Session 6), not timed: with
    one warp and three stages the fp32 programs spill heavily (head_dim 128: an 8-9 KB stack per thread; 256 with
    four query heads per KV head: 31-33 KB, and 90-130 s to compile), with four warps and one stage head_dim 128
    does not spill (16-24 B) and 256 x 4 heads has 7.6 KB."""
    if bits in (4, 2):
        if far_impl == "cc":
            cap = CC_REG_CAP if group == 1 and (bits == 4 or rows_heads >= 64) else None
            return {"num_warps": 1, "num_stages": 1, "pages_per_iter": 1, "sub_tokens": 8, "prefetch": False,
                    "near_block": CC_NEAR_BLOCK, "cc_opts": CC_DEFAULT_OPTS_BY_BITS[bits], "maxnreg": cap}
        if exact:
            return {"num_warps": 4, "num_stages": 1, "pages_per_iter": 1, "sub_tokens": 0, "prefetch": False,
                    "near_block": NEAR_BLOCK, "cc_opts": ()}
        return {"num_warps": 1, "num_stages": 3, "pages_per_iter": 1, "sub_tokens": 0, "prefetch": False,
                "near_block": NEAR_BLOCK, "cc_opts": ()}
    return {"num_warps": 4, "num_stages": 2, "pages_per_iter": 1, "sub_tokens": 0, "prefetch": False,
            "near_block": NEAR_BLOCK, "cc_opts": ()}


def int32_offset_overflow(**pools: torch.Tensor) -> dict:
    """The pools too large for ``cc_opts`` "i32" (32-bit history offsets): {name: elements}; empty if all fit."""
    return {name: t.numel() for name, t in pools.items() if t.numel() >= INT32_OFFSET_LIMIT}


def check_int32_offsets(**pools: torch.Tensor) -> None:
    """``cc_opts`` "i32" computes history offsets in 32 bits: every pool must have fewer than 2**31 elements."""
    big = int32_offset_overflow(**pools)
    if big:
        raise ValueError(f"cc_opts 'i32' reads history pools with 32-bit offsets, but {big} have 2**31 or more "
                         "elements: drop 'i32' for this cell (or give it fewer pages)")
