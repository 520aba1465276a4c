"""Dynamo's host cost per call of a compiled decode step, by cache: guards and arguments, no GPU needed.

Session 6 measured that ``replay()`` of LoopKV-M's compiled step holds the host 0.34 ms longer than BF16's at batch
1 x 8K on the H200 (``docs/decode-benchmark.md``). Part of every call of a ``torch.compile``'d function is
Dynamo's: evaluating the guards of the compiled frame (one ``TENSOR_MATCH`` and more per tensor it reads) and
collecting the graph's inputs. This probe compiles ``bench_decode``'s step for Ouro's 96 cells at tiny widths, on
CPU, with a backend that does no work, so the time per call is Dynamo's alone, and counts the graph's inputs.
It also times ``torch.compiler.set_stance(skip_guard_eval_unsafe=True)``, which skips most guard evaluation.

    PYTHONPATH=. python benchmarks/probe_dynamo_overhead.py --out benchmarks/results/dynamo_overhead_DATE.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_decode as bd  # noqa: E402


def per_call_ms(fn, calls: int, repeats: int = 7) -> float:
    """Median over ``repeats`` of the mean ms per call over ``calls`` calls (a 2-core machine is noisy)."""
    fn()
    means = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        means.append((time.perf_counter() - t0) / calls * 1e3)
    return sorted(means)[repeats // 2]


def tiny_model(layers: int = 24, device: str = "cpu"):
    """Ouro's 4 loops x ``layers`` layers at tiny widths (fp32, seeded), its config and bench_decode's plans."""
    cfg = bd.ouro_1p4b_config(vocab_size=128, hidden_size=64, intermediate_size=96, num_attention_heads=2,
                              num_key_value_heads=2, head_dim=64, num_hidden_layers=layers)
    torch.manual_seed(0)
    model = bd.OuroForCausalLM(cfg).to(device).eval()
    bd.register()
    return model, cfg, bd.paper_plans(cfg.total_ut_steps, cfg.num_hidden_layers)


def tiny_step(arm: str, model, cfg, plans, device: str = "cpu"):
    """bench_decode's decode step for ``arm`` at batch 1, the cache filled to 600 tokens."""
    model.set_attn_implementation("sdpa" if arm == "bf16" else "loopkv")
    capacity = 700 + bd.HEADROOM
    cache = bd.build_cache(arm, plans, cfg, batch=1, capacity=capacity, dtype=torch.float32, device=device)
    bd.fill(cache, 600, k_scale=0.5)
    tok = torch.randint(3, cfg.vocab_size, (1, 1), device=device)
    pos = torch.full((1, 1), 600, device=device)
    return bd.make_step(model, cache, tok, pos, dense=arm == "bf16", capacity=capacity)


def measure(arm: str, model, cfg, plans, *, calls: int) -> dict:
    torch._dynamo.reset()
    step = tiny_step(arm, model, cfg, plans)
    seen = {}

    def backend(gm, example_inputs):
        seen["graph_inputs"] = len(example_inputs)
        seen["parameters"] = sum(isinstance(x, torch.nn.Parameter) for x in example_inputs)
        return lambda *args: None  # no work: what is left per call is Dynamo's

    compiled = torch.compile(step, backend=backend, fullgraph=True)
    compiled()
    row = {"arm": arm, **seen, "guarded_ms": round(per_call_ms(compiled, calls), 4)}
    with torch.compiler.set_stance(skip_guard_eval_unsafe=True):
        row["skip_guard_eval_unsafe_ms"] = round(per_call_ms(compiled, calls), 4)
    return row


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arms", default="bf16,loopkv-m,kivi4")
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--per-cell", action="store_true", help="LoopKVCache(stacked=False) (design-decisions §11)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    bd.STACKED = not args.per_cell
    model, cfg, plans = tiny_model()  # Ouro's 24 layers x 4 loops, tiny widths
    rows = [measure(a, model, cfg, plans, calls=args.calls) for a in args.arms.split(",") if a]
    result = {"benchmark": "probe_dynamo_overhead",
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(), "device": "cpu",
              "cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
              "versions": bd.versions(), "cells": cfg.total_ut_steps * cfg.num_hidden_layers,
              "stacked": not args.per_cell,
              "rows": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    print(f"{'arm':10s} {'inputs':>7s} {'params':>7s} {'ms/call':>8s} {'skip guards ms/call':>20s}")
    for r in rows:
        print(f"{r['arm']:10s} {r['graph_inputs']:7d} {r['parameters']:7d} {r['guarded_ms']:8.3f} "
              f"{r['skip_guard_eval_unsafe_ms']:20.3f}")


if __name__ == "__main__":
    main()
