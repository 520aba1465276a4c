"""bench_serving's rate ladder and goodput rule (benchmarks/bench_serving.py), on rows made up for an arm whose
attainment falls below 95% above a known rate: wherever the ladder starts, it brackets that rate and the goodput is it.
"""

import importlib.util
import pathlib

import pytest

PATH = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "bench_serving.py"
RATES = [0.125, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_serving", PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _arm(capacity):
    def run(rate):
        return {"arm": "a", "rate": rate, "complete": True, "attainment": 1.0 if rate <= capacity else 0.5}
    return run


@pytest.mark.parametrize("capacity", [0.5, 2.0])
@pytest.mark.parametrize("first", range(len(RATES)))
def test_the_ladder_brackets_the_goodput_from_any_start(bench, capacity, first):
    rows = bench.ladder(RATES, first, _arm(capacity))
    assert bench.capacity(rows) == (capacity, "measured")
    tested = [r["rate"] for r in rows]
    assert len(set(tested)) == len(tested)  # no rate twice
    assert {capacity, RATES[RATES.index(capacity) + 1]} <= set(tested)


def test_censored_ladders_say_so(bench):
    assert bench.capacity(bench.ladder(RATES, 2, _arm(100.0))) == (8.0, "at least")
    assert bench.capacity(bench.ladder(RATES, 3, _arm(0.01))) == (0.0, "below lowest")
    cut = [{"rate": 0.5, "complete": True, "attainment": 1.0}, {"rate": 1.0, "complete": False, "attainment": 0.0}]
    assert bench.capacity(cut) == (0.5, "at least")  # an incomplete rate counts for nothing


def test_the_first_rate_is_half_what_the_peak_speeds_could_finish(bench):
    # 100-token prompts at 1000 tok/s and 100-token outputs at 400 tok/s: 0.35 s a request, 2.86 req/s; half is 1.43
    peak = {"prompt_tokens_per_s": 1000.0, "tokens_per_s": 400.0}
    assert RATES[bench.first_rate(RATES, peak, 100.0, 100.0, "auto")] == 1.0
    assert bench.first_rate(RATES, peak, 100.0, 100.0, "lowest") == 0
    assert bench.first_rate(RATES, {"prompt_tokens_per_s": 1.0, "tokens_per_s": 1.0}, 100.0, 100.0, "auto") == 0
    assert bench.first_rate(RATES, {"prompt_tokens_per_s": 1.0, "tokens_per_s": None}, 1.0, 1.0, "auto") == 0
