"""The exact knapsack planner against independent references: brute force over every assignment of every
cell (the final loop's included) on small instances, with per-cell rules, per-loop tau and both objectives;
scipy's MILP (HiGHS) on larger ones; and the paper's byte figures."""

import itertools
import math
import time
import warnings

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loopkv.cells import Cell, CellLayout
from loopkv.planning.bytes import ModelShape, unit_kib
from loopkv.planning.constraints import allowed_options, as_rules, parse_rule
from loopkv.planning.knapsack import (
    DAMAGE_RTOL,
    OPTION_UNITS,
    UncountedDamageWarning,
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
INFEASIBLE = "infeasible|no plan fits|no plan can serve"


def _profile(loops, layers, grids, final, *, kl_share=1.0, kv_heads=KV_HEADS, head_dim=HEAD_DIM):
    return Profile.from_arrays(loops=loops, layers=layers, kv_heads=kv_heads, head_dim=head_dim, damage=grids,
                               final=final, kl_share=kl_share)


# ------------------------------------------------------------------------------------------ brute force
def _cost(assign, loops, layers, taus, hot):
    """(stored, read) in byte units of a full assignment, from the definitions: a share cell stores 0 and
    reads its source's units; an INT4 read by a cell of a loop with finite tau saves 1 - hot units."""
    stored = read = 0.0
    for i, o in enumerate(assign):
        src = assign[(loops - 1) * layers + i % layers] if o == "share" else o
        stored += 0 if o == "share" else OPTION_UNITS[o]
        read += OPTION_UNITS[src] - ((1 - hot) if (src == "int4" and math.isfinite(taus[i // layers])) else 0)
    return stored, read


def _brute(profile, menus, taus, hot, *, eps, m_units=None, r_units=None, objective="read"):
    """Every assignment of every cell from ``menus`` (one list per flat index) where each share reads an
    int4 final cell (the source the profile measured): the feasible ones as (objective, damage, other,
    assignment), and the least damage among those that fit the byte caps (None if none)."""
    T, L = profile.loops, profile.layers
    cells = [profile.layout.cell(i) for i in range(T * L)]
    feasible, least = [], None
    for assign in itertools.product(*menus):
        if any(o == "share" and assign[(T - 1) * L + i % L] != "int4" for i, o in enumerate(assign)):
            continue
        s, r = _cost(assign, T, L, taus, hot)
        if (m_units is not None and s > m_units) or (r_units is not None and r > r_units + 1e-9):
            continue
        d = math.fsum(profile.damage_of(c, o) for c, o in zip(cells, assign, strict=True))
        least = d if least is None else min(least, d)
        if d <= eps * (1 + DAMAGE_RTOL):
            feasible.append((r, d, s, assign) if objective == "read" else (s, d, r, assign))
    return feasible, least


damages = st.one_of(
    st.just(0.0),
    st.sampled_from([0.25, 0.5, 1.0, 2.0]),  # ties
    st.floats(0.0, 4.0, allow_nan=False, allow_infinity=False),
)
option_sets = st.sampled_from([("int4", "int2", "share"), ("int4", "int2"), ("int4", "share"),
                               ("bf16", "int4", "int2", "share"), ("int2",)])
final_sets = st.sampled_from([("int4",), ("int4", "int2"), ("bf16", "int4"), ("bf16", "int4", "int2"), ("int2",)])


@st.composite
def instances(draw):
    loops = draw(st.integers(2, 3))
    layers = draw(st.integers(1, 3 if loops == 2 else 2))
    options, finals = draw(option_sets), draw(final_sets)
    grids = {o: [[draw(damages) for _ in range(layers)] for _ in range(loops - 1)] for o in ("int4", "int2", "share")}
    final = {"int2": [draw(damages) for _ in range(layers)]}
    old = draw(st.booleans())  # a profile from before the final loop's INT4 was profiled
    if not old:
        final["int4"] = [draw(damages) for _ in range(layers)]
    profile = _profile(loops, layers, grids, final)
    n = loops * layers
    menus = [list(finals if i >= (loops - 1) * layers else options) for i in range(n)]
    fix, forbid = {}, {}
    for i in draw(st.lists(st.integers(0, n - 1), max_size=2, unique=True)):  # per-cell rules
        cell = profile.layout.cell(i)
        pool = ["bf16", "int4", "int2"] + (["share"] if cell.loop < loops - 1 else [])
        chosen = draw(st.lists(st.sampled_from(pool), min_size=1, max_size=2, unique=True))
        if draw(st.booleans()):
            fix[cell], menus[i] = chosen, list(chosen)
        elif set(menus[i]) - set(chosen):
            forbid[cell], menus[i] = chosen, [o for o in menus[i] if o not in chosen]
    tau_choice = draw(st.sampled_from(["inf", "all", "per-loop"]))
    taus = {"inf": [math.inf] * loops, "all": [14.0] * loops,
            "per-loop": [draw(st.sampled_from([10.0, math.inf])) for _ in range(loops)]}[tau_choice]
    hot = draw(st.sampled_from([0.0, 1 / 6, 0.5, 1.0])) if any(map(math.isfinite, taus)) else 1.0
    return profile, options, finals, fix, forbid, menus, taus, hot


def _expected_error(kwargs, profile, menus, taus, hot, budgets, objective):
    feasible, least = _brute(profile, menus, taus, hot, objective=objective, **budgets)
    if feasible:
        return feasible, None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UncountedDamageWarning)
        with pytest.raises(ValueError, match=INFEASIBLE) as err:
            solve(profile, **kwargs)
    if least is not None and "minimum achievable damage" in str(err.value):
        assert f"{least:.6g}" in str(err.value)
    return None, err


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(inst=instances(), data=st.data())
def test_solve_matches_brute_force(inst, data):
    """Optimality against every assignment: both objectives, damage / storage / read budgets (boundary ties
    included), fix and forbid rules, per-loop tau and hot fractions, final-loop options chosen per layer."""
    profile, options, finals, fix, forbid, menus, taus, hot = inst
    objective = data.draw(st.sampled_from(["read", "stored"]))
    everything = _brute(profile, menus, taus, hot, eps=math.inf)[0]
    if not everything:  # the rules leave no assignment (e.g. a fixed share over a non-int4 source)
        with pytest.raises(ValueError, match=INFEASIBLE):
            solve(profile, max_damage=math.inf, options=options, final_options=finals, fix=fix, forbid=forbid,
                  tau=taus, hot_fraction=hot)
        return
    pick = data.draw(st.sampled_from(everything))  # (read, damage, stored, assignment)
    eps = data.draw(st.sampled_from([math.inf, pick[1], pick[1] * 0.5, pick[1] + 0.3]))
    m_units = data.draw(st.sampled_from([None, pick[2], pick[2] - 1]))
    r_units = data.draw(st.sampled_from([None, pick[0], pick[0] - 0.5]))
    kwargs = {"max_damage": eps, "objective": objective, "options": options, "final_options": finals, "fix": fix,
              "forbid": forbid, "tau": taus, "hot_fraction": hot}
    if m_units is not None:
        kwargs["max_stored_kib"] = m_units * UKIB
    if r_units is not None:
        kwargs["max_read_kib"] = r_units * UKIB
    budgets = {"eps": eps, "m_units": m_units, "r_units": r_units}
    feasible, err = _expected_error(kwargs, profile, menus, taus, hot, budgets, objective)
    if err is not None:
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UncountedDamageWarning)
        plan = solve(profile, **kwargs)
    best = min(f[0] for f in feasible)
    best_damage = min(f[1] for f in feasible if abs(f[0] - best) < 1e-9)
    stored, read = _cost(plan.options, profile.loops, profile.layers, taus, hot)
    assert (read if objective == "read" else stored) == pytest.approx(best, abs=1e-9)
    damage = predicted_damage(profile, plan)
    assert damage == pytest.approx(best_damage, rel=1e-12, abs=1e-15)  # tie-break: least damage
    assert damage <= eps * (1 + DAMAGE_RTOL)
    assert m_units is None or stored <= m_units
    assert r_units is None or read <= r_units + 1e-9
    assert all(o in menus[i] for i, o in enumerate(plan.options))  # menus, final menus and rules obeyed
    # The plan's bookkeeping equals the byte model (loopkv.planning.bytes, independent code).
    assert plan.taus == tuple(taus)
    assert plan.predicted["damage"] == damage
    bpt = plan.bytes_per_token(hot_fraction=hot)
    assert bpt.stored_kib == pytest.approx(stored * UKIB, rel=1e-12)
    assert bpt.read_kib == pytest.approx(read * UKIB, rel=1e-12)
    if plan.v_precision:
        assert plan.predicted["read_kib_v_precision"] == pytest.approx(bpt.read_kib, rel=1e-12)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(inst=instances(), eps_frac=st.floats(0.0, 1.2), m_frac=st.one_of(st.none(), st.floats(0.3, 1.2)))
def test_layerwise_matches_brute_force(inst, eps_frac, m_frac):
    """One option per layer for the non-final cells that no fix rule names; fixed cells and the final loop
    free per cell: the least read among such assignments."""
    profile, options, finals, fix, forbid, menus, taus, hot = inst
    T, L = profile.loops, profile.layers
    fixed = {profile.layout.flat_index(c) for c in fix}
    everything = [f for f in _brute(profile, menus, taus, hot, eps=math.inf)[0]
                  if all(len({f[3][t * L + layer] for t in range(T - 1) if t * L + layer not in fixed}) <= 1
                         for layer in range(L))]
    eps = eps_frac * max([f[1] for f in everything], default=0.0)
    m_units = None if m_frac is None else math.floor(m_frac * T * L * 5)
    feasible = [f for f in everything if f[1] <= eps * (1 + DAMAGE_RTOL) and (m_units is None or f[2] <= m_units)]
    kwargs = {"options": options, "final_options": finals, "fix": fix, "forbid": forbid, "tau": taus,
              "hot_fraction": hot, **({} if m_units is None else {"max_stored_kib": m_units * UKIB})}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UncountedDamageWarning)
        if not feasible:
            with pytest.raises(ValueError, match=INFEASIBLE):
                solve_layerwise(profile, max_damage=eps, **kwargs)
            return
        plan = solve_layerwise(profile, max_damage=eps, **kwargs)
    stored, read = _cost(plan.options, T, L, taus, hot)
    assert read == pytest.approx(min(f[0] for f in feasible), abs=1e-9)
    for layer in range(L):
        tied = {plan.option(Cell(t, layer)) for t in range(T - 1) if t * L + layer not in fixed}
        assert len(tied) <= 1
    assert predicted_damage(profile, plan) <= eps * (1 + DAMAGE_RTOL) + 1e-12
    assert m_units is None or stored <= m_units


def _milp_min_read(profile, options, finals, eps, m_units):
    """The same knapsack as a MILP: x[c, o] one-hot per cell (final cells from ``finals``), a share at layer l
    only when the final cell of layer l is int4, minimise read units at tau = inf."""
    from scipy.optimize import Bounds, LinearConstraint, milp

    T, L = profile.loops, profile.layers
    menus = [finals if i >= (T - 1) * L else options for i in range(T * L)]
    var = [(i, o) for i in range(T * L) for o in menus[i]]
    index = {v: k for k, v in enumerate(var)}
    n = len(var)
    onehot = np.zeros((T * L, n))
    for k, (i, _) in enumerate(var):
        onehot[i, k] = 1
    read = np.array([0.0 if o == "share" else OPTION_UNITS[o] for _, o in var])
    read += np.array([OPTION_UNITS["int4"] if o == "share" else 0 for _, o in var])  # a share reads int4
    stored = np.array([0.0 if o == "share" else OPTION_UNITS[o] for _, o in var])
    dmg = np.array([profile.damage_of(profile.layout.cell(i), o) for i, o in var])
    cons = [LinearConstraint(onehot, 1, 1), LinearConstraint(dmg[None], -np.inf, eps)]
    for i, o in var:
        if o == "share":  # x[c, share] <= x[final_l, int4]
            row = np.zeros(n)
            row[index[(i, o)]] = 1
            src = ((T - 1) * L + i % L, "int4")
            if src in index:
                row[index[src]] = -1
            cons.append(LinearConstraint(row[None], -np.inf, 0))
    if m_units is not None:
        cons.append(LinearConstraint(stored[None], -np.inf, m_units))
    res = milp(read, constraints=cons, integrality=np.ones(n), bounds=Bounds(0, 1), options={"mip_rel_gap": 0})
    if res.status == 2:  # infeasible
        return None
    assert res.status == 0, res.message
    return round(res.fun)


@settings(max_examples=15, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    options=st.sampled_from([("int4", "int2", "share"), ("bf16", "int4", "int2", "share")]),
    finals=st.sampled_from([("int4",), ("int4", "int2"), ("bf16", "int4", "int2")]),
    eps_frac=st.floats(0.05, 0.9),
    m_frac=st.one_of(st.none(), st.floats(0.3, 1.0)),
)
def test_solve_matches_milp(seed, options, finals, eps_frac, m_frac):
    """3 loops x 8 layers and 4 x 8: the DP's optimal read equals HiGHS's on the same knapsack."""
    rng = np.random.default_rng(seed)
    loops, layers = int(rng.integers(3, 5)), 8
    grids = {"int4": rng.exponential(0.02, (loops - 1, layers)), "int2": rng.exponential(0.3, (loops - 1, layers)),
             "share": rng.exponential(0.4, (loops - 1, layers))}
    grids["int4"][0, 0] = 0.0  # zeros happen (three quarters of INT4 cells are < 1% KL_share)
    profile = _profile(loops, layers, grids, {"int4": rng.exponential(0.02, layers),
                                              "int2": rng.exponential(0.3, layers)})
    eps = eps_frac * (grids["int2"].sum() + sum(profile.final_int2))
    m_units = None if m_frac is None else math.floor(m_frac * loops * layers * 5)
    kw = {"options": options, "final_options": finals}
    if m_units is not None:
        kw["max_stored_kib"] = m_units * UKIB
    expected = _milp_min_read(profile, options, finals, eps, m_units)
    if expected is None:
        with pytest.raises(ValueError, match=INFEASIBLE):
            solve(profile, max_damage=eps, **kw)
        return
    plan = solve(profile, max_damage=eps, **kw)
    stored, read = plan_units(plan)
    assert read == expected
    assert predicted_damage(profile, plan) <= eps * (1 + DAMAGE_RTOL)
    assert m_units is None or stored <= m_units


# ------------------------------------------------------------------------------------- the final loop
def _ouro_profile(seed=0, loops=4, layers=24, final_int4=True):
    rng = np.random.default_rng(seed)
    grids = {
        "int4": rng.exponential(0.005, (loops - 1, layers)) * KL_SHARE,
        "int2": rng.exponential(0.1, (loops - 1, layers)) * KL_SHARE,
        "share": rng.exponential(0.15, (loops - 1, layers)) * KL_SHARE,
    }
    final = {"int2": rng.exponential(0.25, layers) * KL_SHARE}
    if final_int4:
        final["int4"] = rng.exponential(0.002, layers) * KL_SHARE
    return _profile(loops, layers, grids, final, kl_share=KL_SHARE, kv_heads=16, head_dim=128)


def test_eps_zero_is_all_exact_final_loop_included():
    profile = _ouro_profile(seed=7)
    plan = solve(profile, max_damage=0.0, options=("bf16", "int4", "int2", "share"), final_options=("bf16", "int4"))
    assert set(plan.options) == {"bf16"}
    assert plan.predicted["damage"] == 0.0
    assert plan.predicted["stored_kib"] == 96 * 8
    # Without bf16 in the final loop's menu, eps = 0 is refused, naming the least damage (the final loop's).
    with pytest.raises(ValueError, match="offer 'bf16'") as err:
        solve(profile, max_damage=0.0, options=("bf16", "int4", "int2", "share"))
    assert f"{sum(profile.final_int4):.6g}" in str(err.value)


def test_final_loop_damage_counts_in_the_budget():
    """The paper's "sum of single-cell damages plus source" (Table 12): the final loop's INT4 is in eps."""
    profile = _ouro_profile(seed=4)
    final4 = math.fsum(profile.final_int4)
    plan = solve(profile, max_damage=math.inf, options=("int4",))
    assert plan.predicted["damage_final_loop"] == pytest.approx(final4)
    nonfinal = math.fsum(profile.damage_of(c, "int4") for c in profile.layout if c.loop < 3)
    assert plan.predicted["damage"] == pytest.approx(nonfinal + final4)
    # A budget just below that sum is infeasible for uniform INT4; allowing bf16 in the final loop buys it back.
    with pytest.raises(ValueError, match="infeasible"):
        solve(profile, max_damage=(nonfinal + final4) * 0.999, options=("int4",))
    cheaper = solve(profile, max_damage=(nonfinal + final4) * 0.999, options=("int4",), final_options=("bf16", "int4"))
    assert "bf16" in cheaper.options[72:]
    int2 = solve(profile, max_damage=math.inf, final_option="int2", options=("int2",))
    assert int2.predicted["damage_final_loop"] == pytest.approx(sum(profile.final_int2))
    assert int2.predicted["stored_kib"] == 96 * 1.5


def test_profile_without_final_int4_plans_and_says_what_it_leaves_out():
    old = _ouro_profile(seed=5, final_int4=False)
    assert old.uncounted()
    with pytest.warns(UncountedDamageWarning, match="final loop's own INT4"):
        plan = solve_preset(old, "r")
    assert "final loop's own INT4" in plan.predicted["uncounted"][0]
    assert plan.predicted["damage_final_loop"] == 0.0
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a plan that keeps the final loop exact leaves nothing out
        exact_final = solve(old, max_damage=math.inf, final_options=("bf16",))
    assert "uncounted" not in exact_final.predicted


def test_share_is_offered_only_over_the_profiled_source():
    profile = _ouro_profile(seed=6)
    plan = solve(profile, max_damage=math.inf, objective="stored", final_options=("bf16", "int4", "int2"))
    T, L = 4, 24
    for i, o in enumerate(plan.options):
        if o == "share":
            assert plan.options[(T - 1) * L + i % L] == "int4"
    with pytest.raises(ValueError, match="may only 'share'"):
        solve(profile, max_damage=math.inf, fix="2:5=share", final_options=("bf16",))


# ------------------------------------------------------------------------------------- rules
def test_rules_as_text_and_the_layer_only_ablation():
    profile = _ouro_profile(seed=8)
    plan = solve(profile, max_damage=6.0, damage_unit="kl_share", fix=["2:*=share"], forbid=["*:7=int2"])
    assert all(plan.option(Cell(2, layer)) == "share" for layer in range(24))
    assert all(plan.option(Cell(t, 7)) != "int2" for t in range(3))
    assert plan.provenance["fix"] == ("2:*=share",)
    assert plan.provenance["forbid"] == ("*:7=int2",)
    # The paper's layer-only ablation with loop 3 (1-based) shared: loops 0-1 tied per layer, loop 2 shares.
    ablation = solve_layerwise(profile, max_damage=8.0, damage_unit="kl_share", fix="2:*=share")
    for layer in range(24):
        assert ablation.option(Cell(0, layer)) == ablation.option(Cell(1, layer))
        assert ablation.option(Cell(2, layer)) == "share"
    same = solve(profile, max_damage=2.0, damage_unit="kl_share", fix={Cell(t, 5): "int4" for t in range(3)})
    assert [same.option(Cell(t, 5)) for t in range(3)] == ["int4"] * 3


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"fix": "3:*=share"}, "puts 'share' in the final loop"),
        ({"fix": "9:0=int4"}, r"names loop\(s\) \[9\]"),
        ({"fix": "0:0=int8"}, "unknown option"),
        ({"fix": "0-:0=int4"}, "must be \\*, N, A-B"),
        ({"fix": "0:0"}, "is not LOOPS:LAYERS=OPTIONS"),
        ({"fix": ["0:0=int4", "0:0=int2"]}, "fixed twice"),
        ({"fix": "0:0=int4", "forbid": "0:0=int4"}, "leaves cell \\(0, 0\\) no option"),
        ({"fix": [42]}, "rule strings"),
    ],
)
def test_rule_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        solve(_ouro_profile(), max_damage=math.inf, **kwargs)


# ------------------------------------------------------------------------------------- the min-stored objective
def test_min_stored_under_read_budget():
    profile = _ouro_profile(seed=9)
    free = solve(profile, max_damage=2.0, damage_unit="kl_share", objective="stored")
    capped = solve(profile, max_damage=2.0, damage_unit="kl_share", objective="stored", max_read_kib=200.0)
    assert capped.predicted["read_kib"] <= 200.0
    assert capped.predicted["stored_kib"] >= free.predicted["stored_kib"]
    m = solve_preset(profile, "m")  # min read at <= 156 KiB stored: stores no less than the min-stored plan
    assert free.predicted["stored_kib"] <= m.predicted["stored_kib"]
    assert free.provenance["objective"].startswith("min stored bytes")


# ------------------------------------------------------------------------------------- Ouro-1.4B shape
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
    m2 = solve_preset(profile, "m", max_stored_kib=170.0)  # overriding the storage budget replaces the fraction
    assert m2.provenance["budgets"]["max_stored_kib"] == 170.0
    assert m2.predicted["read_kib"] <= m.predicted["read_kib"]


def test_timing_ouro_and_144_cells():
    """Sanity, not a benchmark: the DP is far from the CPU's limits, with the widest menus too."""
    profile = _ouro_profile(seed=1)
    start = time.perf_counter()
    solve(profile, max_damage=2.0, damage_unit="kl_share", storage_fraction=0.65)
    solve(profile, max_damage=1.19, damage_unit="kl_share", options=("bf16", "int4", "int2", "share"))
    assert time.perf_counter() - start < 1.0
    start = time.perf_counter()
    solve(profile, max_damage=2.0, damage_unit="kl_share", storage_fraction=0.65, tau=(10, 10, math.inf, math.inf),
          hot_fraction=1 / 6, options=("bf16", "int4", "int2", "share"), final_options=("bf16", "int4", "int2"))
    assert time.perf_counter() - start < 5.0
    big = _ouro_profile(seed=2, loops=7)  # 144 non-final cells
    start = time.perf_counter()
    solve(big, max_damage=8.0, damage_unit="kl_share", storage_fraction=0.65)
    assert time.perf_counter() - start < 10.0


def test_budget_units_and_rounding():
    profile = _ouro_profile(seed=3)
    a = solve(profile, max_damage=3.0 * KL_SHARE, max_stored_kib=156.0)
    b = solve(profile, max_damage=3.0, damage_unit="kl_share", storage_fraction=0.65)
    assert a.options == b.options
    c = solve(profile, max_damage=3.0 * KL_SHARE, max_stored_kib=156.49)  # KiB budgets round down to 0.5 KiB units
    assert c.provenance["budgets"]["max_stored_kib"] == 156.0
    assert c.options == a.options


def test_infeasible_messages():
    profile = _ouro_profile(seed=5)
    with pytest.raises(ValueError, match="minimum achievable damage") as err:
        solve(profile, max_damage=0.01, damage_unit="kl_share", storage_fraction=0.65)
    least = float(str(err.value).split("damage there is ")[1].split(" ")[0])
    solve(profile, max_damage=least * 1.001, storage_fraction=0.65)  # the stated minimum is achievable
    with pytest.raises(ValueError, match="least storage is 168 KiB"):  # 72 x 1.5 (int2) + 24 x 2.5 (int4 final)
        solve(profile, max_damage=math.inf, max_stored_kib=100.0, options=("int4", "int2"))
    with pytest.raises(ValueError, match="no plan fits stored <= 50"):
        solve(profile, max_damage=math.inf, max_stored_kib=50.0)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_damage": -1.0}, "max_damage"),
        ({"max_damage": 1.0, "damage_unit": "bits"}, "damage_unit"),
        ({"max_damage": 1.0, "max_stored_kib": 100.0, "storage_fraction": 0.5}, "not both"),
        ({"max_damage": 1.0, "options": ("int8",)}, "options"),
        ({"max_damage": 1.0, "final_option": "share"}, "final_option"),
        ({"max_damage": 1.0, "final_options": ("share",)}, "final_options"),
        ({"max_damage": 1.0, "final_options": ("int4",), "final_option": "int4"}, "not both"),
        ({"max_damage": 1.0, "hot_fraction": 0.5}, "hot_fraction"),
        ({"max_damage": 1.0, "tau": -1.0}, "tau"),
        ({"max_damage": 1.0, "tau": (1.0, 2.0)}, "2 entries but the plan has 4 loops"),
        ({"max_damage": 1.0, "objective": "speed"}, "objective"),
        ({"max_damage": 1.0, "max_read_kib": -1.0}, "max_read_kib"),
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


# ---- Per-cell rules: the LOOPS:LAYERS=OPTIONS syntax and what fix / forbid leave each cell.
LAYOUT = CellLayout(4, 6)
MENU, FINAL = ("int4", "int2", "share"), ("int4",)


def _cells(rule):
    return [tuple(c) for c in parse_rule(rule).cells(LAYOUT)]


def test_rule_syntax():
    assert _cells("2:*=share") == [(2, layer) for layer in range(6)]
    assert _cells("*:3=int2") == [(t, 3) for t in range(4)]
    assert _cells("0-1:4,0=int4") == [(0, 0), (0, 4), (1, 0), (1, 4)]
    assert parse_rule(" 1 : 2 = int4|bf16 ").options == ("int4", "bf16")
    for bad, match in [("2:*", "LOOPS:LAYERS=OPTIONS"), ("x:1=int4", "must be \\*, N, A-B"),
                       ("3-1:0=int4", "range '3-1' is empty"), ("0:0=int9", "unknown option")]:
        with pytest.raises(ValueError, match=match):
            parse_rule(bad)
    with pytest.raises(ValueError, match=r"layer\(s\) \[6\].*0\.\.5"):
        parse_rule("0:6=int4").cells(LAYOUT)


def test_fix_and_forbid():
    allowed = allowed_options(LAYOUT, MENU, FINAL, fix=["2:*=share", "0:0=int4|bf16"], forbid=["*:5=int2"])
    assert allowed[LAYOUT.flat_index(Cell(2, 3))] == ("share",)
    assert allowed[LAYOUT.flat_index(Cell(0, 0))] == ("int4", "bf16")  # a fixed option may be off the menu
    assert allowed[LAYOUT.flat_index(Cell(1, 5))] == ("int4", "share")
    assert allowed[LAYOUT.flat_index(Cell(3, 5))] == ("int4",)  # the final loop: its own menu
    assert allowed[LAYOUT.flat_index(Cell(1, 1))] == MENU


def test_rule_forms():
    text = as_rules(["1:2=int4"], "fix")
    pair = as_rules((Cell(1, 2), "int4"), "fix")
    mapping = as_rules({Cell(1, 2): ["int4"]}, "fix")
    assert [r.cells(LAYOUT) for r in text] == [r.cells(LAYOUT) for r in pair] == [r.cells(LAYOUT) for r in mapping]
    assert text[0].options == pair[0].options == mapping[0].options == ("int4",)
    with pytest.raises(ValueError, match="rule strings"):
        as_rules([3.5], "forbid")
