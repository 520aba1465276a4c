"""Where a continuous-batching step's host time goes: transformers' engine with LoopKV storage (loopkv/serving) at a
tiny shape with Ouro-1.4B's 96 cells, on the CPU (or a GPU if there is one).

    python benchmarks/profile_serving.py [--loops 4] [--layers 24] [--requests 8] [--new 48]
        [--prompt 40] [--cprofile 25]
        [--out benchmarks/results/serving_profile.json]

Reports, per decode-only step (every request decoding one token) and per step with prompts or prompt chunks:
* the step's wall time (from one forward's first cell to the next's: the engine's scheduling, its batch preparation,
  the model and loopkv's cache, i.e. everything a step costs on the host when the device is fast); for steps with
  prompts, the median and each step's packed tokens;
* the calls that would synchronize the host with a GPU, counted by caller (transformers' engine, loopkv, the rest;
  ``loopkv.serving.host_syncs``): ``Tensor.tolist``, ``Tensor.item``, ``bool``/``int`` of a tensor, and tensors built
  from host data with a device argument (``torch.tensor(..., device=)``, a blocking host-to-device copy on a GPU);
* with ``--cprofile TOP``, a cProfile of the engine's thread (which slows its steps), its TOP functions by own time,
  and their total by package.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import pstats
import sys

import torch

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent))
from run_info import RESULTS, ROOT, run_info, write_json  # noqa: E402

import loopkv  # noqa: E402
from loopkv.models.ouro import OuroConfig, OuroForCausalLM  # noqa: E402
from loopkv.serving.host_syncs import between, mean_per_step, record_steps  # noqa: E402
from loopkv.serving.transformers_cb import engine_cache, engine_config  # noqa: E402


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--loops", type=int, default=4)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=40, help="tokens per prompt; more than --requests")
    ap.add_argument("--new", type=int, default=48)
    ap.add_argument("--cprofile", type=int, default=0, metavar="TOP",
                    help="also profile the engine's thread (slows every step) and list its TOP functions")
    ap.add_argument("--out", default=str(RESULTS / "serving_profile.json"))
    args = ap.parse_args(argv)

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    cfg = OuroConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=args.layers,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=32, total_ut_steps=args.loops,
                     max_position_embeddings=4096, rope_theta=10000.0)
    model = OuroForCausalLM(cfg).to(device).eval()
    plan = loopkv.Plan.uniform(loops=args.loops, layers=args.layers, option="int4", tau=14.0)
    from transformers import GenerationConfig

    gen = GenerationConfig(max_new_tokens=args.new, do_sample=False, eos_token_id=-1, pad_token_id=0)
    prompts = [[3 + (i * 7 + j) % 90 for j in range(args.prompt)] for i in range(args.requests)]
    max_len = max(512, args.prompt + args.new)
    cb = engine_config(pool_pages=args.requests * -(-max_len // 32), max_len=max_len, max_slots=args.requests)

    profiler = cProfile.Profile()

    def on_step(step):
        if args.cprofile and not steps:  # the engine's thread: profile it from its first forward on
            profiler.enable()

    with engine_cache(plan, max_slots=args.requests, max_len=max_len), record_steps(on_step=on_step) as steps, \
            torch.no_grad():
        model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cb)

    timed = between(steps)  # a decode-only step: every token of the packed batch one decoding row's
    decode = [(seconds, syncs) for step, seconds, syncs in timed if step.tokens <= args.requests]
    decode = decode[len(decode) // 4:]  # past the first steps (allocator and first-call warm-up)
    step_ms = sorted(d for d, _ in decode)[len(decode) // 2] * 1e3
    syncs = mean_per_step([c for _, c in decode])
    prompt = [(step, seconds, c) for step, seconds, c in timed if step.tokens > args.requests]
    prompt_ms = [seconds * 1e3 for _, seconds, _ in prompt]
    prompt_tokens = [step.tokens for step, _, _ in prompt]
    prompt_ms_median = sorted(prompt_ms)[len(prompt_ms) // 2] if prompt_ms else None
    prompt_syncs = mean_per_step([c for _, _, c in prompt])
    by_package = collections.Counter()
    rows = []
    for (file, line, fn), (_, calls, own, total, _) in (pstats.Stats(profiler).stats.items() if args.cprofile else ()):
        pkg = ("transformers" if "/transformers/" in file else "loopkv" if "/loopkv/" in file
               else "torch" if "/torch/" in file or file == "~" else "other")
        by_package[pkg] += own
        rows.append((own, total, calls, f"{file.split('site-packages/')[-1].removeprefix(f'{ROOT}/')}:{line}({fn})"))
    rows.sort(reverse=True)
    result = run_info(__file__, argv, device) | {
        "cells": args.loops * args.layers, "requests": args.requests, "decode_steps_measured": len(decode),
        "decode_step_ms_median": step_ms, "host_syncs_per_decode_step": syncs,
        "host_syncs_per_decode_step_total": sum(syncs.values()),
        "prompt_steps_measured": len(prompt), "host_syncs_per_prompt_step": prompt_syncs,
        "host_syncs_per_prompt_step_total": sum(prompt_syncs.values()), "prompt_step_ms": prompt_ms,
        "prompt_step_tokens": prompt_tokens, "prompt_step_ms_median": prompt_ms_median,
        "own_time_s_by_package": dict(by_package),
        "top_own_time": [{"own_s": o, "total_s": t, "calls": c, "function": f} for o, t, c, f in rows[:args.cprofile]],
    }
    write_json(args.out, result)
    for o, t, c, f in rows[:args.cprofile]:
        print(f"{o:8.3f} {t:8.3f} {c:8d}  {f}")
    if args.cprofile:
        print("own time by package:", {k: round(v, 2) for k, v in by_package.most_common()})
    print(f"{args.loops * args.layers} cells, {args.requests} requests: decode step {step_ms:.1f} ms (median of "
          f"{len(decode)}), host syncs per decode step {result['host_syncs_per_decode_step_total']:.1f}:")
    for name, n in syncs.items():
        print(f"  {name:<40}{n:8.1f}")
    print(f"steps with prompts or chunks: {len(prompt)}, packed tokens {prompt_tokens}, "
          f"ms {[round(m, 1) for m in prompt_ms]} (median {prompt_ms_median or 0:.1f}); host syncs per such step "
          f"{result['host_syncs_per_prompt_step_total']:.1f}:")
    for name, n in prompt_syncs.items():
        print(f"  {name:<40}{n:8.1f}")
    return result


if __name__ == "__main__":
    main()
