"""The exact knapsack planner against independent references: brute force over every assignment on
small instances, scipy's MILP (HiGHS) on larger ones, and the paper's byte figures."""

import itertools
import math
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loopkv.cells import Cell
from loopkv.planning.bytes import ModelShape, unit_kib
from loopkv.planning.knapsack import (
    DAMAGE_RTOL,
    OPTION_UNITS,
    plan_units,
    predicted_damage,
    solve,
    solve_layerwise,
    solve_preset,
    unit_kib_of,
)
from loopkv.planning.plan import Plan
from loopkv.planning.profile_data import Profile

KL_SHARE = 1.2e-4  # the paper's unit on Ouro-1.4B (§2.3), used for realistic magnitudes
KV_HEADS, HEAD_DIM = 1, 32  # tiny shape: 1 unit = 64 bits = 8 bytes
UKIB = unit_kib(ModelShape(loops=4, layers=1, kv_heads=KV_HEADS, head_dim=HEAD_DIM))  # 1/128 KiB


def _profile(loops, layers, grids, final_int2, *, kl_share=1.0, kv_heads=KV_HEADS, head_dim=HEAD_DIM):
    return Profile.from_arrays(
        loops=loops,
        layers=layers,
        kv_heads=kv_heads,
        head_dim=head_dim,
        damage=grids,
        final_int2=final_int2,
        kl_share=kl_share,
    )


def _read_units_per_cell(option, final_option):
    return OPTION_UNITS[final_option] if option == "share" else OPTION_UNITS[option]


def _brute(profile, options, final_option, eps, m_units):
    """Every assignment of the non-final cells: (damage, stored, read, assignment) of the feasible ones,
    and the least damage among the storage-feasible ones (None if none)."""
    T, L = profile.loops, profile.layers
    cells = [Cell(t, layer) for t in range(T - 1) for layer in range(L)]
    base_d = sum(profile.final_int2) if final_option == "int2" else 0.0
    base_s = L * OPTION_UNITS[final_option]
    feasible, least = [], None
    for assign in itertools.product(options, repeat=len(cells)):
        d = sum(profile.damage_of(c, o) for c, o in zip(cells, assign, strict=True)) + base_d
        s = base_s + sum(0 if o == "share" else OPTION_UNITS[o] for o in assign)
        r = base_s + sum(_read_units_per_cell(o, final_option) for o in assign)
        if m_units is not None and s > m_units:
            continue
        least = d if least is None else min(least, d)
        if d <= eps * (1 + DAMAGE_RTOL):
            feasible.append((r, d, s, assign))
    return feasible, least


damages = st.one_of(
    st.just(0.0),
    st.sampled_from([0.25, 0.5, 1.0, 2.0]),  # ties
    st.floats(0.0, 4.0, allow_nan=False, allow_infinity=False),
)
option_sets = st.sampled_from(
    [
        ("int4", "int2", "share"),
        ("int4", "int2"),
        ("int4", "share"),
        ("bf16", "int4", "int2", "share"),
        ("int2",),
    ]
)


@st.composite
def instances(draw, max_cells=7):
    loops = draw(st.integers(2, 4))
    layers = draw(st.integers(1, 4))
    n = (loops - 1) * layers
    if n > max_cells:
        layers = max(1, max_cells // (loops - 1))
    options = draw(option_sets)
    if len(options) == 4:  # 4**n assignments: keep brute force small
        loops, layers = min(loops, 3), min(layers, 3)
    grids = {o: [[draw(damages) for _ in range(layers)] for _ in range(loops - 1)] for o in ("int4", "int2", "share")}
    final_int2 = [draw(damages) for _ in range(layers)]
    profile = _profile(loops, layers, grids, final_int2)
    final_option = draw(st.sampled_from(["int4", "int2", "bf16"]))
    return profile, options, final_option


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(inst=instances(), data=st.data())
def test_solve_matches_brute_force(inst, data):
    profile, options, final_option = inst
    T, L = profile.loops, profile.layers
    # Budgets: none, random, or exactly an achievable plan's damage / storage (boundary ties).
    n = (T - 1) * L
    everything = _brute(profile, options, final_option, math.inf, None)[0]
    pick = data.draw(st.sampled_from(everything))
    eps = data.draw(st.sampled_from([math.inf, pick[1], pick[1] * 0.5, pick[1] + 0.3]))
    m_units = data.draw(st.sampled_from([None, pick[2], pick[2] - 1, L * 5 + n * 2]))
    kw = {} if m_units is None else {"max_stored_kib": m_units * UKIB}
    feasible, least = _brute(profile, options, final_option, eps, m_units)
    if not feasible:
        with pytest.raises(ValueError, match="infeasible|no plan fits|below the final loop") as err:
            solve(profile, max_damage=eps, final_option=final_option, options=options, **kw)
        if least is not None:
            assert f"{least:.6g}" in str(err.value)
        return
    plan = solve(profile, max_damage=eps, final_option=final_option, options=options, **kw)
    best_read = min(f[0] for f in feasible)
    best_damage = min(f[1] for f in feasible if f[0] == best_read)
    stored, read = plan_units(plan)
    assert read == best_read
    damage = predicted_damage(profile, plan)
    assert damage == pytest.approx(best_damage, rel=1e-12, abs=1e-15)  # tie-break: least damage
    assert damage <= eps * (1 + DAMAGE_RTOL)
    if m_units is not None:
        assert stored <= m_units
    # The plan's bookkeeping: final loop fixed, predicted figures equal the byte model's.
    assert plan.options[(T - 1) * L :] == (final_option,) * L
    assert all(o in options for o in plan.options[: (T - 1) * L])
    assert plan.predicted["stored_kib"] == stored * UKIB
    assert plan.predicted["read_kib"] == read * UKIB
    assert plan.predicted["damage"] == damage
    bpt = plan.bytes_per_token()  # the teammate's byte model (loopkv.planning.bytes), independent code
    assert bpt.stored_kib == pytest.approx(plan.predicted["stored_kib"], rel=1e-12)
    assert bpt.read_kib == pytest.approx(plan.predicted["read_kib"], rel=1e-12)


@settings(max_examples=60, deadline=None)
@given(inst=instances(max_cells=6), hot=st.sampled_from([0.0, 1 / 6, 0.5, 1.0]), frac=st.floats(0.2, 1.2))
def test_v_precision_reads_are_also_minimal(inst, hot, frac):
    """Module docstring claim: with options from {int4, int2, share} and an int4/int2 final loop, the
    plan minimizing plain reads also minimizes reads with V precision at any hot fraction."""
    profile, options, final_option = inst
    if "bf16" in options or final_option == "bf16":
        return
    T, L = profile.loops, profile.layers
    m_units = math.floor(frac * T * L * 5)
    eps = 0.6 * sum(max(profile.damage_of(c, o) for o in options) for c in profile.layout if c.loop < T - 1)
    feasible, _ = _brute(profile, options, final_option, eps, m_units)
    if not feasible:
        return
    plan = solve(
        profile,
        max_damage=eps,
        max_stored_kib=m_units * UKIB,
        final_option=final_option,
        options=options,
        tau=14.0,
        hot_fraction=hot,
    )

    def vp_read(assign):
        n4 = sum(o == "int4" or (o == "share" and final_option == "int4") for o in assign)
        n4 += L * (final_option == "int4")
        base = L * OPTION_UNITS[final_option] + sum(_read_units_per_cell(o, final_option) for o in assign)
        return (base - (1 - hot) * n4) * UKIB

    best = min(vp_read(f[3]) for f in feasible)
    assert plan.predicted["read_kib_v_precision"] == pytest.approx(best, rel=1e-12)
    assert plan.bytes_per_token(hot_fraction=hot).read_kib == pytest.approx(best, rel=1e-12)


def _milp_min_read(profile, options, final_option, eps, m_units):
    from scipy.optimize import Bounds, LinearConstraint, milp

    T, L = profile.loops, profile.layers
    cells = [Cell(t, layer) for t in range(T - 1) for layer in range(L)]
    n, k = len(cells), len(options)
    read = np.array([_read_units_per_cell(o, final_option) for o in options] * n, dtype=float)
    stored = np.array([0 if o == "share" else OPTION_UNITS[o] for o in options] * n, dtype=float)
    dmg = np.array([profile.damage_of(c, o) for c in cells for o in options])
    onehot = np.kron(np.eye(n), np.ones(k))
    base_d = sum(profile.final_int2) if final_option == "int2" else 0.0
    cons = [LinearConstraint(onehot, 1, 1), LinearConstraint(dmg[None], -np.inf, eps - base_d)]
    if m_units is not None:
        cons.append(LinearConstraint(stored[None], -np.inf, m_units - L * OPTION_UNITS[final_option]))
    res = milp(read, constraints=cons, integrality=np.ones(n * k), bounds=Bounds(0, 1), options={"mip_rel_gap": 0})
    if res.status == 2:  # infeasible
        return None
    assert res.status == 0, res.message
    return round(res.fun) + L * OPTION_UNITS[final_option]


@settings(max_examples=15, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    options=st.sampled_from([("int4", "int2", "share"), ("bf16", "int4", "int2", "share")]),
    final_option=st.sampled_from(["int4", "int2"]),
    eps_frac=st.floats(0.05, 0.9),
    m_frac=st.one_of(st.none(), st.floats(0.3, 1.0)),
)
def test_solve_matches_milp(seed, options, final_option, eps_frac, m_frac):
    """3 loops x 8 layers and 4 x 8: the DP's optimal read equals HiGHS's on the same knapsack."""
    rng = np.random.default_rng(seed)
    loops = int(rng.integers(3, 5))
    layers = 8
    grids = {
        "int4": rng.exponential(0.02, (loops - 1, layers)),
        "int2": rng.exponential(0.3, (loops - 1, layers)),
        "share": rng.exponential(0.4, (loops - 1, layers)),
    }
    grids["int4"][0, 0] = 0.0  # zeros happen (three quarters of INT4 cells are < 1% KL_share)
    profile = _profile(loops, layers, grids, rng.exponential(0.3, layers))
    worst = sum(grids["int2"].ravel()) + (sum(profile.final_int2) if final_option == "int2" else 0.0)
    eps = eps_frac * worst
    m_units = None if m_frac is None else math.floor(m_frac * loops * layers * 5)
    kw = {} if m_units is None else {"max_stored_kib": m_units * UKIB}
    expected = _milp_min_read(profile, options, final_option, eps, m_units)
    if expected is None:
        with pytest.raises(ValueError, match="infeasible|no plan fits|below the final loop"):
            solve(profile, max_damage=eps, final_option=final_option, options=options, **kw)
        return
    plan = solve(profile, max_damage=eps, final_option=final_option, options=options, **kw)
    stored, read = plan_units(plan)
    assert read == expected
    assert predicted_damage(profile, plan) <= eps * (1 + DAMAGE_RTOL)
    if m_units is not None:
        assert stored <= m_units


@settings(max_examples=40, deadline=None)
@given(
    inst=instances(max_cells=12),
    eps_frac=st.floats(0.0, 1.2),
    m_frac=st.one_of(st.none(), st.floats(0.3, 1.2)),
)
def test_layerwise_matches_brute_force(inst, eps_frac, m_frac):
    profile, options, final_option = inst
    T, L = profile.loops, profile.layers
    base_d = sum(profile.final_int2) if final_option == "int2" else 0.0
    fu = OPTION_UNITS[final_option]
    m_units = None if m_frac is None else math.floor(m_frac * T * L * 5)
    per_layer = {}
    for assign in itertools.product(options, repeat=L):
        cells = [(Cell(t, layer), assign[layer]) for t in range(T - 1) for layer in range(L)]
        d = sum(math.fsum(profile.damage_of(Cell(t, layer), assign[layer]) for t in range(T - 1)) for layer in range(L))
        s = L * fu + sum(0 if o == "share" else OPTION_UNITS[o] for _, o in cells)
        r = L * fu + sum(_read_units_per_cell(o, final_option) for _, o in cells)
        per_layer[assign] = (r, d + base_d, s)
    eps = eps_frac * max(v[1] for v in per_layer.values())
    feasible = [v for v in per_layer.values() if (m_units is None or v[2] <= m_units) and v[1] <= eps * (1 + 1e-9)]
    kw = {} if m_units is None else {"max_stored_kib": m_units * UKIB}
    if not feasible:
        with pytest.raises(ValueError, match="infeasible|no plan fits|below the final loop"):
            solve_layerwise(profile, max_damage=eps, final_option=final_option, options=options, **kw)
        return
    plan = solve_layerwise(profile, max_damage=eps, final_option=final_option, options=options, **kw)
    stored, read = plan_units(plan)
    assert read == min(v[0] for v in feasible)
    for layer in range(L):  # one option per layer across loops 0..T-2
        assert len({plan.option(Cell(t, layer)) for t in range(T - 1)}) == 1
    assert predicted_damage(profile, plan) <= eps * (1 + 1e-9) + 1e-12
    assert m_units is None or stored <= m_units


# ------------------------------------------------------------------------------------- Ouro-1.4B shape
def _ouro_profile(seed=0, loops=4, layers=24):
    rng = np.random.default_rng(seed)
    grids = {
        "int4": rng.exponential(0.005, (loops - 1, layers)) * KL_SHARE,
        "int2": rng.exponential(0.1, (loops - 1, layers)) * KL_SHARE,
        "share": rng.exponential(0.15, (loops - 1, layers)) * KL_SHARE,
    }
    return _profile(
        loops,
        layers,
        grids,
        rng.exponential(0.25, layers) * KL_SHARE,
        kl_share=KL_SHARE,
        kv_heads=16,
        head_dim=128,
    )


def test_units_reproduce_paper_byte_figures():
    """Paper Tables 8 and 12 (stored / read KiB, loops 1-based in the paper)."""
    assert unit_kib_of(Plan.uniform(loops=4, layers=24, kv_heads=16, head_dim=128)) == 0.5
    cases = {
        ("int4", "int4", "int4", "int4"): (240, 240),
        ("bf16", "bf16", "bf16", "bf16"): (768, 768),
        ("int4", "int4", "share", "int4"): (180, 240),
        ("int4", "int2", "share", "int4"): (156, 216),
        ("int2", "int2", "share", "int4"): (132, 192),
    }
    for per_loop, (stored, read) in cases.items():
        plan = Plan.from_loops(loops=4, layers=24, per_loop=per_loop)
        s, r = plan_units(plan)
        assert (s * 0.5, r * 0.5) == (stored, read)


def test_presets_on_ouro_shape():
    profile = _ouro_profile()
    r = solve_preset(profile, "r")
    m = solve_preset(profile, "M")
    assert r.provenance["preset"] == "r"
    assert m.provenance["preset"] == "m"
    assert r.provenance["budgets"]["max_stored_kib"] is None
    assert m.provenance["budgets"]["max_stored_kib"] == 156.0  # 0.65 x 240 KiB
    assert r.predicted["damage_kl_share"] <= 1.19 * (1 + DAMAGE_RTOL)
    assert m.predicted["damage_kl_share"] <= 2.0 * (1 + DAMAGE_RTOL)
    assert m.predicted["stored_kib"] <= 156.0
    # R has no storage budget and sharing saves no reads: it shares only where sharing is cheaper in
    # damage than INT4 (ties go to less storage) at the same reads.
    for cell in r.cells("share"):
        assert profile.damage_of(cell, "share") <= profile.damage_of(cell, "int4")
    assert r.provenance["profile_hash"] == profile.content_hash()
    assert Plan.from_json_str(m.to_json_str()) == m  # the planner's output survives its JSON
    # Overriding the storage budget replaces the preset's fraction.
    m2 = solve_preset(profile, "m", max_stored_kib=170.0)
    assert m2.provenance["budgets"]["max_stored_kib"] == 170.0
    assert m2.predicted["read_kib"] <= m.predicted["read_kib"]


def test_timing_72_and_144_cells():
    """Sanity, not a benchmark: the DP is far from the CPU's limits."""
    profile = _ouro_profile(seed=1)
    start = time.perf_counter()
    solve(profile, max_damage=2.0, damage_unit="kl_share", storage_fraction=0.65)
    solve(profile, max_damage=1.19, damage_unit="kl_share", options=("bf16", "int4", "int2", "share"))
    assert time.perf_counter() - start < 1.0
    big = _ouro_profile(seed=2, loops=7)  # 144 non-final cells
    start = time.perf_counter()
    solve(big, max_damage=8.0, damage_unit="kl_share", storage_fraction=0.65)
    assert time.perf_counter() - start < 10.0


def test_budget_units_and_rounding():
    profile = _ouro_profile(seed=3)
    a = solve(profile, max_damage=2.0 * KL_SHARE, max_stored_kib=156.0)
    b = solve(profile, max_damage=2.0, damage_unit="kl_share", storage_fraction=0.65)
    assert a.options == b.options
    # KiB budgets round down to whole 0.5 KiB units.
    c = solve(profile, max_damage=2.0 * KL_SHARE, max_stored_kib=156.49)
    assert c.provenance["budgets"]["max_stored_kib"] == 156.0
    assert c.options == a.options


def test_final_int2_damage_counts():
    profile = _ouro_profile(seed=4)
    plan = solve(profile, max_damage=math.inf, final_option="int2", options=("int2",))
    assert plan.predicted["damage_final_loop"] == pytest.approx(sum(profile.final_int2))
    assert plan.predicted["damage"] == pytest.approx(sum(profile.damage_of(c, "int2") for c in profile.layout))
    assert plan.predicted["stored_kib"] == 96 * 1.5


def test_infeasible_messages():
    profile = _ouro_profile(seed=5)
    with pytest.raises(ValueError, match="minimum achievable damage") as err:
        solve(profile, max_damage=0.01, damage_unit="kl_share", storage_fraction=0.65)
    least = float(str(err.value).split("damage there is ")[1].split(" ")[0])
    solve(profile, max_damage=least * 1.001, storage_fraction=0.65)  # the stated minimum is achievable
    with pytest.raises(ValueError, match="least storage"):
        solve(profile, max_damage=math.inf, max_stored_kib=100.0, options=("int4", "int2"))
    with pytest.raises(ValueError, match="below the final loop"):
        solve(profile, max_damage=math.inf, max_stored_kib=50.0)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_damage": -1.0}, "max_damage"),
        ({"max_damage": 1.0, "damage_unit": "bits"}, "damage_unit"),
        ({"max_damage": 1.0, "max_stored_kib": 100.0, "storage_fraction": 0.5}, "not both"),
        ({"max_damage": 1.0, "options": ("int8",)}, "options"),
        ({"max_damage": 1.0, "final_option": "share"}, "final_option"),
        ({"max_damage": 1.0, "hot_fraction": 0.5}, "hot_fraction"),
        ({"max_damage": 1.0, "tau": -1.0}, "tau"),
    ],
)
def test_argument_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        solve(_ouro_profile(), **kwargs)


def test_profile_requirements():
    p = _ouro_profile()
    no_unit = Profile.from_arrays(
        loops=4, layers=24, kv_heads=16, head_dim=128, damage={o: [[0.0] * 24] * 3 for o in ("int4", "int2")}
    )
    with pytest.raises(ValueError, match="kl_share"):
        solve(no_unit, max_damage=1.0, damage_unit="kl_share", options=("int4", "int2"))
    with pytest.raises(ValueError, match="final_int2"):
        solve(no_unit, max_damage=1.0, final_option="int2", options=("int4", "int2"))
    with pytest.raises(ValueError, match="lacks"):
        solve(no_unit, max_damage=1.0)  # no share damages measured
    partial = Profile.partial(loops=4, layers=24, kv_heads=16, head_dim=128).with_damage(Cell(0, 0), "int4", 0.0)
    with pytest.raises(ValueError, match="Profile.missing"):
        solve(partial, max_damage=1.0)
    with pytest.raises(ValueError, match="preset"):
        solve_preset(p, "x")
