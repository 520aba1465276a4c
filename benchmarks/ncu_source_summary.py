"""Where a kernel's warps stall, per SASS opcode of its hottest loop, from Nsight Compute's source page.

``ncu_summary.py`` says how long warps stall and why; this says *at which instructions*. Input: the CSV that
``ncu -i REPORT --page source --csv --print-source sass`` prints for a report taken with ``--set full
--import-source yes`` (one kernel). The hottest loop is the set of instructions executed at least ``--band``
times the most-executed one's count (a page loop runs once per page; the code around it far less often).

Output (JSON, with the date): the loop's size and share of all stall samples, its stall reasons (share of the
loop's samples), and per opcode: instruction count, samples and the reasons that dominate it.

Usage: python benchmarks/ncu_source_summary.py SOURCE.csv [--raw RAW.csv] [--out SUMMARY.json]
(``--raw``: the same report's ``--page raw --csv``; adds pipe utilization and the occupancy limits.)
"""

from __future__ import annotations

import argparse
import collections
import csv
import datetime
import json
import re

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"
RAW_KEYS = {  # short name -> ncu raw metric (percent of peak, or a count)
    "issue_active_pct": "smsp__issue_active.avg.pct_of_peak_sustained_active",
    "pipe_alu_pct": "sm__inst_executed_pipe_alu.avg.pct_of_peak_sustained_active",
    "pipe_fma_pct": "sm__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active",
    "pipe_lsu_pct": "sm__inst_executed_pipe_lsu.avg.pct_of_peak_sustained_active",
    "pipe_xu_pct": "sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active",
    "pipe_uniform_pct": "sm__inst_executed_pipe_uniform.avg.pct_of_peak_sustained_active",
    "warps_active_pct": "sm__warps_active.avg.pct_of_peak_sustained_active",
    "limit_registers_blocks": "launch__occupancy_limit_registers",
    "limit_shared_mem_blocks": "launch__occupancy_limit_shared_mem",
    "time_us": "gpu__time_duration.sum",
}


def _num(x: str) -> float:
    try:
        return float(x.replace(",", ""))
    except (AttributeError, ValueError):
        return 0.0


def opcode(sass: str) -> str:
    """``@!P0 LOP3.LUT R1, ...`` -> ``LOP3.LUT`` (the predicate dropped)."""
    return re.sub(r"^@!?U?P\w+\s+", "", sass.strip()).split()[0]


def read_source(path: str) -> list[dict[str, str]]:
    """The source page's rows (one per SASS instruction); ncu's own lines (``==``) and the kernel-name line
    above the header are skipped."""
    with open(path, newline="") as f:
        rows = [r for r in csv.reader(ln for ln in f if not ln.startswith("=="))]
    start = next(i for i, r in enumerate(rows) if "Source" in r and SAMPLES in r)
    head = rows[start]
    return [dict(zip(head, r, strict=True)) for r in rows[start + 1:] if len(r) == len(head)]


def summarize(rows: list[dict[str, str]], band: float = 0.9) -> dict:
    stalls = [k for k in rows[0] if k.startswith("stall_") and "Not Issued" not in k]
    top = max(_num(r[EXECUTED]) for r in rows)
    loop = [r for r in rows if _num(r[EXECUTED]) >= band * top]
    total = sum(_num(r[SAMPLES]) for r in rows)
    in_loop = sum(_num(r[SAMPLES]) for r in loop)
    reasons = collections.Counter()
    per_op: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for r in loop:
        op = per_op[opcode(r["Source"])]
        op["instructions"] += 1
        op["samples"] += _num(r[SAMPLES])
        for s in stalls:
            reasons[s] += _num(r[s])
            op[s] += _num(r[s])
    ops = []
    for name, c in sorted(per_op.items(), key=lambda kv: -kv[1]["samples"]):
        main = sorted(((s, c[s]) for s in stalls if c[s]), key=lambda kv: -kv[1])[:3]
        ops.append({"opcode": name, "instructions": int(c["instructions"]), "samples": int(c["samples"]),
                    "share": round(c["samples"] / in_loop, 4) if in_loop else None,
                    "main_reasons": {s.removeprefix("stall_"): round(v / c["samples"], 3) for s, v in main}})
    return {"loop_instructions": len(loop), "loop_executions_per_instruction": int(top),
            "loop_share_of_samples": round(in_loop / total, 4) if total else None,
            "loop_reasons": {s.removeprefix("stall_"): round(v / in_loop, 4)
                             for s, v in reasons.most_common() if v} if in_loop else {},
            "opcodes": ops}


def read_raw(path: str) -> dict:
    with open(path, newline="") as f:
        rows = [r for r in csv.reader(ln for ln in f if not ln.startswith("=="))]
    vals = dict(zip(rows[0], rows[2], strict=False))
    return {short: _num(vals[m]) for short, m in RAW_KEYS.items() if m in vals}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("source")
    ap.add_argument("--raw", default=None)
    ap.add_argument("--band", type=float, default=0.9, help="loop = executed >= band x the most-executed count")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    out = {"date": datetime.date.today().isoformat(), "source_csv": args.source,
           **summarize(read_source(args.source), args.band)}
    if args.raw:
        out["raw"] = read_raw(args.raw)
    text = json.dumps(out, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(f"loop: {out['loop_instructions']} instructions, {out['loop_share_of_samples']:.1%} of stall samples")
    for k, v in list(out["loop_reasons"].items())[:6]:
        print(f"  {k:22s} {v:6.1%}")
    for o in out["opcodes"][:10]:
        print(f"  {o['opcode']:16s} n={o['instructions']:4d} {o['share']:6.1%}  {o['main_reasons']}")


if __name__ == "__main__":
    main()
