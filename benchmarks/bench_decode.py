"""End-to-end decode throughput of an Ouro-1.4B-shaped model on one GPU, each arm at its peak batch under a KV budget.

Arms, in one run, on the same model with the same capture of the whole decode step (ratios are taken within a capture):

* ``bf16``: transformers' ``StaticCache`` with one layer per cell (``static_dense_cache``), SDPA with the
  static-cache mask: the dense baseline a transformers user compiles;
* ``kivi4``: uniform INT4 (``Plan.uniform("int4")``); ``kivi4v``: the same with V precision (tau = 14);
* ``loopkv-r`` / ``loopkv-m``: plans with the paper's composition (§3.2, Table 8), built as grids (the weights are
  random, so there is no profile to solve a knapsack on; the cost depends only on how many cells take each option):
  R = INT2 in 25 of the 72 cells of loops 1-3, all in the first or last six layers (215 KiB stored / 215 read per
  token); M = 26 shared cells (20 in loop 3, 6 in loop 2), 20 INT2, the rest INT4 (155 stored / 220 read). Both with
  V precision (tau = 14). The byte counts are asserted against ``Plan.bytes_per_token``.

Weights are random (shapes set the cost) and the cache is filled synthetically to the context (prefilling 16K tokens
per row would dominate the run): codes uniform, K scales chosen so that V precision keeps a realistic share of tokens
hot (measured on the model's own queries, ``hot_fraction``; the paper measures 17-22% on real attention, §3.3).

For each arm and context: the largest batch whose cache fits the KV budget (``--kv-budget-gib``), and the step time
and tokens/s at the batches ``--batches`` picks (default: 1, ``--sweep`` below the peak, ``--common-batch`` and the
peak). The decode step (model forward, greedy argmax, position update) is captured once per point as one CUDA graph
(``--capture graph``) or compiled with ``torch.compile(mode="reduce-overhead", fullgraph=True)`` (``--capture
compile``: about 2.5 minutes per point at Ouro-1.4B's size), or both (``--capture graph,compile``). ``step_ms`` is
the mean over ``--steps`` consecutive steps, a multiple of 32: every cell quantizes one page per 32 steps, so the
mean includes the window exits in proportion; each step waits for the previous one. ``step_ms_back_to_back`` queues
the same replays without waiting (the difference is host time per step). ``--profile`` picks the points whose replay
is profiled over one page cycle (GPU time per kernel role, idle time before each) and whose eager step's launches
are counted. Each point runs in a process of its own: once ``torch.profiler`` has traced CUDA in a process, later
graph launches in it hold the host longer; with ``--profile none`` nothing is profiled and ``--shared-process`` runs
every point in this process.

The numbers the docs quote (one H200, 96 GiB KV budget, 16K context, each arm at its peak batch, graph capture and
compiled; about 10 minutes):

    python benchmarks/bench_decode.py --contexts 16384 --arms bf16,kivi4,loopkv-m --batches peak \\
        --capture graph,compile --profile none --shared-process --out benchmarks/results/decode.json

Runs split by capture (``--capture graph`` and ``--capture compile`` to two files) are merged by ``plot_decode.py``.

``--smoke``: a tiny model on the CPU (PyTorch reference ops, eager steps timed with the host clock), every arm at
batch 1 and its peak under a small budget; checks the script in seconds. Writes JSON (device, versions, date,
command, every measurement) to ``--out`` after every point and prints a table last with each arm's peak tokens/s
against BF16's and KIVI-4's in the same run.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback

import torch
import torch.nn.functional as F
from run_info import RESULTS, run_info, write_json

import loopkv
from loopkv import format as fmt
from loopkv.models.ouro import OuroConfig, OuroForCausalLM, static_dense_cache
from loopkv.ops import codec

ARMS = ("bf16", "kivi4", "kivi4v", "loopkv-r", "loopkv-m")
CAPTURES = ("graph", "compile")
TAU = 14.0
GIB = 1 << 30
PAGE_CYCLE = fmt.PAGE  # each cell quantizes one page (its window exit) every PAGE_CYCLE decode steps
# The cache holds ctx + HEADROOM tokens (the KV budget counts all of it) and is filled to ctx - LEAD, so the measured
# steps run around the nominal context: capture warm-ups (<= 3), 3 warm steps, the timed steps (twice), a profiled
# page cycle and one eager step must fit in LEAD + HEADROOM (checked after every point)
HEADROOM = 64
LEAD = 64
HOT_CELLS = 8  # INT4 cells whose queries the hot share is measured on
LAUNCH_EVENTS = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx",
                 "cudaGraphLaunch", "cuGraphLaunch", "cudaMemcpyAsync", "cudaMemsetAsync")
# GPU kernels by role, by a part of their name: loopkv's readers and SDPA's kernels; loopkv's page quantizers
KERNEL_ROLES = {"attention": ("attn", "attention", "fmha", "flash"),
                "quantizer": ("advance", "write_pages", "append", "quant")}
# --smoke: a few steps per point (not a page cycle: the smoke checks the script, it measures nothing)
# and a wider K spread, so that V precision's rule keeps only part of the tiny model's history hot
SMOKE = {"contexts": "448", "batches": "1,peak", "steps": 2, "max_batch": 8, "bf16_rows_in_budget": 3, "k_scale": 8.0}


def ouro_1p4b_config(**overrides) -> OuroConfig:
    """Ouro-1.4B's shapes: 24 layers x 4 loops, 16 MHA heads of 128."""
    cfg = dict(vocab_size=49152, hidden_size=2048, intermediate_size=5632, num_hidden_layers=24,
               num_attention_heads=16, num_key_value_heads=16, head_dim=128, total_ut_steps=4,
               max_position_embeddings=65536, rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False)
    cfg.update(overrides)
    return OuroConfig(**cfg)


def smoke_config() -> OuroConfig:
    return ouro_1p4b_config(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                            num_attention_heads=2, num_key_value_heads=2, head_dim=32)


# ---- plans -----------------------------------------------------------------------------------------------------
def paper_plans(loops: int, layers: int) -> dict[str, loopkv.Plan]:
    """The quantized arms' plans; R and M follow the paper's composition (module docstring)."""
    edge = [i for i in range(layers) if i < layers // 4 or i >= layers - layers // 4]  # first/last quarter
    r = [["int4"] * layers for _ in range(loops)]
    m = [["int4"] * layers for _ in range(loops)]
    spots = [(t, i) for t in range(loops - 1) for i in edge][: round(25 / 72 * (loops - 1) * layers)]
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
    return {"kivi4": loopkv.Plan.uniform(loops=loops, layers=layers, option="int4"),
            "kivi4v": loopkv.Plan.uniform(loops=loops, layers=layers, option="int4", tau=TAU),
            "loopkv-r": loopkv.Plan.from_grid(r, tau=TAU),
            "loopkv-m": loopkv.Plan.from_grid(m, tau=TAU)}


# ---- caches, filled synthetically ----------------------------------------------------------------------------------
def build_cache(arm, plans, cfg, *, batch, capacity, dtype, device):
    if arm == "bf16":
        cache = static_dense_cache(cfg, max_cache_len=capacity)
        kv = torch.zeros(batch, cfg.num_key_value_heads, 1, cfg.head_dim, dtype=dtype, device=device)
        for layer in cache.layers:
            layer.lazy_initialization(kv, kv)
        return cache
    return loopkv.LoopKVCache(plans[arm], config=cfg, max_batch_size=batch, max_cache_len=capacity, dtype=dtype,
                              device=device)


def cache_bytes(cache) -> int:
    if isinstance(cache, loopkv.LoopKVCache):
        return cache.memory_report().total_bytes
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
    for idx, option in enumerate(cache.plan.options):
        st = cache.storage(idx)
        st.sink_k.normal_(0.0, 4.6 * k_scale)
        st.win_k.normal_(0.0, 4.6 * k_scale)
        st.sink_v.normal_()
        st.win_v.normal_()
        st.lengths.fill_(length)
        if option in fmt.QUANTIZED:  # a share cell's pool is its source's, filled there
            levels = (1 << fmt.BITS[option]) - 1
            step = k_scale * 15 / levels  # the same K spread at either width
            for t in (st.k_pages, st.v_hi, st.v_lo):
                if t.numel():
                    t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8, device=t.device))
            st.k_scale.fill_(step)
            st.k_zero.fill_(-step * levels / 2)
            st.v_scale.fill_(3.0 / levels)
            st.v_zero.fill_(-1.5)


# ---- the decode step -----------------------------------------------------------------------------------------------
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


_GRAPHS_AT_RESET = 0


def prepare_compile(recompile_limit: int = 64) -> None:
    """Before each (context, arm) of ``--capture compile``: forget compiled frames and allow many recompiles (every
    point compiles the same ``step`` code with another cache or batch; past Dynamo's limit it would stop compiling)."""
    global _GRAPHS_AT_RESET
    torch._dynamo.reset()
    cfg = torch._dynamo.config
    setattr(cfg, "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit", recompile_limit)
    _GRAPHS_AT_RESET = _graphs_total()


def _graphs_total() -> int:
    from torch._dynamo.utils import counters  # process-wide; ``reset`` does not clear it

    return int(counters["stats"].get("unique_graphs", 0))


def capture(step, mode: str):
    """Returns ``replay()``: one call = one whole decode step. ``eager`` (the smoke run) is the step itself."""
    if mode == "eager":
        return step
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    if mode == "compile":
        compiled = torch.compile(step, mode="reduce-overhead", fullgraph=True)
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


class HostEvent:
    """``torch.cuda.Event``'s timing interface on the host clock (the CPU smoke run)."""

    def __init__(self, enable_timing: bool = True):
        self.t = 0.0

    def record(self) -> None:
        self.t = time.perf_counter()

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: HostEvent) -> float:
        return (end.t - self.t) * 1e3


def time_steps(replay, steps: int, event) -> tuple[float, float, float]:
    """(mean, median, host mean) ms over ``steps`` consecutive steps, each waited for; the host mean is how long the
    ``replay()`` call itself held the host."""
    times, host = [], []
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


def time_back_to_back(replay, steps: int, event) -> float:
    """Mean ms per step over ``steps`` replays queued back to back (one event before the first, one after the last)."""
    a, b = event(enable_timing=True), event(enable_timing=True)
    a.record()
    for _ in range(steps):
        replay()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / steps


# ---- profiles --------------------------------------------------------------------------------------------------------
def _per_call(total: float, repeat: int) -> float | int:
    q = total / repeat
    return int(q) if float(q).is_integer() else round(q, 2)


def count_launches(fn, repeat: int = 1) -> dict:
    """Host launch calls and GPU kernels per call of ``fn``, averaged over ``repeat`` calls in one profile."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(repeat):
            fn()
        torch.cuda.synchronize()
    host: dict[str, int] = {}
    for e in prof.events():
        if e.name in LAUNCH_EVENTS:
            host[e.name] = host.get(e.name, 0) + 1
    host = {k: _per_call(v, repeat) for k, v in host.items()}
    per_call = {k: (_per_call(v, repeat) if k.endswith("_us") or k == "gpu_kernels" else v)
                for k, v in kernel_times(prof.events()).items()}
    return {"host_launches": sum(v for k, v in host.items() if "Memcpy" not in k and "Memset" not in k),
            "host_calls": host, "profiled_calls": repeat, **per_call}


def _role(name: str) -> str:
    low = name.lower()
    return next((role for role, parts in KERNEL_ROLES.items() if any(p in low for p in parts)), "other")


def kernel_times(events) -> dict:
    """GPU kernels of a profile: how many, their summed time (us; one stream), the sums and shares per
    ``KERNEL_ROLES`` role, and the idle time between kernels, charged to the role of the kernel after the gap."""
    kernels = [e for e in events if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA]
    roles = dict.fromkeys(KERNEL_ROLES, 0.0)
    total = 0.0
    for e in kernels:
        us = e.time_range.elapsed_us()
        total += us
        if (role := _role(e.name)) != "other":
            roles[role] += us
    idle = dict.fromkeys((*KERNEL_ROLES, "other"), 0.0)
    for prev, nxt in itertools.pairwise(sorted(kernels, key=lambda e: e.time_range.start)):
        idle[_role(nxt.name)] += max(0.0, nxt.time_range.start - prev.time_range.end)
    out = {"gpu_kernels": len(kernels), "gpu_us": round(total, 1)}
    for role, us in roles.items():
        out[f"{role}_us"] = round(us, 1)
        out[f"{role}_share"] = round(us / total, 4) if total else None
    out["idle_us"] = round(sum(idle.values()), 1)
    for role, us in idle.items():
        out[f"idle_before_{role}_us"] = round(us, 1)
    return out


# ---- V precision: how many history tokens are hot on the model's queries ---------------------------------------------
@torch.no_grad()
def hot_fraction(model, cache, step) -> float | None:
    """Share of row 0's history tokens whose V low plane a V-precision read fetches (paper §3.3), over the first
    ``HOT_CELLS`` INT4 cells, on the queries of one eager ``step``: hot for at least one query head of the group by
    ``loopkv.format.cold_threshold``. None for caches without V precision."""
    if not isinstance(cache, loopkv.LoopKVCache) or not cache.plan.v_precision:
        return None
    cells = [i for i, o in enumerate(cache.plan.options) if o == "int4"][:HOT_CELLS]
    queries = {}

    def hook(module, args, kwargs):
        cell = int(kwargs["cell_index"])
        if cell in cells:
            hidden = (args[0] if args else kwargs["hidden_states"])[:1].float()  # row 0, [1, 1, hidden]
            q = F.linear(hidden, module.q_proj.weight.float()).view(1, 1, -1, module.head_dim).transpose(1, 2)
            cos, sin = (x[:1].float().unsqueeze(1) for x in kwargs["position_embeddings"])
            half = q.shape[-1] // 2
            q = q * cos + torch.cat((-q[..., half:], q[..., :half]), dim=-1) * sin  # RoPE
            queries[cell] = (q[0, :, 0], module.scaling)  # [Hq, D]

    handles = [layer.self_attn.register_forward_pre_hook(hook, with_kwargs=True) for layer in model.model.layers]
    try:
        step()
    finally:
        for h in handles:
            h.remove()
    hot = total = 0
    for cell, (q, scale) in queries.items():
        st = cache.storage(cell)
        npg = fmt.n_pages(int(st.lengths[0]))
        if npg == 0:
            continue
        phys = st.page_table[0, :npg].long()
        k = codec.decode_k(codec.PageCodes(*(getattr(st, f)[phys] for f in fmt.POOL_FIELDS)), 4)  # [P, H, PAGE, D]
        qh = q.view(k.shape[1], -1, q.shape[-1])  # [H, g, D]
        s = torch.einsum("hgd,phtd->phgt", qh, k) * scale
        s_sink = torch.einsum("hgd,htd->hgt", qh, st.sink_k[0].float()) * scale
        m_ref = torch.maximum(s_sink.amax(-1)[None], s.amax(-1))  # [P, H, g]
        tau = cache.plan.taus[cell // cache.plan.layers]  # the cell's loop's threshold (inf: every token hot)
        hot_tok = (s >= fmt.cold_threshold(m_ref, tau)[..., None]).any(dim=2)  # [P, H, PAGE]
        hot += int(hot_tok.sum())
        total += hot_tok.numel()
    return round(hot / total, 4) if total else None


# ---- one measurement -------------------------------------------------------------------------------------------------
def profiled(batch: int, peak: int, mode: str) -> bool:
    """Whether ``--profile MODE`` profiles the point at ``batch``: "all" every point, "ends" batch 1 and the peak."""
    return mode == "all" or (mode == "ends" and batch in (1, peak))


def measure(model, cfg, arm, plans, *, ctx, batch, steps, capture_mode, k_scale, dtype, device, launches=False,
            profile=False) -> dict:
    cuda = torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    capacity = ctx + HEADROOM
    cache = build_cache(arm, plans, cfg, batch=batch, capacity=capacity, dtype=dtype, device=device)
    model.set_attn_implementation("sdpa" if arm == "bf16" else "loopkv")  # "loopkv": registered by the cache
    if cuda and isinstance(cache, loopkv.LoopKVCache):
        cache.warmup()
    fill(cache, ctx - LEAD, k_scale=k_scale)
    tok = torch.randint(3, cfg.vocab_size, (batch, 1), device=device)
    pos = torch.full((batch, 1), ctx - LEAD, dtype=torch.long, device=device)
    if capture_mode == "compile":
        torch._dynamo.mark_static_address(tok)
        torch._dynamo.mark_static_address(pos)
    row = {"arm": arm, "ctx": ctx, "batch": batch, "capture": capture_mode, "cache_bytes": cache_bytes(cache),
           "filled_to": ctx - LEAD}
    step = make_step(model, cache, tok, pos, dense=arm == "bf16", capacity=capacity)
    t0 = time.perf_counter()
    replay = capture(step, capture_mode)
    row["capture_s"] = round(time.perf_counter() - t0, 2)
    if capture_mode == "compile":
        row["compiled_graphs"] = _graphs_total() - _GRAPHS_AT_RESET
    event = torch.cuda.Event if cuda else HostEvent
    time_steps(replay, min(3, steps), event)  # warm
    ms, ms_median, host_ms = time_steps(replay, steps, event)
    row.update(step_ms=round(ms, 3), step_ms_median=round(ms_median, 3), timed_steps=steps,
               tok_s=round(batch * 1000.0 / ms, 1), replay_host_ms=round(host_ms, 3),
               step_ms_back_to_back=round(time_back_to_back(replay, steps, event), 3))
    # profiles after capture and timing (a profiler session before capture can break it)
    if profile:
        row["graph"] = count_launches(replay, PAGE_CYCLE)
    if launches:
        row["eager"] = count_launches(step)
    row["max_memory_allocated"] = torch.cuda.max_memory_allocated() if cuda else None
    row["hot_fraction"] = hot_fraction(model, cache, step)  # one eager step, after everything timed
    written = int(pos.max())
    if written > capacity:
        raise RuntimeError(f"bench_decode: {written} tokens written into a cache of {capacity}: raise HEADROOM or LEAD")
    row["tokens_after"] = written
    del replay, cache, step
    if cuda:
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
    ``only`` (``--batches``: integers and/or ``peak``, in the order given, those above the peak dropped)."""
    if only:
        picked = [peak if b == "peak" else int(b) for b in only.split(",") if b]
        return list(dict.fromkeys(b for b in picked if 1 <= b <= peak))
    return sorted({b for b in sweep if b < peak} | {1, min(common, peak), peak})


def summarize(rows: list[dict], contexts: list[int], captures: list[str]) -> list[dict]:
    """Per (capture, ctx, arm): tokens/s at the largest batch measured, and its ratio against bf16's and kivi4's
    under the same capture."""
    out = []
    for capture_mode, ctx in itertools.product(captures, contexts):
        at = [r for r in rows if r["ctx"] == ctx and r["capture"] == capture_mode]
        peak = {a: max((r for r in at if r["arm"] == a), key=lambda r: r["batch"], default=None) for a in ARMS}
        one = {a: next((r for r in at if r["arm"] == a and r["batch"] == 1), None) for a in ARMS}
        for a in ARMS:
            if peak[a] is None:
                continue
            s = {"capture": capture_mode, "arm": a, "ctx": ctx, "peak_batch": peak[a]["batch"],
                 "peak_tok_s": peak[a]["tok_s"], "peak_step_ms": peak[a]["step_ms"],
                 "batch1_step_ms": one[a]["step_ms"] if one[a] else None, "hot_fraction": peak[a].get("hot_fraction")}
            for base in ("bf16", "kivi4"):
                if peak[base]:
                    s[f"x_{base}"] = round(peak[a]["tok_s"] / peak[base]["tok_s"], 3)
            if one[a] and one["bf16"]:
                s["batch1_vs_bf16"] = round(one["bf16"]["step_ms"] / one[a]["step_ms"], 3)
            for key, r in (("batch1", one[a]), ("peak", peak[a])):  # the quantizer kernels' share of GPU time
                if r and r.get("graph", {}).get("quantizer_share") is not None:
                    s[f"quantizer_share_{key}"] = r["graph"]["quantizer_share"]
            out.append(s)
    return out


def print_table(summary: list[dict]) -> None:
    print(f"{'capture':7s} {'arm':9s} {'ctx':>6s} {'peak B':>6s} {'tok/s':>9s} {'x bf16':>7s} {'x kivi4':>7s} "
          f"{'step ms':>8s} {'B=1 ms':>7s} {'hot':>5s}")
    for s in summary:
        cols = [_num(s.get(k), w) for k, w in (("x_bf16", 7), ("x_kivi4", 7), ("peak_step_ms", 8),
                                                ("batch1_step_ms", 7), ("hot_fraction", 5))]
        print(f"{s['capture']:7s} {s['arm']:9s} {s['ctx']:6d} {s['peak_batch']:6d} {s['peak_tok_s']:9.1f} "
              f"{' '.join(cols)}")


def _num(x: float | None, width: int) -> str:
    """A table cell: ``x`` to 2 decimals, or "-" where the run has no such number."""
    return f"{'-' if x is None else f'{x:.2f}':>{width}s}"


# ---- points in processes of their own -------------------------------------------------------------------------------
def load_model(cfg, weights: str, *, device, dtype):
    """The model whose parameters the parent process saved to ``weights`` (its seeded initialization), built on
    ``device`` and cast to ``dtype``; the rotary buffers are computed from the config."""
    with torch.device(device):
        model = OuroForCausalLM(cfg)
    model.load_state_dict(torch.load(weights, map_location=device, weights_only=True, mmap=True), strict=True)
    return model.to(dtype=dtype).eval()


def run_point_in_child(args, capture: str, ctx: int, arm: str, batch: int, *, profile: bool, launches: bool,
                       weights: str) -> dict:
    """``measure`` in a fresh process (see the module docstring for why); its output's tail on failure."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "row.json")
        argv = [sys.executable, os.path.abspath(__file__), "--point", f"{ctx},{arm},{batch}", "--point-profile",
                str(int(profile)), "--point-launches", str(int(launches)), "--weights", weights, "--out", out,
                "--capture", capture, "--steps", str(args.steps), "--k-scale", str(args.k_scale)]
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # loopkv importable from the tree
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
        proc = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        if proc.returncode or not os.path.exists(out):
            raise RuntimeError(f"point {arm} ctx={ctx} B={batch} failed in its process (rc={proc.returncode}):\n"
                               + proc.stdout[-3000:])
        with open(out) as f:
            return json.load(f)


# ---- driver ----------------------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--contexts", default="8192,16384", help="comma-separated context lengths")
    p.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, from {', '.join(ARMS)}")
    p.add_argument("--kv-budget-gib", type=float, default=96.0, help="KV memory budget per arm (GiB)")
    p.add_argument("--batches", default=None,
                   help="measure only these batches, in this order: integers and/or 'peak' (each arm's largest "
                        "batch in the budget), e.g. 'peak,1'")
    p.add_argument("--sweep", default="4,8,16,32", help="batches below each arm's peak (without --batches)")
    p.add_argument("--common-batch", type=int, default=8, help="batch every arm is measured at (without --batches)")
    p.add_argument("--max-batch", type=int, default=128)
    p.add_argument("--steps", type=int, default=PAGE_CYCLE,
                   help=f"timed decode steps per point, a multiple of {PAGE_CYCLE} (a page cycle)")
    p.add_argument("--capture", default="graph",
                   help="graph, compile, or both ('graph,compile': every point under each, ratios within each)")
    p.add_argument("--profile", choices=("all", "ends", "none"), default="all",
                   help="points whose replay is profiled: every point, batch 1 and each arm's peak, or none")
    p.add_argument("--shared-process", action="store_true",
                   help="measure every point in this process (default: one process per point)")
    p.add_argument("--k-scale", type=float, default=1.8, help="synthetic K spread (sets V precision's hot share)")
    p.add_argument("--smoke", action="store_true", help="tiny model on the CPU: checks the script end to end")
    p.add_argument("--out", default=None,
                   help="JSON path (default: benchmarks/results/decode.json; with --smoke a temporary file)")
    p.add_argument("--point", default=None, help=argparse.SUPPRESS)  # "ctx,arm,batch": a child process's point
    p.add_argument("--point-profile", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--point-launches", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--weights", default=None, help=argparse.SUPPRESS)  # the parent's saved parameters
    return p


def check_args(p: argparse.ArgumentParser, args) -> None:
    most = (LEAD + HEADROOM - PAGE_CYCLE - 8) // 2 // PAGE_CYCLE * PAGE_CYCLE
    if args.steps <= 0 or args.steps % PAGE_CYCLE or args.steps > most:
        p.error(f"--steps must be a positive multiple of {PAGE_CYCLE} of at most {most} (timed twice within the "
                f"cache's headroom), got {args.steps}")
    bad = [b for b in (args.batches or "").split(",") if b and b != "peak" and not b.isdigit()]
    if bad:
        p.error(f"--batches: {bad} are not batch sizes; give integers and/or 'peak', e.g. 'peak,1'")
    unknown = sorted(set(args.arms.split(",")) - set(ARMS) - {""})
    if unknown:
        p.error(f"unknown arms {unknown}: choose from {', '.join(ARMS)}")
    captures = [c for c in args.capture.split(",") if c]
    if not captures or set(captures) - set(CAPTURES) or (args.point and len(captures) > 1):
        p.error(f"--capture: graph, compile or graph,compile, got {args.capture!r}")


def main(argv=None) -> dict | None:
    p = build_parser()
    args = p.parse_args(argv)
    check_args(p, args)
    if args.smoke:
        device, dtype, cfg, captures = torch.device("cpu"), torch.float32, smoke_config(), ["eager"]
        args.contexts, args.batches, args.steps = SMOKE["contexts"], SMOKE["batches"], SMOKE["steps"]
        args.max_batch, args.k_scale = SMOKE["max_batch"], SMOKE["k_scale"]
        args.profile, args.shared_process = "none", True
        out = args.out or os.path.join(tempfile.gettempdir(), "decode_smoke.json")
    else:
        if not torch.cuda.is_available():
            raise SystemExit("bench_decode needs a CUDA GPU (--smoke checks the script on the CPU)")
        device, dtype, cfg = torch.device("cuda"), torch.bfloat16, ouro_1p4b_config()
        captures = list(dict.fromkeys(c for c in args.capture.split(",") if c))
        out = args.out or str(RESULTS / "decode.json")
    torch.manual_seed(0)
    plans = paper_plans(cfg.total_ut_steps, cfg.num_hidden_layers)
    kib = {a: [plan.bytes_per_token(cfg).stored_kib, plan.bytes_per_token(cfg).read_kib] for a, plan in plans.items()}
    if not args.smoke:  # the paper's R and M (§3.2, Table 8)
        if kib["loopkv-r"] != [215.0, 215.0] or kib["loopkv-m"] != [155.0, 220.0]:
            raise RuntimeError(f"bench_decode: R and M are not the paper's 215/215 and 155/220 KiB per token: {kib}")
    measure_kw = dict(steps=args.steps, k_scale=args.k_scale, dtype=dtype, device=device)
    if args.point:  # a child process: one point, its row to --out
        model = load_model(cfg, args.weights, device=device, dtype=dtype)
        ctx, arm, batch = args.point.split(",")
        if captures == ["compile"]:
            prepare_compile()
        row = measure(model, cfg, arm, plans, ctx=int(ctx), batch=int(batch), capture_mode=captures[0],
                      launches=bool(args.point_launches), profile=bool(args.point_profile), **measure_kw)
        write_json(args.out, {**row, "process": "own"})
        return None
    weights = None
    if args.shared_process:
        model = OuroForCausalLM(cfg).to(device=device, dtype=dtype).eval()
    else:  # the points' processes load these parameters instead of initializing their own
        model = OuroForCausalLM(cfg).to(dtype=dtype).eval()
        weights_dir = tempfile.TemporaryDirectory()  # removed when this process ends
        weights = os.path.join(weights_dir.name, "weights.pt")
        torch.save(model.state_dict(), weights)
    contexts = [int(c) for c in args.contexts.split(",")]
    arms = [a for a in args.arms.split(",") if a]
    sweep = [int(b) for b in args.sweep.split(",") if b]
    if args.smoke:  # a budget of a few BF16 rows
        budget = SMOKE["bf16_rows_in_budget"] * bytes_per_row("bf16", plans, cfg, capacity=contexts[0] + HEADROOM,
                                                             dtype=dtype, device=device)
    else:
        budget = int(args.kv_budget_gib * GIB)
    t_start = time.perf_counter()
    result = {**run_info(__file__, argv, device), "args": vars(args), "captures": captures,
              "model": {"shape": "tiny (smoke)" if args.smoke else "Ouro-1.4B (random weights)",
                        "params": sum(x.numel() for x in model.parameters()), "dtype": str(dtype)},
              "kv_budget_bytes": budget,
              "plans_kib_per_token_stored_read": {a: kib[a] for a in arms if a in kib},
              "plan_grids": {a: plans[a].grid() for a in arms if a in plans},
              "fits": {}, "rows": [], "summary": [], "errors": [], "complete": False}

    def write() -> None:
        result.update(summary=summarize(result["rows"], contexts, captures),
                      wall_s=round(time.perf_counter() - t_start, 1))
        write_json(out, result)

    for capture_mode, ctx, arm in itertools.product(captures, contexts, arms):
        if capture_mode == "compile":
            prepare_compile()
        per_row = bytes_per_row(arm, plans, cfg, capacity=ctx + HEADROOM, dtype=dtype, device=device)
        peak = min(budget // per_row, args.max_batch)
        result["fits"][f"{arm}@{ctx}"] = {"bytes_per_row": per_row, "max_batch": peak}
        for b in batches_for(peak, sweep, args.common_batch, args.batches):
            prof = profiled(b, peak, args.profile)
            launches = b == 1 and args.profile != "none"
            try:
                if args.shared_process:
                    row = measure(model, cfg, arm, plans, ctx=ctx, batch=b, capture_mode=capture_mode,
                                  launches=launches, profile=prof, **measure_kw)
                    row["process"] = "shared"
                else:
                    row = run_point_in_child(args, capture_mode, ctx, arm, b, profile=prof, launches=launches,
                                             weights=weights)
            except Exception as exc:  # record and go on: one broken point must not lose the run
                if args.smoke:
                    raise
                result["errors"].append({"capture": capture_mode, "arm": arm, "ctx": ctx, "batch": b,
                                         "error": traceback.format_exc()[-3000:]})
                print(f"{capture_mode} {arm} ctx={ctx} B={b} FAILED: {exc!r}", flush=True)
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
                break
            result["rows"].append(row)
            print(f"{capture_mode:7s} {arm:9s} ctx={ctx:6d} B={b:3d} step={row['step_ms']:8.3f} ms (back to back "
                  f"{row['step_ms_back_to_back']:8.3f}, host {row['replay_host_ms']:6.3f})  "
                  f"tok/s={row['tok_s']:8.1f}", flush=True)
            write()  # after every point: a run cut short keeps what it measured
    result["complete"] = True
    write()
    print("wrote", out)
    print_table(result["summary"])
    return result


if __name__ == "__main__":
    main()
