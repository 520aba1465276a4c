"""Soak: the compiled decode step driven for thousands of steps over many requests, checked as it goes.

One LoopKVCache (every kind of cell: INT4 with V precision, INT2, ``share``) serves a sequence of requests: each
starts with ``cache.reset()``, prefills a left-padded batch eagerly (rows of different lengths, several around the
319/351 boundaries where pages 0 and 1 are quantized) and then runs the compiled step (forward, greedy argmax,
positions advanced on the device) until the request's share of ``--steps`` is done, so every row leaves the window
many times. The batch size changes between requests. What is recorded and must hold:

* **recompiles**: Dynamo compiles and CUDA-graph recordings (``torch._dynamo.callback_handler``, and the counters
  ``unique_graphs`` / ``cudagraph_skips``) after the warm-up, the first request of each batch size: none; and no
  CUDA-graph skip at all.
* **memory**: ``torch.cuda.memory_allocated()`` at the start (after ``reset``) and the end of every request: after
  the warm-up, the same number every time.
* **compiled = eager**: on sampled steps (every ``--check-every`` steps, and each step at which a row reaches 319,
  320, 351 or 352 tokens) the cache's state is copied into a second cache and one eager step runs there on the same
  input; its logits must equal the compiled step's within the fp32 logits tolerance (tests/tolerances.py), the
  tier the compile tests hold the compiled step to before any code could flip, and the tokens must agree.

On CUDA: ``torch.compile(mode="reduce-overhead", fullgraph=True, dynamic=False)``, as ``generate``'s
``CompileConfig(fullgraph=True, mode="reduce-overhead")`` compiles the step, after ``cache.warmup()``. ``--smoke``:
a tiny model on the CPU, ``backend="eager"`` (Dynamo's graph capture and guards, no Inductor, no CUDA graphs;
``--smoke --backend inductor`` compiles it with Inductor, about a minute), 120 steps. The GPU run::

    python benchmarks/bench_soak.py --out benchmarks/results/soak.json

Exit status 1 (after writing the JSON) when a check fails.
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import torch
import torch._dynamo
from run_info import RESULTS, run_info, write_json
from torch._dynamo.utils import counters

import loopkv
from loopkv.models.ouro import OuroConfig, OuroForCausalLM

# The model and plan of tests/cache/test_compile_gpu.py: 4 loops x 3 layers, head_dim 128, every kind of cell.
MODEL = dict(vocab_size=257, hidden_size=256, intermediate_size=512, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, head_dim=128, total_ut_steps=4, max_position_embeddings=4096,
             rope_theta=10000.0, eos_token_id=None, pad_token_id=0)
PLAN_GRID = [["int2", "int4", "int4"], ["int4", "int2", "int4"], ["share", "share", "int4"], ["int4"] * 3]
SMOKE_MODEL = dict(MODEL, hidden_size=64, intermediate_size=96, num_hidden_layers=2, head_dim=32, total_ut_steps=2)
SMOKE_GRID = [["share", "int2"], ["int4", "int4"]]
TAU = 14.0
# compiled logits against eager, fp32: the same math in other summation orders (tests/tolerances.py's whole-model
# fp32 tier; a script cannot import the tests, which are not installed)
LOGITS_ATOL = LOGITS_RTOL = 1e-4
# Prompt lengths a row draws from: short rows (sink only), and rows at and around the first window exits (page 0 is
# quantized at 319 tokens and read from 320, page 1 at 351 / 352).
LENGTHS = (5, 40, 100, 290, 300, 317, 318, 319, 320, 350, 351, 352, 480)
BOUNDARIES = (319, 320, 351, 352)


def schedule(steps: int, per_request: int, batches: tuple[int, ...], seed: int) -> list[tuple[list[int], int]]:
    """(prompt lengths of the rows, decode steps) per request; the batch size cycles through ``batches``. Row 0
    starts 2 tokens before page 0's or page 1's quantization (317, 349: alternately), the others at random."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    while steps > 0:
        batch = batches[len(out) % len(batches)]
        lens = [LENGTHS[int(i)] for i in torch.randint(len(LENGTHS), (batch,), generator=gen)]
        lens[0] = (317, 349)[len(out) % 2]
        out.append((lens, min(per_request, steps)))
        steps -= per_request
    return out


def left_padded(lens: list[int], vocab: int, gen: torch.Generator, device) -> tuple[torch.Tensor, torch.Tensor]:
    S = max(lens)
    ids = torch.zeros(len(lens), S, dtype=torch.long)
    mask = torch.zeros(len(lens), S, dtype=torch.long)
    for b, n in enumerate(lens):
        ids[b, S - n:] = torch.randint(3, vocab, (n,), generator=gen)
        mask[b, S - n:] = 1
    return ids.to(device), mask.to(device)


def copy_state(src: loopkv.LoopKVCache, dst: loopkv.LoopKVCache) -> None:
    """Every tensor of every cell of ``src`` into ``dst`` (the same plan and shapes)."""
    for idx in range(len(src.layers)):
        theirs = dst.storage(idx).own_tensors()
        for name, t in src.storage(idx).own_tensors().items():
            theirs[name].copy_(t)


class CompileEvents:
    """Dynamo compiles and CUDA-graph recordings, counted by ``torch._dynamo.callback_handler`` (where this torch has
    the trigger kinds; otherwise every start is counted as a compile)."""

    def __init__(self):
        self.compiles = 0
        self.recordings = 0

    def __call__(self, args=None) -> None:
        trigger = getattr(getattr(args, "callback_trigger", None), "name", "DYNAMO")
        if trigger == "CUDAGRAPH_RECORDING":
            self.recordings += 1
        else:
            self.compiles += 1

    def snapshot(self) -> dict:
        return {"compiles": self.compiles, "cudagraph_recordings": self.recordings,
                "unique_graphs": int(counters["stats"].get("unique_graphs", 0)),
                "cudagraph_skips": int(counters["inductor"].get("cudagraph_skips", 0))}


def make_step(model, cache):
    """One decode step over static buffers tok [B, 1] and pos [B, 1], advanced in place (greedy); returns logits."""

    @torch.no_grad()
    def step(tok, pos):
        logits = model(input_ids=tok, position_ids=pos, past_key_values=cache, logits_to_keep=1).logits
        tok.copy_(logits[:, -1].argmax(-1, keepdim=True))
        pos.add_(1)
        return logits

    return step


def allocated(device) -> int | None:
    if torch.device(device).type != "cuda":
        return None
    torch.cuda.synchronize(device)
    return torch.cuda.memory_allocated(device)


def compare(got: torch.Tensor, want: torch.Tensor) -> dict:
    """Compiled against eager logits [B, 1, V] of the same state and input."""
    diff = (got - want).abs()
    close = bool(torch.isclose(got, want, atol=LOGITS_ATOL, rtol=LOGITS_RTOL).all())
    top2 = want[:, -1].topk(2, dim=-1).values
    tie = (top2[:, 0] - top2[:, 1]) <= 2 * LOGITS_ATOL  # a near-tie may pick either token
    same = got[:, -1].argmax(-1) == want[:, -1].argmax(-1)
    return {"max_abs": float(diff.max()), "close": close, "tokens_differ": int((~same & ~tie).sum())}


def run_request(model, cache, reference, step, buffers, lens, steps, *, check_every, step0, gen, device) -> dict:
    """One request: reset, eager prefill on both caches, ``steps`` compiled decode steps, checks on sampled steps."""
    row = {"batch": len(lens), "prompt_lengths": lens, "steps": steps, "allocated_start": None}
    cache.reset()
    reference.reset()
    row["allocated_start"] = allocated(device)
    ids, mask = left_padded(lens, model.config.vocab_size, gen, device)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, past_key_values=cache, logits_to_keep=1).logits
        model(input_ids=ids, attention_mask=mask, past_key_values=reference, logits_to_keep=1)
    tok, pos = buffers[len(lens)]
    tok.copy_(logits[:, -1].argmax(-1, keepdim=True))
    pos.copy_(torch.tensor(lens, device=device)[:, None])
    del ids, mask, logits
    checks = []
    t0 = time.perf_counter()
    for i in range(steps):
        held = [n + i for n in lens]  # tokens each row holds before this step writes its token
        if (step0 + i) % check_every == 0 or any(h + 1 in BOUNDARIES for h in held):
            copy_state(cache, reference)
            with torch.no_grad():
                want = model(input_ids=tok.clone(), position_ids=pos.clone(), past_key_values=reference,
                             logits_to_keep=1).logits
            got = step(tok, pos).clone()
            checks.append(dict(compare(got, want), step=i, held=held))
            del want, got
        else:
            step(tok, pos)
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    row["seconds"] = round(time.perf_counter() - t0, 3)
    row["final_lengths"] = cache.storage(0).lengths[: len(lens)].tolist()
    row["expected_lengths"] = [n + steps for n in lens]
    row["checks"] = checks
    row["allocated_end"] = allocated(device)
    return row


def summarize(rows: list[dict], warm_at: int, after_warmup: dict | None, end: dict, *, seconds: float) -> dict:
    """The run's checks over the requests after the warm-up (``rows[warm_at:]``; ``after_warmup``: the compile
    events then, None if no request followed), with what failed."""
    steady = rows[warm_at:]
    recompiles = {k: end[k] - after_warmup[k] for k in end} if after_warmup is not None else None
    memory = [m for r in steady for m in (r["allocated_start"], r["allocated_end"]) if m is not None]
    checks = [c for r in rows for c in r["checks"]]
    summary = {
        "requests": len(rows), "warmup_requests": sum(r["warmup"] for r in rows),
        "decode_steps": sum(r["steps"] for r in rows), "seconds": round(seconds, 1),
        "events_warmup": after_warmup, "events_end": end, "recompiles_after_warmup": recompiles,
        "allocated_min": min(memory) if memory else None, "allocated_max": max(memory) if memory else None,
        "allocated_growth": (max(memory) - min(memory)) if memory else None,
        "checks": len(checks), "checks_not_close": sum(not c["close"] for c in checks),
        "tokens_differ": sum(c["tokens_differ"] for c in checks),
        "max_abs_logit_diff": max((c["max_abs"] for c in checks), default=None),
        "tolerance": {"atol": LOGITS_ATOL, "rtol": LOGITS_RTOL},
        "lengths_as_expected": all(r["final_lengths"] == r["expected_lengths"] for r in rows),
    }
    failures = []
    if recompiles is None:
        failures.append("no request ran after the warm-up (more --steps or fewer batch sizes)")
    elif any(recompiles.values()):
        failures.append(f"compiled again after the warm-up: {recompiles}")
    if end["cudagraph_skips"]:
        failures.append(f"CUDA graphs skipped {end['cudagraph_skips']} times (the step ran without its graph)")
    if summary["allocated_growth"]:
        failures.append(f"memory_allocated moved by {summary['allocated_growth']} bytes after the warm-up")
    if summary["checks_not_close"] or summary["tokens_differ"]:
        failures.append(f"{summary['checks_not_close']} checks beyond tolerance, {summary['tokens_differ']} tokens")
    if not summary["lengths_as_expected"]:
        failures.append("a row does not hold prompt + steps tokens")
    summary["failures"] = failures
    summary["passed"] = not failures
    return summary


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=10_000, help="decode steps in total, over all requests")
    p.add_argument("--steps-per-request", type=int, default=500)
    p.add_argument("--batches", default="2,1,4", help="batch sizes, cycled request by request")
    p.add_argument("--check-every", type=int, default=97, help="compare with eager every this many steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default=None, help="default: cuda if available")
    p.add_argument("--backend", choices=("inductor", "eager"), default=None,
                   help="torch.compile's backend: inductor (the default; with mode='reduce-overhead' on CUDA), or "
                        "eager (Dynamo's capture and guards only; the default with --smoke)")
    p.add_argument("--smoke", action="store_true",
                   help="tiny model on the CPU, backend='eager', 3 requests of 40 steps at batch 2, 1, 2")
    p.add_argument("--out", default=str(RESULTS / "soak.json"))
    return p


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    threads = torch.get_num_threads()
    if args.smoke:
        args.steps, args.steps_per_request, args.batches, args.check_every = 120, 40, "2,1", 13
        args.device = "cpu"
        torch.set_num_threads(1)  # thousands of tiny ops: two threads waiting on each other cost 100x on 2 cores
    try:
        return soak(args, argv)
    finally:
        torch.set_num_threads(threads)


def soak(args, argv) -> dict:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cuda = device.type == "cuda"
    batches = tuple(int(b) for b in args.batches.split(","))
    if min(batches) < 1 or args.steps < 1 or args.steps_per_request < 1 or args.check_every < 1:
        raise SystemExit("bench_soak: --steps, --steps-per-request, --check-every and the batch sizes must be >= 1")
    requests = schedule(args.steps, args.steps_per_request, batches, args.seed)
    max_len = max(LENGTHS) + args.steps_per_request + 1

    torch.manual_seed(args.seed)
    config = OuroConfig(**(SMOKE_MODEL if args.smoke else MODEL))
    model = OuroForCausalLM(config).to(device).eval()
    plan = loopkv.Plan.from_grid(SMOKE_GRID if args.smoke else PLAN_GRID, tau=TAU)
    cache, reference = (loopkv.LoopKVCache(plan, config=config, max_batch_size=max(batches), max_cache_len=max_len,
                                           dtype=torch.float32, device=device) for _ in range(2))
    cache.warmup()
    reference.warmup()
    buffers = {}
    for b in sorted(set(batches)):
        buffers[b] = (torch.zeros(b, 1, dtype=torch.long, device=device),
                      torch.zeros(b, 1, dtype=torch.long, device=device))
        for t in buffers[b]:
            torch._dynamo.mark_static_address(t)

    torch._dynamo.reset()
    counters.clear()
    events = CompileEvents()
    handler = torch._dynamo.callback_handler
    handler.register_start_callback(events)
    backend = args.backend or ("eager" if args.smoke else "inductor")
    options = dict(backend=backend, **(dict(mode="reduce-overhead") if cuda and backend == "inductor" else {}))
    step = torch.compile(make_step(model, cache), fullgraph=True, dynamic=False, **options)
    gen = torch.Generator().manual_seed(args.seed + 1)
    first = {}  # the first request of each batch size; the warm-up ends with the last of them
    for i, (lens, _) in enumerate(requests):
        first.setdefault(len(lens), i)
    warm_at = max(first.values()) + 1
    rows, done, after_warmup = [], 0, None
    t0 = time.perf_counter()
    try:
        for i, (lens, steps) in enumerate(requests):
            row = run_request(model, cache, reference, step, buffers, lens, steps, check_every=args.check_every,
                              step0=done, gen=gen, device=device)
            row["warmup"] = i < warm_at
            row["events_after"] = events.snapshot()
            if i + 1 == warm_at:
                after_warmup = row["events_after"]
            rows.append(row)
            done += steps
    finally:
        handler.remove_start_callback(events)
    summary = summarize(rows, warm_at, after_warmup if warm_at < len(rows) else None, events.snapshot(),
                        seconds=time.perf_counter() - t0)
    failures = summary["failures"]
    result = {**run_info(__file__, argv, device), "model": {k: v for k, v in config.to_dict().items()
                                                             if k in MODEL},
              "plan": plan.grid(), "tau": TAU, "max_cache_len": max_len, "batches": list(batches),
              "steps_per_request": args.steps_per_request, "check_every": args.check_every,
              "compile": options, "summary": summary, "requests": rows}
    write_json(args.out, result)
    print_table(rows, summary)
    if failures:
        print("bench_soak: FAILED: " + "; ".join(failures), file=sys.stderr)
        if argv is None:
            raise SystemExit(1)
    return result


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.2f}"


def print_table(rows: list[dict], summary: dict) -> None:
    print(f"{'req':>4} {'B':>2} {'prompts':<24} {'steps':>5} {'s':>6} {'MiB start':>9} {'MiB end':>9} "
          f"{'checks':>6} {'max|dlogit|':>11} warm-up")
    for i, r in enumerate(rows):
        worst = max((c["max_abs"] for c in r["checks"]), default=math.nan)
        print(f"{i:>4} {r['batch']:>2} {','.join(map(str, r['prompt_lengths'])):<24} {r['steps']:>5} "
              f"{r['seconds']:>6.1f} {_mib(r['allocated_start']):>9} {_mib(r['allocated_end']):>9} "
              f"{len(r['checks']):>6} {worst:>11.2e} {'yes' if r['warmup'] else ''}")
    print(f"{summary['decode_steps']} steps in {summary['seconds']} s; after warm-up: recompiles "
          f"{summary['recompiles_after_warmup']}, memory growth {summary['allocated_growth']} bytes; "
          f"{summary['checks']} checks, max |dlogit| {summary['max_abs_logit_diff']}; "
          f"{'PASSED' if summary['passed'] else 'FAILED'}")


if __name__ == "__main__":
    main()
