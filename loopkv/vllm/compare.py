"""Checking a vLLM deployment of loopkv against transformers with ``LoopKVCache`` (docs/vllm.md, "Checks on the
GPU"): where two runs' greedy tokens part (:func:`compare_tokens`), how far their top-K logprobs are apart where their
contexts are still the same (:func:`topk_kl`, :func:`compare_logprobs`), the served-KL check with its bound
(:func:`served_kl_check`) and a graph arm against its eager twin (:func:`graph_eager_check`); :func:`greedy_topk`
produces the reference side through transformers.

A run, in the format vLLM's top-K logprobs come in: ``{"tokens": [[id, ...] per prompt], "logprobs": [[{id: logprob}
per generated position] per prompt]}`` (ids may be strings, as JSON keys are). Pure Python; :func:`greedy_topk`
imports torch. Importing this module imports no vLLM.
"""

from __future__ import annotations

import math
from collections.abc import Callable

# served KL <= SERVED_KL_FACTOR x (LoopKVCache's KL + the BF16 engines' KL): served_kl_check explains the bound
SERVED_KL_FACTOR = 2.0
# vLLM BF16 against transformers' dense BF16 on the same checkpoint, top-K KL mean: two exact engines differ by
# rounding alone (order 1e-3 nats and below); a checkpoint vLLM read wrong gives order 1
ENGINES_KL_MAX = 0.05


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """The first index where two token lists differ (a shorter list differs where it ends), or None if equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare_tokens(reference: list[list[int]], other: list[list[int]]) -> dict:
    """Per prompt, where ``other``'s tokens leave ``reference``'s; ``equal`` when no prompt does."""
    if len(reference) != len(other):
        raise ValueError(f"{len(reference)} reference prompts against {len(other)}")
    diverge = [first_divergence(r, o) for r, o in zip(reference, other, strict=True)]
    return {"equal": all(d is None for d in diverge), "prompts_equal": sum(d is None for d in diverge),
            "first_divergence": diverge}


def topk_kl(p: dict, q: dict) -> float | None:
    """KL(p || q) over the tokens both top-K sets hold, each renormalized over them (natural log); None if they
    share no token. ``p``, ``q``: token -> logprob (vLLM's top-K logprobs at one position)."""
    shared = [t for t in p if t in q]
    if not shared:
        return None
    lp = [p[t] for t in shared]
    lq = [q[t] for t in shared]
    zp = math.log(sum(math.exp(x) for x in lp))
    zq = math.log(sum(math.exp(x) for x in lq))
    return sum(math.exp(a - zp) * ((a - zp) - (b - zq)) for a, b in zip(lp, lq, strict=True))


def compare_logprobs(ref_tokens: list[list[int]], ref_lp: list[list[dict]], other_lp: list[list[dict]],
                     divergences: list[int | None]) -> dict:
    """The two arms' logprobs where their contexts are the same (each prompt's positions up to and including its
    first divergence): top-1 agreement, the top-K KL (:func:`topk_kl`) and the gap between the logprobs the two
    give the reference's greedy token. Position lists are of dicts token -> logprob (JSON keys may be strings)."""
    rows, top1, kls, gaps = [], [], [], []
    for toks, lp_r, lp_o, d in zip(ref_tokens, ref_lp, other_lp, divergences, strict=True):
        n = min(len(lp_r), len(lp_o)) if d is None else min(d + 1, len(lp_r), len(lp_o))
        for i in range(n):
            p = {int(t): float(v) for t, v in lp_r[i].items()}
            q = {int(t): float(v) for t, v in lp_o[i].items()}
            top1.append(max(p, key=p.get) == max(q, key=q.get))
            kl = topk_kl(p, q)
            if kl is not None:
                kls.append(kl)
            if toks[i] in p and toks[i] in q:
                gaps.append(abs(p[toks[i]] - q[toks[i]]))
        rows.append(n)
    mean = (lambda xs: sum(xs) / len(xs) if xs else None)
    return {"positions_per_prompt": rows, "positions": len(top1), "top1_agreement": mean(top1),
            "topk_kl_mean": mean(kls), "topk_kl_max": max(kls) if kls else None,
            "ref_token_logprob_gap_mean": mean(gaps), "ref_token_logprob_gap_max": max(gaps) if gaps else None,
            "what": "positions whose context is the same in both arms (up to each prompt's first divergence); "
                    "KL over the tokens both top-K lists hold, renormalized over them"}


def served_kl_check(arms: dict, reference: dict) -> dict:
    """The served KL of every quantized arm beside LoopKVCache's, all in :func:`compare_logprobs`' definition (top-K
    KL mean over the positions whose context is still the same in both):

    * ``engines_kl``: vLLM BF16 from transformers' dense BF16, the same checkpoint: rounding alone (kernels, order of
      operations); above ``ENGINES_KL_MAX`` vLLM did not read the checkpoint as loopkv's Ouro means it;
    * per arm, ``served_kl`` (the arm from vLLM BF16) and ``reference_kl`` (``LoopKVCache(plan)`` from the dense
      cache, transformers), their ratio, and ``bound`` = ``SERVED_KL_FACTOR x (reference_kl + engines_kl)``.

    The bound: the served arm differs from vLLM BF16 by the plan's quantization, which ``reference_kl`` measures, and
    by the rounding of loopkv's kernels against vLLM's, which is of the order of ``engines_kl`` (two BF16 engines on
    the same weights); for small logit errors the KL is about half their variance, so independent errors add their
    KLs; the factor 2 covers that the two means run over different positions (each pair diverges elsewhere) of only a
    few hundred. ``ok``: served_kl <= bound."""
    dense = reference["dense"]

    def kl(ref: dict, other: dict) -> dict:
        div = compare_tokens(ref["tokens"], other["tokens"])["first_divergence"]
        return compare_logprobs(ref["tokens"], ref["logprobs"], other["logprobs"], div)

    out = {"factor": SERVED_KL_FACTOR, "engines_kl_max": ENGINES_KL_MAX, "arms": {}}
    if "vllm" not in arms:
        return out
    engines = kl(dense, arms["vllm"])
    out["engines"] = {"kl": engines["topk_kl_mean"], "top1_agreement": engines["top1_agreement"],
                      "positions": engines["positions"],
                      "first_divergence": compare_tokens(dense["tokens"], arms["vllm"]["tokens"])["first_divergence"]}
    out["weights_agree"] = engines["topk_kl_mean"] is not None and engines["topk_kl_mean"] <= ENGINES_KL_MAX
    for label, ref in reference.get("plans", {}).items():
        if label not in arms or not arms[label].get("logprobs"):
            continue
        served, plain = kl(arms["vllm"], arms[label]), kl(dense, ref)
        s, r, e = served["topk_kl_mean"], plain["topk_kl_mean"], engines["topk_kl_mean"]
        row = {"served_kl": s, "reference_kl": r, "served_positions": served["positions"],
               "reference_positions": plain["positions"]}
        if None not in (s, r, e):
            row["ratio"] = s / r if r > 0 else None
            row["bound"] = SERVED_KL_FACTOR * (r + e)
            row["ok"] = s <= row["bound"]
        else:
            row["ok"] = None
        out["arms"][label] = row
    return out


def graph_eager_check(graph: dict, eager: dict, engines_kl: float | None) -> dict:
    """The graph arm against its eager twin (the same plan with ``--enforce-eager``): their tokens
    (:func:`compare_tokens`), their logprobs where the contexts are the same (:func:`compare_logprobs`, the eager arm
    as the reference) and ``ok``: the KL mean is at most ``engines_kl`` (:func:`served_kl_check`'s, two BF16 engines on
    the same weights), or None where either is unknown.

    Not token equality: the two arms are not the same computation bit for bit (vLLM's own layers run other kernels
    outside its graphs), so on a random checkpoint, whose top logits lie within rounding of each other, a greedy token
    can flip at a near-tie and the contexts part. A capture that replayed a stale or wrong input would differ by far
    more than two engines' rounding."""
    cmp = compare_tokens(eager["tokens"], graph["tokens"])
    lp = compare_logprobs(eager["tokens"], eager["logprobs"], graph["logprobs"], cmp["first_divergence"])
    kl = lp["topk_kl_mean"]
    return {**cmp, "logprobs": lp, "engines_kl": engines_kl,
            "ok": None if kl is None or engines_kl is None else kl <= engines_kl}


def greedy_topk(model, prompts: list[list[int]], new_cache: Callable, *, new_tokens: int, k: int) -> dict:
    """Greedy ``new_tokens`` tokens of each prompt (alone, batch 1) through transformers with the cache
    ``new_cache(capacity)`` makes, and at each generated position the top-``k`` logprobs (log-softmax over the whole
    vocabulary in float32, as vLLM's), in the arms' format: ``{"tokens": [[id]], "logprobs": [[{"id": lp}]]}``."""
    import torch

    tokens, logprobs = [], []
    for prompt in prompts:
        cache = new_cache(len(prompt) + new_tokens)
        ids = torch.tensor([prompt], device=model.device)
        row, lps = [], []
        with torch.no_grad():
            logits = model(input_ids=ids, past_key_values=cache, logits_to_keep=1).logits[0, -1]
            for i in range(new_tokens):
                top = torch.topk(torch.log_softmax(logits.float(), dim=-1), k)
                row.append(int(top.indices[0]))
                lps.append({str(t): round(v, 5) for t, v in zip(top.indices.tolist(), top.values.tolist(),
                                                               strict=True)})
                if i + 1 < new_tokens:
                    step = torch.tensor([[row[-1]]], device=model.device)
                    logits = model(input_ids=step, past_key_values=cache).logits[0, -1]
        tokens.append(row)
        logprobs.append(lps)
    return {"tokens": tokens, "logprobs": logprobs}
