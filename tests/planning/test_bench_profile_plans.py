"""``benchmarks/bench_profile.py --compare-plans``: plans solved from two profiles compared cell by cell, their KL
measured through the real cache, the verdict against the eval's noise. The GPU run (TF32) gives the numbers; these
tests check the plumbing on the CPU, where TF32 does nothing."""

from __future__ import annotations

import importlib
import json
import math
import pathlib
import sys

import numpy as np
import pytest

from loopkv.planning.knapsack import predicted_damage, solve_preset
from loopkv.planning.profile_data import Profile
from tests.planning.test_profile import LAYERS, LOOPS, tiny_documents, tiny_model

BENCHMARKS = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"
TAU = 14.0


@pytest.fixture(scope="module")
def bench():
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    return importlib.import_module("bench_profile")


def profile_with(int2: float) -> Profile:
    """Damages (nats) on the tiny model's shape: INT4 0.01, share 0.05, INT2 ``int2``; KL_share 0.1."""
    grid = np.ones((LOOPS - 1, LAYERS))
    return Profile.from_arrays(loops=LOOPS, layers=LAYERS, kv_heads=2, head_dim=32,
                               damage={"int4": 0.01 * grid, "int2": int2 * grid, "share": 0.05 * grid},
                               final={"int4": [0.001] * LAYERS, "int2": [0.5] * LAYERS}, kl_share=0.1)


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def test_differing_plans_are_listed_cell_by_cell_and_measured(bench, model):
    # cheap INT2 in one profile, unaffordable INT2 in the other: R and M differ, and so does every ladder budget
    a, b = profile_with(0.02), profile_with(10.0)
    docs = tiny_documents(2, 330, seed=5)
    rows = bench.compare_plans(model, a, b, docs, ladder=(1.0,), tau=TAU, positions=2, deadline=-math.inf)
    by = {r["budget"]: r for r in rows}
    assert list(by) == ["R", "M", "1 KL_share", "1 KL_share, stored <= 0.65"]
    for name in ("R", "M"):
        pa, pb = solve_preset(a, name.lower(), tau=TAU), solve_preset(b, name.lower(), tau=TAU)
        row = by[name]
        expected = [i for i in range(LOOPS * LAYERS) if pa.options[i] != pb.options[i]]
        assert expected  # the profiles were made to disagree
        assert row["cells_differ"] == len(expected)
        assert [d["cell"] for d in row["differences"]] == [[i // LAYERS, i % LAYERS] for i in expected]
        assert [(d["fp32"], d["tf32"]) for d in row["differences"]] == [(pa.options[i], pb.options[i])
                                                                       for i in expected]
        assert all("int2" not in loop for loop in row["tf32"]["cells"])
        assert row["tf32"]["damage_by_fp32_profile_kl_share"] == pytest.approx(predicted_damage(a, pb) / 0.1)
        kl = row["kl"]  # presets are measured whatever the deadline
        assert kl["how"] == "measured"
        assert kl["fp32_plan"]["positions"] == kl["tf32_plan"]["positions"] == 4
        assert kl["kl_difference"] == pytest.approx(kl["tf32_plan"]["kl"] - kl["fp32_plan"]["kl"])
        se = np.std(kl["fp32_plan"]["per_document"], ddof=1) / math.sqrt(2)
        assert kl["eval_standard_error"] == pytest.approx(se)
        assert kl["within_eval_noise"] == (abs(kl["kl_difference"]) < se)
    assert by["1 KL_share"]["cells_differ"] > 0
    assert by["1 KL_share"]["kl"]["how"] == "skipped: past --budget-s"  # ladder pairs stop at the deadline
    summary = bench.plans_summary(rows, LOOPS * LAYERS)
    assert summary["differing_skipped"] >= 1
    assert summary["differing_measured"] == 2
    assert summary["plans_differ"] == summary["differing_measured"] + summary["differing_skipped"]
    assert summary["max_cells_differ"] == max(r["cells_differ"] for r in rows if r["cells_differ"] is not None)


def test_equal_plans_are_trivially_within_the_noise(bench, model):
    a = profile_with(0.02)
    rows = bench.compare_plans(model, a, a, tiny_documents(2, 330, seed=5), ladder=(1.0,), tau=TAU, positions=2)
    for row in rows:
        if row["cells_differ"] is None:
            continue
        assert row["cells_differ"] == 0
        assert row["differences"] == []
        assert row["kl"]["within_eval_noise"] is True
        assert row["kl"]["how"].startswith("equal plans")
        measured = row["kl"]["fp32_plan"]
        assert (measured is not None) == (row["budget"] in ("R", "M"))  # presets measured once, the ladder not
        if measured is not None:
            assert row["kl"]["tf32_plan"] is measured
            assert measured["kl"] > 0
    summary = bench.plans_summary(rows, LOOPS * LAYERS)
    assert summary["plans_differ"] == 0
    assert summary["max_cells_differ"] == 0
    assert summary["verdict"].startswith(f"0 of {summary['feasible_on_both']} budgets give different plans")


def test_kl_verdict_against_the_eval_noise(bench):
    fp32 = {"kl": 2.0, "per_document": [1.0, 3.0], "standard_error": 1.0}
    near = bench.kl_verdict(fp32, {"kl": 2.5, "per_document": [1.4, 3.6]})
    assert near["within_eval_noise"]
    assert near["difference_over_se"] == pytest.approx(0.5)
    assert near["paired_standard_error"] == pytest.approx(np.std([0.4, 0.6], ddof=1) / math.sqrt(2))
    far = bench.kl_verdict(fp32, {"kl": 3.5, "per_document": [2.5, 4.5]})
    assert not far["within_eval_noise"]
    assert far["relative_difference"] == pytest.approx(0.75)


@pytest.mark.parametrize(("argv", "needle"), [(["--ladder", "one"], "--ladder"), (["--ladder", "0,1"], "positive"),
                                          (["--eval-seed", "0"], "--eval-seed"), (["--eval-docs", "1"], "2 or more")])
def test_bad_arguments_are_refused(bench, argv, needle, capsys):
    with pytest.raises(SystemExit) as err:
        bench._parse(["--compare-plans", *argv])
    assert err.value.code == 2
    assert needle in capsys.readouterr().err


def test_compare_plans_smoke_on_the_cpu(bench, tmp_path, capsys):
    out = tmp_path / "plans.json"
    result = bench.main(["--compare-plans", "--smoke", "--out", str(out)])
    assert json.loads(out.read_text())["summary"] == result["summary"]
    assert result["command"] == f"python benchmarks/bench_profile.py --compare-plans --smoke --out {out}"
    assert "arms" not in result  # the Ouro-shaped arms do not run
    measured = {json.dumps(r["kl"]["fp32_plan"]): r["kl"]["fp32_plan"]["seconds"]  # one per distinct measurement
                for r in result["plans"] if r["kl"].get("fp32_plan")}
    assert 0 < sum(measured.values()) < result["seconds"]
    assert result["tf32_acts"] is False
    # on a CPU TF32 is a no-op: the two profiles and therefore every plan are equal
    assert result["profiles"]["same_damages"] is True
    assert all(d["fp32"] == d["tf32"] for d in result["profiles"]["noise_floor"]["per_damage"])
    assert result["summary"]["plans_differ"] == 0
    assert [r["budget"] for r in result["plans"]] == ["R", "M", "1 KL_share", "1 KL_share, stored <= 0.65"]
    r = next(r for r in result["plans"] if r["budget"] == "R")
    assert r["kl"]["fp32_plan"]["positions"] == 2 * 2
    assert "budgets give different plans" in capsys.readouterr().out
