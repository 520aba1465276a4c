"""loopkv.serving.goodput: the rate search, the goodput rule and the step timing, on rows made up for an arm whose
attainment falls below 95% above a known rate, and on a made-up step log; the SLO of one request; the trace; the
attainment of vLLM's per-request records against the token times they were made from."""

import itertools
import math
import random

import pytest

from loopkv.serving.goodput import (
    capacity,
    decode_steps,
    first_rate,
    meets_slo,
    search,
    trace,
    vllm_bench_attainment,
)


def _arm(limit):
    def run(rate):
        return {"arm": "a", "rate": rate, "complete": True, "attainment": 1.0 if rate <= limit else 0.5}
    return run


@pytest.mark.parametrize("limit", [0.07, 0.5, 1.3, 9.0])
@pytest.mark.parametrize("start", [0.02, 0.4, 1.0, 3.0, 50.0])
def test_the_search_brackets_the_goodput_from_any_start(limit, start):
    """Enough trials: the goodput found meets 95%, and the lowest rate tested above it misses, within the bracket."""
    rows = search(start, _arm(limit), max_trials=30, bracket=1.5)
    goodput, status = capacity(rows)
    assert status == "measured"
    assert goodput <= limit
    above = min(r["rate"] for r in rows if r["rate"] > goodput)
    assert above > limit
    assert above / goodput <= 1.5
    tested = [r["rate"] for r in rows]
    assert len(set(tested)) == len(tested)  # no rate twice
    # doubling or halving to the bracket, then bisecting: about log2(distance) + log2(log2(2) / log2(1.5)) trials
    assert len(rows) <= abs(math.log2(start / limit)) + 4


def test_the_search_stops_at_its_trials_and_at_an_incomplete_rate():
    assert len(search(1.0, _arm(100.0), max_trials=3, bracket=1.5)) == 3
    rows = search(1.0, _arm(100.0), max_trials=3, bracket=1.5)
    assert capacity(rows) == (4.0, "at least")
    assert capacity(search(1.0, _arm(0.01), max_trials=3, bracket=1.5)) == (0.0, "below lowest")

    def cut(rate):
        return {"rate": rate, "complete": rate < 2.0, "attainment": 1.0}
    rows = search(1.0, cut, max_trials=10, bracket=1.5)
    assert [r["rate"] for r in rows] == [1.0, 2.0]
    assert capacity(rows) == (1.0, "at least")  # an incomplete rate counts for nothing


def test_noise_above_a_miss_does_not_count():
    rows = [{"rate": 1.0, "complete": True, "attainment": 0.5}, {"rate": 2.0, "complete": True, "attainment": 1.0}]
    assert capacity(rows) == (0.0, "below lowest")
    nxt = search(1.0, lambda r: rows.pop(0) if rows else _arm(0.6)(r), max_trials=3, bracket=1.5)
    assert nxt[-1]["rate"] == 0.5  # below the lowest rate missed


def test_the_first_rate_is_most_of_the_lower_of_the_prompts_and_the_slots_capacity():
    # capacity of the prompts: 1 / (a mean prompt's first token alone); of the slots: 8 slots each decoding a
    # 100-token output at the peak's step (40 ms: 2 req/s, 80 ms: 1 req/s, 20 ms: 4 req/s); 70% of the lower
    assert first_rate(0.5, {"batch": 8, "step_s": 0.04}, 100.0, floor=0.01) == pytest.approx(0.7 * 2.0)
    assert first_rate(0.25, {"batch": 8, "step_s": 0.08}, 100.0, floor=0.01) == pytest.approx(0.7 * 1.0)
    assert first_rate(0.1, {"batch": 8, "step_s": 0.02}, 100.0, floor=0.01) == pytest.approx(0.7 * 4.0)
    assert first_rate(100.0, {"batch": 1, "step_s": 1.0}, 100.0, floor=0.01) == 0.01
    assert first_rate(0.1, {"batch": 1, "step_s": None}, 1.0, floor=0.5) == 0.5


def test_decode_steps_are_timed_apart_from_prompt_steps():
    """(start, decoding rows, prompt tokens): prompt and mixed steps are left out, a decode-only step with fewer rows
    too, and each step lasts until the next begins; prompt tokens/s runs until the first decode-only step."""
    log = [(0.0, 0, 0), (10.0, 0, 300), (10.5, 1, 200), (11.5, 2, 0), (11.7, 2, 0), (12.0, 2, 64), (13.0, 2, 0),
           (13.1, 1, 0), (13.4, 1, 0)]
    durations, prompt_rate = decode_steps(log, since=10.0, batch=2)
    assert durations == pytest.approx([0.2, 0.3, 0.1])
    assert prompt_rate == pytest.approx(500 / 1.5)
    assert decode_steps(log, since=13.05, batch=1) == (pytest.approx([0.3]), None)


def test_the_trace_draws_prompts_and_outputs_in_their_ranges():
    default = trace(200, 16384, 0, (128, 512))
    assert all(8192 <= p <= 16384 - 512 and 128 <= n <= 512 for _, p, n in default)
    assert [a for a, _, _ in default] == sorted(a for a, _, _ in default)  # arrivals in order
    assert trace(200, 16384, 0, (128, 512)) == default  # seeded: the same requests at every rate
    short = trace(200, 16384, 0, (1024, 4096), (100, 300))
    assert all(100 <= p <= 300 and 1024 <= n <= 4096 for _, p, n in short)
    with pytest.raises(ValueError, match="fits max_len=16384"):
        trace(4, 16384, 0, (1024, 4096), (100, 13000))


def test_a_request_meets_the_slo_when_both_latencies_are_within_their_bounds():
    slo = {"ttft_slo_s": 10.0, "tpot_slo_s": 0.3}
    assert meets_slo(10.0, 0.3, **slo)  # at the bound: met
    assert not meets_slo(10.01, 0.1, **slo)
    assert not meets_slo(1.0, 0.31, **slo)
    assert not meets_slo(math.inf, math.inf, **slo)  # never finished


def _vllm_records(seed: int, n: int) -> tuple[dict, list[dict]]:
    """``vllm bench serve``'s per-request lists for ``n`` made-up requests, and the requests as token times."""
    rng = random.Random(seed)
    requests = []
    for _ in range(n):
        start = rng.uniform(0, 100)
        tokens = rng.choice([0, 1, 2, rng.randint(3, 400)])
        times = [start + rng.uniform(0.1, 14)]
        for _ in range(tokens - 1):
            times.append(times[-1] + rng.expovariate(1 / 0.02) + (rng.random() < 0.02) * rng.uniform(0, 3))
        requests.append({"start": start, "times": times if tokens else [], "error": "" if tokens and
                         rng.random() > 0.1 else "boom"})
    result = {"ttfts": [], "itls": [], "output_lens": [], "errors": []}
    for r in requests:
        t = r["times"]
        result["ttfts"].append(t[0] - r["start"] if t else 0.0)
        result["itls"].append([b - a for a, b in itertools.pairwise(t)])
        result["output_lens"].append(len(t))
        result["errors"].append(r["error"])
    return result, requests


@pytest.mark.parametrize("seed", range(5))
def test_vllm_records_are_scored_as_the_token_times_they_come_from(seed):
    result, requests = _vllm_records(seed, 300)
    for ttft_slo, tpot_slo in [(10.0, 0.03), (5.0, 0.025), (14.0, 1.0)]:
        # by hand: from each request's first and last token times (vLLM's TPOT: (latency - ttft) / (tokens - 1))
        met = 0
        for r in requests:
            t = r["times"]
            if r["error"] or not t:
                continue
            tpot = (t[-1] - t[0]) / (len(t) - 1) if len(t) > 1 else 0.0
            met += t[0] - r["start"] <= ttft_slo and tpot <= tpot_slo
        got = vllm_bench_attainment(result, ttft_slo_s=ttft_slo, tpot_slo_s=tpot_slo)
        assert got["requests"] == len(requests)
        assert got["met"] == met
        assert got["attainment"] == met / len(requests)
    assert 0 < vllm_bench_attainment(result, ttft_slo_s=10.0, tpot_slo_s=0.03)["met"] < len(requests)


def test_vllm_records_without_details_are_refused():
    with pytest.raises(ValueError, match="--save-detailed"):
        vllm_bench_attainment({"ttfts": [1.0], "output_lens": [3]}, ttft_slo_s=10, tpot_slo_s=1)
