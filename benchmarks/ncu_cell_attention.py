"""One launch of the fused cell attention per (reader arm, mode), to be run under Nsight Compute.

Where does the reader's time go? ``bench_cell_attention.py`` times the arms; this script only launches them
(one call each: Triton's compile runs first, on the host), so that ``ncu`` can read the hardware counters
(stall reasons, issue-slot use, DRAM throughput, L2 hit rate) of exactly those kernels. The launch order is
printed to stderr and written to ``--order``; ``benchmarks/ncu_summary.py`` joins it with ncu's CSV.

Usage (on the GPU machine):
    ncu --clock-control none -k regex:_cell_attn_kernel --section SpeedOfLight --section Occupancy \\
        --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis --page raw --csv \\
        python benchmarks/ncu_cell_attention.py --readers default,i32 --order ORDER.json > NCU.csv
"""

from __future__ import annotations

import argparse
import json
import math
import sys

import torch

from benchmarks.bench_cell_attention import READERS, TAU, make_cell, make_dense
from loopkv.ops import triton_attention as ta

MODES = {"int4": (4, math.inf, False), "int4_vp": (4, TAU, True), "int2": (2, math.inf, False)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--readers", default="default", help="comma-separated arms of bench_cell_attention.READERS")
    ap.add_argument("--modes", default="int4,int4_vp,int2", help=f"comma-separated, of {sorted(MODES)}")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=16384)
    ap.add_argument("--order", default=None, help="write the launch order (JSON list) here")
    args = ap.parse_args()
    readers = [r for r in args.readers.split(",") if r]
    modes = [m for m in args.modes.split(",") if m]
    bad = [r for r in readers if r not in READERS] + [m for m in modes if m not in MODES]
    if bad:
        ap.error(f"unknown arm(s) or mode(s) {bad}; arms: {sorted(READERS)}, modes: {sorted(MODES)}")
    order = []
    for mode in modes:
        bits, tau, hot = MODES[mode]
        dense = make_dense(args.batch, args.context, seed=7, hot=hot)
        cell = make_cell(dense, bits)
        q = dense["q"]
        del dense
        for name in readers:
            ta.cell_attention(q, *cell, bits, tau, 128**-0.5, **READERS[name])
            torch.cuda.synchronize()
            order.append({"arm": name, "mode": mode, "batch": args.batch, "context": args.context})
            print(f"launch {len(order) - 1}: {name} {mode}", file=sys.stderr, flush=True)
        del cell
        torch.cuda.empty_cache()
    if args.order:
        with open(args.order, "w") as f:
            json.dump(order, f, indent=1)


if __name__ == "__main__":
    main()
