"""A later turn of a conversation on the small model: one forward (LoopKVCache's one-pass continuation) against
feeding the turn token by token (the served semantics' definition) and against the dense cache, same process.

    python benchmarks/bench_continuation.py [--prompt 1000] [--turn 300] [--plan loopkv-m|kivi-4]
        [--model small|ouro-1.4b] [--no-stepped] [--device cpu|cuda] [--out benchmarks/results/continuation.json]

``--model ouro-1.4b``: Ouro-1.4B's shapes with random weights in bf16 (on a GPU), where a turn is also timed against
one pass over the prompt and the turn together (``whole_pass_s``: what a serving engine that keeps prompts whole
runs), so a chunk's cost can be set against a whole prompt's; ``--no-stepped`` leaves out token by token (minutes
at that size).

Each way runs once untimed first (compiling its kernels on CUDA). Reports seconds per turn for each way, the
speed-up of one pass over token by token, and the largest logit difference between the two (they compute the same
thing in a different order).
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent))
from run_info import RESULTS, run_info, write_json  # noqa: E402

import loopkv  # noqa: E402
from loopkv.models.ouro import OuroForCausalLM, dense_cache  # noqa: E402
from loopkv.models.small import load_small  # noqa: E402


def _plan(name: str, config) -> loopkv.Plan:
    loops, layers = config.total_ut_steps, config.num_hidden_layers
    if name == "kivi-4":
        return loopkv.Plan.uniform(loops=loops, layers=layers, option="int4")
    # LoopKV-M's shape: INT4 history in the final loop, earlier loops share it (paper Table 9's memory-lean plan)
    return loopkv.Plan.from_loops(loops=loops, layers=layers, per_loop=["share"] * (loops - 1) + ["int4"], tau=14.0)


def _sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt", type=int, default=1000, help="tokens of the first turn (prefill)")
    ap.add_argument("--turn", type=int, default=300, help="tokens of the later turn")
    ap.add_argument("--plan", choices=("loopkv-m", "kivi-4"), default="loopkv-m")
    ap.add_argument("--model", choices=("small", "ouro-1.4b"), default="small")
    ap.add_argument("--no-stepped", action="store_true", help="leave out feeding the turn token by token")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default=str(RESULTS / "continuation.json"))
    args = ap.parse_args(argv)

    if args.model == "small":
        model, dtype = load_small(device=args.device), torch.float32
    else:
        from bench_decode import ouro_1p4b_config

        dtype = torch.bfloat16
        torch.manual_seed(0)
        with torch.device(args.device):
            model = OuroForCausalLM(ouro_1p4b_config()).to(dtype=dtype).eval()
    plan = _plan(args.plan, model.config)
    ids = torch.randint(3, model.config.vocab_size, (1, args.prompt + args.turn),
                        generator=torch.Generator().manual_seed(0)).to(args.device)
    first, turn = ids[:, :args.prompt], ids[:, args.prompt:]
    length = args.prompt + args.turn

    def new_cache(kind):
        if kind == "dense":
            return dense_cache(model.config)
        return loopkv.LoopKVCache(plan, config=model.config, max_batch_size=1, max_cache_len=length,
                                  dtype=dtype, device=args.device)

    def timed(kind, token_by_token, tokens=args.turn):
        """Seconds for the turn's first ``tokens`` tokens after the prompt, and their logits."""
        cache = new_cache(kind)
        with torch.no_grad():
            model(input_ids=first, past_key_values=cache)
            _sync(args.device)
            start = time.perf_counter()
            if token_by_token:
                logits = torch.cat([model(input_ids=turn[:, i:i + 1], past_key_values=cache).logits
                                    for i in range(tokens)], dim=1)
            else:
                logits = model(input_ids=turn[:, :tokens], past_key_values=cache).logits
            _sync(args.device)
        return time.perf_counter() - start, logits

    def whole_pass() -> float:
        """Seconds for one pass over the prompt and the turn together into an empty LoopKVCache."""
        cache = new_cache("loopkv")
        with torch.no_grad():
            _sync(args.device)
            start = time.perf_counter()
            model(input_ids=ids, past_key_values=cache)
            _sync(args.device)
        return time.perf_counter() - start

    stepped_way = not args.no_stepped
    # each way once untimed first (on CUDA its kernels are compiled then), at the turn's shapes
    timed("loopkv", False)
    timed("dense", False)
    if stepped_way:
        timed("loopkv", True, 2)
    if args.model != "small":
        whole_pass()
    one_pass_s, one_pass = timed("loopkv", False)
    dense_s, _ = timed("dense", False)
    result = run_info(__file__, argv, args.device) | {
        "model": args.model, "dtype": str(dtype), "prompt": args.prompt, "turn": args.turn, "plan": args.plan,
        "one_pass_s": one_pass_s, "dense_one_pass_s": dense_s}
    if stepped_way:
        stepped_s, stepped = timed("loopkv", True)
        result |= {"token_by_token_s": stepped_s, "speedup_over_token_by_token": stepped_s / one_pass_s,
                   "max_abs_logit_difference": float((one_pass - stepped).abs().max())}
    if args.model != "small":
        result["whole_pass_s"] = whole_pass()
    write_json(args.out, result)
    print(f"{'way':<36}{'s per turn':>12}")
    for name, key in (("LoopKV one pass", "one_pass_s"), ("LoopKV token by token", "token_by_token_s"),
                      ("dense cache one pass", "dense_one_pass_s"),
                      ("LoopKV prompt and turn in one pass", "whole_pass_s")):
        if key in result:
            print(f"{name:<36}{result[key]:>12.3f}")
    if stepped_way:
        print(f"one pass is {result['speedup_over_token_by_token']:.1f}x token by token; "
              f"max |logit difference| {result['max_abs_logit_difference']:.2e}")
    return result


if __name__ == "__main__":
    main()
