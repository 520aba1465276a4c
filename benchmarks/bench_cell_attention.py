"""The fused cell reader against cuDNN SDPA on BF16: decode attention of one looped model's cell on the GPU.

One cell of B rows of ``context`` tokens, of the shape ``--cells`` names (``CELLS``): Ouro-1.4B's (16 KV heads x 128,
one query head per KV head; the default), Dory-4B's (4 KV heads x 256, 4 query heads per KV head) or Huginn-0125's
(55 heads x 96, one query head per KV head). Arms:

* ``cudnn_bf16``: ``F.scaled_dot_product_attention`` with the cuDNN backend on dense BF16 K/V (the baseline); a
  group's query heads are its query rows (q [B, KV heads, group, D]), so K and V are read once per KV head, as a
  GQA decode kernel reads them; where cuDNN has no kernel for the shape the first SDPA backend that has one runs
  (``backend``);
* the reader, ``loopkv.ops.triton_attention.cell_attention`` with its defaults, in four modes on the same shape:
  ``int4`` (tau = inf), ``int4_vpdata`` (INT4, tau = inf, on data built so that about 1/6 of the history tokens
  are hot for the query), ``int4_vp`` (the same data at tau = 14: V precision skips the cold tokens' low plane;
  ``vp_gain`` = int4_vpdata time / int4_vp time) and ``int2``;
* ``--alternatives``: INT4 again under other launches than the table's (``ALTERNATIVES``: ``int4@dot_w8`` etc.), to
  time the rows of ``loopkv/ops/triton_config.py`` that were chosen without a GPU.

Every mode's output is checked in the same run against ``loopkv.ops.cell_attention.cell_attention_reference``
(plain PyTorch, fp32) on the same stored state: ``max_abs_vs_reference``. Times are medians of
``triton.testing.do_bench`` over CUDA-graph replays; a graph holds one call per input set, with enough sets that
they do not fit in L2 together (do_bench also flushes L2 before each replay). Bytes are those an arm must read
(codes, scales and zeros, exact sink and window; V precision subtracts the low plane of cold tokens); TB/s =
bytes / time; ``x_cudnn`` = cuDNN's time / the arm's.

The numbers the docs quote (one H200; the headline B = 32 x 16K first, then B = 1 and 8 at 8K and 16K):

    python benchmarks/bench_cell_attention.py --batches 32,1,8 --contexts 16384,8192 \\
        --out benchmarks/results/cell_attention.json

Dory's and Huginn's cells at B = 32 x 16K, with Ouro's in the same run, and the alternative launches:

    python benchmarks/bench_cell_attention.py --cells ouro,dory,huginn --batches 32 --contexts 16384 \\
        --alternatives dot_w8,cc_w8 --out benchmarks/results/cell_attention_cells.json

Without options: B in 1, 8, 32 x 8K, 16K, 32K. ``--capacity N`` sizes the page tables for rows of N tokens (a
cache's ``max_cache_len``) while the rows hold the context. ``--smoke``: two heads, one short row (on the CPU where
there is no GPU, the reader under ``TRITON_INTERPRET=1``); checks the script in seconds. Writes JSON (device,
versions, date, command, every measurement) to ``--out`` and prints a table last.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import os
import sys
import tempfile
import time

import torch

if "--smoke" in sys.argv[1:] and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: the reader runs on the CPU

import torch.nn.functional as F  # noqa: E402
from run_info import RESULTS, run_info, write_json  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

from loopkv import format as fmt  # noqa: E402
from loopkv.ops import codec  # noqa: E402
from loopkv.ops.cell_attention import cell_attention_reference  # noqa: E402

TAU = 14.0
HOT = 1.0 / 6.0  # share of history tokens built hot for the V-precision modes
MODES = (("int4", 4, math.inf, False), ("int4_vpdata", 4, math.inf, True), ("int4_vp", 4, TAU, True),
         ("int2", 2, math.inf, False))  # name, bits, tau, V-precision data
HEADLINE = ((32, 16384), (1, 8192), (8, 16384))  # measured first, so a run cut short keeps them


@dataclasses.dataclass(frozen=True)
class Cell:
    """A cell's shape: KV heads, query heads per KV head, head_dim."""

    kv_heads: int
    group: int
    head_dim: int
    source: str


CELLS = {
    "ouro": Cell(16, 1, 128, "Ouro-1.4B: 16 heads x 128, no GQA"),
    "dory": Cell(4, 4, 256, "Dory-4B (transformers' DoryConfig): 16 query heads, 4 KV heads x 256"),
    "huginn": Cell(55, 1, 96, "Huginn-0125: n_embd 5280, 55 heads, 55 KV heads, head_dim 96"),
}
# Other launches than the table's for the INT4 arm (name -> Launch fields; reader "cc": the CUDA-core reader)
ALTERNATIVES = {
    "dot_w1": dict(reader="dot", num_warps=1, num_stages=3, near_block=64),
    "dot_w4": dict(reader="dot", num_warps=4, num_stages=3, near_block=64),
    "dot_w8": dict(reader="dot", num_warps=8, num_stages=3, near_block=64),
    "cc_w1": dict(reader="cc", num_warps=1, num_stages=1, near_block=32, maxnreg=128, chunk_coef=0.002),
    "cc_w2": dict(reader="cc", num_warps=2, num_stages=1, near_block=32, maxnreg=128, chunk_coef=0.002),
    "cc_w4": dict(reader="cc", num_warps=4, num_stages=1, near_block=32, chunk_coef=0.002),
    "cc_w8": dict(reader="cc", num_warps=8, num_stages=1, near_block=32, chunk_coef=0.002),
    # the tensor-core reader with the query heads alone as rows (triton_dot.far_gqa), for 3-8 query heads per KV head.
    # Static sm_90 builds at Dory's cell (Triton 3.6, INT4): 233 registers uncapped (two programs per SM), 168 with
    # 16 B of stack (three), 128 with 104 B (four); eight warps replicate its 16-row tiles (same instructions per warp)
    "gqa_w4": dict(reader="gqa", num_warps=4, num_stages=1, near_block=64),
    "gqa_w4_r128": dict(reader="gqa", num_warps=4, num_stages=1, near_block=64, maxnreg=128),  # the table's, INT4
    "gqa_w4_r168": dict(reader="gqa", num_warps=4, num_stages=1, near_block=64, maxnreg=168),
}


def make_dense(B: int, cell: Cell, ctx: int, *, seed: int, hot: bool, device) -> dict:
    """q [B, H * group, D] and dense K, V [B, H, ctx, D] (bf16). ``hot``: history scores 12 +- 1 for a ``HOT`` share
    of the tokens and -2 +- 1 for the rest, sink scores 12 (so the reference max is ~12-14 and tau = 14 marks the
    others cold; a group's query heads are one direction plus 5% noise, so that they agree on what is cold);
    otherwise K with per-channel offsets and spreads like real keys."""
    H, G, D = cell.kv_heads, cell.group, cell.head_dim
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(B, H, D, device=device, generator=g)
    v = torch.randn(B, H, ctx, D, device=device, generator=g, dtype=torch.bfloat16)
    if hot:
        u = q / q.norm(dim=-1, keepdim=True)
        target = torch.where(torch.rand(B, H, ctx, device=device, generator=g) < HOT, 12.0, -2.0)
        target += torch.randn(B, H, ctx, device=device, generator=g)
        target[:, :, : fmt.SINK] = 12.0
        k = torch.randn(B, H, ctx, D, device=device, generator=g)
        k -= (k * u[:, :, None]).sum(-1, keepdim=True) * u[:, :, None]
        # score = scale * q . k = target: k's component along u is target / (scale * |q|)
        k += (target / (D**-0.5 * q.norm(dim=-1, keepdim=True)))[..., None] * u[:, :, None]
    else:
        spread = 0.5 + torch.rand(1, H, 1, D, device=device, generator=g)
        k = torch.randn(B, H, ctx, D, device=device, generator=g) * spread
        k = k + torch.randn(1, H, 1, D, device=device, generator=g)
    if G > 1:
        noise = torch.randn(B, H, G, D, device=device, generator=g) * q.norm(dim=-1, keepdim=True)[..., None]
        q = (q[:, :, None] + (0.05 if hot else 1.0) * D**-0.5 * noise).flatten(1, 2)
    return {"q": q.to(torch.bfloat16), "k": k.to(torch.bfloat16), "v": v}


def make_cell(dense: dict, bits: int, capacity: int | None = None) -> list:
    """The cell's storage holding the dense context (the reader's arguments after q, in order): sink, window ring,
    lengths, a page table (``capacity``: sized for rows of that many tokens) and the pool, pages encoded by the
    codec."""
    k, v = dense["k"], dense["v"]
    B, H, ctx, D = k.shape
    dev = k.device
    npg = fmt.n_pages(ctx)
    maxp = max(npg, fmt.max_pages(capacity) if capacity else 0, 1)
    start = fmt.SINK + fmt.PAGE * npg  # first window position
    win_k = torch.zeros(B, H, fmt.RING, D, device=dev, dtype=k.dtype)
    win_v = torch.zeros_like(win_k)
    slots = fmt.ring_slot(torch.arange(start, ctx, device=dev))
    win_k[:, :, slots] = k[:, :, start:]
    win_v[:, :, slots] = v[:, :, start:]
    kinds = {"uint8": torch.uint8, "float16": torch.float16}
    pool = {name: torch.zeros(shape, dtype=kinds[fmt.pool_field_kind(bits, name)], device=dev)
            for name, shape in fmt.pool_field_shapes(bits, B * maxp, H, D).items()}
    if npg:
        def pages(x):  # [B, H, ctx, D] -> [B * npg, H, PAGE, D], row-major
            return x[:, :, fmt.SINK:start].unflatten(2, (npg, fmt.PAGE)).transpose(1, 2).flatten(0, 1).float()

        phys = (torch.arange(B, device=dev)[:, None] * maxp + torch.arange(npg, device=dev)).flatten()
        for name, codes in zip(fmt.POOL_FIELDS, codec.encode_pages(pages(k), pages(v), bits), strict=True):
            if codes.numel():
                pool[name][phys] = codes.to(pool[name].dtype)
    lengths = torch.full((B,), ctx, dtype=torch.int32, device=dev)
    table = torch.arange(B * maxp, dtype=torch.int32, device=dev).view(B, maxp)
    sink_k, sink_v = k[:, :, : fmt.SINK].contiguous(), v[:, :, : fmt.SINK].contiguous()
    return [sink_k, sink_v, win_k, win_v, lengths, table, *(pool[name] for name in fmt.POOL_FIELDS)]


def reference(q, cell: list, bits: int, tau: float, scale: float) -> torch.Tensor:
    """``cell_attention_reference`` (fp32) over a few rows at a time (its decoded pages stay a few GB)."""
    B, H, maxp = q.shape[0], cell[0].shape[1], cell[5].shape[1]
    step = max(1, (1 << 16) // (maxp * H))
    outs = []
    for b in range(0, B, step):
        rows = [t[b:b + step] for t in cell[:6]]  # sink, window, lengths and page table are per row
        outs.append(cell_attention_reference(q[b:b + step].float(), *rows, *cell[6:], bits, tau, scale))
    return torch.cat(outs)


def hot_fraction(q, cell: list, tau: float, rows: int = 4) -> float:
    """Share of history (token, KV head) pairs that are hot for some query head of the group by V precision's rule
    (``loopkv.format.cold_threshold``), from the stored codes of the first ``rows`` rows."""
    pool = codec.PageCodes(*cell[6:])
    H, D = cell[0].shape[1], cell[0].shape[3]
    scale = D**-0.5
    hot = total = 0
    for b in range(min(q.shape[0], rows)):
        npg = fmt.n_pages(int(cell[4][b]))
        pages = codec.PageCodes(*[t[cell[5][b, :npg].long()] for t in pool])
        qb = q[b].float().view(H, -1, D)  # [H, G, D]
        s = torch.einsum("hgd,phtd->phgt", qb, codec.decode_k(pages, 4)) * scale
        sink = (torch.einsum("hgd,htd->hgt", qb, cell[0][b].float()) * scale).amax(-1)  # [H, G]
        m_ref = torch.maximum(sink[None], s.amax(-1))  # [P, H, G]
        hot_kv = (s >= fmt.cold_threshold(m_ref, tau)[..., None]).any(2)  # [P, H, T]: hot for a query head
        hot += int(hot_kv.sum())
        total += hot_kv.numel()
    return hot / total if total else math.nan  # no history pages (a context under 320 tokens)


def history_bytes(B: int, H: int, D: int, ctx: int, bits: int, cold_fraction: float = 0.0) -> int:
    """Bytes the reader must read: exact sink + window, the pages' codes, scales and zeros, less the low plane of
    cold tokens."""
    npg = fmt.n_pages(ctx)
    exact = B * H * (ctx - fmt.PAGE * npg) * D * 2 * 2
    pages = B * npg * fmt.page_bytes(bits, H, D)
    cold = B * H * npg * fmt.PAGE * cold_fraction * (D // 4)
    return int(exact + pages - cold)


def bench(make_call, n_sets: int, device) -> float:
    """Median ms of one call. CUDA: a graph holds one call per input set and do_bench times its replays."""
    calls = [make_call(i) for i in range(n_sets)]
    if torch.device(device).type == "cpu":
        t = time.perf_counter()
        for c in calls:
            c()
        return (time.perf_counter() - t) * 1e3 / n_sets
    import triton

    for c in calls:
        c()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    return triton.testing.do_bench(graph.replay, warmup=20, rep=100, return_mode="median") / n_sets


def n_sets_for(nbytes: int, device) -> int:
    """Input sets per graph: enough that together they are 3x the L2 cache (at most 8)."""
    if torch.device(device).type == "cpu":
        return 1
    l2 = torch.cuda.get_device_properties(device).L2_cache_size
    return int(min(8, max(1, math.ceil(3 * l2 / max(nbytes, 1)))))


@contextlib.contextmanager
def launched_as(name: str | None):
    """Every reader call inside runs the launch ``ALTERNATIVES[name]`` (None: the table's)."""
    if name is None:
        yield
        return
    from loopkv.ops import triton_config

    fields = ALTERNATIVES[name]
    saved = triton_config.launch_config
    triton_config.launch_config = lambda *args: triton_config.Launch(**fields)
    try:
        yield
    finally:
        triton_config.launch_config = saved


def sdpa_call(q, k, v, scale: float, device):
    """The baseline's call and its SDPA backend: cuDNN, or the first backend with a kernel for the shape."""
    if torch.device(device).type == "cpu":
        return (lambda: F.scaled_dot_product_attention(q, k, v, scale=scale)), "cpu"
    for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
        def call(backend=backend):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, scale=scale)
        try:
            call()
        except RuntimeError:
            continue
        return call, backend.name.lower()
    raise RuntimeError(f"no SDPA backend runs q {tuple(q.shape)}, k {tuple(k.shape)}")


def run_shape(B: int, ctx: int, *, cell: Cell, capacity: int | None, alternatives: list[str], device,
              alt_modes: tuple[str, ...] = ("int4",)) -> dict:
    """cuDNN BF16 and the reader in every mode (and the alternatives, in ``alt_modes``) at one shape."""
    from loopkv.ops import triton_attention

    H, G, D = cell.kv_heads, cell.group, cell.head_dim
    scale = D**-0.5
    dense_bytes = B * H * ctx * D * 2 * 2
    sets_dense = n_sets_for(dense_bytes, device)
    sets = n_sets_for(history_bytes(B, H, D, ctx, 4), device)
    res = {"batch": B, "context": ctx, "capacity": capacity, "history_pages": fmt.n_pages(ctx), "modes": {}}
    plain = [make_dense(B, cell, ctx, seed=s, hot=False, device=device) for s in range(max(sets, sets_dense))]
    backend = []

    def make_sdpa(i):  # a group's query heads as its query rows: K and V read once per KV head
        call, name = sdpa_call(plain[i]["q"].unflatten(1, (H, G)), plain[i]["k"], plain[i]["v"], scale, device)
        backend.append(name)
        return call

    ms = bench(make_sdpa, sets_dense, device)
    res["cudnn_bf16"] = {"ms": ms, "bytes": dense_bytes, "tb_s": dense_bytes / ms / 1e9, "backend": backend[0]}
    hot = [make_dense(B, cell, ctx, seed=100 + s, hot=True, device=device) for s in range(sets)]
    arms = [(*m, None) for m in MODES] + [(f"{m[0]}@{a}", *m[1:], a) for a in alternatives for m in MODES
                                          if m[0] in alt_modes]
    for mode, bits, tau, vpdata, launch in arms:
        data = hot if vpdata else plain[:sets]
        cells = [make_cell(d, bits, capacity) for d in data]
        qs = [d["q"] for d in data]
        cold = 0.0
        if mode.startswith("int4_vp") and tau == TAU:
            res["hot_fraction"] = hot_fraction(qs[0], cells[0], tau)
            cold = 1.0 - res["hot_fraction"] if fmt.n_pages(ctx) else 0.0
        with launched_as(launch):
            out = triton_attention.cell_attention(qs[0], *cells[0], bits, tau, scale).float()
            ms = bench(lambda i, cells=cells, qs=qs, bits=bits, tau=tau: (
                lambda: triton_attention.cell_attention(qs[i], *cells[i], bits, tau, scale)), len(cells), device)
        err = float((out - reference(qs[0], cells[0], bits, tau, scale)).abs().max())
        nbytes = history_bytes(B, H, D, ctx, bits, cold)
        res["modes"][mode] = {"ms": ms, "bytes": nbytes, "tb_s": nbytes / ms / 1e9,
                              "x_cudnn": res["cudnn_bf16"]["ms"] / ms, "max_abs_vs_reference": err}
        del cells
    res["vp_gain"] = res["modes"]["int4_vpdata"]["ms"] / res["modes"]["int4_vp"]["ms"]
    return res


def print_table(result: dict) -> None:
    names = [m for m, *_ in MODES]
    print(f"{'B':>3} {'ctx':>6} {'cudnn ms':>9} " + " ".join(f"{n:>17}" for n in names)
          + f" {'hot':>5} {'vp gain':>7} {'max|err|':>8} {'cell':>6}   (ms (x cuDNN BF16); err: against the fp32 "
            "reference; alternative launches below their row)")
    for r in result["rows"]:
        if "error" in r:
            print(f"{r['batch']:>3} {r['context']:>6} error: {r['error'][:100]} ({r['cell']})")
            continue
        cells = [f"{r['modes'][n]['ms']:.4f} ({r['modes'][n]['x_cudnn']:.2f}x)" for n in names]
        err = max(m["max_abs_vs_reference"] for m in r["modes"].values())
        print(f"{r['batch']:>3} {r['context']:>6} {r['cudnn_bf16']['ms']:>9.4f} " + " ".join(f"{c:>17}" for c in cells)
              + f" {r.get('hot_fraction', math.nan):>5.3f} {r['vp_gain']:>6.2f}x {err:>8.1e} {r['cell']:>6}")
        alts = [f"{n} {m['ms']:.4f} ({m['x_cudnn']:.2f}x)" for n, m in r["modes"].items() if n not in names]
        if alts:
            print("      " + "  ".join(alts))


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _names(choices) -> callable:
    def parse(text: str) -> list[str]:
        names = [x for x in text.split(",") if x]
        unknown = [n for n in names if n not in choices]
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown {unknown}; choose from {', '.join(choices)}")
        return names
    return parse


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=_ints, default=[1, 8, 32], help="comma-separated batch sizes")
    ap.add_argument("--contexts", type=_ints, default=[8192, 16384, 32768], help="comma-separated context lengths")
    ap.add_argument("--cells", type=_names(CELLS), default=["ouro"],
                    help=f"comma-separated cell shapes from {', '.join(CELLS)} (default: ouro)")
    ap.add_argument("--alternatives", type=_names(ALTERNATIVES), default=[],
                    help=f"INT4 again under these launches too, from {', '.join(ALTERNATIVES)}")
    ap.add_argument("--alt-modes", type=_names([m for m, *_ in MODES]), default=["int4"],
                    help="the modes the alternatives run in (default: int4)")
    ap.add_argument("--capacity", type=int, default=None,
                    help="page tables sized for rows of this many tokens (default: the context); the rows hold "
                         "the context")
    ap.add_argument("--smoke", action="store_true",
                    help="two KV heads, one short row: checks the script in seconds")
    ap.add_argument("--out", default=None,
                    help="JSON path (default: benchmarks/results/cell_attention.json; with --smoke a temporary file)")
    args = ap.parse_args(argv)
    cells = {name: CELLS[name] for name in args.cells}
    if args.smoke:  # on the GPU where there is one, else the CPU with the reader in Triton's interpreter
        device = "cuda" if torch.cuda.is_available() else "cpu"
        cells = {name: dataclasses.replace(c, kv_heads=2) for name, c in cells.items()}
        args.batches, args.contexts = [1], [fmt.SINK + fmt.WINDOW + fmt.PAGE * 4 + 7]
        out = args.out or os.path.join(tempfile.gettempdir(), "cell_attention_smoke.json")
    else:
        if not torch.cuda.is_available():
            raise SystemExit("bench_cell_attention needs a CUDA GPU (--smoke checks the script on the CPU)")
        device = "cuda"
        out = args.out or str(RESULTS / "cell_attention.json")
    t0 = time.perf_counter()
    result = {**run_info(__file__, argv, device),
              "shape": {"dtype": "bfloat16", "tau": TAU, "hot_share_built": HOT},
              "cells": {name: {"kv_heads": c.kv_heads, "q_heads_per_kv": c.group, "head_dim": c.head_dim,
                               "source": c.source} for name, c in cells.items()},
              "args": vars(args), "rows": []}
    shapes = [(b, c) for b in args.batches for c in args.contexts]
    shapes = [s for s in HEADLINE if s in shapes] + [s for s in shapes if s not in HEADLINE]
    for name, cell in cells.items():
        for B, ctx in shapes:
            try:
                row = run_shape(B, ctx, cell=cell, capacity=args.capacity, alternatives=args.alternatives,
                                device=device, alt_modes=tuple(args.alt_modes))
            except torch.OutOfMemoryError as e:
                row = {"batch": B, "context": ctx, "error": repr(e)[:300]}
            result["rows"].append({"cell": name, **row})
            if device == "cuda":
                torch.cuda.empty_cache()
            result["seconds"] = round(time.perf_counter() - t0, 1)
            write_json(out, result)  # after every shape: a run cut short keeps what it measured
            print(f"done {name} B={B} ctx={ctx} at {result['seconds']:.0f} s", flush=True)
    print("wrote", out)
    print_table(result)
    return result


if __name__ == "__main__":
    main()
