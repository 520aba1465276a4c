"""Where a continuous-batching step's host time goes: transformers' engine with LoopKV storage (loopkv/serving) at a
tiny shape with Ouro-1.4B's 96 cells, on the CPU (or a GPU if there is one).

    python benchmarks/profile_serving.py [--loops 4] [--layers 24] [--requests 8] [--new 48]
        [--prompt 40] [--cprofile 25]
        [--out benchmarks/results/serving_profile.json]

Reports, per decode-only step (every request decoding one token) and per step with prompts or prompt chunks:
* the step's wall time (from one forward's first cell to the next's: the engine's scheduling, its batch preparation,
  the model and loopkv's cache, i.e. everything a step costs on the host when the device is fast); for steps with
  prompts, the median and each step's packed tokens;
* the calls that would synchronize the host with a GPU, counted by caller (transformers' engine, loopkv, the rest):
  ``Tensor.tolist``, ``Tensor.item``, ``bool``/``int`` of a tensor, and tensors built from host data with a device
  argument (``torch.tensor(..., device=)``, a blocking host-to-device copy on a GPU);
* with ``--cprofile TOP``, a cProfile of the engine's thread (which slows its steps), its TOP functions by own time,
  and their total by package.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import cProfile
import pstats
import sys
import time

import torch

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent))
from run_info import RESULTS, ROOT, run_info, write_json  # noqa: E402

import loopkv  # noqa: E402
from loopkv.models.ouro import OuroConfig, OuroForCausalLM  # noqa: E402
from loopkv.serving.engine_cache import EngineCache  # noqa: E402
from loopkv.serving.transformers_cb import engine_cache, engine_config  # noqa: E402


def _caller() -> str:
    """The package of the first frame outside this file and torch's own Python."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if name != __file__ and "/torch/" not in name:
            break
        frame = frame.f_back
    name = frame.f_code.co_filename if frame is not None else ""
    if "/loopkv/ops/" in name:
        return "loopkv.ops"  # the reference ops: on a GPU the Triton kernels run instead
    return "transformers" if "/transformers/" in name else "loopkv" if "/loopkv/" in name else "other"


@contextlib.contextmanager
def count_host_syncs(counts: collections.Counter):
    """Count, by caller, the calls that synchronize the host with a GPU (module docstring)."""
    originals = {n: getattr(torch.Tensor, n) for n in ("tolist", "item", "__bool__", "__int__")}
    tensor = torch.tensor

    def wrap(name):
        def counted(self, *a, **k):
            counts[(_caller(), name)] += 1
            return originals[name](self, *a, **k)
        return counted

    def counted_tensor(data, *a, **k):
        if k.get("device") is not None and not isinstance(data, torch.Tensor):
            counts[(_caller(), "tensor(device=)")] += 1
        return tensor(data, *a, **k)

    for name in originals:
        setattr(torch.Tensor, name, wrap(name))
    torch.tensor = counted_tensor
    try:
        yield counts
    finally:
        for name, fn in originals.items():
            setattr(torch.Tensor, name, fn)
        torch.tensor = tensor


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

    # per forward: when it started, whether every token decoded, the sync counts so far, its packed tokens
    steps: list[tuple[float, bool, collections.Counter, int]] = []
    counts: collections.Counter = collections.Counter()
    run_step = EngineCache.run_step

    def timed_run_step(self, logits_of, *, input_ids, **k):
        if not steps and args.cprofile:  # the engine's thread: profile it from its first forward on
            profiler.enable()
        tokens = input_ids.shape[1]
        steps.append((time.perf_counter(), tokens <= args.requests, counts.copy(), tokens))
        return run_step(self, logits_of, input_ids=input_ids, **k)

    profiler = cProfile.Profile()
    EngineCache.run_step = timed_run_step
    try:
        with engine_cache(plan, max_slots=args.requests, max_len=max_len), count_host_syncs(counts), torch.no_grad():
            model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cb)
    finally:
        EngineCache.run_step = run_step

    decode = [(steps[i + 1][0] - steps[i][0], steps[i + 1][2] - steps[i][2]) for i in range(len(steps) - 1)
              if steps[i][1]]
    decode = decode[len(decode) // 4:]  # past the first steps (allocator and first-call warm-up)
    step_ms = sorted(d for d, _ in decode)[len(decode) // 2] * 1e3
    per_step = collections.Counter()
    for _, c in decode:
        per_step.update(c)
    syncs = {f"{who}:{what}": n / len(decode) for (who, what), n in sorted(per_step.items())}
    prompt = [steps[i + 1][2] - steps[i][2] for i in range(len(steps) - 1) if not steps[i][1]]
    prompt_ms = [(steps[i + 1][0] - steps[i][0]) * 1e3 for i in range(len(steps) - 1) if not steps[i][1]]
    prompt_tokens = [steps[i][3] for i in range(len(steps) - 1) if not steps[i][1]]
    prompt_ms_median = sorted(prompt_ms)[len(prompt_ms) // 2] if prompt_ms else None
    per_prompt_step = collections.Counter()
    for c in prompt:
        per_prompt_step.update(c)
    prompt_syncs = {f"{who}:{what}": n / len(prompt) for (who, what), n in sorted(per_prompt_step.items())}
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
