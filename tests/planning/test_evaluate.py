"""KL through the real LoopKVCache, and the additivity report (paper Appendix D)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from scipy import stats

import loopkv
from loopkv.cells import Cell
from loopkv.planning.correction import PAPER, Correction, errors, family, fit
from loopkv.planning.evaluate import additivity_report, measure_kl, random_plans, summarize
from loopkv.planning.knapsack import predicted_damage
from loopkv.planning.plan import Plan
from loopkv.planning.profiler import profile
from loopkv.planning.simulate import FIRST_HISTORY
from tests.planning.test_profile import LAYERS, LOOPS, tiny_documents, tiny_model
from tests.tolerances import LOGITS_FP32_ATOL

# Logits within LOGITS_FP32_ATOL of each other: q ∝ p·exp(-δ) with every |δ| <= atol, and by
# Hoeffding's lemma KL(p || q) = log E_p[e^-δ] + E_p[δ] <= (max δ - min δ)^2 / 8 <= (2 atol)^2 / 8.
KL_OF_ROUNDOFF = (2 * LOGITS_FP32_ATOL) ** 2 / 8


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture(scope="module")
def doc():
    return tiny_documents(1, 360)


def _single(cell: Cell, option: str) -> loopkv.Plan:
    options = ["bf16"] * (LOOPS * LAYERS)
    options[cell.loop * LAYERS + cell.layer] = option
    return loopkv.Plan(loops=LOOPS, layers=LAYERS, options=tuple(options))


def test_bf16_plan_has_zero_kl(model, doc):
    result = measure_kl(model, loopkv.Plan.uniform(loops=LOOPS, layers=LAYERS, option="bf16"), doc, progress=False)
    assert 0.0 <= result.kl <= KL_OF_ROUNDOFF
    assert result.agreement == 1.0
    assert result.positions == 360 - FIRST_HISTORY
    assert result.first_position == FIRST_HISTORY
    assert result.per_document == (result.kl,)


def test_measured_kl_is_the_profiled_damage(model, doc):
    """One cell at INT2 through the real cache = the profiler's single-cell damage of that cell (the
    same positions, the same pooling; the logits agree to fp32 round-off, see test_profile)."""
    prof = profile(model, doc, options=("int2",), final_options=(), progress=False)
    cell = Cell(1, 0)
    measured = measure_kl(model, _single(cell, "int2"), doc, progress=False)
    assert measured.kl > 100 * KL_OF_ROUNDOFF
    assert measured.kl == pytest.approx(prof.damage_of(cell, "int2"), rel=1e-3)
    assert 0.0 < measured.agreement <= 1.0


def test_max_positions_and_prefill(model, doc):
    plan = _single(Cell(0, 0), "int4")
    short = measure_kl(model, plan, doc, max_positions=5, progress=False)
    assert short.positions == 5
    late = measure_kl(model, plan, doc, prefill_len=340, progress=False)
    assert late.first_position == 340
    assert late.positions == 20
    with pytest.raises(ValueError, match="prefill_len"):
        measure_kl(model, plan, doc, prefill_len=0, progress=False)
    with pytest.raises(ValueError, match="max_positions"):
        measure_kl(model, plan, doc, max_positions=0, progress=False)
    with pytest.raises(ValueError, match="fewer than"):
        measure_kl(model, plan, doc[:, :300], progress=False)


def test_mismatched_plan_or_profile_is_refused(model, doc):
    with pytest.raises(ValueError, match="does not fit the model"):
        measure_kl(model, loopkv.Plan.uniform(loops=LOOPS + 1, layers=LAYERS), doc, progress=False)
    with pytest.raises(ValueError, match="head_dim"):
        measure_kl(model, loopkv.Plan.uniform(loops=LOOPS, layers=LAYERS, head_dim=64), doc, progress=False)
    other = loopkv.planning.Profile.partial(loops=LOOPS, layers=LAYERS + 1, kv_heads=2, head_dim=32)
    with pytest.raises(ValueError, match="does not match the model"):
        additivity_report(model, other, [], doc, progress=False)


def test_summarize_matches_scipy():
    rng = np.random.default_rng(0)
    predicted = rng.exponential(1.0, 12)
    measured = predicted * rng.uniform(0.6, 1.4, 12)
    rep = summarize([f"p{i}" for i in range(12)], predicted, measured, kl_share=2.0)
    assert rep.pearson == pytest.approx(stats.pearsonr(predicted, measured)[0], rel=1e-9)
    assert rep.log_pearson == pytest.approx(stats.pearsonr(np.log(predicted), np.log(measured))[0], rel=1e-9)
    assert rep.spearman == pytest.approx(stats.spearmanr(predicted, measured)[0], rel=1e-9)
    assert rep.log_slope == pytest.approx(stats.linregress(np.log(predicted), np.log(measured)).slope, rel=1e-9)
    assert rep.ratio_min == pytest.approx((measured / predicted).min())
    assert rep.ratio_max == pytest.approx((measured / predicted).max())
    text = rep.format()
    assert "p11" in text
    assert "KL_share" in text
    one = summarize(["a"], [1.0], [2.0])
    assert math.isnan(one.pearson)
    assert one.ratio_min == one.ratio_max == 2.0
    ties = summarize(list("abcd"), [1.0, 1.0, 2.0, 3.0], [1.0, 2.0, 2.0, 4.0])
    assert ties.spearman == pytest.approx(stats.spearmanr([1, 1, 2, 3], [1, 2, 2, 4])[0])


def test_random_plans_are_seeded_and_valid():
    prof = loopkv.planning.Profile.partial(loops=4, layers=6, kv_heads=2, head_dim=32)
    plans = random_plans(prof, 5, seed=3)
    assert [p.options for p in plans] == [p.options for p in random_plans(prof, 5, seed=3)]
    assert [p.options for p in plans] != [p.options for p in random_plans(prof, 5, seed=4)]
    for p in plans:
        grid = p.grid()
        assert grid[3] == ["int4"] * 6
        assert "share" not in grid[0]  # default: share only in the last two non-final loops
        assert set(o for row in grid[:3] for o in row) <= {"int4", "int2", "share"}
    assert all("share" not in p.options for p in random_plans(prof, 5, options=("int4", "int2")))


def test_additivity_report_end_to_end(model, doc):
    doc = doc[:, :340]  # 20 counted positions: one window exit during decode (position 351 is not needed)
    prof = profile(model, doc, options=("int4", "int2"), final_options=(), progress=False)
    plans = [_single(Cell(0, 1), "int2"), *random_plans(prof, 2, seed=0, options=("int4", "int2"))]
    rep = additivity_report(model, prof, plans, doc, progress=False, fit_on=[0])
    assert rep.predicted == tuple(predicted_damage(prof, p) for p in plans)
    assert rep.names[1] == "random_plans(seed=0) #0"
    # a single-cell plan is measured as profiled
    assert rep.measured[0] == pytest.approx(rep.predicted[0], rel=1e-3)
    assert all(m > 0 for m in rep.measured)
    assert rep.to_dict()["results"][0]["positions"] == 340 - FIRST_HISTORY
    # the correction is fitted on plan 0 (own codes: factor measured / predicted) and scored on the others
    assert rep.fitted == (True, False, False)
    assert rep.correction["own"] == pytest.approx(rep.measured[0] / rep.predicted[0])
    assert rep.corrected[1] == pytest.approx(rep.correction["own"] * rep.predicted[1])
    assert rep.errors["raw"]["plans"] == 2
    assert len(rep.format().splitlines()) == len(plans) + 4  # header, plans, summary, correction, its errors
    assert math.isfinite(rep.ratio_max)


# ---- The additivity correction (paper Appendix D): two fitted factors, scored on plans they were not fitted on.
OWN = Plan.from_loops(loops=4, layers=2, per_loop=["int4", "int2", "int4", "int4"])
SHARED = Plan.share_loop(loops=4, layers=2)


def test_family_and_paper_factors():
    assert family(OWN) == "own"
    assert family(SHARED) == "shared"
    assert (PAPER.own, PAPER.shared) == (0.73, 0.97)  # paper Appendix D
    assert PAPER.predict(OWN, 2.0) == pytest.approx(1.46)
    assert PAPER.predict(SHARED, 2.0) == pytest.approx(1.94)


def test_fit_is_the_geometric_mean_ratio_per_family():
    rng = np.random.default_rng(0)
    summed = rng.uniform(1, 5, 8)
    noise = rng.uniform(0.8, 1.25, 8)
    plans = [OWN, SHARED] * 4
    measured = [s * (0.6 if p is OWN else 1.3) * e for s, p, e in zip(summed, plans, noise, strict=True)]
    corr = fit(plans, summed, measured)
    own = [m / s for m, s, p in zip(measured, summed, plans, strict=True) if p is OWN]
    shared = [m / s for m, s, p in zip(measured, summed, plans, strict=True) if p is SHARED]
    assert corr.own == pytest.approx(math.prod(own) ** (1 / len(own)))  # exp(mean(log ratio))
    assert corr.shared == pytest.approx(math.prod(shared) ** (1 / len(shared)))
    assert (corr.n_own, corr.n_shared) == (4, 4)
    # exact factors are recovered exactly
    exact = fit(plans, summed, [s * (0.6 if p is OWN else 1.3) for s, p in zip(summed, plans, strict=True)])
    assert (exact.own, exact.shared) == (pytest.approx(0.6), pytest.approx(1.3))


def test_fit_keeps_the_fallback_for_a_family_without_plans():
    corr = fit([OWN, OWN], [1.0, 2.0], [0.5, 1.0])
    assert corr.own == pytest.approx(0.5)
    assert corr.shared == PAPER.shared
    assert corr.n_shared == 0
    assert "shared factor from paper Appendix D" in corr.source
    zero = fit([OWN], [0.0], [1.0])  # a zero sum cannot be fitted
    assert zero.own == PAPER.own


def test_errors():
    e = errors([1.0, 3.0], [2.0, 2.0])
    assert e["mae"] == pytest.approx(0.5)  # |1-2|/2, |3-2|/2
    assert e["worst_factor"] == pytest.approx(2.0)
    assert math.isnan(errors([0.0], [1.0])["mae"])


def test_summarize_fits_on_some_plans_and_scores_the_others():
    plans = [OWN, SHARED, OWN, SHARED, OWN]
    summed = [1.0, 2.0, 3.0, 4.0, 5.0]
    measured = [0.5, 2.4, 1.5, 4.8, 3.0]  # own: 0.5 S (fitted) ... the last 0.6 S (scored)
    rep = summarize([f"p{i}" for i in range(5)], summed, measured, plans=plans, fit_on=[0, 1, 2, 3])
    assert rep.fitted == (True, True, True, True, False)
    assert rep.correction["own"] == pytest.approx(0.5)
    assert rep.correction["shared"] == pytest.approx(1.2)
    assert rep.corrected == pytest.approx((0.5, 2.4, 1.5, 4.8, 2.5))
    assert rep.errors["raw"]["plans"] == 1  # only the plan it was not fitted on
    assert rep.errors["raw"]["mae"] == pytest.approx(abs(5.0 - 3.0) / 3.0)
    assert rep.errors["corrected"]["mae"] == pytest.approx(abs(2.5 - 3.0) / 3.0)
    text = rep.format()
    assert "corrected" in text
    assert "fitted on 4 of these plans" in text
    frozen = summarize(["a", "b"], [1.0, 1.0], [0.7, 1.0], plans=[OWN, SHARED], correction=PAPER)
    assert frozen.corrected == pytest.approx((0.73, 0.97))
    assert frozen.errors["scored"] == "every plan"
    json.dumps(frozen.to_dict())  # JSON-ready


def test_correction_round_trip_and_errors():
    corr = Correction(0.8, 1.1, "test", 3, 2)
    assert Correction.from_dict(json.loads(json.dumps(corr.to_dict()))) == corr
    with pytest.raises(ValueError, match="'own' and 'shared'|\\('own', 'shared'\\)"):
        Correction.from_dict({"own": 1.0})
    with pytest.raises(ValueError, match="finite factor > 0"):
        Correction(0.0, 1.0, "bad")
