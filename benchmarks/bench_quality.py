"""Quality benchmark (issue 4, part 3): the paper's arms on the small looped model loopkv ships.

Per arm, by the dense simulation of the served cache (``loopkv.planning.simulate``, reused through the
helpers in :mod:`loopkv.demo`):

* fp32 KL against the exact model per held-out document (positions >= 320), mean with a 95% bootstrap CI;
* next-token agreement with the exact model per document, paired difference arm - BF16 with a CI;
* retrieval exact match on fresh synthetic prompts per context length, paired difference arm - BF16;
* stored / read KiB per history token (``plan.bytes_per_token``).

Attention structure of the exact model (fp32 recomputation from each attention module's inputs): the
mass on the first 32 tokens per loop (``loopkv.models.train_small.attention_mass``) and the fraction of
history tokens that are hot at tau = 14 (score >= m_ref - 14 ln 2, m_ref = max(sink max, page max),
DESIGN.md §7) per loop.

Run: ``PYTHONPATH=. python benchmarks/bench_quality.py`` (CPU, ~15 min on 2 cores with the defaults).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import pathlib
import platform
import time
from collections.abc import Sequence

import torch

TAU = 14.0
SEED = 0
RESULTS = pathlib.Path(__file__).resolve().parent / "results"


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--kl-docs", type=int, default=6, help="held-out documents for KL and agreement")
    p.add_argument("--kl-len", type=int, default=1024, help="tokens per KL document")
    p.add_argument("--contexts", default="2048,4096", help="retrieval context lengths, comma-separated")
    p.add_argument("--prompts", default="10,6", help="retrieval prompts per context, comma-separated")
    p.add_argument("--boot", type=int, default=5000, help="bootstrap resamples")
    p.add_argument("--share-passes", type=int, default=2,
                   help="simulation passes for plans with share cells (2 = loopkv.demo's setting)")
    p.add_argument("--arms", default="", help="comma-separated arm names to run (default all)")
    p.add_argument("--out", default=str(RESULTS / f"quality_{datetime.date.today().isoformat()}.json"))
    return p.parse_args(argv)


def arms(profile, config) -> list:
    """The benchmark's arms: the demo's five plus naive INT2, naive last-loop reuse, INT4 + loop T-2 sharing."""
    from loopkv.demo import Arm
    from loopkv.planning import Plan
    from loopkv.planning.knapsack import solve_preset

    t, n = config.total_ut_steps, config.num_hidden_layers
    return [
        Arm("BF16 (exact)", None),
        Arm("KIVI-4", Plan.uniform(loops=t, layers=n, option="int4")),
        Arm("KIVI-4 + V", Plan.uniform(loops=t, layers=n, option="int4", tau=TAU)),
        Arm("LoopKV-R", solve_preset(profile, "r", tau=TAU)),
        Arm("LoopKV-M", solve_preset(profile, "m", tau=TAU)),
        Arm("naive INT2", Plan.from_loops(loops=t, layers=n, per_loop=["int2"] * (t - 1) + ["int4"])),
        Arm("naive last-loop reuse", Plan.from_loops(loops=t, layers=n, per_loop=["share"] * (t - 1) + ["int4"])),
        Arm(f"INT4 + loop-{t - 2} share", Plan.share_loop(loops=t, layers=n, option="int4")),
    ]


def bootstrap(values: Sequence[float], *, boot: int, seed: int = SEED) -> dict:
    """Mean of ``values`` with a percentile 95% bootstrap interval (items resampled with replacement)."""
    x = torch.tensor(list(values), dtype=torch.float64)
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, len(x), (boot, len(x)), generator=g)
    means = x[idx].mean(1)
    lo, hi = torch.quantile(means, torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist()
    return {"mean": float(x.mean()), "ci95": [lo, hi], "n": len(x),
            "significant": bool(lo > 0 or hi < 0)}


def _n_pages(length: torch.Tensor) -> torch.Tensor:
    """History pages that have left the window at sequence length ``length`` (page p from 320 + 32 p on)."""
    from loopkv.ops.codec import PAGE, SINK, WINDOW

    return torch.clamp(torch.div(length - SINK - WINDOW, PAGE, rounding_mode="floor") + 1, min=0)


@torch.no_grad()
def hot_fraction(model, ids: torch.Tensor, *, queries: int = 256, tau: float = TAU) -> list[float]:
    """Per loop (mean over layers, heads, the last ``queries`` rows), the fraction of history tokens whose
    exact fp32 score is >= max(sink max, own page max) - tau ln 2 (DESIGN.md §7). ``ids [S]``."""
    from loopkv.models.train_small import _rope
    from loopkv.ops.codec import PAGE, SINK

    cfg = model.config
    n_layers, loops = cfg.num_hidden_layers, cfg.total_ut_steps
    ids = ids.reshape(1, -1).to(model.device)
    s = ids.shape[1]
    qpos = torch.arange(s - queries, s, device=model.device)
    n_hist = PAGE * _n_pages(qpos + 1)  # [Q] history tokens per row
    if int(n_hist.min()) <= 0:
        raise ValueError(f"ids must be long enough that every query row has history; got {s} tokens")
    cells: dict[int, float] = {}

    def hook(module, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        b = hidden.shape[0]
        cos, sin = (x.float() for x in kwargs["position_embeddings"])
        q = module.q_proj(hidden).view(b, s, -1, module.head_dim).transpose(1, 2).float()
        k = module.k_proj(hidden).view(b, s, -1, module.head_dim).transpose(1, 2).float()
        q, k = _rope(q[:, :, s - queries:], cos[:, s - queries:], sin[:, s - queries:]), _rope(k, cos, sin)
        k = k.repeat_interleave(module.num_key_value_groups, dim=1)
        scores = (q @ k.transpose(2, 3) * module.scaling)[0]  # [Hq, Q, S]
        sink_max = scores[..., :SINK].amax(-1, keepdim=True)  # [Hq, Q, 1]
        hist_end = SINK + int(n_hist.max())
        pages = scores[..., SINK:hist_end].unflatten(-1, (-1, PAGE))  # [Hq, Q, P, PAGE]
        m_ref = torch.maximum(pages.amax(-1, keepdim=True), sink_max[..., None])
        hot = (pages >= m_ref - tau * math.log(2)).flatten(-2)  # [Hq, Q, Hist]
        valid = torch.arange(hist_end - SINK, device=hot.device)[None, :] < n_hist[:, None]  # [Q, Hist]
        cells[int(kwargs["cell_index"])] = float(((hot & valid).sum(-1) / n_hist).mean())

    handles = [layer.self_attn.register_forward_pre_hook(hook, with_kwargs=True) for layer in model.model.layers]
    try:
        model(input_ids=ids, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return [sum(cells[t * n_layers + j] for j in range(n_layers)) / n_layers for t in range(loops)]


def _simulate(model, plan, ids, *, prefill_len: int, logits_from: int, share_passes: int) -> torch.Tensor:
    """loopkv.demo's simulation ([N - logits_from, V] fp32 logits), with ``share_passes`` for share plans."""
    from loopkv import demo
    from loopkv.planning.simulate import simulate_plan

    if plan is None or share_passes == 2 or "share" not in plan.options:
        return demo._simulate(model, plan, ids, prefill_len=prefill_len, logits_from=logits_from)
    with torch.no_grad():
        return simulate_plan(model, plan, ids, prefill_len=prefill_len, logits_from=logits_from,
                             share_passes=share_passes).float()


def _per_doc(model, arm, docs, exact, *, share_passes: int) -> tuple[list[float], list[float]]:
    from loopkv.demo import kl_and_agreement
    from loopkv.planning.simulate import FIRST_HISTORY

    kls, agree = [], []
    for doc, ref in zip(docs, exact, strict=True):
        got = _simulate(model, arm.plan, doc, prefill_len=FIRST_HISTORY, logits_from=FIRST_HISTORY,
                        share_passes=share_passes)
        kl, ok = kl_and_agreement(ref, got)
        kls.append(kl)
        agree.append(ok)
    return kls, agree


def _per_prompt(model, arm, items, *, share_passes: int) -> list[float]:
    hits = []
    for prompt, answer in items:
        ids = torch.cat([prompt, answer])
        logits = _simulate(model, arm.plan, ids, prefill_len=len(prompt), logits_from=len(prompt) - 1,
                           share_passes=share_passes)
        hits.append(float(torch.equal(logits[: len(answer)].argmax(-1).cpu(), answer)))
    return hits


def main(argv: Sequence[str] | None = None) -> int:
    import transformers

    from loopkv.demo import PROFILE_FILE
    from loopkv.models.data import heldout_windows, load_corpus, retrieval_task
    from loopkv.models.small import SMALL_DIR, encode, load_small
    from loopkv.models.train_small import attention_mass
    from loopkv.planning.profile_data import Profile
    from loopkv.planning.simulate import FIRST_HISTORY

    args = _parse(argv)
    t0 = time.perf_counter()
    torch.manual_seed(SEED)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    model = load_small(device=args.device)
    cfg = model.config
    profile = Profile.from_json(SMALL_DIR / PROFILE_FILE)
    all_arms = arms(profile, cfg)
    if args.arms:
        keep = {a.strip() for a in args.arms.split(",")}
        all_arms = [a for a in all_arms if a.plan is None or a.name in keep]
    contexts = [int(c) for c in args.contexts.split(",")]
    counts = [int(c) for c in args.prompts.split(",")]
    if len(counts) != len(contexts):
        raise ValueError(f"--prompts needs one count per context ({len(contexts)}), got {args.prompts!r}")

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

    # attention structure of the exact model on the KL documents
    sink = [attention_mass(model, d[None], device=torch.device(args.device), queries=128)["per_loop"]["first_32"]
            for d in docs]
    hot = [hot_fraction(model, d, queries=min(256, args.kl_len - FIRST_HISTORY)) for d in docs]
    structure = {
        "sink_mass_first_32_per_loop": [sum(x[t] for x in sink) / len(sink) for t in range(cfg.total_ut_steps)],
        "hot_fraction_tau14_per_loop": [sum(x[t] for x in hot) / len(hot) for t in range(cfg.total_ut_steps)],
        "note": f"exact model, fp32, mean over {len(docs)} docs x {args.kl_len} tokens, layers and heads; sink: "
                "last 128 query rows; hot: last 256 query rows, history tokens only",
    }
    print("structure", json.dumps(structure, indent=1), flush=True)

    results, base_ret, timings = [], {}, {}
    for arm in all_arms:
        ta = time.perf_counter()
        b = arm.plan.bytes_per_token(cfg) if arm.plan is not None else None
        row = {"arm": arm.name, "plan_grid": arm.plan.grid() if arm.plan is not None else None,
               "stored_kib": b.stored_kib if b else None, "read_kib": b.read_kib if b else None}
        if arm.plan is None:
            from loopkv.planning import Plan

            b = Plan.uniform(loops=cfg.total_ut_steps, layers=cfg.num_hidden_layers,
                             option="bf16").bytes_per_token(cfg)
            row.update(stored_kib=b.stored_kib, read_kib=b.read_kib, kl_per_doc=[0.0] * len(docs),
                       agree_per_doc=[1.0] * len(docs))
        else:
            kls, agree = _per_doc(model, arm, docs, exact, share_passes=args.share_passes)
            row.update(kl_per_doc=kls, agree_per_doc=agree, kl=bootstrap(kls, boot=args.boot),
                       agree_diff=bootstrap([a - 1.0 for a in agree], boot=args.boot))
        row["retrieval"] = {}
        for n, items in tasks.items():
            hits = _per_prompt(model, arm, items, share_passes=args.share_passes)
            entry = {"per_prompt": hits, "exact_match": sum(hits) / len(hits)}
            if arm.plan is None:
                base_ret[n] = hits
            else:
                entry["diff_vs_bf16"] = bootstrap([h - g for h, g in zip(hits, base_ret[n], strict=True)],
                                                  boot=args.boot)
            row["retrieval"][str(n)] = entry
        timings[arm.name] = time.perf_counter() - ta
        results.append(row)
        print(f"{arm.name}: {timings[arm.name]:.0f} s  stored {row['stored_kib']:.2f} read {row['read_kib']:.2f} "
              f"KL {sum(row['kl_per_doc']) / len(docs):.3e} agree {sum(row['agree_per_doc']) / len(docs):.3f} "
              + " ".join(f"ret@{n} {e['exact_match']:.2f}" for n, e in row["retrieval"].items()), flush=True)

    out = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": args.device, "cpu": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(), "torch": torch.__version__, "transformers": transformers.__version__,
        "model": {"loops": cfg.total_ut_steps, "layers": cfg.num_hidden_layers,
                  "kv_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim},
        "tau": TAU, "bootstrap_resamples": args.boot,
        "counts": {"kl_docs": len(docs), "kl_len": args.kl_len, "kl_positions_from": FIRST_HISTORY,
                   "retrieval_prompts": {str(n): c for n, c in zip(contexts, counts, strict=True)},
                   "retrieval_seeds": "20000 + i", "heldout_seed": 1},
        "share_passes": args.share_passes,
        "structure": structure, "arms": results, "seconds_per_arm": timings,
        "total_seconds": time.perf_counter() - t0,
    }
    path = pathlib.Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {path} ({out['total_seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
