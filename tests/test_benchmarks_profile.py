"""``benchmarks/bench_profile.py --smoke`` end to end on the CPU: the JSON a reviewer reads has every field, and its
extrapolation is the cost model applied to the sampled batches."""

import datetime
import importlib
import json
import pathlib
import sys

import pytest

BENCHMARKS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"


def test_bench_profile_smoke(tmp_path, capsys):
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    bench = importlib.import_module("bench_profile")
    out = tmp_path / "profile.json"
    bench.main(["--smoke", "--out", str(out)])
    result = json.loads(out.read_text())
    assert result["benchmark"] == "bench_profile"
    assert result["command"] == f"python benchmarks/bench_profile.py --smoke --out {out}"
    assert {"torch", "transformers", "loopkv"} <= set(result["versions"])
    datetime.datetime.fromisoformat(result["date"])
    # the tiny model: 3 loops x 2 layers -> 4 cells x 3 options + 2 final cells x 2 options + KL_share
    assert result["profile"]["evaluations"] == 4 * 3 + 2 * 2 + 1
    assert list(result["arms"]) == ["tf32", "fp32", "fp32-rows"]
    for arm in result["arms"].values():
        assert arm["how"] == "extrapolated"
        rows = arm["sampled"]
        assert rows
        per_unit = sum(r["seconds_per_doc"] for r in rows) / sum(r["units"] for r in rows)
        assert arm["seconds_per_unit_per_doc"] == pytest.approx(per_unit)
        full = result["profile"]["documents"] * (per_unit * arm["units_per_doc"] + arm["reference_seconds_per_doc"])
        assert arm["full_profile_minutes"] == pytest.approx(full / 60)
        assert arm["minutes_per_evaluation"] == pytest.approx(full / 60 / result["profile"]["evaluations"])
    assert result["arms"]["fp32-rows"]["units_per_doc"] >= result["arms"]["fp32"]["units_per_doc"]
    check = result["tf32_check"]
    assert len(check["ouro_shape"]["jobs"]) == 2
    assert check["small_model"]["damages"] == 16
    assert result["summary"]["evaluations_per_profile"] == 17
    assert "min/profile" in capsys.readouterr().out


def test_profile_batches_and_cost_model_at_ouro_shape():
    """The batches the H200 run extrapolates over: Ouro-1.4B's 265 evaluations in 34 batches of 8; the exact
    prefix run once makes a batch of the final loop's cells cost little more than one row."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    bench = importlib.import_module("bench_profile")
    from loopkv.planning.profiler import _Runner

    batches = bench.profile_batches(bench.ouro_config(False), 8)
    assert sum(len(b) for b in batches) == 72 * 3 + 24 * 2 + 1
    assert len(batches) == 34
    run = _Runner(None, [], loops=4, layers=24, tau=float("inf"), share_source="int4", share_passes=2,
                  prefill_len=320, first=320)
    last_plain = batches[23]  # int4/int2 of final-loop cells 92..95
    assert [run.first_cell(j) for j in last_plain][0] == 92
    assert bench.cost_units(run, last_plain, share_prefix=True) == pytest.approx(92 / 96 + 8 * 4 / 96)
    assert bench.cost_units(run, last_plain, share_prefix=False) == 8
    assert bench.cost_units(run, batches[24], share_prefix=False) == 16  # share jobs: two passes
    assert bench.sample(batches, 4) == [0, 23, 24, 33]
