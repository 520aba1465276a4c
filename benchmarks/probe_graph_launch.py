"""Where batch 1's host time goes: how long ``CUDAGraph.replay()`` holds the host, and what makes it longer.

Session 6 found that a synchronized decode step of LoopKV-M at batch 1 x 8K waited 2.5-3.0 ms for the host to
submit its CUDA graph, against 0.1 ms for the BF16 arm's graph (``docs/decode-benchmark.md``). Session 7 found
why with this probe: the BF16 arm was timed first, and every arm after it was timed after a ``torch.profiler``
session in the same process. It measures, in one process on the GPU:

* synthetic graphs of ``N`` launches each: an ATen kernel (``add_``), a one-program Triton kernel with one
  pointer, and the same kernel with 24 more pointers (is a Triton node dearer to submit than an ATen node?);
* graphs of 96 launches of one loopkv kernel on an Ouro-sized cell (``cell_attention`` readers, ``append_``);
* the decode step of each named arm of ``bench_decode`` captured with ``torch.cuda.graph`` (no Dynamo): the
  host API calls of one eager step by name and where its memcpys come from, and the host and GPU times;
* ``--profiler-effect``: one arm's step and a tiny graph timed before and after a ``torch.profiler`` session
  (session 7: after it, every graph launch in the process holds the host 4-9x longer).

``replay_host_ms`` is how long ``replay()`` blocks the host (mean of ``--reps``, the GPU idle before each);
``step_ms`` the GPU time of a synchronized replay; ``b2b_ms`` per replay queued back to back.
Writes JSON (``--out``) and prints a table last. GPU only.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_decode as bd  # noqa: E402


@triton.jit
def _tiny(x_ptr):
    tl.store(x_ptr, tl.load(x_ptr) + 1.0)


@triton.jit
def _tiny_wide(x_ptr, a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15, a16, a17, a18, a19,
               a20, a21, a22, a23):
    tl.store(x_ptr, tl.load(x_ptr) + 1.0)


def timed(replay, reps: int) -> dict:
    """Host ms of ``replay()`` on an idle GPU and GPU ms of a synchronized replay (``bench_decode.time_steps``),
    ms per back-to-back replay (``bench_decode.time_back_to_back``)."""
    gpu, _, host = bd.time_steps(replay, reps)
    return {"replay_host_ms": round(host, 4), "step_ms": round(gpu, 4),
            "b2b_ms": round(bd.time_back_to_back(replay, reps), 4)}


def synthetic(n: int, reps: int) -> list[dict]:
    x = torch.zeros(1, device="cuda")
    ptrs = [torch.zeros(1, device="cuda") for _ in range(24)]
    src, dst = torch.zeros(64, device="cuda"), torch.zeros(64, device="cuda")

    def with_copies(k: int):  # Triton nodes with k device-to-device cudaMemcpyAsync nodes spread among them
        def fn():
            for i in range(n):
                _tiny[(1,)](x)
                if k and i % (n // k) == n // (2 * k):
                    dst.copy_(src)
        return fn
    cases = {
        "aten add_": lambda: [x.add_(1.0) for _ in range(n)],
        "triton + 1 memcpy": with_copies(1),
        "triton + 3 memcpy": with_copies(3),
        "triton 1 arg": lambda: [_tiny[(1,)](x) for _ in range(n)],
        "triton 25 args": lambda: [_tiny_wide[(1,)](x, *ptrs) for _ in range(n)],
    }
    rows = []
    for name, fn in cases.items():
        rows.append({"graph": f"{name} x{n}", "nodes": n, **timed(bd.capture(fn, "graph"), reps)})
    return rows


def kernel_graphs(n: int, reps: int) -> list[dict]:
    """Graphs of ``n`` launches of one loopkv kernel on one Ouro-sized cell (B1, 16 KV heads x 128, 8K, INT4)."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "ops"))
    from test_triton_attention import make_cell

    from loopkv.ops import layout
    from loopkv.ops import triton_attention as ta
    from loopkv.ops import triton_quant as tq

    maxp = layout.stored_pages(16384)
    st = make_cell(1, 16, 128, maxp, 4, [8192], dtype=torch.bfloat16, device="cuda", seed=1)
    q = torch.randn(1, 16, 128, device="cuda").to(torch.bfloat16)
    kn = torch.randn(1, 16, 1, 128, device="cuda").to(torch.bfloat16)
    x = torch.zeros(1, device="cuda")
    cases = {
        "tiny triton": lambda: _tiny[(1,)](x),
        "cell_attention cc": lambda: ta.cell_attention(q, *st, 4, 14.0, 0.088),
        "cell_attention cc 1 split": lambda: ta.cell_attention(q, *st, 4, 14.0, 0.088, splits=1),
        "cell_attention cc uncapped": lambda: ta.cell_attention(q, *st, 4, 14.0, 0.088, maxnreg=255),
        "cell_attention dot": lambda: ta.cell_attention(q, *st, 4, 14.0, 0.088, far_impl="dot"),
        "append_": lambda: tq.append(kn, kn, *st, 4),
    }
    rows = []
    for name, one in cases.items():
        replay = bd.capture(lambda one=one: [one() for _ in range(n)], "graph")
        rows.append({"graph": f"{name} x{n}", "nodes": n, **timed(replay, reps)})
    return rows


def memcpy_sources(step, limit: int = 8) -> list[str]:
    """The Python frames (loopkv / transformers / model code) of each ``cudaMemcpyAsync`` of one eager step."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA],
                                with_stack=True) as prof:
        step()
        torch.cuda.synchronize()
    out = []
    for e in prof.events():
        if "Memcpy" not in e.name or len(out) >= limit:
            continue
        chain, p = [], e
        while p is not None:
            chain.append(p.name)
            frames = [f for f in (p.stack or []) if "loopkv" in f or "transformers" in f or "bench" in f]
            if frames:
                out.append(" <- ".join(chain) + " @ " + " | ".join(frames[:4]))
                break
            p = p.cpu_parent
        else:
            out.append(" <- ".join(chain))
    return out


def decode_step(arm: str, model, cfg, plans, *, ctx: int, batch: int):
    """``bench_decode``'s decode step of ``arm`` on a cache filled to ``ctx`` (eager; returns the cache too)."""
    capacity = ctx + bd.HEADROOM
    cache = bd.build_cache(arm, plans, cfg, batch=batch, capacity=capacity, dtype=torch.bfloat16, device="cuda")
    if hasattr(cache, "warmup"):
        cache.warmup()
    bd.fill(cache, ctx - bd.LEAD, k_scale=1.8)
    tok = torch.randint(3, cfg.vocab_size, (batch, 1), device="cuda")
    pos = torch.full((batch, 1), ctx - bd.LEAD, dtype=torch.long, device="cuda")
    model.set_attn_implementation("sdpa" if arm == "bf16" else "loopkv")
    return bd.make_step(model, cache, tok, pos, dense=arm == "bf16", capacity=capacity), cache


def decode_graph(arm: str, model, cfg, plans, *, ctx: int, batch: int, reps: int) -> dict:
    step, cache = decode_step(arm, model, cfg, plans, ctx=ctx, batch=batch)
    replay = bd.capture(step, "graph")
    row = {"graph": f"{arm} B{batch} ctx{ctx}", **timed(replay, reps)}  # timed before any profiler session
    row["memcpy_sources"] = memcpy_sources(step)
    row["eager_calls"] = bd.count_launches(step)  # host API calls by name
    row["nodes"] = int(row["eager_calls"]["gpu_kernels"])
    del replay, step, cache
    torch.cuda.empty_cache()
    return row


def profiler_effect(arm: str, model, cfg, plans, *, ctx: int, batch: int, n: int, reps: int) -> list[dict]:
    """The same two graphs (``n`` tiny Triton launches; ``arm``'s decode step) timed before and after one
    ``torch.profiler`` session with CUDA activities has run in the process (on another tiny op)."""
    x = torch.zeros(1, device="cuda")
    tiny = bd.capture(lambda: [_tiny[(1,)](x) for _ in range(n)], "graph")
    step = bd.capture(decode_step(arm, model, cfg, plans, ctx=ctx, batch=batch)[0], "graph")
    rows = []
    for when in ("before", "after"):
        if when == "after":
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                    torch.profiler.ProfilerActivity.CUDA]):
                x.add_(1.0)
                torch.cuda.synchronize()
        rows.append({"graph": f"tiny triton x{n}, {when} profiler", "nodes": n, **timed(tiny, reps)})
        rows.append({"graph": f"{arm} B{batch}, {when} profiler", "nodes": 0, **timed(step, reps)})
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arms", default="bf16,loopkv-m")
    p.add_argument("--ctx", type=int, default=8192)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--nodes", type=int, default=4000, help="launches per synthetic graph")
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--profiler-effect", action="store_true",
                   help="only time the first arm's graph and a tiny one before and after a profiler session")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("probe_graph_launch needs a CUDA GPU")
    torch.manual_seed(0)
    cfg = bd.ouro_1p4b_config()
    model = bd.OuroForCausalLM(cfg).to(device="cuda", dtype=torch.bfloat16).eval()
    plans = bd.paper_plans(cfg.total_ut_steps, cfg.num_hidden_layers)
    bd.register()
    if args.profiler_effect:
        rows = profiler_effect(args.arms.split(",")[0], model, cfg, plans, ctx=args.ctx, batch=args.batch,
                               n=args.nodes, reps=args.reps)
    else:
        rows = synthetic(args.nodes, args.reps) + kernel_graphs(96, 10)
    for arm in [a for a in args.arms.split(",") if a and not args.profiler_effect]:
        # a decode graph timed after another arm's profiled one pays the profiler's launch overhead (see above):
        # give one arm per process for clean host times
        rows.append(decode_graph(arm, model, cfg, plans, ctx=args.ctx, batch=args.batch, reps=args.reps))
    result = {"benchmark": "probe_graph_launch", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
              "device": torch.cuda.get_device_name(), "versions": bd.versions(), "args": vars(args), "rows": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    for r in rows:
        if "eager_calls" in r:
            print(r["graph"], r["eager_calls"]["host_calls"])
            print("\n  ".join(["memcpy from:", *r["memcpy_sources"]]))
    print(f"{'graph':34s} {'nodes':>6s} {'host ms':>8s} {'step ms':>8s} {'b2b ms':>8s} {'us/node host':>12s}")
    for r in rows:
        per_node = f"{1e3 * r['replay_host_ms'] / r['nodes']:12.3f}" if r["nodes"] else f"{'-':>12s}"
        print(f"{r['graph']:34s} {r['nodes']:6d} {r['replay_host_ms']:8.3f} {r['step_ms']:8.3f} {r['b2b_ms']:8.3f} "
              f"{per_node}")


if __name__ == "__main__":
    main()
