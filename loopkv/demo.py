"""``loopkv demo``: the LoopKV pipeline end to end on the built-in small looped model.

1. Load the small Ouro-architecture model loopkv ships (``loopkv.models.small``).
2. Load its shipped per-cell profile (or re-profile with ``--reprofile``, a few minutes on a CPU).
3. Solve the paper's two knapsack plans: R (read-optimized) and M (memory-optimized), with V precision.
4. For each arm (BF16 exact, KIVI-4, KIVI-4 + V precision, LoopKV-R, LoopKV-M):
   * stored / read KiB per history token and the memory saved against BF16 (byte model, which the
     cache's allocation matches: ``LoopKVCache.memory_report``);
   * fp32 KL against the exact model and next-token agreement on held-out text, by the dense
     simulation of the served cache (``loopkv.planning.simulate``, tested equal to the cache's reads);
   * retrieval exact match on fresh synthetic documents (greedy answer == teacher-forced argmax of
     every answer token, with the prompt prefilled exactly as the cache does);
   * a real ``model.generate`` through a ``LoopKVCache`` on one retrieval prompt: whether it gives the
     answer, and on a GPU its decode tokens/s (on a CPU it runs the PyTorch reference ops, which show that
     the path works, not how fast the kernels are: the table leaves tok/s out there).
5. Print the table and write the plans (JSON) and their heatmaps (PNG) into ``--out`` (default
   ``loopkv-demo/`` in the current folder).
"""

from __future__ import annotations

import argparse
import math
import pathlib
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from loopkv.cli import DEFAULT_TAU
from loopkv.cli_errors import check_output_dir, resolve_device

TAU = DEFAULT_TAU  # the paper's V-precision threshold (§3.3), as `loopkv plan` records by default
PROFILE_FILE = "profile.json"
OUT = "loopkv-demo"
# --quick: one short prompt and document per column (a smoke run, as CI runs it)
QUICK = {"contexts": "512", "prompts": 1, "kl_docs": 1, "kl_len": 448, "gen_context": 448}


@dataclass
class Arm:
    name: str
    plan: object | None  # None: the exact model (dense cache)
    stored_kib: float = 0.0
    read_kib: float = 0.0
    kl: float = 0.0
    agree: float = 1.0
    retrieval: dict | None = None
    tok_s: float = math.nan
    answer_ok: bool | None = None


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="loopkv demo", description=__doc__.split("\n\n")[0],
                                epilog=f"Writes loopkv-r.json, loopkv-m.json and their heatmaps (PNG) into --out, "
                                f"by default {OUT}/ in the current folder.")
    p.add_argument("--reprofile", action="store_true", help="profile again instead of loading the shipped profile")
    p.add_argument("--contexts", default="2048,4096", help="retrieval context lengths, comma-separated")
    p.add_argument("--prompts", type=int, default=2, help="retrieval prompts per context")
    p.add_argument("--kl-docs", type=int, default=2, help="held-out documents for the KL column")
    p.add_argument("--kl-len", type=int, default=1024, help="tokens per KL document")
    p.add_argument("--gen-context", type=int, default=1024,
                   help="retrieval prompt length for the generate and tok/s columns")
    p.add_argument("--out", default=OUT, help=f"folder the plans (JSON) and heatmaps (PNG) are written to, "
                   f"created if missing (default: {OUT}/ in the current folder)")
    p.add_argument("--quick", action="store_true",
                   help=f"a smoke run (CI): retrieval on {QUICK['prompts']} prompt of {QUICK['contexts']} tokens, "
                        f"KL on {QUICK['kl_docs']} document of {QUICK['kl_len']} tokens, generate on a "
                        f"{QUICK['gen_context']}-token prompt")
    p.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    args = p.parse_args(argv)
    if args.quick:
        for name, value in QUICK.items():
            setattr(args, name, value)
    return args


def _arms(profile, config) -> list[Arm]:
    from loopkv.planning import Plan
    from loopkv.planning.knapsack import solve_preset

    loops, layers = config.total_ut_steps, config.num_hidden_layers
    arms = [
        Arm("BF16 (exact)", None),
        Arm("KIVI-4", Plan.uniform(loops=loops, layers=layers, option="int4")),
        Arm("KIVI-4 + V", Plan.uniform(loops=loops, layers=layers, option="int4", tau=TAU)),
        Arm("LoopKV-R", solve_preset(profile, "r", tau=TAU)),
        Arm("LoopKV-M", solve_preset(profile, "m", tau=TAU)),
    ]
    bf16 = Plan.uniform(loops=loops, layers=layers, option="bf16")
    for arm in arms:
        b = (arm.plan or bf16).bytes_per_token(config)
        arm.stored_kib, arm.read_kib = b.stored_kib, b.read_kib
    return arms


def _profile(model, args):
    from loopkv.models.small import SMALL_DIR
    from loopkv.planning.profile_data import Profile

    shipped = SMALL_DIR / PROFILE_FILE
    if shipped.is_file() and not args.reprofile:
        from loopkv.planning.profiler import model_fingerprint

        profile = Profile.from_json(shipped)
        if profile.provenance.get("model_fingerprint") != model_fingerprint(model):
            print(f"warning: {shipped} was profiled on another checkpoint; run `loopkv demo --reprofile`",
                  file=sys.stderr)
        return profile
    from loopkv.planning.profiler import calibration_documents, profile

    out = pathlib.Path(args.out) / PROFILE_FILE
    out.parent.mkdir(parents=True, exist_ok=True)
    print(f"profiling every cell (resumable: {out}) ...")
    return profile(model, calibration_documents(n=4, length=1024, seed=0), out=out)


def _kl_docs(args) -> list[torch.Tensor]:
    from loopkv.models.data import heldout_windows, load_corpus

    return list(heldout_windows(load_corpus(), n=args.kl_docs, seq_len=args.kl_len, seed=1))


def _simulate(model, plan, ids, *, prefill_len, logits_from):
    from loopkv.planning.simulate import simulate_plan

    if plan is None:  # the exact model
        with torch.no_grad():
            return model(input_ids=ids[None].to(model.device)).logits[0, logits_from:].float()
    passes = 2 if "share" in plan.options else 1  # share sources iterate to the served fixed point
    with torch.no_grad():
        return simulate_plan(model, plan, ids, prefill_len=prefill_len, logits_from=logits_from,
                             share_passes=passes).float()


def kl_and_agreement(ref: torch.Tensor, got: torch.Tensor) -> tuple[float, float]:
    """Mean KL(softmax(ref) || softmax(got)) over all positions, in the logits' dtype, and the share of positions
    whose argmax agrees."""
    lp, lq = torch.log_softmax(ref, -1), torch.log_softmax(got, -1)
    kl = (lp.exp() * (lp - lq)).sum(-1).clamp_min(0).mean().item()
    return kl, (ref.argmax(-1) == got.argmax(-1)).float().mean().item()


def _kl_and_agreement(model, arm: Arm, docs, exact_logits) -> None:
    from loopkv.planning.simulate import FIRST_HISTORY

    kls, agree = [], []
    for doc, ref in zip(docs, exact_logits, strict=True):
        got = _simulate(model, arm.plan, doc, prefill_len=FIRST_HISTORY, logits_from=FIRST_HISTORY)
        kl, ok = kl_and_agreement(ref, got)
        kls.append(kl)
        agree.append(ok)
    arm.kl, arm.agree = sum(kls) / len(kls), sum(agree) / len(agree)


def _retrieval(model, arm: Arm, tasks) -> None:
    arm.retrieval = {}
    for n, items in tasks.items():
        hits = 0
        for prompt, answer in items:
            ids = torch.cat([prompt, answer])
            logits = _simulate(model, arm.plan, ids, prefill_len=len(prompt), logits_from=len(prompt) - 1)
            hits += bool(torch.equal(logits[: len(answer)].argmax(-1).cpu(), answer))
        arm.retrieval[n] = hits / len(items)


def _decode_speed(model, arm: Arm, prompt, answer) -> None:
    import loopkv
    from loopkv.planning import Plan

    cfg = model.config
    plan = arm.plan or Plan.uniform(loops=cfg.total_ut_steps, layers=cfg.num_hidden_layers, option="bf16")
    new = len(answer) + 4
    cache = loopkv.LoopKVCache(plan, config=cfg, max_batch_size=1, max_cache_len=len(prompt) + new,
                               dtype=model.dtype, device=model.device)
    ids = prompt[None].to(model.device)
    with torch.no_grad():
        model(input_ids=ids, past_key_values=cache)  # prefill, not timed
        cache.reset()
        t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache, max_new_tokens=new,
                             min_new_tokens=new, do_sample=False, pad_token_id=0)
        elapsed = time.perf_counter() - t0
    arm.tok_s = new / elapsed  # prefill included: an honest upper bound on per-token time
    arm.answer_ok = torch.equal(out[0, len(prompt): len(prompt) + len(answer)].cpu(), answer)


def format_table(arms: list[Arm], contexts: list[int], *, tok_s: bool) -> str:
    """The demo's table; ``tok_s``: with the decode-speed column (on a GPU; a CPU runs the reference ops)."""
    bf16 = arms[0].stored_kib
    head = (f"{'arm':<14} {'stored KiB':>10} {'read KiB':>9} {'saved':>6} {'KL (nats)':>10} {'agree':>6} "
            + " ".join(f"{'ret@' + str(n):>8}" for n in contexts) + f" {'generate':>8}"
            + (f" {'tok/s':>7}" if tok_s else ""))
    lines = [head, "-" * len(head)]
    for a in arms:
        ret = " ".join(f"{a.retrieval[n]:>8.0%}" for n in contexts)
        gen = {True: "right", False: "wrong", None: "-"}[a.answer_ok]
        lines.append(f"{a.name:<14} {a.stored_kib:>10.2f} {a.read_kib:>9.2f} {1 - a.stored_kib / bf16:>6.0%} "
                     f"{a.kl:>10.2e} {a.agree:>6.1%} {ret} {gen:>8}" + (f" {a.tok_s:>7.1f}" if tok_s else ""))
    return "\n".join(lines)


def format_notes(*, cells: int, docs: int, first: int, prompts: int, device: str) -> str:
    """What the table's columns mean, one line each."""
    cuda = device.startswith("cuda")
    speed = ("tok/s: decode tokens per second of that generate, eager, prefill included (the served, compiled "
             "speed is measured by benchmarks/bench_decode.py)" if cuda else
             f"no tok/s column on {device}: there the cache runs the PyTorch reference ops, written to be plainly "
             "correct, not fast; their speed, which differs from arm to arm, says nothing about the GPU kernels' "
             "(decode speed is measured on a GPU by benchmarks/bench_decode.py)")
    return "\n".join([
        f"stored / read KiB: per history token, summed over the {cells} cells; saved: history memory saved vs BF16; "
        "'read' counts no V-precision savings (the hot fraction is not measured here).",
        f"KL (nats): mean over positions of KL(exact || arm), the next-token distribution of the exact fp32 model "
        f"against the arm's, in nats per token, on {docs} held-out document(s) from position {first} on (0: "
        "identical); agree: share of those positions where both pick the same next token.",
        f"ret@n: retrieval exact match over {prompts} prompt(s) of n tokens.",
        "generate: whether model.generate through a real LoopKVCache gives the retrieval answer "
        "(the other columns simulate the served cache).",
        speed + ".",
    ])


def main(argv: Sequence[str] | None = None) -> int:
    from tqdm.auto import tqdm

    from loopkv.models.data import load_corpus, retrieval_task
    from loopkv.models.small import encode, load_small
    from loopkv.planning.show import plot_plan

    args = _parse(argv)
    check_output_dir(args.out, "--out")  # before the work, not after it
    args.device = resolve_device(args.device)
    t_start = time.perf_counter()
    torch.manual_seed(0)
    model = load_small(device=args.device)
    cfg = model.config
    print(f"small looped model: T={cfg.total_ut_steps} loops x L={cfg.num_hidden_layers} layers, "
          f"{cfg.num_key_value_heads} KV heads x {cfg.head_dim}, {sum(p.numel() for p in model.parameters()):,} "
          f"parameters, on {args.device}")
    profile = _profile(model, args)
    arms = _arms(profile, cfg)
    contexts = [int(c) for c in args.contexts.split(",")]
    corpus = load_corpus()
    tasks = {}
    for n in contexts:
        items = []
        for seed in range(args.prompts):
            prompt, answer = retrieval_task(n, 10_000 + seed, corpus=corpus)
            items.append((encode(prompt), encode(answer, bos=False)))
        tasks[n] = items
    gen_prompt, gen_answer = retrieval_task(args.gen_context, 99, corpus=corpus)
    gen_prompt, gen_answer = encode(gen_prompt), encode(gen_answer, bos=False)
    docs = _kl_docs(args)
    from loopkv.planning.simulate import FIRST_HISTORY

    with torch.no_grad():
        exact = [model(input_ids=d[None].to(model.device)).logits[0, FIRST_HISTORY:].float() for d in docs]
    for arm in tqdm(arms, desc="loopkv demo", unit="arm"):
        if arm.plan is not None:
            _kl_and_agreement(model, arm, docs, exact)
        _retrieval(model, arm, tasks)
        _decode_speed(model, arm, gen_prompt, gen_answer)

    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for arm in arms[3:]:
        arm.plan.to_json(out / f"{arm.name.lower()}.json")
        try:
            plot_plan(arm.plan, out / f"{arm.name.lower()}.png", title=arm.name)
        except ImportError as err:
            print(f"(no heatmap: {err})", file=sys.stderr)
    print()
    print(format_table(arms, contexts, tok_s=args.device.startswith("cuda")))
    print()
    print(format_notes(cells=cfg.total_ut_steps * cfg.num_hidden_layers, docs=len(docs), first=FIRST_HISTORY,
                       prompts=args.prompts, device=args.device))
    print(f"plans and heatmaps in {out}/ ; {time.perf_counter() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
