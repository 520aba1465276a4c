"""End-to-end decode throughput of an Ouro-1.4B-shaped model on one GPU (issue 7, paper §5.3, Figure 7, Table 7).

Arms, one run, the same model and the same capture of the whole decode step as one CUDA graph:

* ``bf16``: transformers' ``StaticCache`` with one layer per cell (``static_dense_cache``), SDPA with the
  static-cache mask: the dense baseline a transformers user compiles.
* ``kivi4``: uniform INT4, no V precision (``Plan.uniform("int4")``).
* ``kivi4v``: uniform INT4 with V precision (tau = 14, the paper's setting).
* ``loopkv-r`` / ``loopkv-m``: plans with the paper's composition (§3.2, Figure 6, Table 8), built here as
  grids (the weights are random, so there is no profile to solve a knapsack on; the cost depends only on
  how many cells take each option): R = INT2 in 25 of the 72 cells of loops 1-3, all in the first or last
  six layers, no sharing (215 KiB stored / 215 read per token); M = 26 shared cells (20 in loop 3, 6 in
  loop 2), 20 INT2, the rest INT4 (155 stored / 220 read). Both with V precision (tau = 14). The byte
  counts are asserted against ``Plan.bytes_per_token``.

Weights are random (shapes set the cost) and the cache is filled synthetically to the context length
(prefilling 16K tokens per row for every batch would dominate the run): codes uniform, K scales chosen so
that V precision keeps a realistic fraction of tokens hot (measured on the model's own queries and
reported per arm as ``hot_fraction``; the paper measures 17-22% on real attention, §3.3).

For each arm and context: the largest batch whose cache fits the KV budget (``--kv-budget-gib``), decode
tok/s and step time at a sweep of batches up to it (Figure 7), host launches per decode step (eager vs
graph replay, counted with the profiler), and ``torch.cuda.max_memory_allocated``. The decode step
(model forward, greedy argmax, position update) is captured once per (arm, batch) with
``torch.cuda.graph`` (``--capture graph``, default) or compiled with
``torch.compile(mode="reduce-overhead", fullgraph=True)`` (``--capture compile``: slow to compile per
batch, so use it on a few points, ``--batches peak,1``). The step time is the mean over a whole page cycle
(``--steps``, a multiple of 32 consecutive steps: every cell quantizes one page per 32 steps, so the mean
includes the window exits in proportion; before session 4 it was the median of 10 steps right after the fill,
which contained no exit). Each point runs in a process of its own (``--shared-process`` to run them all in this
one): once ``torch.profiler`` has traced CUDA in a process, every later graph launch holds the host 4-9x longer
(session 7, ``benchmarks/probe_graph_launch.py --profiler-effect``: the BF16 step's ``replay()`` 0.32 -> 2.76 ms),
so in one process every point after the first profiled one was timed with that overhead; within a point the timing
comes before the profiling. ``step_ms`` waits for every step; ``step_ms_back_to_back`` queues the same number of
replays without waiting (the difference is host-side time per step). The replay is profiled over one page cycle for
the GPU time per kernel role (cell attention, the quantizer) and the idle time before each. Writes JSON (device,
versions, date, every measurement) to ``--out`` and prints a table last.

    PYTHONPATH=. python benchmarks/bench_decode.py --out benchmarks/results/decode_$(date +%F).json
    PYTHONPATH=. python benchmarks/bench_decode.py --smoke   # tiny model on CPU: checks the script runs
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback

import torch

import loopkv
from loopkv.cache.attention import register
from loopkv.models.ouro import OuroConfig, OuroForCausalLM, static_dense_cache
from loopkv.ops import codec, triton_config
from loopkv.ops.layout import n_pages

ARMS = ("bf16", "kivi4", "kivi4v", "loopkv-r", "loopkv-m")
# "loopkv-m-fused": M with LoopKVCache(fused_append=True): each decode append inside its cell's attention launch
# (append_attention_, docs/design-decisions.md §10; session 8: 5.9% more GPU time per step than M at batch 1 x 8K)
FUSED_ARMS = ("loopkv-m-fused",)
# "-step": LoopKVCache(step_append=True): each read writes its cell's token (token_attention_), one advance_ per
# kind of pool after the step's last cell counts the tokens and quantizes the window exits (design-decisions §12)
# LoopKVCache's default since session 11 (the plain arms use the default); "-cell": step_append=False, one append_
# per cell and step, the default before session 11 (session 11's JSON named these arms "loopkv-m" and "kivi4")
STEP_ARMS = ("loopkv-m-step", "kivi4-step")
CELL_ARMS = ("loopkv-m-cell", "kivi4-cell")
# "-k32": the library default with "k16" dropped from the CUDA-core reader's default cc_opts (K's field work in fp32,
# the default up to session 12), set for the point and restored after (triton_config.cc_options). Session 13's JSON
# has the opposite arms, "-k16" (the then-opt-in "k16" added), which are today's defaults
K32_ARMS = ("loopkv-m-k32", "kivi4-k32")
# "-r<cap>": the library default with the CUDA-core reader's register cap at <cap> instead of triton_config.CC_REG_CAP
# (one-warp programs per SM: 112 -> 18, 120 -> 17, 128 -> 16, 136 -> 15, 144 -> 14), set for the point and restored
# after (cc_options)
REG_CAP_ARMS = {f"{a}-r{c}": c for c in (112, 120, 136, 144) for a in ("loopkv-m", "kivi4")}
# "-ff": every cell's history programs launched before its near programs (triton_config.FAR_FIRST,
# cell_attention(far_first=...)), set for the point and restored after (cc_options). Measured in session 15 against
# the then-default launch order (decode_2026-11-30_session15_graph_16k_ff.json) and the default since: today "-ff" is
# the plain arm, and "-nf" is the old order
FAR_FIRST_ARMS = ("loopkv-m-ff", "kivi4-ff")
OLD_ORDER_ARMS = ("loopkv-m-nf", "kivi4-nf")
# "-s16": session 16's split count (triton_config.WAVES 124 and no minimum chunk, CHUNK_COEF 0), set for the point
# and restored after (cc_options). Session 18 measured compiled M at the 16K peak 48.10 ms with the default and 46.81
# with these, in two device calls (decode_2026-12-01_session18_compile_16k_*.json); graph capture had gone the other
# way across sessions 16-17. These arms put both in one process
S16_SPLIT_ARMS = ("loopkv-m-s16", "kivi4-s16")
# the arms above run their base arm's plan ("loopkv-m" or "kivi4", the prefix of their name) with one cache or
# reader setting changed
VARIANT_ARMS = (*FUSED_ARMS, *STEP_ARMS, *CELL_ARMS, *K32_ARMS, *REG_CAP_ARMS, *FAR_FIRST_ARMS, *OLD_ORDER_ARMS,
                *S16_SPLIT_ARMS)
# measured only when named in --arms: the variant arms, and "loopkv-m-notau", M's grid with V precision off (tau =
# inf; the same 155 / 220 KiB in Plan's accounting, which does not count V precision's savings)
EXTRA_ARMS = ("loopkv-m-notau", *VARIANT_ARMS)
STACKED = True  # LoopKVCache(stacked=...): the cells as slices of a few buffers (design-decisions §11); --per-cell
TAU = 14.0
GIB = 1 << 30
PAGE_CYCLE = codec.PAGE  # each cell quantizes one page (its window exit) every PAGE_CYCLE decode steps
# The cache holds ctx + HEADROOM tokens (the KV budget counts all of it: the same per-row bytes as sessions 2-4)
# and is filled to ctx - LEAD, so the measured steps run around the nominal context: capture warm-ups (<= 3),
# 3 warm replays, the timed steps (twice: per step and back to back), a profiled page cycle, one eager step and the
# hot-fraction step must fit in
# LEAD + HEADROOM (checked after every point)
HEADROOM = 64
LEAD = 64
LAUNCH_EVENTS = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx",
                 "cudaGraphLaunch", "cuGraphLaunch", "cudaMemcpyAsync", "cudaMemsetAsync")


def ouro_1p4b_config(**overrides) -> OuroConfig:
    """Ouro-1.4B's shapes (notes/kivi-ouro-vllm.md §3): 24 layers x 4 loops, 16 MHA heads of 128."""
    cfg = dict(vocab_size=49152, hidden_size=2048, intermediate_size=5632, num_hidden_layers=24,
               num_attention_heads=16, num_key_value_heads=16, head_dim=128, total_ut_steps=4,
               max_position_embeddings=65536, rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False)
    cfg.update(overrides)
    return OuroConfig(**cfg)


def smoke_config() -> OuroConfig:
    return ouro_1p4b_config(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                            num_attention_heads=2, num_key_value_heads=2, head_dim=32)


# ---- plans ---------------------------------------------------------------------------------------------
def paper_plans(loops: int, layers: int) -> dict[str, loopkv.Plan]:
    """The four quantized arms. R and M follow the paper's composition (module docstring)."""
    edge = [i for i in range(layers) if i < layers // 4 or i >= layers - layers // 4]  # first/last quarter
    r = [["int4"] * layers for _ in range(loops)]
    m = [["int4"] * layers for _ in range(loops)]
    n_int2_r = round(25 / 72 * (loops - 1) * layers)
    spots = [(t, i) for t in range(loops - 1) for i in edge][:n_int2_r]
    for t, i in spots:
        r[t][i] = "int2"
    if loops >= 3:
        mid = set(range(layers // 3, layers // 3 + max(1, layers // 6)))  # 4 of 24 middle layers keep INT4
        for i in range(layers):
            if i not in mid:
                m[loops - 2][i] = "share"  # loop 3 of 4: 20 of 24
        for i in range(layers - layers // 4, layers):
            m[loops - 3][i] = "share"  # loop 2 of 4: the last 6
        own = [(t, i) for t in range(loops - 2) for i in range(layers) if m[t][i] == "int4"]
        own.sort(key=lambda c: (c[1] not in edge, c))  # INT2 in the first/last layers first, as the paper's
        for t, i in own[: round(20 / 24 * layers)]:
            m[t][i] = "int2"
    plans = {
        "kivi4": loopkv.Plan.uniform(loops=loops, layers=layers, option="int4"),
        "kivi4v": loopkv.Plan.uniform(loops=loops, layers=layers, option="int4", tau=TAU),
        "loopkv-r": loopkv.Plan.from_grid(r, tau=TAU),
        "loopkv-m": loopkv.Plan.from_grid(m, tau=TAU),
        "loopkv-m-notau": loopkv.Plan.from_grid(m, tau=math.inf),
    }
    return {**plans, **{arm: plans["loopkv-m" if arm.startswith("loopkv-m") else "kivi4"] for arm in VARIANT_ARMS}}


# ---- caches, filled synthetically -------------------------------------------------------------------------
def build_cache(arm, plans, cfg, *, batch, capacity, dtype, device):
    if arm == "bf16":
        cache = static_dense_cache(cfg, max_cache_len=capacity)
        kv = torch.zeros(batch, cfg.num_key_value_heads, 1, cfg.head_dim, dtype=dtype, device=device)
        for layer in cache.layers:
            layer.lazy_initialization(kv, kv)
        return cache
    return loopkv.LoopKVCache(plans[arm], config=cfg, max_batch_size=batch, max_cache_len=capacity,
                              dtype=dtype, device=device, fused_append=arm in FUSED_ARMS, stacked=STACKED,
                              step_append=True if arm in STEP_ARMS else False if arm in CELL_ARMS else None)


def cache_bytes(cache) -> int:
    if isinstance(cache, loopkv.LoopKVCache):
        return sum(t.numel() * t.element_size() for layer in cache.layers
                   for t in layer.storage.own_tensors().values())
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))


@torch.no_grad()
def fill(cache, length: int, *, k_scale: float) -> None:
    """Every row holds ``length`` tokens of synthetic K/V (codes uniform; K spread ~ ``k_scale``)."""
    if not isinstance(cache, loopkv.LoopKVCache):
        for layer in cache.layers:
            layer.keys.normal_(0.0, 4.6 * k_scale)
            layer.values.normal_()
            layer.cumulative_length.fill_(length)
        return
    for layer in cache.layers:
        st = layer.storage
        st.sink_k.normal_(0.0, 4.6 * k_scale)
        st.win_k.normal_(0.0, 4.6 * k_scale)
        st.sink_v.normal_()
        st.win_v.normal_()
        st.lengths.fill_(length)
        if st.own_bits in (2, 4):
            levels = (1 << st.own_bits) - 1
            step = k_scale * 15 / levels  # the same K spread at either width
            for t in (st.k_pages, st.v_hi, st.v_lo):
                if t.numel():
                    t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8, device=t.device))
            st.k_scale.fill_(step)
            st.k_zero.fill_(-step * levels / 2)
            st.v_scale.fill_(3.0 / levels)
            st.v_zero.fill_(-1.5)


# ---- the decode step ---------------------------------------------------------------------------------------
def make_step(model, cache, tok, pos, *, dense: bool, capacity: int):
    """One decode step over static buffers: tok [B, 1] and pos [B, 1] advance in place (greedy)."""
    slots = torch.arange(capacity, device=tok.device)

    @torch.no_grad()
    def step():
        mask = (slots[None, :] <= pos)[:, None, None, :] if dense else None  # [B, 1, 1, capacity]
        logits = model(input_ids=tok, position_ids=pos, attention_mask=mask, past_key_values=cache,
                       logits_to_keep=1).logits
        tok.copy_(logits[:, -1].argmax(-1, keepdim=True))
        pos.add_(1)

    return step


def prepare_compile(recompile_limit: int = 64) -> None:
    """Before each (context, arm) of ``--capture compile``: forget compiled frames and allow many recompiles.

    Every point compiles the same ``step`` code object with another cache, batch or attention function, so
    Dynamo recompiles it; past the recompile limit (8 by default) it stops compiling that code (with
    ``fullgraph=True`` the point fails; measured on CPU with torch 2.13, tests/test_bench_decode.py).
    The on-disk inductor and Triton caches survive ``reset``, so an identical graph compiles faster again."""
    global _GRAPHS_AT_RESET
    torch._dynamo.reset()
    cfg = torch._dynamo.config
    setattr(cfg, "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit", recompile_limit)
    _GRAPHS_AT_RESET = _graphs_total()


def _graphs_total() -> int:
    from torch._dynamo.utils import counters  # process-wide; ``reset`` does not clear it

    return int(counters["stats"].get("unique_graphs", 0))


_GRAPHS_AT_RESET = 0


def compiled_graphs() -> int:
    """Graphs Dynamo compiled since ``prepare_compile`` (recorded per point: a fallback to eager adds none)."""
    return _graphs_total() - _GRAPHS_AT_RESET


def capture(step, mode: str, *, dynamic: bool | None = None):
    """Returns ``replay()``: one call = one whole decode step. ``dynamic``: ``torch.compile``'s (compile mode;
    True compiles one graph for every batch size after batch 1, which is always specialized)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    if mode == "compile":
        compiled = torch.compile(step, mode="reduce-overhead", fullgraph=True, dynamic=dynamic)
        with torch.cuda.stream(side):
            for _ in range(3):
                compiled()
        torch.cuda.current_stream().wait_stream(side)
        return compiled
    with torch.cuda.stream(side):
        for _ in range(2):  # JIT-compiles the Triton kernels, allocates counters, outside capture
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        step()
    return graph.replay


def _per_call(total: float, repeat: int) -> float | int:
    """``total / repeat``, kept an int when it divides (counts per step print as counts)."""
    q = total / repeat
    return int(q) if float(q).is_integer() else round(q, 2)


def count_launches(fn, repeat: int = 1) -> dict:
    """Host-side launch API calls and GPU kernels per call of ``fn``, averaged over ``repeat`` calls in one
    profiler session (``PAGE_CYCLE`` calls of a decode step include each cell's window exit once)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(repeat):
            fn()
        torch.cuda.synchronize()
    host = {}
    for e in prof.events():
        if e.name in LAUNCH_EVENTS:
            host[e.name] = host.get(e.name, 0) + 1
    host = {k: _per_call(v, repeat) for k, v in host.items()}
    per_call = {k: (_per_call(v, repeat) if k.endswith("_us") or k == "gpu_kernels" else v)
                for k, v in kernel_times(prof.events()).items()}
    return {"host_launches": sum(v for k, v in host.items() if "Memcpy" not in k and "Memset" not in k),
            "host_calls": host, "profiled_calls": repeat, **per_call}


# Triton kernels of loopkv by role (loopkv/ops/triton_quant.py, triton_attention.py)
# step_append's quantizer is _advance_kernel; its token write runs inside _cell_attn_kernel (counted as attention)
KERNEL_ROLES = {"quantizer": ("_append_kernel", "_write_pages_kernel", "_advance_kernel"),
                "attention": ("_cell_attn_kernel",)}


def _role(name: str) -> str:
    return next((role for role, names in KERNEL_ROLES.items() if any(n in name for n in names)), "other")


def kernel_times(events) -> dict:
    """GPU kernels of a profile: how many, their summed durations (us; one stream, so no overlap), the sums per
    ``KERNEL_ROLES`` role (the quantizer's share of a step is issue 6's "< 2% of a decode step"), and the idle
    time between consecutive kernels, charged to the role of the kernel that follows the gap (session 4 found
    the step 4-7 ms longer than its kernels at M's peak, more than BF16's 2.7 ms: this says before which
    kernels that time goes)."""
    kernels = [e for e in events if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA]
    roles = dict.fromkeys(KERNEL_ROLES, 0.0)
    total = 0.0
    for e in kernels:
        us = e.time_range.elapsed_us()
        total += us
        if (role := _role(e.name)) != "other":
            roles[role] += us
    idle = dict.fromkeys((*KERNEL_ROLES, "other"), 0.0)
    timed = sorted(kernels, key=lambda e: e.time_range.start)
    for prev, nxt in itertools.pairwise(timed):
        idle[_role(nxt.name)] += max(0.0, nxt.time_range.start - prev.time_range.end)
    out = {"gpu_kernels": len(kernels), "gpu_us": round(total, 1)}
    for role, us in roles.items():
        out[f"{role}_us"] = round(us, 1)
        out[f"{role}_share"] = round(us / total, 4) if total else None
    out["idle_us"] = round(sum(idle.values()), 1)
    for role, us in idle.items():
        out[f"idle_before_{role}_us"] = round(us, 1)
    return out


def time_steps(replay, steps: int, event=None) -> tuple[float, float, float]:
    """(mean, median, host mean) of per-step times (ms) over ``steps`` consecutive replays, CUDA events; the host
    mean is how long the ``replay()`` call itself took on the host (each step starts on an idle GPU, so this is
    the submission the GPU may wait for: session 6 found up to 3.4 ms between these step times and the
    back-to-back ones at batch 1). The mean is the throughput figure: over a multiple of ``PAGE_CYCLE`` steps it
    includes every cell's window exit (the page quantized when it leaves the window) in proportion; the median
    of a short run can miss them all."""
    event = event or torch.cuda.Event
    times = []
    host = []
    for _ in range(steps):
        a, b = event(enable_timing=True), event(enable_timing=True)
        a.record()
        t0 = time.perf_counter()
        replay()
        host.append((time.perf_counter() - t0) * 1e3)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return sum(times) / len(times), sorted(times)[len(times) // 2], sum(host) / len(host)


def time_back_to_back(replay, steps: int, event=None) -> float:
    """Mean ms per step over ``steps`` replays queued back to back: one event before the first and one after the
    last, no synchronization in between. ``time_steps`` waits for every step, so each of its steps starts on an
    idle GPU and may include the host's submission of the graph; here the host queues step n + 1 while step n
    runs. The difference between the two is that host-side part (session 5 left a 1-2 ms gap at batch 1
    unexplained: docs/decode-benchmark.md)."""
    event = event or torch.cuda.Event
    a, b = event(enable_timing=True), event(enable_timing=True)
    a.record()
    for _ in range(steps):
        replay()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / steps


# ---- V precision: how many history tokens are hot on these queries -----------------------------------------
@torch.no_grad()
def capture_queries(model, cache, tok, pos, *, cells: int = 8) -> list[tuple[int, torch.Tensor, float]]:
    """(cell index, row 0's query [1, Hq, D] fp32, softmax scale) of the first ``cells`` INT4-reading cells
    in one eager decode step (which appends one token to the cache)."""
    seen: list[tuple[int, torch.Tensor, float]] = []
    original, original_fused = cache.read_cell, cache.append_read_cell

    def note(layer_idx, query, scale):
        if len(seen) < cells and cache.layers[layer_idx].storage.read_bits == 4:
            seen.append((layer_idx, query[:1].float(), scale))

    def spy(layer_idx, query, *, scale):
        note(layer_idx, query, scale)
        return original(layer_idx, query, scale=scale)

    def spy_fused(layer_idx, query, k, v, *, scale):  # fused_append: the decode read appends too
        note(layer_idx, query, scale)
        return original_fused(layer_idx, query, k, v, scale=scale)

    cache.read_cell, cache.append_read_cell = spy, spy_fused
    try:
        make_step(model, cache, tok.clone(), pos.clone(), dense=False, capacity=cache.max_cache_len)()
    finally:
        del cache.read_cell, cache.append_read_cell
    return seen


def hot_share(cache, seen) -> float | None:
    """Fraction of row 0's history tokens whose V lo plane a V-precision read fetches (paper §3.3): hot for
    at least one query head of the group, ``s >= max(sink max, page max) - tau ln 2`` (reference math)."""
    hot = total = 0
    for idx, q, scale in seen:
        st = cache.layers[idx].storage
        npg = n_pages(int(st.lengths[0]))
        if npg == 0:
            continue
        phys = st.page_table[0, :npg].long()
        pages = codec.PageCodes(*(t[phys] for t in st.pool()))
        k = codec.decode_k(pages, 4)  # [P, H, PAGE, D]
        qh = q[0].view(st.sink_k.shape[1], -1, q.shape[-1])  # [H, g, D]
        s = torch.einsum("hgd,phtd->phgt", qh, k) * scale
        s_sink = torch.einsum("hgd,htd->hgt", qh, st.sink_k[0].float()) * scale
        m_ref = torch.maximum(s_sink.amax(-1)[None], s.amax(-1))  # [P, H, g]
        hot_tok = (s >= (m_ref - cache.tau * math.log(2.0))[..., None]).any(dim=2)  # [P, H, PAGE]
        hot += int(hot_tok.sum())
        total += hot_tok.numel()
    return hot / total if total else None


def hot_fraction(model, cache, tok, pos, *, cells: int = 8) -> float | None:
    """:func:`hot_share` on the queries of one eager step; None for caches without V precision."""
    if not isinstance(cache, loopkv.LoopKVCache) or math.isinf(cache.tau):
        return None
    return hot_share(cache, capture_queries(model, cache, tok, pos, cells=cells))


# ---- one measurement -----------------------------------------------------------------------------------------
def profiled(batch: int, peak: int, mode: str) -> bool:
    """Whether ``--profile MODE`` profiles the point at ``batch`` (an arm's ``peak``): "all" every point, "ends"
    batch 1 and the peak (the profile of a page cycle costs seconds per point), "none" no point."""
    if mode not in ("all", "ends", "none"):
        raise ValueError(f"--profile must be all, ends or none, got {mode!r}")
    return mode == "all" or (mode == "ends" and batch in (1, peak))


def reader_options(arm):
    """The reader's defaults for ``arm``'s points: the ``-k32`` arms drop "k16", the ``-r<cap>`` arms set the register
    cap, the ``-ff`` / ``-nf`` arms launch history programs first / in the old order, the ``-s16`` arms take session
    16's split count (all restored after)."""
    ff = True if arm in FAR_FIRST_ARMS else False if arm in OLD_ORDER_ARMS else None
    s16 = arm in S16_SPLIT_ARMS
    return triton_config.cc_options(drop=("k16",) if arm in K32_ARMS else (), reg_cap=REG_CAP_ARMS.get(arm),
                                    far_first=ff, waves=124 if s16 else None, chunk_coef=0.0 if s16 else None)


def measure(model, cfg, arm, plans, **kw):
    with reader_options(arm):
        return _measure(model, cfg, arm, plans, **kw)


def _measure(model, cfg, arm, plans, *, ctx, batch, steps, capture_mode, k_scale, dtype, device, launches,
             dynamic=None, profile=True):
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    capacity = ctx + HEADROOM
    cache = build_cache(arm, plans, cfg, batch=batch, capacity=capacity, dtype=dtype, device=device)
    if isinstance(cache, loopkv.LoopKVCache):
        cache.warmup()
    fill(cache, ctx - LEAD, k_scale=k_scale)
    tok = torch.randint(3, cfg.vocab_size, (batch, 1), device=device)
    pos = torch.full((batch, 1), ctx - LEAD, dtype=torch.long, device=device)
    torch._dynamo.mark_static_address(tok)
    torch._dynamo.mark_static_address(pos)
    row = {"arm": arm, "ctx": ctx, "batch": batch, "capture": capture_mode, "cache_bytes": cache_bytes(cache),
           "filled_to": ctx - LEAD}
    step = make_step(model, cache, tok, pos, dense=arm == "bf16", capacity=capacity)
    t0 = time.perf_counter()
    replay = capture(step, capture_mode, dynamic=dynamic)
    row["capture_s"] = round(time.perf_counter() - t0, 2)
    if capture_mode == "compile":
        row["compiled_graphs_since_reset"] = compiled_graphs()
    time_steps(replay, 3)
    ms, ms_median, host_ms = time_steps(replay, steps)
    row["replay_host_ms"] = round(host_ms, 3)
    row["step_ms_back_to_back"] = round(time_back_to_back(replay, steps), 3)
    # after capture and timing: a profiler session before capture can break it. The replay is profiled at
    # every batch over one page cycle (GPU time per kernel role, window exits included), the eager step only at
    # batch 1 (its launch count)
    if profile:
        row["graph"] = count_launches(replay, PAGE_CYCLE)
    if launches:
        row["eager"] = count_launches(step)
    row.update(step_ms=round(ms, 3), step_ms_median=round(ms_median, 3), timed_steps=steps,
               tok_s=round(batch * 1000.0 / ms, 1), ms_per_token=round(ms, 3),
               max_memory_allocated=torch.cuda.max_memory_allocated(),
               finite=bool(torch.isfinite(tok.float()).all()))
    if launches:
        row["hot_fraction"] = hot_fraction(model, cache, tok, pos)
    written = int(pos.max()) + int(launches)  # pos = tokens per row so far; + the hot-fraction step's append
    if written > capacity:
        raise RuntimeError(f"bench_decode: {written} tokens written into a cache of {capacity}: raise HEADROOM "
                           "or LEAD")
    row["tokens_after"] = written
    del replay, cache, step
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return row


def bytes_per_row(arm, plans, cfg, *, capacity, dtype, device) -> int:
    cache = build_cache(arm, plans, cfg, batch=1, capacity=capacity, dtype=dtype, device=device)
    n = cache_bytes(cache)
    del cache
    return n


def batches_for(peak: int, sweep: list[int], common: int, only: str | None = None) -> list[int]:
    """Batches measured for one arm: 1, the sweep below the peak, the common batch and the peak (ascending), or
    ``only`` (``--batches``: comma-separated integers and/or ``peak``, run in the order given, those above the
    peak dropped)."""
    if only:
        picked = [peak if b == "peak" else int(b) for b in only.split(",") if b]
        return list(dict.fromkeys(b for b in picked if 1 <= b <= peak))
    return sorted({b for b in sweep if b < peak} | {1, min(common, peak), peak})


# ---- driver ------------------------------------------------------------------------------------------------------
def versions() -> dict:
    import transformers
    import triton

    return {"torch": torch.__version__, "triton": triton.__version__, "transformers": transformers.__version__,
            "cuda": torch.version.cuda, "python": platform.python_version(), "loopkv": loopkv.__version__}


def summarize(rows: list[dict], contexts: list[int]) -> list[dict]:
    """Per (arm, ctx): peak tok/s (at the largest batch measured) and ratios against bf16 and kivi4."""
    out = []
    for ctx in contexts:
        at = [r for r in rows if r["ctx"] == ctx]
        names = ARMS + EXTRA_ARMS
        peak = {a: max((r for r in at if r["arm"] == a), key=lambda r: r["batch"], default=None) for a in names}
        one = {a: next((r for r in at if r["arm"] == a and r["batch"] == 1), None) for a in names}
        for a in names:
            if peak[a] is None:
                continue
            s = {"arm": a, "ctx": ctx, "peak_batch": peak[a]["batch"], "peak_tok_s": peak[a]["tok_s"],
                 "peak_step_ms": peak[a]["step_ms"], "batch1_step_ms": one[a]["step_ms"] if one[a] else None}
            for base in ("bf16", "kivi4"):
                if peak.get(base):
                    s[f"x_{base}"] = round(peak[a]["tok_s"] / peak[base]["tok_s"], 3)
            if one[a] and one.get("bf16") and one["bf16"]:
                s["batch1_vs_bf16"] = round(one["bf16"]["step_ms"] / one[a]["step_ms"], 3)
            for key, r in (("batch1", one[a]), ("peak", peak[a])):  # GPU time share of the quantizer kernels
                if r and r.get("graph", {}).get("quantizer_share") is not None:
                    s[f"quantizer_share_{key}"] = r["graph"]["quantizer_share"]
            out.append(s)
    return out


def load_model(cfg, weights: str, *, device, dtype):
    """The model whose parameters the parent process saved to ``weights`` (its seeded CPU initialization, which
    takes about 25 s at Ouro-1.4B's size on 2 cores): built on ``device`` (whose own random init is fast and then
    overwritten), parameters loaded, cast to ``dtype``. Non-persistent buffers (the rotary frequencies) are computed
    on ``device`` from the config."""
    with torch.device(device):
        model = OuroForCausalLM(cfg)
    state = torch.load(weights, map_location=device, weights_only=True, mmap=True)
    model.load_state_dict(state, strict=True)
    return model.to(dtype=dtype).eval()


def point_argv(args, ctx: int, arm: str, batch: int, *, profile: bool, launches: bool, out: str,
               weights: str | None = None) -> list[str]:
    """The command line of a child process that measures one point (``--point``) with this run's settings."""
    argv = [sys.executable, os.path.abspath(__file__), "--point", f"{ctx},{arm},{batch}",
            "--point-profile", str(int(profile)), "--point-launches", str(int(launches)), "--out", out,
            "--capture", args.capture, "--steps", str(args.steps), "--k-scale", str(args.k_scale),
            "--far-impl", args.far_impl]
    return (argv + (["--dynamic"] if args.dynamic else []) + (["--per-cell"] if args.per_cell else [])
            + (["--weights", weights] if weights else []))


def run_point_in_child(args, ctx: int, arm: str, batch: int, *, profile: bool, launches: bool,
                       weights: str | None = None) -> dict:
    """``measure`` in a fresh process (see the module docstring for why); its stderr tail on failure."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "row.json")
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # loopkv importable from the tree
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
        proc = subprocess.run(point_argv(args, ctx, arm, batch, profile=profile, launches=launches, out=out,
                                         weights=weights),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        if proc.returncode or not os.path.exists(out):
            raise RuntimeError(f"point {arm} ctx={ctx} B={batch} failed in its process (rc={proc.returncode}):\n"
                               + proc.stdout[-3000:])
        with open(out) as f:
            return json.load(f)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--contexts", default="8192,16384", help="comma-separated context lengths")
    p.add_argument("--arms", default=",".join(ARMS))
    p.add_argument("--kv-budget-gib", type=float, default=96.0, help="KV memory budget per arm (GiB)")
    p.add_argument("--sweep", default="4,8,16,32", help="batches measured below each arm's peak")
    p.add_argument("--common-batch", type=int, default=8, help="batch every arm is measured at (if it fits)")
    p.add_argument("--batches", default=None,
                   help="measure only these batches, in this order (e.g. 'peak,1'; 'peak' is each arm's budget "
                        "peak): a compiled sweep spends minutes per point, so it can put the headline first")
    p.add_argument("--steps", type=int, default=PAGE_CYCLE,
                   help=f"timed decode steps per point, a multiple of {PAGE_CYCLE} (one window exit per cell each)")
    p.add_argument("--capture", choices=("graph", "compile"), default="graph")
    p.add_argument("--profile", choices=("all", "ends", "none"), default="all",
                   help="which points get the profiled page cycle (GPU time per kernel role, idle time): every "
                        "point, batch 1 and each arm's peak, or none: no profiler at all (nor batch 1's eager "
                        "launch count), so --shared-process points stay clean and skip a process start each")
    p.add_argument("--dynamic", action="store_true",
                   help="compile mode: symbolic shapes (one compile per arm for every batch > 1)")
    p.add_argument("--k-scale", type=float, default=1.8, help="synthetic K spread (sets V precision's hot share)")
    p.add_argument("--max-batch", type=int, default=128)
    p.add_argument("--far-impl", choices=("auto", "cc", "dot"), default="auto",
                   help="history reader of the INT4/INT2 cells (auto: the library's default)")
    p.add_argument("--per-cell", action="store_true",
                   help="LoopKVCache(stacked=False): one set of tensors per cell instead of the default stacked "
                        "buffers (more compiled-step inputs, more host time per call)")
    p.add_argument("--smoke", action="store_true", help="tiny model, CPU-sized: check the script end to end")
    p.add_argument("--shared-process", action="store_true",
                   help="measure every point in this process (default: one process per point; after a profiled "
                        "point, graph launches in the same process are slower on the host)")
    p.add_argument("--point", default=None, help=argparse.SUPPRESS)  # "ctx,arm,batch": a child process's point
    p.add_argument("--point-profile", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--point-launches", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--weights", default=None, help=argparse.SUPPRESS)  # the parent's saved parameters
    p.add_argument("--out", default=None, help="JSON path")
    return p


def main(argv=None) -> None:
    p = build_parser()
    args = p.parse_args(argv)
    if args.steps <= 0 or args.steps % PAGE_CYCLE or 2 * args.steps + PAGE_CYCLE + 8 > LEAD + HEADROOM:
        raise SystemExit(f"--steps must be a positive multiple of {PAGE_CYCLE} (a page cycle: every cell quantizes "
                         f"one page per {PAGE_CYCLE} steps, and the mean step time must include it) of at most "
                         f"{(LEAD + HEADROOM - PAGE_CYCLE - 8) // 2 // PAGE_CYCLE * PAGE_CYCLE} (timed twice, per "
                         "step and back to back, "
                         f"within the cache's headroom), got {args.steps}")
    bad = [b for b in (args.batches or "").split(",") if b and b != "peak" and not b.isdigit()]
    if bad:
        raise SystemExit(f"--batches: {bad} are not batch sizes; give integers and/or 'peak', e.g. 'peak,1'")

    global STACKED
    STACKED = not args.per_cell
    if args.smoke:
        return smoke()
    if not torch.cuda.is_available():
        raise SystemExit("bench_decode needs a CUDA GPU (use --smoke to check the script on the CPU)")
    device, dtype = torch.device("cuda"), torch.bfloat16
    from loopkv.ops import triton_attention

    if args.far_impl != "auto":
        triton_attention.CC_DEFAULT = args.far_impl == "cc"  # choose_far_impl's default for small groups
    torch.manual_seed(0)
    cfg = ouro_1p4b_config()
    weights = None
    if args.point and args.weights:
        model = load_model(cfg, args.weights, device=device, dtype=dtype)
    elif args.point or args.shared_process:
        model = OuroForCausalLM(cfg).to(device=device, dtype=dtype).eval()
    else:  # the points run in processes of their own, which load these parameters instead of initializing
        model = OuroForCausalLM(cfg).to(dtype=dtype).eval()
        weights_dir = tempfile.TemporaryDirectory()  # removed when this process ends
        weights = os.path.join(weights_dir.name, "weights.pt")
        torch.save(model.state_dict(), weights)
    plans = paper_plans(cfg.total_ut_steps, cfg.num_hidden_layers)
    kib = {a: plans[a].bytes_per_token(cfg) for a in plans}
    plan_kib = {a: (b.stored_kib, b.read_kib) for a, b in kib.items()}
    assert plan_kib["loopkv-r"] == (215.0, 215.0), plan_kib  # the paper's R and M (§3.2, Table 8)
    assert plan_kib["loopkv-m"] == (155.0, 220.0), plan_kib
    register()  # the "loopkv" attention/mask functions, before set_attn_implementation
    if args.point:  # a child process: one point, its row to --out
        ctx_s, arm, b_s = args.point.split(",")
        if args.capture == "compile":
            prepare_compile()
        model.set_attn_implementation("sdpa" if arm == "bf16" else "loopkv")
        row = measure(model, cfg, arm, plans, ctx=int(ctx_s), batch=int(b_s), steps=args.steps,
                      capture_mode=args.capture, k_scale=args.k_scale, dtype=dtype, device=device,
                      launches=bool(args.point_launches), dynamic=True if args.dynamic else None,
                      profile=bool(args.point_profile))
        row["process"] = "own"
        with open(args.out, "w") as f:
            json.dump(row, f, default=str)
        return
    contexts = [int(c) for c in args.contexts.split(",")]
    arms = [a for a in args.arms.split(",") if a]
    unknown = sorted(set(arms) - set(ARMS + EXTRA_ARMS))
    if unknown:
        raise SystemExit(f"unknown arms {unknown}: choose from {', '.join(ARMS + EXTRA_ARMS)}")
    sweep = [int(b) for b in args.sweep.split(",") if b]
    budget = int(args.kv_budget_gib * GIB)
    rows, fits, errors = [], {}, []
    t_start = time.perf_counter()

    def run() -> None:
        for ctx in contexts:
            for arm in arms:
                if args.capture == "compile":
                    prepare_compile()
                per_row = bytes_per_row(arm, plans, cfg, capacity=ctx + HEADROOM, dtype=dtype, device=device)
                peak = min(budget // per_row, args.max_batch)
                fits[f"{arm}@{ctx}"] = {"bytes_per_row": per_row, "max_batch": peak}
                for b in batches_for(peak, sweep, args.common_batch, args.batches):
                    model.set_attn_implementation("sdpa" if arm == "bf16" else "loopkv")
                    try:
                        if args.shared_process:
                            row = measure(model, cfg, arm, plans, ctx=ctx, batch=b, steps=args.steps,
                                          capture_mode=args.capture, k_scale=args.k_scale, dtype=dtype,
                                          device=device, launches=b == 1 and args.profile != "none",
                                          dynamic=True if args.dynamic else None,
                                          profile=profiled(b, peak, args.profile))
                            row["process"] = "shared"
                        else:
                            row = run_point_in_child(args, ctx, arm, b, profile=profiled(b, peak, args.profile),
                                                     launches=b == 1 and args.profile != "none", weights=weights)
                    except Exception as exc:  # record and go on: one broken point must not lose the run
                        errors.append({"arm": arm, "ctx": ctx, "batch": b, "error": traceback.format_exc()[-3000:]})
                        print(f"{arm} ctx={ctx} B={b} FAILED: {exc!r}", flush=True)
                        torch.cuda.synchronize()
                        torch.cuda.empty_cache()
                        break
                    rows.append(row)
                    print(f"{arm:9s} ctx={ctx:6d} B={b:3d} step={row['step_ms']:8.3f} ms "
                          f"(back to back {row['step_ms_back_to_back']:8.3f}, "
                          f"replay() on host {row['replay_host_ms']:6.3f})  tok/s={row['tok_s']:8.1f}  "
                          f"peak mem={row['max_memory_allocated'] / GIB:6.1f} GiB", flush=True)
                    write()  # after every point: a run cut short keeps what it measured

    def write() -> dict:
        result = {
            "benchmark": "bench_decode", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "device": torch.cuda.get_device_name(), "versions": versions(), "args": vars(args),
            "model": {"shape": "Ouro-1.4B (random weights)", "params": sum(p.numel() for p in model.parameters())},
            "kv_budget_bytes": budget,
            # the plans of the arms this run measured (paper_plans has one per variant arm)
            "plans_kib_per_token_stored_read": {a: plan_kib[a] for a in arms if a in plan_kib},
            "plan_grids": {a: plans[a].grid() for a in arms if a in plans}, "fits": fits, "rows": rows,
            "summary": summarize(rows, contexts), "errors": errors,
            "complete": done, "wall_s": round(time.perf_counter() - t_start, 1),
            "far_reader_small_groups": "cc" if getattr(triton_attention, "CC_DEFAULT", False) else "dot",
        }
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1, default=str)
        return result

    done = False
    run()
    done = True
    summary = write()["summary"]
    print_table(summary, rows)


def print_table(summary: list[dict], rows: list[dict]) -> None:
    launches = {r["arm"]: r for r in rows if "eager" in r}
    print(f"{'arm':9s} {'ctx':>6s} {'peak B':>6s} {'tok/s':>8s} {'x bf16':>7s} {'x kivi4':>7s} {'B1 ms':>7s} "
          f"{'B1 vs bf16':>10s} {'launch eager/graph':>18s} {'hot':>5s} {'quant% B1/peak':>14s}")
    for s in summary:
        r = launches.get(s["arm"], {})
        lg = f"{r.get('eager', {}).get('host_launches', '-')}/{r.get('graph', {}).get('host_launches', '-')}"
        hot = r.get("hot_fraction")
        qs = "/".join("-" if s.get(f"quantizer_share_{k}") is None else f"{100 * s[f'quantizer_share_{k}']:.1f}"
                      for k in ("batch1", "peak"))
        cols = [_num(s.get(k), w) for k, w in (("x_bf16", 7), ("x_kivi4", 7), ("batch1_step_ms", 7),
                                                ("batch1_vs_bf16", 10))]
        print(f"{s['arm']:9s} {s['ctx']:6d} {s['peak_batch']:6d} {s['peak_tok_s']:8.1f} {' '.join(cols)} "
              f"{lg:>18s} {'-' if hot is None else f'{hot:.2f}':>5s} {qs:>14s}")


def _num(x: float | None, width: int) -> str:
    """A table cell: ``x`` to 2 decimals, or "-" where the run has no such number (an arm or batch not run)."""
    return f"{'-' if x is None else f'{x:.2f}':>{width}s}"


def smoke() -> None:
    """CPU: the tiny model through every arm's cache (eager steps), plans' bytes, fill and hot fraction."""
    cfg = smoke_config()
    torch.manual_seed(0)
    model = OuroForCausalLM(cfg).eval()
    plans = paper_plans(cfg.total_ut_steps, cfg.num_hidden_layers)
    register()
    ctx = 700
    for arm in (*ARMS, *VARIANT_ARMS):
        model.set_attn_implementation("sdpa" if arm == "bf16" else "loopkv")
        cache = build_cache(arm, plans, cfg, batch=2, capacity=ctx + 64, dtype=torch.float32, device="cpu")
        fill(cache, ctx, k_scale=0.5)
        tok = torch.randint(3, cfg.vocab_size, (2, 1))
        pos = torch.full((2, 1), ctx)
        step = make_step(model, cache, tok, pos, dense=arm == "bf16", capacity=ctx + 64)
        with torch.no_grad(), reader_options(arm):
            for _ in range(3):
                step()
        hot = hot_fraction(model, cache, tok, pos) if arm != "bf16" else None
        print(f"{arm:9s} ok: pos={int(pos[0])} bytes={cache_bytes(cache)} hot={hot}")


if __name__ == "__main__":
    main()
