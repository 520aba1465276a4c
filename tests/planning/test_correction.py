"""The additivity correction (paper Appendix D): two fitted factors, scored on plans they were not fitted on."""

import json
import math

import numpy as np
import pytest

from loopkv.planning.correction import PAPER, Correction, errors, family, fit
from loopkv.planning.evaluate import summarize
from loopkv.planning.plan import Plan

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
