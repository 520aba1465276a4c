"""A later turn of a conversation on the small model: one forward (LoopKVCache's one-pass continuation) against
feeding the turn token by token (the served semantics' definition) and against the dense cache, same process.

    python benchmarks/bench_continuation.py [--prompt 1000] [--turn 300] [--plan loopkv-m|kivi-4]
        [--device cpu|cuda] [--out benchmarks/results/continuation.json]

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
from loopkv.models.ouro import dense_cache  # noqa: E402
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
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default=str(RESULTS / "continuation.json"))
    args = ap.parse_args(argv)

    model = load_small(device=args.device)
    plan = _plan(args.plan, model.config)
    ids = torch.randint(3, model.config.vocab_size, (1, args.prompt + args.turn),
                        generator=torch.Generator().manual_seed(0)).to(args.device)
    first, turn = ids[:, :args.prompt], ids[:, args.prompt:]
    length = args.prompt + args.turn

    def new_cache(kind):
        if kind == "dense":
            return dense_cache(model.config)
        return loopkv.LoopKVCache(plan, config=model.config, max_batch_size=1, max_cache_len=length,
                                  dtype=torch.float32, device=args.device)

    def timed(kind, token_by_token, tokens=args.turn):
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

    # each way once untimed first (on CUDA its kernels are compiled then), at the turn's shapes
    for kind, token_by_token, tokens in (("loopkv", False, args.turn), ("loopkv", True, 2),
                                         ("dense", False, args.turn)):
        timed(kind, token_by_token, tokens)
    one_pass_s, one_pass = timed("loopkv", False)
    stepped_s, stepped = timed("loopkv", True)
    dense_s, _ = timed("dense", False)
    result = run_info(__file__, argv, args.device) | {
        "prompt": args.prompt, "turn": args.turn, "plan": args.plan,
        "one_pass_s": one_pass_s, "token_by_token_s": stepped_s, "dense_one_pass_s": dense_s,
        "speedup_over_token_by_token": stepped_s / one_pass_s,
        "max_abs_logit_difference": float((one_pass - stepped).abs().max()),
    }
    write_json(args.out, result)
    print(f"{'way':<28}{'s per turn':>12}")
    for name, key in (("LoopKV one pass", "one_pass_s"), ("LoopKV token by token", "token_by_token_s"),
                      ("dense cache one pass", "dense_one_pass_s")):
        print(f"{name:<28}{result[key]:>12.3f}")
    print(f"one pass is {result['speedup_over_token_by_token']:.1f}x token by token; "
          f"max |logit difference| {result['max_abs_logit_difference']:.2e}")
    return result


if __name__ == "__main__":
    main()
