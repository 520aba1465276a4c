"""Goodput under a latency SLO, for measuring a serving setup: a seeded Poisson trace of requests, the timing of
decode-only steps from an engine's step log, and the search over arrival rates for the highest rate whose requests
meet the SLO (docs/design.md, "Serving"). A request meets the SLO when its time to first token and its mean time per
output token are within their bounds (:func:`meets_slo`); a rate is met when at least :data:`ATTAINMENT` of its
requests do. ``benchmarks/bench_serving.py`` runs these on transformers' engine with LoopKV storage.

A rate's row, as :func:`search` and :func:`capacity` read it: ``{"rate": requests/s, "complete": bool (False when
its measurement was cut short: it counts for nothing), "attainment": the share of its requests meeting the SLO}``.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterable

ATTAINMENT = 0.95  # the share of a rate's requests that must meet the SLO for the rate to count as met


def meets_slo(ttft_s: float, tpot_s: float, *, ttft_slo_s: float, tpot_slo_s: float) -> bool:
    """Whether one request meets the SLO: time to first token within ``ttft_slo_s`` and mean time per output token
    within ``tpot_slo_s`` (both in seconds; a request that never finished has ``inf`` for both)."""
    return ttft_s <= ttft_slo_s and tpot_s <= tpot_slo_s


def vllm_bench_requests(result: dict) -> list[tuple[bool, float, float]]:
    """Per request of one run of vLLM's ``vllm bench serve --save-detailed`` (its result JSON as a dict, whose lists
    ``ttfts``, ``itls``, ``output_lens`` and ``errors`` are read): whether it succeeded (no error, at least one
    token), its time to first token and its mean time per output token, the sum of its inter-token latencies over
    its tokens after the first (vLLM's TPOT; 0 for a request of one token, ``inf`` for one that failed)."""
    fields = ("ttfts", "itls", "output_lens", "errors")
    missing = [f for f in fields if f not in result]
    if missing:
        raise ValueError(f"the vllm bench serve result lacks {missing}: run it with --save-detailed")
    out = []
    for ttft, itls, tokens, error in zip(*(result[f] for f in fields), strict=True):
        ok = not error and tokens >= 1
        tpot = (sum(itls) / (tokens - 1) if tokens > 1 else 0.0) if ok else math.inf
        out.append((ok, ttft if ok else math.inf, tpot))
    return out


def vllm_bench_attainment(result: dict, *, ttft_slo_s: float, tpot_slo_s: float) -> dict:
    """The SLO attainment of one run of ``vllm bench serve --save-detailed``: the share of its requests
    (:func:`vllm_bench_requests`) that succeeded and meet the SLO (:func:`meets_slo`). Returns ``{"requests",
    "met", "attainment"}``."""
    rows = vllm_bench_requests(result)
    met = sum(ok and meets_slo(ttft, tpot, ttft_slo_s=ttft_slo_s, tpot_slo_s=tpot_slo_s) for ok, ttft, tpot in rows)
    return {"requests": len(rows), "met": met, "attainment": met / len(rows) if rows else 0.0}


def trace(n: int, max_len: int, seed: int, outputs: tuple[int, int],
          prompts: tuple[int, int] | None = None) -> list[tuple[float, int, int]]:
    """(arrival s at 1 request/s, prompt tokens, output tokens) per request; the same requests at every rate: prompts
    uniform in ``prompts`` (default [max_len / 2, max_len - the longest output]), outputs uniform in ``outputs``."""
    lo_out, hi_out = outputs
    lo_in, hi_in = prompts or (max_len // 2, max_len - hi_out)
    if not 1 <= lo_in <= hi_in or hi_in + hi_out > max_len or not 1 <= lo_out <= hi_out:
        raise ValueError(f"prompts {lo_in}..{hi_in} and outputs {lo_out}..{hi_out} tokens must be ranges of at least "
                         f"1 whose longest request fits max_len={max_len}")
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(1.0)
        new = rng.randint(lo_out, hi_out)
        out.append((t, rng.randint(lo_in, hi_in), new))
    return out


def peak_batch(slots: int, pool_pages: int, prompt: int, steps: int, margin: float) -> int:
    """The most requests of ``prompt`` tokens, sent at once, that transformers' engine with a LoopKV engine cache
    holds decoding together for ``steps`` steps: at most ``slots``; their blocks (``engine_cache.blocks_for``) within
    the pool of ``pool_pages``; and each prompt admitted by the engine's scheduler, which takes a new prompt beside
    decoding requests only while at least ``margin`` of the pool is free (its ``safety_margin``: 0.15 for the FIFO
    scheduler unless the engine's config sets it). The first admitted request decodes one token in each later
    request's prompt step, so each is counted at ``prompt + batch + steps`` tokens. More requests than this would
    either preempt and prefill again (past the pool) or leave the last prompt waiting until another finishes (past
    the margin). Exact when each step takes one prompt (prompts longer than half the step's budget, as at 16K): the
    5.17 engine checks the margin before each prompt it admits, the 5.24 engine once per step, so shorter prompts
    admitted together in one step can pass it there."""
    from loopkv.serving.engine_cache import blocks_for

    batch = slots
    while batch > 1:
        per = blocks_for(prompt + batch + steps)
        if batch * per <= pool_pages and pool_pages - (batch - 1) * per >= margin * pool_pages:
            break
        batch -= 1
    return batch


def decode_steps(steps: Iterable[tuple[float, int, int]], since: float, batch: int) -> tuple[list[float], float | None]:
    """From a step log (``EngineCache.steps``: start, decoding rows, prompt tokens), the steps begun after ``since``:
    the durations of the decode-only steps with ``batch`` rows decoding (each until the next step began), and the
    prompt tokens per second until the first decode-only step (None if there is none, or no prompt before it)."""
    steps = [s for s in list(steps) if s[0] >= since]  # list(): one C call, so the engine's thread cannot append midway
    durations = [b[0] - a[0] for a, b in zip(steps, steps[1:], strict=False) if a[2] == 0 and a[1] == batch]
    first = next((s[0] for s in steps if s[2] == 0 and s[1]), None)
    prompt = sum(s[2] for s in steps if first is not None and s[0] < first)
    return durations, (prompt / (first - since) if first is not None and prompt else None)


def capacity(rows: list[dict]) -> tuple[float, str]:
    """An arm's goodput from its complete rows: the highest rate meeting 95% below the lowest rate missing it, and
    whether that is bracketed (``measured``: a tested rate above it missed), ``at least`` (no tested rate missed) or
    ``below lowest`` (the lowest tested rate missed: 0)."""
    rows = [r for r in rows if r["complete"]]
    failed = [r["rate"] for r in rows if r["attainment"] < ATTAINMENT]
    ceiling = min(failed, default=math.inf)
    met = [r["rate"] for r in rows if r["attainment"] >= ATTAINMENT and r["rate"] < ceiling]
    if not met:
        return 0.0, "below lowest" if failed else "no complete rate"
    return max(met), "measured" if failed else "at least"


def search(start: float, run: Callable[[float], dict], *, max_trials: int, bracket: float,
           factor: float = 2.0) -> list[dict]:
    """Rates from ``start`` (``run(rate) -> row``): times ``factor`` while every rate tested met 95%, divided by it
    while every one missed, then the geometric mean of the highest rate met and the lowest missed, until those are
    within ``bracket`` of each other, ``max_trials`` rows are run, or a row is incomplete (its time ran out)."""
    rows, rate = [], start
    while len(rows) < max_trials:
        rows.append(run(rate))
        if not rows[-1]["complete"]:
            break
        done = [r for r in rows if r["complete"]]
        met = [r["rate"] for r in done if r["attainment"] >= ATTAINMENT]
        missed = [r["rate"] for r in done if r["attainment"] < ATTAINMENT]
        if not missed:
            rate = max(met) * factor
        elif not met or min(met) >= min(missed):  # every rate met is above one missed: go below the lowest missed
            rate = min(missed) / factor
        else:
            lo, hi = max(m for m in met if m < min(missed)), min(missed)
            if hi / lo <= bracket:
                break
            rate = math.sqrt(lo * hi)
    return rows


def first_rate(probe_s: float, peak: dict, mean_new: float, floor: float) -> float:
    """The search's first rate: 70% of the lower of two capacities, the prompts' (one mean prompt alone takes
    ``probe_s`` to its first token: 1 / probe_s) and the slots' (every slot decoding a mean output at the peak's step:
    slots / (mean_new x step)); queueing, longer contexts and the SLO make the real capacity lower. At least
    ``floor``."""
    if not peak.get("step_s"):
        return floor
    return max(floor, 0.7 * min(1 / probe_s, peak["batch"] / (mean_new * peak["step_s"])))
