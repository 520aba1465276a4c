"""Quality of the paper's arms on the small looped model loopkv ships, against the exact model in the same run.

Per arm, by the dense simulation of the served cache (``loopkv.planning.simulate.simulate_plan``, tested equal to
``LoopKVCache``'s reads), on the small model (``loopkv.models.small.load_small``: Ouro architecture, 4 loops x 6
layers, 2 KV heads x 128, byte vocabulary) in fp32:

* KL(exact || arm) per held-out document (positions >= 320), mean with a 95% bootstrap interval;
* next-token agreement with the exact model per document, paired difference arm - BF16 with an interval;
* retrieval exact match on fresh synthetic prompts per context length, paired difference arm - BF16;
* stored / read KiB per history token (``plan.bytes_per_token``).

Arms: BF16 (the exact model), KIVI-4, KIVI-4 + V (tau = 14), LoopKV-R and LoopKV-M (solved from the shipped profile
with the paper's presets), naive INT2 (every loop but the last), naive last-loop reuse, and INT4 + sharing of loop
T - 2. Also the exact model's attention structure per loop: the mass on the first 32 tokens and the share of history
tokens hot at tau = 14 (``loopkv.format.cold_threshold``).

The numbers the docs quote (2-core CPU, about 30 minutes):

    python benchmarks/bench_quality.py --out benchmarks/results/quality.json

``--device cuda`` runs it on a GPU (``--kl-docs 32 --prompts 100,100,100`` for narrower intervals). ``--smoke``: one
short document and one short prompt, BF16, KIVI-4 + V and LoopKV-M; checks the script in half a minute on 2 cores.
Writes JSON (device, versions, date, command, every per-document and per-prompt number) to ``--out`` and prints a
table last.
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile
import time
from collections.abc import Sequence

import torch
from run_info import RESULTS, run_info, write_json

from loopkv import format as fmt

TAU = 14.0
SEED = 0
SINK_QUERIES = 128  # query rows (the last of each document) the sink mass is averaged over
HOT_QUERIES = 256  # and the hot share
# --smoke: one short document and prompt, two arms (V precision; INT2 and share cells) beside BF16
SMOKE = {"kl_docs": 1, "kl_len": 352, "contexts": "352", "prompts": "1", "boot": 200, "arms": "KIVI-4 + V,LoopKV-M"}


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--kl-docs", type=int, default=6, help="held-out documents for KL and agreement")
    p.add_argument("--kl-len", type=int, default=1024, help="tokens per KL document")
    p.add_argument("--contexts", default="1024,2048,4096", help="retrieval context lengths, comma-separated")
    p.add_argument("--prompts", default="20,20,12", help="retrieval prompts per context, comma-separated")
    p.add_argument("--boot", type=int, default=5000, help="bootstrap resamples")
    p.add_argument("--arms", default="", help="comma-separated arm names to run (default: all; BF16 always runs)")
    p.add_argument("--smoke", action="store_true", help="one short document and prompt, three arms: checks the script")
    p.add_argument("--out", default=None,
                   help="JSON path (default: benchmarks/results/quality.json; with --smoke a temporary file)")
    args = p.parse_args(argv)
    if args.smoke:
        for key, value in SMOKE.items():
            setattr(args, key, value)
    return args


def arms(profile, config) -> list[tuple[str, object | None]]:
    """(name, plan) of every arm; the plan None is the exact model."""
    from loopkv.planning import Plan, solve_preset

    t, n = config.total_ut_steps, config.num_hidden_layers
    return [
        ("BF16 (exact)", None),
        ("KIVI-4", Plan.uniform(loops=t, layers=n, option="int4")),
        ("KIVI-4 + V", Plan.uniform(loops=t, layers=n, option="int4", tau=TAU)),
        ("LoopKV-R", solve_preset(profile, "r", tau=TAU)),
        ("LoopKV-M", solve_preset(profile, "m", tau=TAU)),
        ("naive INT2", Plan.from_loops(loops=t, layers=n, per_loop=["int2"] * (t - 1) + ["int4"])),
        ("naive last-loop reuse", Plan.from_loops(loops=t, layers=n, per_loop=["share"] * (t - 1) + ["int4"])),
        (f"INT4 + loop-{t - 2} share", Plan.share_loop(loops=t, layers=n, option="int4")),
    ]


def bootstrap(values: Sequence[float], *, boot: int, seed: int = SEED) -> dict:
    """Mean of ``values`` with a percentile 95% bootstrap interval (items resampled with replacement)."""
    x = torch.tensor(list(values), dtype=torch.float64)
    g = torch.Generator().manual_seed(seed)
    means = x[torch.randint(0, len(x), (boot, len(x)), generator=g)].mean(1)
    lo, hi = torch.quantile(means, torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist()
    return {"mean": float(x.mean()), "ci95": [lo, hi], "n": len(x), "significant": bool(lo > 0 or hi < 0)}


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos.unsqueeze(1) + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin.unsqueeze(1)


@torch.no_grad()
def attention_structure(model, ids: torch.Tensor, *, tau: float = TAU) -> dict[str, list[float]]:
    """Per loop (mean over layers, query heads and rows), from fp32 scores recomputed from each attention module's
    inputs: the softmax mass on the first ``SINK`` tokens over the last ``SINK_QUERIES`` rows, and the share of
    history tokens with ``s >= cold_threshold(max(sink max, own page max), tau)`` over the last ``HOT_QUERIES`` rows
    (at most those with history). ``ids [S]``."""
    cfg = model.config
    ids = ids.reshape(1, -1).to(model.device)
    s = ids.shape[1]
    hot_q = min(HOT_QUERIES, s - (fmt.SINK + fmt.WINDOW + fmt.PAGE))
    queries = max(SINK_QUERIES, hot_q)
    qpos = torch.arange(s - hot_q, s, device=model.device)
    n_hist = fmt.PAGE * fmt.n_pages(qpos + 1)  # [hot_q] history tokens per row
    if hot_q <= 0 or int(n_hist.min()) <= 0:
        raise ValueError(f"the document must be long enough that its query rows have history; got {s} tokens")
    sink: dict[int, float] = {}
    hot: dict[int, float] = {}

    def hook(module, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        cos, sin = (x.float() for x in kwargs["position_embeddings"])
        q = module.q_proj(hidden).view(1, s, -1, module.head_dim).transpose(1, 2).float()
        k = module.k_proj(hidden).view(1, s, -1, module.head_dim).transpose(1, 2).float()
        q, k = _rope(q[:, :, s - queries:], cos[:, s - queries:], sin[:, s - queries:]), _rope(k, cos, sin)
        k = k.repeat_interleave(module.num_key_value_groups, dim=1)
        scores = (q @ k.transpose(2, 3) * module.scaling)[0]  # [Hq, queries, S]
        rows = torch.arange(s - queries, s, device=scores.device)
        causal = torch.arange(s, device=scores.device)[None, :] <= rows[:, None]
        weights = scores[:, -SINK_QUERIES:].masked_fill(~causal[-SINK_QUERIES:], -math.inf).softmax(-1)
        cell = int(kwargs["cell_index"])
        sink[cell] = float(weights[..., : fmt.SINK].sum(-1).mean())
        sc = scores[:, -hot_q:]
        end = fmt.SINK + int(n_hist.max())
        pages = sc[..., fmt.SINK:end].unflatten(-1, (-1, fmt.PAGE))  # [Hq, hot_q, P, PAGE]
        m_ref = torch.maximum(pages.amax(-1, keepdim=True), sc[..., : fmt.SINK].amax(-1)[..., None, None])
        is_hot = (pages >= fmt.cold_threshold(m_ref, tau)).flatten(-2)  # [Hq, hot_q, history]
        valid = torch.arange(end - fmt.SINK, device=sc.device)[None, :] < n_hist[:, None]
        hot[cell] = float(((is_hot & valid).sum(-1) / n_hist).mean())

    handles = [layer.self_attn.register_forward_pre_hook(hook, with_kwargs=True) for layer in model.model.layers]
    try:
        model(input_ids=ids, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    layers, loops = cfg.num_hidden_layers, cfg.total_ut_steps

    def per_loop(cells):
        return [sum(cells[t * layers + j] for j in range(layers)) / layers for t in range(loops)]

    return {"sink_mass_first_32": per_loop(sink), "hot_fraction_tau14": per_loop(hot)}


@torch.no_grad()
def logits_of(model, plan, ids: torch.Tensor, *, prefill_len: int, logits_from: int) -> torch.Tensor:
    """[N - logits_from, V] fp32 logits of the exact model (``plan`` None) or of the plan's served cache (share
    sources iterated twice towards the served fixed point)."""
    from loopkv.planning.simulate import simulate_plan

    if plan is None:
        return model(input_ids=ids[None].to(model.device)).logits[0, logits_from:].float()
    passes = 2 if "share" in plan.options else 1
    return simulate_plan(model, plan, ids, prefill_len=prefill_len, logits_from=logits_from,
                         share_passes=passes).float()


def kl_and_agreement(ref: torch.Tensor, got: torch.Tensor) -> tuple[float, float]:
    """Mean KL(softmax(ref) || softmax(got)) over positions, and the share of positions whose argmax agrees."""
    lp, lq = torch.log_softmax(ref, -1), torch.log_softmax(got, -1)
    kl = (lp.exp() * (lp - lq)).sum(-1).clamp_min(0).mean().item()
    return kl, (ref.argmax(-1) == got.argmax(-1)).float().mean().item()


def run_arm(model, plan, docs, exact, tasks, base_ret, *, boot: int) -> dict:
    from loopkv.planning.simulate import FIRST_HISTORY

    row: dict = {"plan_grid": plan.grid() if plan is not None else None}
    if plan is None:
        row.update(kl_per_doc=[0.0] * len(docs), agree_per_doc=[1.0] * len(docs))
    else:
        kls, agree = [], []
        for doc, ref in zip(docs, exact, strict=True):
            got = logits_of(model, plan, doc, prefill_len=FIRST_HISTORY, logits_from=FIRST_HISTORY)
            kl, ok = kl_and_agreement(ref, got)
            kls.append(kl)
            agree.append(ok)
        row.update(kl_per_doc=kls, agree_per_doc=agree, kl=bootstrap(kls, boot=boot),
                   agree_diff=bootstrap([a - 1.0 for a in agree], boot=boot))
    row["retrieval"] = {}
    for n, items in tasks.items():
        hits = []
        for prompt, answer in items:
            logits = logits_of(model, plan, torch.cat([prompt, answer]), prefill_len=len(prompt),
                               logits_from=len(prompt) - 1)
            hits.append(float(torch.equal(logits[: len(answer)].argmax(-1).cpu(), answer)))
        entry = {"per_prompt": hits, "exact_match": sum(hits) / len(hits)}
        if plan is None:
            base_ret[n] = hits
        else:
            entry["diff_vs_bf16"] = bootstrap([h - g for h, g in zip(hits, base_ret[n], strict=True)], boot=boot)
        row["retrieval"][str(n)] = entry
    return row


def print_table(result: dict) -> None:
    contexts = list(result["counts"]["retrieval_prompts"])
    print(f"{'arm':<22} {'stored':>7} {'read':>6} {'BF16/arm':>8} {'KL (nats)':>10} {'agree-BF16':>10} "
          + " ".join(f"{'ret@' + n:>15}" for n in contexts) + "   (KiB/token; retrieval: hits (pp vs BF16))")
    base = result["arms"][0]["stored_kib"]
    for r in result["arms"]:
        kl = r.get("kl", {}).get("mean", 0.0)
        agree = r.get("agree_diff", {}).get("mean", 0.0) * 100
        ret = []
        for n in contexts:
            e = r["retrieval"][n]
            hits = f"{round(sum(e['per_prompt']))}/{len(e['per_prompt'])}"
            diff = e.get("diff_vs_bf16")
            ret.append(hits + (f" ({diff['mean'] * 100:+.0f})" if diff else ""))
        print(f"{r['arm']:<22} {r['stored_kib']:>7.2f} {r['read_kib']:>6.2f}  {base / r['stored_kib']:>6.2f}x "
              f"{kl:>10.2e} {agree:>+9.2f}p " + " ".join(f"{x:>15}" for x in ret))


def main(argv: Sequence[str] | None = None) -> dict:
    from loopkv.models.data import heldout_windows, load_corpus, retrieval_task
    from loopkv.models.small import SMALL_DIR, encode, load_small
    from loopkv.planning import Plan, Profile
    from loopkv.planning.simulate import FIRST_HISTORY

    args = _parse(argv)
    out = args.out or (os.path.join(tempfile.gettempdir(), "quality_smoke.json") if args.smoke
                       else str(RESULTS / "quality.json"))
    t0 = time.perf_counter()
    torch.manual_seed(SEED)
    model = load_small(device=args.device)
    cfg = model.config
    profile = Profile.from_json(SMALL_DIR / "profile.json")
    all_arms = arms(profile, cfg)
    if args.arms:
        keep = {a.strip() for a in args.arms.split(",")}
        unknown = sorted(keep - {name for name, _ in all_arms})
        if unknown:
            raise SystemExit(f"--arms: unknown {unknown}; choose from {[name for name, _ in all_arms]}")
        all_arms = [(name, plan) for name, plan in all_arms if plan is None or name in keep]
    contexts = [int(c) for c in args.contexts.split(",")]
    counts = [int(c) for c in args.prompts.split(",")]
    if len(counts) != len(contexts):
        raise SystemExit(f"--prompts needs one count per context ({len(contexts)}), got {args.prompts!r}")

    corpus = load_corpus()
    docs = list(heldout_windows(corpus, n=args.kl_docs, seq_len=args.kl_len, seed=1))
    tasks = {}
    for n, count in zip(contexts, counts, strict=True):
        tasks[n] = []
        for seed in range(count):
            prompt, answer = retrieval_task(n, 20_000 + seed, corpus=corpus)
            tasks[n].append((encode(prompt), encode(answer, bos=False)))
    with torch.no_grad():
        exact = [model(input_ids=d[None].to(model.device)).logits[0, FIRST_HISTORY:].float() for d in docs]
    per_doc = [attention_structure(model, d) for d in docs]
    structure = {f"{key}_per_loop": [sum(x[key][t] for x in per_doc) / len(per_doc)
                                     for t in range(cfg.total_ut_steps)] for key in per_doc[0]}
    structure["note"] = (f"exact model, fp32, mean over {len(docs)} docs x {args.kl_len} tokens, layers and query "
                         f"heads; sink: last {SINK_QUERIES} rows; hot (tau = {TAU:g}): last {HOT_QUERIES} rows, "
                         "history tokens only")

    result = {**run_info(__file__, argv, args.device), "args": vars(args),
              "model": {"name": "loopkv small (shipped)", "loops": cfg.total_ut_steps,
                        "layers": cfg.num_hidden_layers, "kv_heads": cfg.num_key_value_heads,
                        "head_dim": cfg.head_dim, "dtype": "float32"},
              "tau": TAU, "bootstrap_resamples": args.boot,
              "counts": {"kl_docs": len(docs), "kl_len": args.kl_len, "kl_positions_from": FIRST_HISTORY,
                         "retrieval_prompts": {str(n): c for n, c in zip(contexts, counts, strict=True)},
                         "retrieval_seeds": "20000 + i", "heldout_seed": 1},
              "structure": structure, "arms": [], "seconds_per_arm": {}}
    base_ret: dict = {}
    bf16 = Plan.uniform(loops=cfg.total_ut_steps, layers=cfg.num_hidden_layers, option="bf16")
    for name, plan in all_arms:
        ta = time.perf_counter()
        b = (plan or bf16).bytes_per_token(cfg)
        row = {"arm": name, "stored_kib": b.stored_kib, "read_kib": b.read_kib,
               **run_arm(model, plan, docs, exact, tasks, base_ret, boot=args.boot)}
        result["arms"].append(row)
        result["seconds_per_arm"][name] = round(time.perf_counter() - ta, 1)
        print(f"{name}: {result['seconds_per_arm'][name]:.0f} s", flush=True)
    result["total_seconds"] = round(time.perf_counter() - t0, 1)
    write_json(out, result)
    print("wrote", out)
    print_table(result)
    return result


if __name__ == "__main__":
    main()
