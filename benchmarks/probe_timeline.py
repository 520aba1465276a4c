"""Where the fused cell attention's time goes, program by program (GPU; docs/kernel-notes.md, session 17).

``cell_attention(timeline=buf)`` makes every program of the launch write its start and end (``%globaltimer``,
ns, one clock for all SMs), its SM, its program index (near ``< NNEAR``, history after) and its history pages.
This script builds the benchmark's cells (``bench_cell_attention.make_dense`` / ``make_cell``), launches each
configuration a few times with a cold L2 and summarizes the median launch (``analyze``):

* ``span_us``: first program start to last program end; ``event_us`` the same launch timed by CUDA events
  (launch latency included), and ``graph_us`` the plain call (no timeline) in a CUDA graph, to show what the
  instrumentation costs;
* near and history programs: count, duration (median, mean, p90) and when they ran; the history programs'
  duration against their page count (least squares: ``far_us_per_page`` and ``far_us_fixed``, where the chunks
  differ: the last split of a row is shorter);
* ``resident``: programs running per SM, time-averaged over the span (the register cap allows 16); its profile
  over ten tenths of the span; ``ramp_us`` (mean over SMs of the first start after the launch's first) and
  ``tail_us`` (mean over SMs of the time from its last program's end to the launch's end);
* ``by_eighth``: by the eighth of the span they started in, the near programs and the history programs with a
  row's full chunk: count and median duration (the first wave's programs run longer; near programs run last).

Usage: PYTHONPATH=. python benchmarks/probe_timeline.py [--configs NAME ...] [--out DIR]
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import bench_cell_attention as bca  # noqa: E402  (the benchmark's cells and timing)

from loopkv.ops import triton_attention as ta  # noqa: E402

# name: (batch, context, bits, V precision, extra cell_attention keywords)
CONFIGS = {
    "int4_b32_300": (32, 300, 4, False, {}),
    "int4_b32_1344": (32, 1344, 4, False, {}),
    "int4_b32_16k": (32, 16384, 4, False, {}),
    "vp_b32_16k": (32, 16384, 4, True, {}),
    "int2_b32_16k": (32, 16384, 2, False, {}),
    "int4_b32_16k_split16": (32, 16384, 4, False, {"splits": 16}),
    "int4_b32_16k_nearfirst": (32, 16384, 4, False, {"far_first": False}),
    "int4_b8_16k": (8, 16384, 4, False, {}),
    # session 17: the even split of the rows' pages into the heuristic's splits (no minimum chunk), as before it
    "int4_b32_1344_coef0": (32, 1344, 4, False, {"chunk_coef": 0.0}),
    "int4_b32_16k_coef0": (32, 16384, 4, False, {"chunk_coef": 0.0}),
    # rows far shorter than the page table (a cache sized for 16K early in its decode): the split count follows the
    # table, the programs past a row's chunks exit ("capacity" is the table's, not a cell_attention argument)
    "int4_b32_300_cap16k": (32, 300, 4, False, {"capacity": 16384}),
    "int4_b32_1344_cap16k": (32, 1344, 4, False, {"capacity": 16384}),
}


def analyze(rows: torch.Tensor, nnear: int) -> dict:
    """Summary of one launch's timeline: ``rows`` int64 [programs, 6] = (start ns, end ns, SM, program,
    row-head, history pages), rows of programs that did not run (end 0) dropped."""
    rows = rows[rows[:, 1] > 0].double()
    start, end, sm, pid, pages = rows[:, 0], rows[:, 1], rows[:, 2].long(), rows[:, 3], rows[:, 5]
    t0 = float(start.min())
    t1 = float(end.max())
    span = t1 - t0
    dur = (end - start) / 1e3  # us
    near = pid < nnear
    far = ~near
    out = {"programs": int(rows.shape[0]), "span_us": span / 1e3}

    def stats(mask):
        d = dur[mask]
        if d.numel() == 0:
            return {"count": 0}
        s = start[mask]
        return {"count": int(d.numel()), "median_us": float(d.median()), "mean_us": float(d.mean()),
                "p90_us": float(torch.quantile(d, 0.9)), "first_start_us": float(s.min() - t0) / 1e3,
                "last_end_us": float(end[mask].max() - t0) / 1e3}

    out["near"] = stats(near)
    out["far"] = stats(far)
    if far.any() and pages[far].unique().numel() > 1:  # duration = fixed + per_page * pages
        x = torch.stack([torch.ones_like(pages[far]), pages[far]], 1)
        coef = torch.linalg.lstsq(x, dur[far][:, None]).solution[:, 0]
        out["far_us_fixed"], out["far_us_per_page"] = float(coef[0]), float(coef[1])
    n_sm = int(sm.max()) + 1
    out["sms"] = n_sm
    out["resident"] = float(dur.sum() * 1e3 / (span * n_sm))
    # programs resident per SM, averaged over each tenth of the span
    edges = torch.linspace(t0, t1, 11, dtype=torch.float64)
    prof = []
    for a, b in zip(edges[:-1], edges[1:], strict=True):
        overlap = (torch.minimum(end, b) - torch.maximum(start, a)).clamp(min=0)
        prof.append(float(overlap.sum() / ((b - a) * n_sm)))
    out["resident_by_tenth"] = prof
    first = torch.full((n_sm,), math.inf, dtype=torch.float64).scatter_reduce(0, sm, start, "amin")
    last = torch.zeros(n_sm, dtype=torch.float64).scatter_reduce(0, sm, end, "amax")
    used = torch.isfinite(first)
    out["sms_used"] = int(used.sum())
    out["ramp_us"] = float((first[used] - t0).mean()) / 1e3
    out["tail_us"] = float((t1 - last[used]).mean()) / 1e3
    out["tail_max_us"] = float((t1 - last[used]).max()) / 1e3
    # by the eighth of the span a program started in: how many near programs and history programs with the row's
    # full chunk (the last chunk of a row is shorter) started, and their median duration
    full = far & (pages == pages[far].max()) if far.any() else far
    eighths = []
    for i in range(8):
        a, b = t0 + span * i / 8, t0 + span * (i + 1) / 8
        inside = (start >= a) & ((start < b) if i < 7 else (start <= b))
        row = {"from_us": (a - t0) / 1e3}
        for name, mask in (("far_full", full & inside), ("near", near & inside)):
            row[name] = int(mask.sum())
            row[f"{name}_median_us"] = float(dur[mask].median()) if mask.any() else math.nan
        eighths.append(row)
    out["by_eighth"] = eighths
    return out


def run_config(name: str, reps: int, flush: torch.Tensor) -> dict:
    B, ctx, bits, vprec, kw = CONFIGS[name]
    kw = dict(kw)
    capacity = kw.pop("capacity", None)
    dense = bca.make_dense(B, ctx, seed=17, hot=vprec)
    cell = bca.make_cell(dense, bits, capacity)
    q = dense["q"]
    tau = bca.TAU if vprec else math.inf
    scale = bca.D ** -0.5
    rows = 200 * B * bca.H  # more than any launch's programs (near + history per row-head <= 10 + 48 + append)
    buf = torch.zeros(rows * 6, dtype=torch.int64, device="cuda")
    nnear = -(-320 // (kw.get("near_block") or ta.CC_NEAR_BLOCK))

    def call(timeline=None):
        return ta.cell_attention(q, *cell, bits, tau, scale, timeline=timeline, **kw)

    ref = call()
    graph_us = bca.bench_graph(lambda i: call, 1) * 1e3
    runs = []
    for _ in range(reps):
        buf.zero_()
        flush.zero_()  # a cold L2, as the benchmark's do_bench
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        out = call(buf)
        e1.record()
        torch.cuda.synchronize()
        if not torch.equal(out, ref):
            raise RuntimeError(f"{name}: the instrumented launch's output differs from the plain one")
        summary = analyze(buf.view(rows, 6).cpu(), nnear)
        summary["event_us"] = e0.elapsed_time(e1) * 1e3
        runs.append((summary["span_us"], summary, buf.view(rows, 6).cpu().clone()))
    runs.sort(key=lambda r: r[0])
    _, summary, raw = runs[len(runs) // 2]
    summary.update({"batch": B, "context": ctx, "capacity": capacity, "bits": bits, "vprec": vprec, "kw": kw,
                    "graph_us": graph_us,
                    "spans_us": [r[0] for r in runs]})
    return summary, raw[raw[:, 1] > 0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--configs", nargs="*", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("probe_timeline.py needs a CUDA GPU (the timeline reads %globaltimer)")
    flush = torch.empty(int(torch.cuda.get_device_properties(0).L2_cache_size * 4) // 4, dtype=torch.int32,
                        device="cuda")
    stamp = datetime.date.today().isoformat()
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "triton": __import__("triton").__version__, "date": stamp, "configs": {}}
    raws = {}
    for name in args.configs:
        summary, raw = run_config(name, args.reps, flush)
        result["configs"][name] = summary
        raws[name] = raw
        print(f"{name}: span {summary['span_us']:.1f} us (graph {summary['graph_us']:.1f}), near "
              f"{summary['near'].get('median_us', float('nan')):.2f} us x {summary['near']['count']}, far "
              f"{summary['far'].get('median_us', float('nan')):.2f} us x {summary['far']['count']}", flush=True)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"timeline_{stamp}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    torch.save(raws, os.path.join(args.out, f"timeline_{stamp}_raw.pt"))
    print(f"\n{'config':26s} {'graph us':>9s} {'span':>7s} {'near med':>8s} {'far med':>8s} {'far fix':>8s} "
          f"{'us/page':>7s} {'resid':>6s} {'ramp':>6s} {'tail':>6s}")
    for name, s in result["configs"].items():
        print(f"{name:26s} {s['graph_us']:9.1f} {s['span_us']:7.1f} {s['near'].get('median_us', math.nan):8.2f} "
              f"{s['far'].get('median_us', math.nan):8.2f} {s.get('far_us_fixed', math.nan):8.2f} "
              f"{s.get('far_us_per_page', math.nan):7.3f} {s['resident']:6.2f} {s['ramp_us']:6.2f} "
              f"{s['tail_us']:6.2f}")


if __name__ == "__main__":
    main()
