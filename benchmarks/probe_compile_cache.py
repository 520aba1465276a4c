"""Is the compile of a decode step paid again in a new process? Inductor's caches across processes, by arm.

A compiled point of ``bench_decode`` spends 120-150 s in inductor on the H200 host (docs/decode-benchmark.md), for
BF16 as for the loopkv arms. Inductor keeps an on-disk FX-graph cache and an AOTAutograd cache; a graph with an
operator the caches cannot key is compiled again in every process ("bypass"). This probe compiles
``bench_decode``'s step (Ouro's 4 loops, tiny widths, ``--layers`` layers) with inductor in a fresh process twice,
sharing one empty cache directory, and records each process's compile seconds and cache counters. With
``--device cuda`` it is the same step on the GPU (Triton kernels for inductor's code, the loopkv ops' CUDA path).

    PYTHONPATH=. python benchmarks/probe_compile_cache.py --out benchmarks/results/compile_cache_DATE.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_decode as bd  # noqa: E402
import probe_dynamo_overhead as pdo  # noqa: E402


def compile_once(arm: str, layers: int, device: str) -> dict:
    """Compile and run the step once in this process; seconds and inductor's cache counters."""
    from torch._dynamo.utils import counters

    model, cfg, plans = pdo.tiny_model(layers, device)
    step = pdo.tiny_step(arm, model, cfg, plans, device)
    t0 = time.perf_counter()
    torch.compile(step, fullgraph=True)()
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    keys = ("fxgraph_cache_hit", "fxgraph_cache_miss", "fxgraph_cache_bypass")
    return {"arm": arm, "compile_s": round(seconds, 2),
            **{k: int(counters["inductor"][k]) for k in keys},
            **{k: int(v) for k, v in counters["aot_autograd"].items() if "cache" in k}}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arms", default="bf16,loopkv-m")
    p.add_argument("--layers", type=int, default=4, help="layers of the tiny Ouro (x 4 loops = cells)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)  # one compile, printed as JSON
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(compile_once(args.child, args.layers, args.device)))
        return
    rows = []
    for arm in [a for a in args.arms.split(",") if a]:
        with tempfile.TemporaryDirectory() as cache_dir:  # empty: the first process compiles from scratch
            env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache_dir)
            for run in ("first process", "second process"):
                out = subprocess.run([sys.executable, __file__, "--child", arm, "--layers", str(args.layers),
                                      "--device", args.device], env=env, check=True, capture_output=True, text=True)
                row = {"run": run, **json.loads(out.stdout.strip().splitlines()[-1])}
                rows.append(row)
                print(row, flush=True)
    result = {"benchmark": "probe_compile_cache", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
              "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "versions": bd.versions(),
              "cells": 4 * args.layers, "args": vars(args), "rows": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
