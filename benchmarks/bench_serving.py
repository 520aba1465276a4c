"""Goodput under a latency SLO: requests arriving over time, served by transformers' continuous-batching engine with
LoopKV storage (loopkv/serving), one arm per plan under the same KV budget, in one process (paper §5.1, §5.4).

    python benchmarks/bench_serving.py [--arms bf16,kivi4,loopkv-r,loopkv-m] [--budget-gib 96] [--max-len 16384]
        [--rates 0.25,0.5,1,2] [--requests 48] [--seed 0] [--smoke] [--out benchmarks/results/serving.json]

Model: Ouro-1.4B's shapes with random weights, bf16 (``--smoke``: a tiny one, on the CPU if there is no GPU). Trace:
seeded Poisson arrivals at each rate; prompts uniform in [max_len / 16, max_len / 2], outputs uniform in [64, 512]
tokens (capped to max_len). Arms: ``bf16`` stores every cell exact (an all-bf16 plan: transformers' own paged cache
has one layer per physical layer and cannot hold a looped model's cells), ``kivi4`` INT4 in every cell, ``loopkv-r``
and ``loopkv-m`` the paper's compositions (as in bench_decode.py). Each arm gets the slots and pages the budget buys:
``slots = budget // (a slot's exact sink and window + bytes per token x the trace's mean context)``, the rest pages.

SLO, per request: time to first token <= 10 s and mean time per output token <= 3x the BF16 arm's batch-1 decode step
(measured first, in this run, through the same engine). Attainment = the share of requests meeting it; goodput = the
highest rate with attainment >= 95%. Also reported: peak decode tokens/s of each arm (its largest rate).
The engine runs eagerly (no CUDA graphs: loopkv's shim splits the batch on the host), so these numbers include the
engine's and the shim's host time; compare them with bench_decode.py's static-batch graphs to see that overhead.
"""

from __future__ import annotations

import argparse
import random
import sys
import threading
import time

import torch

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent))
from bench_decode import ouro_1p4b_config, paper_plans, smoke_config  # noqa: E402
from run_info import RESULTS, run_info, write_json  # noqa: E402

import loopkv  # noqa: E402
from loopkv.models.ouro import OuroForCausalLM  # noqa: E402
from loopkv.serving.transformers_cb import engine_cache, engine_config  # noqa: E402

TTFT_SLO_S = 10.0
TPOT_SLO_X = 3.0
ATTAINMENT = 0.95


def plans(cfg) -> dict[str, loopkv.Plan]:
    loops, layers = cfg.total_ut_steps, cfg.num_hidden_layers
    return {"bf16": loopkv.Plan.uniform(loops=loops, layers=layers, option="bf16"), **paper_plans(loops, layers)}


def trace(rate: float, n: int, max_len: int, seed: int, smoke: bool) -> list[tuple[float, int, int]]:
    """(arrival s, prompt tokens, output tokens) per request."""
    rng = random.Random(seed)
    t, out = 0.0, []
    lo_out, hi_out = (4, 12) if smoke else (64, 512)
    for _ in range(n):
        t += rng.expovariate(rate)
        prompt = rng.randint(max_len // 16, max_len // 2)
        out.append((t, prompt, min(rng.randint(lo_out, hi_out), max_len - prompt)))
    return out


def budget_split(plan, cfg, budget: int, mean_context: float, dtype_bytes: int) -> tuple[int, int]:
    """(slots, pool pages) a KV budget buys for ``plan``."""
    from loopkv.cache.paging import exact_bytes_per_row, pool_pages_for

    exact = exact_bytes_per_row(cfg, dtype_bytes=dtype_bytes)
    per_token = plan.bytes_per_token(cfg, dtype_bytes=dtype_bytes).stored_kib * 1024
    slots = max(1, int(budget // (exact + per_token * mean_context)))
    return slots, pool_pages_for(plan, cfg, budget_bytes=budget, max_batch_size=slots, dtype_bytes=dtype_bytes)


def serve(model, plan, cfg, requests, *, slots, pages, max_len, smoke) -> list[dict]:
    """Run one trace through the engine; per request: ttft_s, tpot_s, tokens."""
    from transformers import GenerationConfig

    gen = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=0, max_new_tokens=max(r[2] for r in requests))
    cb = engine_config(plan, pool_pages=pages, max_batch_tokens=256 if "share" in plan.options else 1024)
    vocab = cfg.vocab_size
    done: dict[str, dict] = {}
    with engine_cache(plan, max_slots=slots, max_len=max_len):
        manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)
        manager.start()
        try:
            start = time.perf_counter()
            submitted = {}
            for i, (arrival, prompt, new) in enumerate(requests):
                delay = start + arrival - time.perf_counter()
                if delay > 0:
                    time.sleep(delay)
                ids = torch.randint(3, vocab, (prompt,), generator=torch.Generator().manual_seed(i)).tolist()
                rid = manager.add_request(ids, request_id=f"r{i}", max_new_tokens=new, record_timestamps=True)
                submitted[rid] = time.perf_counter()
            while len(done) < len(requests):
                result = manager.get_result(timeout=600 if not smoke else 60)
                if result is None:
                    raise RuntimeError(f"the engine returned {len(done)} of {len(requests)} requests")
                if result.is_finished():
                    stamps = result.timestamps or []
                    ttft = stamps[0] - submitted[result.request_id] if stamps else float("inf")
                    tpot = (stamps[-1] - stamps[0]) / (len(stamps) - 1) if len(stamps) > 1 else 0.0
                    done[result.request_id] = {"ttft_s": ttft, "tpot_s": tpot, "tokens": len(result.generated_tokens),
                                               "error": getattr(result, "error", None)}
        finally:
            manager.stop(block=True)
            model.destroy_cached_continuous_batching_manager()
    return list(done.values())


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arms", default="bf16,kivi4,loopkv-r,loopkv-m")
    ap.add_argument("--budget-gib", type=float, default=96.0)
    ap.add_argument("--max-len", type=int, default=16384)
    ap.add_argument("--rates", default="0.25,0.5,1,2", help="requests per second")
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smoke", action="store_true", help="a tiny model and trace: checks the script, measures nothing")
    ap.add_argument("--out", default=str(RESULTS / "serving.json"))
    args = ap.parse_args(argv)
    if args.smoke:  # sizes the smoke run overrides unless given
        given = set(argv if argv is not None else sys.argv[1:])
        for flag, value in (("--max-len", 640), ("--requests", 3), ("--rates", "8"), ("--budget-gib", 0.25),
                            ("--arms", "loopkv-m")):
            if flag not in given:
                setattr(args, flag[2:].replace("-", "_"), value)

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    cfg = smoke_config() if args.smoke else ouro_1p4b_config()
    torch.manual_seed(0)
    model = OuroForCausalLM(cfg).to(device=device, dtype=dtype).eval()
    arms = {name: plan for name, plan in plans(cfg).items() if name in args.arms.split(",")}
    rates = [float(r) for r in args.rates.split(",")]
    budget = int(args.budget_gib * 2**30)

    # the SLO's step: BF16 at batch 1, through the same engine
    one = [(0.0, args.max_len // 4, 8 if args.smoke else 64)]
    bf16 = plans(cfg)["bf16"]
    dtype_bytes = torch.empty(0, dtype=dtype).element_size()
    base = serve(model, bf16, cfg, one, slots=1, pages=budget_split(bf16, cfg, budget, args.max_len, dtype_bytes)[1],
                 max_len=args.max_len, smoke=args.smoke)[0]["tpot_s"]
    tpot_slo = TPOT_SLO_X * base

    rows = []
    for name, plan in arms.items():
        for rate in rates:
            reqs = trace(rate, args.requests, args.max_len, args.seed, args.smoke)
            mean_ctx = sum(p + n for _, p, n in reqs) / len(reqs)
            slots, pages = budget_split(plan, cfg, budget, mean_ctx, dtype_bytes)
            t0 = time.perf_counter()
            got = serve(model, plan, cfg, reqs, slots=slots, pages=pages, max_len=args.max_len, smoke=args.smoke)
            wall = time.perf_counter() - t0
            ok = [r for r in got if r["ttft_s"] <= TTFT_SLO_S and r["tpot_s"] <= tpot_slo and not r["error"]]
            rows.append({"arm": name, "rate": rate, "slots": slots, "pool_pages": pages, "requests": len(got),
                         "attainment": len(ok) / len(got), "tokens_per_s": sum(r["tokens"] for r in got) / wall,
                         "mean_ttft_s": sum(r["ttft_s"] for r in got) / len(got),
                         "mean_tpot_s": sum(r["tpot_s"] for r in got) / len(got), "wall_s": wall})
            print(f"{name:<9} rate {rate:>5} slots {slots:>3} attainment {rows[-1]['attainment']:.2f} "
                  f"tok/s {rows[-1]['tokens_per_s']:.1f}", flush=True)

    goodput = {}
    for name in arms:
        met = [r["rate"] for r in rows if r["arm"] == name and r["attainment"] >= ATTAINMENT]
        goodput[name] = max(met) if met else 0.0
    peak = {name: max(r["tokens_per_s"] for r in rows if r["arm"] == name) for name in arms}
    result = run_info(__file__, argv, device) | {
        "model": "smoke" if args.smoke else "Ouro-1.4B shapes, random weights", "dtype": str(dtype),
        "budget_gib": args.budget_gib, "max_len": args.max_len, "requests": args.requests, "seed": args.seed,
        "slo": {"ttft_s": TTFT_SLO_S, "tpot_s": tpot_slo, "bf16_batch1_step_s": base, "attainment": ATTAINMENT},
        "rows": rows, "goodput_rps": goodput, "peak_tokens_per_s": peak,
        "goodput_vs_bf16": {n: (g / goodput["bf16"] if goodput.get("bf16") else None) for n, g in goodput.items()},
    }
    write_json(args.out, result)
    print(f"{'arm':<10}{'goodput req/s':>15}{'x BF16':>8}{'peak tok/s':>12}")
    for name in arms:
        ratio = result["goodput_vs_bf16"][name]
        print(f"{name:<10}{goodput[name]:>15.3g}{(f'{ratio:.2f}' if ratio else '-'):>8}{peak[name]:>12.1f}")
    return result


if __name__ == "__main__":
    threading.excepthook = lambda a: print(f"thread error: {a.exc_value!r}", file=sys.stderr)
    main()
