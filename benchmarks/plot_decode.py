"""The decode benchmark's figure and markdown table, from ``bench_decode.py``'s JSON (needs matplotlib).

One panel per capture and context: decode tokens/s against the time per output token (the step time: every resident
request gets one token per step) as the batch grows, up to each arm's largest batch under the KV budget (annotated).
Prints the summary table as markdown: each arm's peak tokens/s and its ratio against BF16 and KIVI-4 in the same run.

    python benchmarks/plot_decode.py            # benchmarks/results/decode.json -> docs/decode-benchmark.png

Several JSONs (e.g. one run per capture) are merged into one figure; a (capture, context, arm) given twice is an
error.
``--smoke``: the figure goes to a temporary file, and without a JSON given the input is a fresh
``bench_decode.py --smoke`` run (a tiny model on the CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

from run_info import RESULTS, ROOT

STYLE = {"bf16": ("k", "o"), "kivi4": ("tab:blue", "s"), "kivi4v": ("tab:cyan", "D"),
         "loopkv-r": ("tab:orange", "^"), "loopkv-m": ("tab:red", "v")}
CAPTURES = {"graph": "whole step as one CUDA graph", "compile": 'torch.compile(mode="reduce-overhead")',
            "eager": "eager steps (smoke)"}
DEFAULT_JSON = RESULTS / "decode.json"
DEFAULT_PNG = ROOT / "docs" / "decode-benchmark.png"


def _fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def table(result: dict) -> str:
    lines = ["| capture | arm | ctx | KV/row GiB | peak batch | peak tok/s | x BF16 | x KIVI-4 | step ms at peak | "
             "B=1 step ms | V hot share |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in result["summary"]:
        fit = result["fits"][f"{s['arm']}@{s['ctx']}"]
        lines.append(f"| {s['capture']} | {s['arm']} | {s['ctx']} | {fit['bytes_per_row'] / 2**30:.2f} | "
                     f"{s['peak_batch']} | {s['peak_tok_s']:.1f} | {_fmt(s.get('x_bf16'), '.2f')} | "
                     f"{_fmt(s.get('x_kivi4'), '.2f')} | {s['peak_step_ms']:.1f} | "
                     f"{_fmt(s.get('batch1_step_ms'), '.2f')} | {_fmt(s.get('hot_fraction'), '.2f')} |")
    return "\n".join(lines)


def plot(result: dict, png: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    order = list(CAPTURES)
    panels = sorted({(r["capture"], r["ctx"]) for r in result["rows"]}, key=lambda p: (order.index(p[0]), p[1]))
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.4), squeeze=False)
    for ax, (capture, ctx) in zip(axes[0], panels, strict=True):
        for arm, (color, marker) in STYLE.items():
            pts = sorted((r for r in result["rows"] if (r["arm"], r["ctx"], r["capture"]) == (arm, ctx, capture)),
                         key=lambda r: r["batch"])
            if not pts:
                continue
            ax.plot([p["step_ms"] for p in pts], [p["tok_s"] for p in pts], marker=marker, color=color, label=arm)
            last = pts[-1]
            ax.annotate(str(last["batch"]), (last["step_ms"], last["tok_s"]), textcoords="offset points",
                        xytext=(4, 4), fontsize=8, color=color)
        ax.set_xscale("log")
        ax.set_xlabel("time per output token (ms, log)")
        ax.set_ylabel("decode tok/s")
        length = f"{ctx // 1024}K" if ctx % 1024 == 0 else f"{ctx}-token"
        ax.set_title(f"{length} context, KV budget {result['kv_budget_bytes'] / 2**30:.3g} GiB\n{CAPTURES[capture]}",
                     fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    v = result["versions"]
    fig.suptitle(f"{result['model']['shape']}, {result['device']}\n"
                 f"torch {v['torch']}, triton {v['triton']}, transformers {v['transformers']}, loopkv {v['loopkv']}, "
                 f"{result['date'][:10]}", fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)


def merge(results: list[dict]) -> dict:
    """One result from several runs (rows, summaries and fits concatenated; device and budget must agree)."""
    out = dict(results[0], rows=[], summary=[], fits={}, captures=[])
    seen: set = set()
    for res in results:
        for key in ("device", "kv_budget_bytes"):
            if res[key] != out[key]:
                raise SystemExit(f"plot_decode: the JSONs differ in {key} ({res[key]!r} vs {out[key]!r}); "
                                 "plot them separately")
        points = {(s["capture"], s["ctx"], s["arm"]) for s in res["summary"]}
        if points & seen:
            raise SystemExit(f"plot_decode: (capture, context, arm) {sorted(points & seen)} appear in two JSONs")
        seen |= points
        out["rows"] += res["rows"]
        out["summary"] += res["summary"]
        out["fits"].update(res["fits"])
        out["captures"] += [c for c in res["captures"] if c not in out["captures"]]
    return out


def main(argv=None) -> str:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("json", nargs="*", help=f"bench_decode JSONs (default: {os.path.relpath(DEFAULT_JSON, ROOT)})")
    p.add_argument("--png", default=None, help=f"figure path (default: {os.path.relpath(DEFAULT_PNG, ROOT)})")
    p.add_argument("--smoke", action="store_true",
                   help="figure to a temporary file; without a JSON, plot a fresh bench_decode.py --smoke run")
    args = p.parse_args(argv)
    tmp = tempfile.mkdtemp(prefix="plot_decode_") if args.smoke else None
    paths = args.json
    if not paths and args.smoke:
        import bench_decode

        paths = [os.path.join(tmp, "decode_smoke.json")]
        bench_decode.main(["--smoke", "--out", paths[0]])
    paths = paths or [str(DEFAULT_JSON)]
    png = args.png or (os.path.join(tmp, "decode-benchmark.png") if args.smoke else str(DEFAULT_PNG))
    results = []
    for path in paths:
        with open(path) as f:
            results.append(json.load(f))
    result = merge(results)
    plot(result, png)
    print("wrote", png)
    print(table(result))
    return png


if __name__ == "__main__":
    main()
