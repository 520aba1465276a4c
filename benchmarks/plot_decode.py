"""Figure-7-style plot and markdown table from a ``bench_decode.py`` JSON (runs anywhere, needs matplotlib).

    python benchmarks/plot_decode.py benchmarks/results/decode_2026-11-29.json --png docs/decode-benchmark.png

Several JSONs (e.g. one run per context) are merged into one figure; a (context, arm) given twice is an error.

Left to right, one panel per context: decode tok/s against time per output token (the step time: every
resident request gets one token per step) as the batch grows, up to each arm's largest batch under the
KV budget (annotated). Prints the summary table as markdown.
"""

from __future__ import annotations

import argparse
import json

STYLE = {"bf16": ("k", "o"), "kivi4": ("tab:blue", "s"), "kivi4v": ("tab:cyan", "D"),
         "loopkv-r": ("tab:orange", "^"), "loopkv-m": ("tab:red", "v"), "loopkv-m-notau": ("tab:purple", "<")}


def table(result: dict) -> str:
    rows = result["rows"]
    launches = {r["arm"]: r for r in rows if "eager" in r}
    lines = ["| arm | ctx | KV/row GiB | peak batch | peak tok/s | x BF16 | x KIVI-4 | step ms at peak | "
             "B=1 step ms | B=1 vs BF16 | launches/step eager -> graph | V hot share |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in result["summary"]:
        fit = result["fits"][f"{s['arm']}@{s['ctx']}"]
        r = launches.get(s["arm"], {})
        eager = r.get("eager", {}).get("host_launches", "-")
        graph = r.get("graph", {}).get("host_launches", "-")
        hot = r.get("hot_fraction")
        lines.append(
            f"| {s['arm']} | {s['ctx']} | {fit['bytes_per_row'] / 2**30:.2f} | {s['peak_batch']} | "
            f"{s['peak_tok_s']:.1f} | {s.get('x_bf16', float('nan')):.2f} | {s.get('x_kivi4', float('nan')):.2f} | "
            f"{s['peak_step_ms']:.1f} | {s['batch1_step_ms'] or float('nan'):.2f} | "
            f"{s.get('batch1_vs_bf16', float('nan')):.2f} | {eager} -> {graph} | "
            f"{'-' if hot is None else f'{hot:.2f}'} |")
    return "\n".join(lines)


def plot(result: dict, png: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    contexts = sorted({r["ctx"] for r in result["rows"]})
    fig, axes = plt.subplots(1, len(contexts), figsize=(5.5 * len(contexts), 4.2), squeeze=False)
    for ax, ctx in zip(axes[0], contexts, strict=True):
        for arm, (color, marker) in STYLE.items():
            pts = sorted((r for r in result["rows"] if r["arm"] == arm and r["ctx"] == ctx), key=lambda r: r["batch"])
            if not pts:
                continue
            ax.plot([p["step_ms"] for p in pts], [p["tok_s"] for p in pts], marker=marker, color=color, label=arm)
            last = pts[-1]
            ax.annotate(str(last["batch"]), (last["step_ms"], last["tok_s"]), textcoords="offset points",
                        xytext=(4, 4), fontsize=8, color=color)
        ax.set_xscale("log")
        ax.set_xlabel("time per output token (ms, log)")
        ax.set_ylabel("decode tok/s")
        ax.set_title(f"{ctx // 1024}K context, KV budget {result['kv_budget_bytes'] / 2**30:.0f} GiB")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    mode = result.get("args", {}).get("capture")
    capture = {"graph": "whole step as one CUDA graph", "compile": 'torch.compile(mode="reduce-overhead")',
               None: "capture mode not recorded"}.get(mode, f"capture {mode}")
    fig.suptitle(f"Ouro-1.4B shapes (random weights), {result['device']}\n{capture}, {result['date'][:10]}",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=120)


def merge(results: list[dict]) -> dict:
    """One result from several runs (rows, summaries and fits concatenated; device and budget must agree)."""
    out = dict(results[0], rows=[], summary=[], fits={})
    seen = set()
    for res in results:
        for key in ("device", "kv_budget_bytes"):
            if res[key] != out[key]:
                raise SystemExit(f"plot_decode: the JSONs differ in {key} ({res[key]!r} vs {out[key]!r}); "
                                 "plot them separately")
        pairs = {(s["ctx"], s["arm"]) for s in res["summary"]}
        if pairs & seen:
            raise SystemExit(f"plot_decode: (context, arm) {sorted(pairs & seen)} appear in two JSONs")
        seen |= pairs
        out["rows"] += res["rows"]
        out["summary"] += res["summary"]
        out["fits"].update(res["fits"])
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("json", nargs="+")
    p.add_argument("--png", default=None)
    args = p.parse_args(argv)
    results = []
    for path in args.json:
        with open(path) as f:
            results.append(json.load(f))
    result = merge(results)
    if args.png:
        plot(result, args.png)
    print(table(result))


if __name__ == "__main__":
    main()
