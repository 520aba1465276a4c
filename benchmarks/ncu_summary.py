"""Summarize Nsight Compute's raw CSV of ``ncu_cell_attention.py``'s launches: one row per (arm, mode).

Columns: kernel time, achieved occupancy, issue-slot use, DRAM throughput, L2 hit rate, registers, and the
stall reasons (warp cycles per issued instruction, largest first). Writes the numbers as JSON (with the device
and date) for ``benchmarks/results/``.

Usage: python benchmarks/ncu_summary.py NCU.csv ORDER.json [--out SUMMARY.json]
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json

KEYS = {  # short name -> ncu raw metric
    "time_us": "gpu__time_duration.sum",
    "occupancy_pct": "sm__warps_active.avg.pct_of_peak_sustained_active",
    "issue_active_pct": "smsp__issue_active.avg.pct_of_peak_sustained_active",
    "dram_pct": "dram__throughput.avg.pct_of_peak_sustained_elapsed",
    "l2_hit_pct": "lts__t_sector_hit_rate.pct",
    "registers": "launch__registers_per_thread",
    "warp_cycles_per_issue": "smsp__average_warp_latency_per_inst_issued.ratio",
}
TIME_UNITS_US = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3}
STALL = "smsp__average_warps_issue_stalled_"  # ..._<reason>_per_issue_active.ratio


def _num(x: str) -> float | None:
    try:
        return float(x.replace(",", ""))
    except ValueError:
        return None


def read_rows(path: str) -> tuple[list[str], dict[str, str], list[dict[str, str]]]:
    """ncu ``--page raw --csv``: a header row of metric names, a row of units, then one row per launch (ncu's
    own messages, lines starting with ``==``, are skipped)."""
    with open(path, newline="") as f:
        lines = [ln for ln in f if not ln.startswith("==")]
    rows = list(csv.reader(lines))
    head, units, data = rows[0], dict(zip(rows[0], rows[1], strict=False)), rows[2:]
    return head, units, [dict(zip(head, r, strict=False)) for r in data if len(r) == len(head)]


def summarize(csv_path: str, order_path: str) -> dict:
    head, units, data = read_rows(csv_path)
    with open(order_path) as f:
        order = json.load(f)
    if len(data) != len(order):
        raise SystemExit(f"{csv_path} has {len(data)} launches, {order_path} lists {len(order)}")
    out = []
    for meta, row in zip(order, data, strict=True):
        rec = dict(meta)
        for short, metric in KEYS.items():
            val = _num(row.get(metric, ""))
            if val is not None and short == "time_us":
                val *= TIME_UNITS_US.get(units.get(metric, ""), float("nan"))
            rec[short] = val
        stalls = {}
        for name in head:
            if name.startswith(STALL) and name.endswith("_per_issue_active.ratio"):
                reason = name[len(STALL):-len("_per_issue_active.ratio")]
                val = _num(row[name])
                if val is not None:
                    stalls[reason] = val
        rec["stalls"] = dict(sorted(stalls.items(), key=lambda kv: -kv[1]))
        out.append(rec)
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device": data[0].get("device__attribute_display_name", "?") if data else "?", "launches": out}


def print_table(summary: dict) -> None:
    print(f"{'arm':<14} {'mode':<8} {'us':>7} {'occ%':>5} {'issue%':>6} {'dram%':>5} {'L2hit%':>6} {'reg':>4}  "
          "top stalls (warp cycles per issued instruction)")
    for r in summary["launches"]:
        top = ", ".join(f"{k} {v:.2f}" for k, v in list(r["stalls"].items())[:5])

        def f(x, w, p=1):
            return f"{x:>{w}.{p}f}" if isinstance(x, float) else f"{'-':>{w}}"
        print(f"{r['arm']:<14} {r['mode']:<8} {f(r['time_us'], 7)} {f(r['occupancy_pct'], 5)} "
              f"{f(r['issue_active_pct'], 6)} {f(r['dram_pct'], 5)} {f(r['l2_hit_pct'], 6)} "
              f"{f(r['registers'], 4, 0)}  {top}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("csv")
    ap.add_argument("order")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    summary = summarize(args.csv, args.order)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=1)
    print_table(summary)


if __name__ == "__main__":
    main()
