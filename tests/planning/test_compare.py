"""loopkv.planning.compare: plans solved from two profiles compared cell by cell, and the verdict on their KLs measured
through the real cache against the eval's noise."""

from __future__ import annotations

import math

import numpy as np
import pytest

from loopkv.cells import Cell
from loopkv.planning.compare import differing_cells, kl_verdict, standard_error
from loopkv.planning.evaluate import KLResult, measure_kl
from loopkv.planning.knapsack import solve_preset
from loopkv.planning.plan import Plan
from loopkv.planning.profile_data import Profile
from tests.planning.test_profile import LAYERS, LOOPS, tiny_documents, tiny_model

TAU = 14.0


def profile_with(int2: float) -> Profile:
    """Damages (nats) on the tiny model's shape: INT4 0.01, share 0.05, INT2 ``int2``; KL_share 0.1."""
    grid = np.ones((LOOPS - 1, LAYERS))
    return Profile.from_arrays(loops=LOOPS, layers=LAYERS, kv_heads=2, head_dim=32,
                               damage={"int4": 0.01 * grid, "int2": int2 * grid, "share": 0.05 * grid},
                               final={"int4": [0.001] * LAYERS, "int2": [0.5] * LAYERS}, kl_share=0.1)


@pytest.mark.parametrize("preset", ["r", "m"])
def test_differing_plans_are_listed_cell_by_cell(preset):
    # cheap INT2 in one profile, unaffordable INT2 in the other: the presets' plans differ
    pa, pb = (solve_preset(profile_with(d), preset, tau=TAU) for d in (0.02, 10.0))
    expected = [i for i in range(LOOPS * LAYERS) if pa.options[i] != pb.options[i]]
    assert expected  # the profiles were made to disagree
    got = differing_cells(pa, pb)
    assert got == [(Cell(i // LAYERS, i % LAYERS), pa.options[i], pb.options[i]) for i in expected]
    assert all(y != "int2" for _, _, y in got)
    assert differing_cells(pa, pa) == []
    with pytest.raises(ValueError, match="one model"):
        differing_cells(pa, Plan.uniform(loops=LOOPS + 1, layers=LAYERS, option="int4"))


def _measured(kl, per_document):
    return KLResult(kl=kl, agreement=1.0, positions=2 * len(per_document), first_position=320, prefill_len=320,
                    per_document=tuple(per_document))


def test_kl_verdict_against_the_eval_noise():
    base = _measured(2.0, [1.0, 3.0])  # standard error 1.0
    near = kl_verdict(base, _measured(2.5, [1.4, 3.6]))
    assert near["within_eval_noise"]
    assert near["eval_standard_error"] == pytest.approx(1.0)
    assert near["difference_over_se"] == pytest.approx(0.5)
    assert near["paired_standard_error"] == pytest.approx(np.std([0.4, 0.6], ddof=1) / math.sqrt(2))
    far = kl_verdict(base, _measured(3.5, [2.5, 4.5]))
    assert not far["within_eval_noise"]
    assert far["relative_difference"] == pytest.approx(0.75)
    assert kl_verdict(base, base)["within_eval_noise"]  # equal: no difference at all
    assert kl_verdict(base, base)["difference_over_paired_se"] is None  # no spread in the differences


def test_standard_error_is_numpys():
    values = [0.3, 1.7, 0.2, 0.9, 2.5]
    assert standard_error(values) == pytest.approx(np.std(values, ddof=1) / math.sqrt(len(values)))
    with pytest.raises(ValueError, match="2 or more"):
        standard_error([1.0])


def test_the_verdict_on_plans_measured_through_the_cache():
    model, docs = tiny_model(), tiny_documents(2, 330, seed=5)
    pa, pb = (solve_preset(profile_with(d), "r", tau=TAU) for d in (0.02, 10.0))
    ra, rb = (measure_kl(model, p, docs, max_positions=2, progress=False) for p in (pa, pb))
    got = kl_verdict(ra, rb)
    se = np.std(ra.per_document, ddof=1) / math.sqrt(2)
    assert got["kl_difference"] == pytest.approx(rb.kl - ra.kl)
    assert got["eval_standard_error"] == pytest.approx(se)
    assert got["within_eval_noise"] == (abs(rb.kl - ra.kl) < se)
