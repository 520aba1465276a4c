"""The exact planner: a multiple-choice knapsack with two resource constraints (paper §3.1).

Paper §3.1, eq. (2): every non-final cell ``c`` takes one option ``o`` with stored bytes ``s_o``, read
bytes ``r_o`` and damage ``d[c, o]`` (the profile's single-cell KL), and the plan solves

    min  sum_c r_{o(c)}   s.t.  sum_c d[c, o(c)] <= eps,   sum_c s_{o(c)} <= M.

The final loop, which every ``share`` cell reads, is fixed at ``final_option`` (INT4 by default); its
bytes and its damage (0 for INT4 and BF16 by definition, the profile's ``final_int2`` for INT2) are a
constant of every plan, and ``eps`` and ``M`` bound the whole cache.

Byte unit. Per token and cell a cell with ``E = 2 * kv_heads * head_dim`` K/V elements stores
16 (bf16), 5 (int4) or 3 (int2) bits per element (metadata included, :mod:`loopkv.format`), and a ``share``
cell stores 0 and reads its source's bits. Bits per element is therefore an integer byte unit of
``E / 8`` bytes (0.5 KiB for Ouro-1.4B: int4 = 5 units, int2 = 3 units), the unit of
:func:`loopkv.planning.bytes.unit_kib`. Budgets in KiB are rounded *down* to whole units.

Dynamic program. Damage is real-valued, so the DP runs over integer byte totals and keeps the minimum
damage per state. Every own option reads what it stores, and a ``share`` cell reads the final option's
bytes while storing 0, so ``read = stored + extra`` where ``extra`` counts shared cells; the state is
``(stored units, shared count)``, equivalent to the (stored, read) pair and smaller. After the last cell,
among the states with ``stored <= M`` and ``damage <= eps`` the solver takes the least read, ties to the
least damage, then the least storage. Exact for any damages; 144 cells take well under a second.

Damage budgets are compared with a relative tolerance of ``DAMAGE_RTOL`` (1e-9), so that a budget equal
to some plan's summed damage admits that plan whatever the summation order.

V precision (finite ``tau``) saves ``1 - hot_fraction`` units of every INT4 read (own INT4, a share of an
INT4 source, and the final loop's INT4 cells). The DP minimizes reads at ``tau = inf``. With options
drawn from {int4, int2, share} and an INT4 or INT2 final loop, every plan's read total is
``3 n + a * (number of INT4 readers)`` with ``a = 2`` without and ``1 + hot_fraction`` with V precision,
so the same plans are optimal either way; with ``bf16`` among the options they may not be (recorded in
the plan's provenance as ``objective``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from functools import reduce
from typing import Any

import numpy as np

from loopkv.cells import Cell
from loopkv.format import OPTIONS, stored_bits_per_element
from loopkv.planning import bytes as _bytes
from loopkv.planning.plan import Plan
from loopkv.planning.profile_data import Profile

# Bits per K/V element, metadata included (from the storage format). 1 unit = 1 bit per element = E/8 bytes.
OPTION_UNITS = {o: int(stored_bits_per_element(o)) for o in ("bf16", "int4", "int2")}
SOLVER_OPTIONS = OPTIONS
FINAL_OPTIONS = tuple(o for o in OPTIONS if o != "share")  # the final loop is the source shared cells read
DEFAULT_OPTIONS = ("int4", "int2", "share")
DAMAGE_UNITS = ("abs", "kl_share")
DAMAGE_RTOL = 1e-9
_KIB_RTOL = 1e-9  # a KiB budget within this of a whole unit counts as that unit (float round-off)
# Presets (paper §3.1). R: read-optimized, damage <= 1.19 KL_share, no storage budget. M: memory-
# optimized, damage <= 2.0 KL_share and storage <= 0.65 of uniform INT4 storage (156 of 240 KiB per
# token on Ouro-1.4B, the paper's budget).
PRESETS: Mapping[str, Mapping[str, Any]] = {
    "r": {"max_damage": 1.19, "damage_unit": "kl_share"},
    "m": {"max_damage": 2.0, "damage_unit": "kl_share", "storage_fraction": 0.65},
}


def unit_kib_of(profile_or_plan: Any) -> float:
    """KiB per byte unit for the KV shape of a Profile or a Plan (which must record kv_heads and
    head_dim): one bit per K/V element of one token and cell, ``2 * kv_heads * head_dim / 8 / 1024``,
    the same unit as :func:`loopkv.planning.bytes.unit_kib` (0.5 KiB for Ouro-1.4B)."""
    x = profile_or_plan
    if getattr(x, "kv_heads", None) is None or getattr(x, "head_dim", None) is None:
        raise ValueError("unit_kib_of needs an object that records kv_heads and head_dim (a Profile or a Plan)")
    return _bytes.unit_kib(_bytes.ModelShape(x.loops, x.layers, x.kv_heads, x.head_dim))


def plan_units(plan: Any) -> tuple[int, int]:
    """``(stored, read)`` per history token of ``plan`` in byte units (see the module docstring), at
    ``tau = inf``; multiply by :func:`unit_kib_of` for KiB."""
    stored = read = 0
    layers, final = plan.layers, plan.loops - 1
    for index, option in enumerate(plan.options):
        if option == "share":
            read += OPTION_UNITS[plan.options[final * layers + index % layers]]
        else:
            stored += OPTION_UNITS[option]
            read += OPTION_UNITS[option]
    return stored, read


def predicted_damage(profile: Profile, plan: Any) -> float:
    """The sum of ``plan``'s single-cell damages from ``profile`` (non-final cells in flat order, plus
    the final loop's): what the solver records as ``predicted["damage"]``."""
    if (plan.loops, plan.layers) != (profile.loops, profile.layers):
        raise ValueError(
            f"plan has loops={plan.loops}, layers={plan.layers} but the profile has loops={profile.loops}, "
            f"layers={profile.layers}; use the profile of the plan's model"
        )
    layout, final = profile.layout, profile.loops - 1
    cells = [layout.cell(i) for i in range(layout.num_cells)]
    nonfinal = sum(profile.damage_of(c, plan.options[i]) for i, c in enumerate(cells) if c.loop != final)
    return nonfinal + sum(profile.damage_of(c, plan.options[i]) for i, c in enumerate(cells) if c.loop == final)


# ---------------------------------------------------------------------------------------------- core DP
class _Infeasible(Exception):
    def __init__(self, min_damage: float | None) -> None:
        self.min_damage = min_damage  # None: no assignment fits the storage budget at all


def _mckp(
    damage: np.ndarray,
    stored: np.ndarray,
    extra: np.ndarray,
    *,
    max_damage: float,
    max_stored: int | None,
    base_damage: float = 0.0,
) -> tuple[np.ndarray, float, int, int]:
    """Exact two-constraint multiple-choice knapsack.

    damage: float64 ``[n, k]`` (``inf`` = option not allowed for that item); stored, extra: int64
    ``[n, k]`` >= 0 with ``read = stored + extra``. Returns ``(choice int64 [n], damage, stored, read)``
    minimizing read s.t. ``base_damage + damage <= max_damage * (1 + DAMAGE_RTOL)`` and
    ``stored <= max_stored``; ties go to less damage, then less storage, then the earlier option. The
    returned damage includes ``base_damage``. Raises ``_Infeasible`` (with the least total damage).
    """
    n, k = damage.shape
    positive = extra[(extra > 0) & np.isfinite(damage)]
    g = int(reduce(math.gcd, positive.tolist(), 0)) or 1
    xq = extra // g
    allowed = np.isfinite(damage)
    cap = int(np.where(allowed, stored, 0).max(axis=1).sum()) if max_stored is None else max_stored
    best = np.zeros((1, 1))  # best[S, X]: min damage over the items so far
    s_hi = x_hi = 0
    choices = []
    for i in range(n):
        ok = [j for j in range(k) if allowed[i, j] and stored[i, j] <= cap]
        ns = min(s_hi + max((int(stored[i, j]) for j in ok), default=0), cap)
        nx = x_hi + max((int(xq[i, j]) for j in ok), default=0)
        new = np.full((ns + 1, nx + 1), np.inf)
        ch = np.full((ns + 1, nx + 1), -1, dtype=np.int8)
        for j in ok:
            s, x = int(stored[i, j]), int(xq[i, j])
            rows = min(s_hi, ns - s) + 1
            cand = best[:rows] + damage[i, j]  # [rows, x_hi + 1]
            dst = new[s : s + rows, x : x + x_hi + 1]
            better = cand < dst
            np.copyto(dst, cand, where=better)
            ch[s : s + rows, x : x + x_hi + 1][better] = j
        best, s_hi, x_hi = new, ns, nx
        choices.append(ch)
    reachable = np.isfinite(best)
    if not reachable.any():
        raise _Infeasible(None)
    feasible = reachable & (best + base_damage <= max_damage * (1.0 + DAMAGE_RTOL))
    if not feasible.any():
        raise _Infeasible(float(best[reachable].min()) + base_damage)
    S, X = np.nonzero(feasible)
    reads = S + X * g
    order = np.lexsort((S, best[S, X], reads))  # last key is primary: read, then damage, then stored
    s, x = int(S[order[0]]), int(X[order[0]])
    total_damage, total_stored, total_read = float(best[s, x]) + base_damage, s, s + x * g
    choice = np.empty(n, dtype=np.int64)
    for i in range(n - 1, -1, -1):
        j = int(choices[i][s, x])
        assert j >= 0, "backtracking reached an unreachable state"
        choice[i] = j
        s, x = s - int(stored[i, j]), x - int(xq[i, j])
    assert (s, x) == (0, 0)
    return choice, total_damage, total_stored, total_read


# ------------------------------------------------------------------------------------------- public API
def solve(
    profile: Profile,
    *,
    max_damage: float,
    max_stored_kib: float | None = None,
    final_option: str = "int4",
    options: Sequence[str] = DEFAULT_OPTIONS,
    damage_unit: str = "abs",
    storage_fraction: float | None = None,
    tau: float = math.inf,
    hot_fraction: float = 1.0,
) -> Any:
    """The plan with the least read bytes per token whose summed damage and stored bytes fit the budgets.

    max_damage: the damage budget ``eps`` for the whole cache (final loop included), in nats/token
        (``damage_unit="abs"``) or in units of ``profile.kl_share`` (``"kl_share"``); ``math.inf``: none.
    max_stored_kib: storage budget ``M`` in KiB per history token over all cells, or
    storage_fraction: ``M`` as a fraction of uniform INT4 storage (0.65 on Ouro-1.4B = 156 KiB). At most
        one of the two; neither: no storage budget.
    final_option: the final loop's fixed option (``int4``, ``int2`` or ``bf16``).
    options: the options the non-final cells may take, from ``bf16, int4, int2, share``.
    tau, hot_fraction: V precision threshold recorded in the plan, and the expected fraction of hot
        tokens, used for ``predicted["read_kib_v_precision"]`` (see the module docstring).

    Returns a :class:`loopkv.planning.plan.Plan` with ``predicted`` (damage, damage_kl_share,
    stored_kib, read_kib, ...) and ``provenance`` (solver, budgets, profile hash). Raises ValueError
    when the budgets are infeasible, stating the least damage (or storage) achievable.
    """
    opts = _check_args(profile, final_option, options, tau, hot_fraction)
    budget = _budgets(profile, max_damage, damage_unit, max_stored_kib, storage_fraction)
    layout, final = profile.layout, profile.loops - 1
    cells = [c for c in layout if c.loop != final]
    _check_measured(profile, [(c, o) for c in cells for o in opts if o != "bf16"], opts)
    fu = OPTION_UNITS[final_option]
    damage = np.array([[profile.damage_of(c, o) for o in opts] for c in cells], dtype=np.float64)
    stored = np.array([[0 if o == "share" else OPTION_UNITS[o] for o in opts]] * len(cells), dtype=np.int64)
    extra = np.array([[fu if o == "share" else 0 for o in opts]] * len(cells), dtype=np.int64)
    choice = _run(profile, damage, stored, extra, budget, final_option, opts)
    options_out = [opts[j] for j in choice] + [final_option] * profile.layers
    return _make_plan(profile, options_out, budget, final_option, opts, tau, hot_fraction, "cell")


def solve_layerwise(
    profile: Profile,
    *,
    max_damage: float,
    max_stored_kib: float | None = None,
    final_option: str = "int4",
    options: Sequence[str] = DEFAULT_OPTIONS,
    damage_unit: str = "abs",
    storage_fraction: float | None = None,
    tau: float = math.inf,
    hot_fraction: float = 1.0,
) -> Any:
    """The paper's layer-only ablation (Appendix D): the same knapsack and budgets as :func:`solve`, but
    one option per layer, the same for loops ``0 .. T-2``; an item per layer whose damage is the sum
    of that layer's non-final cells and whose bytes are ``T-1`` times a cell's."""
    opts = _check_args(profile, final_option, options, tau, hot_fraction)
    budget = _budgets(profile, max_damage, damage_unit, max_stored_kib, storage_fraction)
    nl = profile.loops - 1
    needed = [(c, o) for c in profile.layout if c.loop < nl for o in opts if o != "bf16"]
    _check_measured(profile, needed, opts)
    fu = OPTION_UNITS[final_option]
    damage = np.array(
        [
            [math.fsum(profile.damage_of(Cell(t, layer), o) for t in range(nl)) for o in opts]
            for layer in range(profile.layers)
        ],
        dtype=np.float64,
    )
    stored = np.array([[0 if o == "share" else nl * OPTION_UNITS[o] for o in opts]] * profile.layers, np.int64)
    extra = np.array([[nl * fu if o == "share" else 0 for o in opts]] * profile.layers, dtype=np.int64)
    choice = _run(profile, damage, stored, extra, budget, final_option, opts)
    options_out = [opts[choice[layer]] for _ in range(nl) for layer in range(profile.layers)]
    options_out += [final_option] * profile.layers
    return _make_plan(profile, options_out, budget, final_option, opts, tau, hot_fraction, "layer")


def solve_preset(profile: Profile, preset: str, **overrides: Any) -> Any:
    """The paper's presets (§3.1), solved on ``profile``:

    * ``"r"`` (LoopKV-R, read-optimized): damage <= 1.19 KL_share, no storage budget;
    * ``"m"`` (LoopKV-M, memory-optimized): damage <= 2.0 KL_share and storage <= 0.65 of uniform INT4
      storage (156 KiB per token on Ouro-1.4B's 240).

    ``overrides`` are :func:`solve` keywords (e.g. ``tau``, ``options``, ``max_stored_kib``, which
    replaces the M preset's ``storage_fraction``). The plan's provenance records ``preset``.
    """
    key = preset.lower() if isinstance(preset, str) else preset
    if key not in PRESETS:
        raise ValueError(f"preset must be one of {sorted(PRESETS)} (read- or memory-optimized), got {preset!r}")
    kwargs = dict(PRESETS[key])
    if "max_stored_kib" in overrides:
        kwargs.pop("storage_fraction", None)
    if "max_damage" in overrides and "damage_unit" not in overrides:
        kwargs.pop("damage_unit")
    kwargs.update(overrides)
    plan = solve(profile, **kwargs)
    return dataclasses.replace(plan, provenance={**_plain(plan.provenance), "preset": key})


# ------------------------------------------------------------------------------------------- internals
def _check_args(profile: Profile, final_option: str, options: Iterable[str], tau: float, hot: float) -> tuple:
    if not isinstance(profile, Profile):
        raise ValueError(f"profile must be a loopkv.planning.Profile, got {type(profile).__name__}")
    if final_option not in FINAL_OPTIONS:
        raise ValueError(
            f"final_option must be one of {FINAL_OPTIONS} (the final loop cannot share), got {final_option!r}"
        )
    if final_option == "int2" and profile.final_int2 is None:
        raise ValueError("final_option='int2' needs the profile's final_int2 damages; profile the final loop at int2")
    opts = tuple(options) if not isinstance(options, str) else (options,)
    if not opts or len(set(opts)) != len(opts) or any(o not in SOLVER_OPTIONS for o in opts):
        raise ValueError(f"options must be distinct values from {SOLVER_OPTIONS}, got {options!r}")
    if not isinstance(tau, (int, float)) or math.isnan(tau) or tau < 0:
        raise ValueError(f"tau must be a number >= 0 (math.inf: V precision off), got {tau!r}")
    if not isinstance(hot, (int, float)) or not 0.0 <= hot <= 1.0:
        raise ValueError(f"hot_fraction must be in [0, 1], got {hot!r}")
    if math.isinf(tau) and hot != 1.0:
        raise ValueError(f"hot_fraction={hot} needs V precision; pass a finite tau or leave hot_fraction=1.0")
    return opts


def _budgets(profile: Profile, max_damage: float, unit: str, max_kib: float | None, frac: float | None) -> dict:
    if unit not in DAMAGE_UNITS:
        raise ValueError(f"damage_unit must be one of {DAMAGE_UNITS}, got {unit!r}")
    if not isinstance(max_damage, (int, float)) or math.isnan(max_damage) or max_damage < 0:
        raise ValueError(f"max_damage must be a number >= 0 (math.inf: no damage budget), got {max_damage!r}")
    if unit == "kl_share" and profile.kl_share is None:
        raise ValueError("damage_unit='kl_share' needs the profile's kl_share; measure it or pass damage_unit='abs'")
    eps = float(max_damage) * (profile.kl_share if unit == "kl_share" else 1.0)
    if max_kib is not None and frac is not None:
        raise ValueError("pass max_stored_kib or storage_fraction, not both")
    ukib = unit_kib_of(profile)
    uniform_int4 = profile.loops * profile.layers * OPTION_UNITS["int4"]
    m_units = None
    if max_kib is not None:
        if not isinstance(max_kib, (int, float)) or math.isnan(max_kib) or max_kib < 0:
            raise ValueError(f"max_stored_kib must be a number >= 0 (KiB per history token), got {max_kib!r}")
        m_units = None if math.isinf(max_kib) else math.floor(max_kib / ukib * (1 + _KIB_RTOL))
    if frac is not None:
        if not isinstance(frac, (int, float)) or math.isnan(frac) or frac < 0:
            raise ValueError(f"storage_fraction must be a number >= 0 (of uniform INT4 storage), got {frac!r}")
        m_units = None if math.isinf(frac) else math.floor(frac * uniform_int4 * (1 + _KIB_RTOL))
    return {
        "eps": eps,
        "m_units": m_units,
        "unit_kib": ukib,
        "record": {
            "max_damage": None if math.isinf(eps) else eps,
            "max_damage_kl_share": None if math.isinf(eps) or not profile.kl_share else eps / profile.kl_share,
            "damage_unit": unit,
            "max_stored_kib": None if m_units is None else m_units * ukib,
            "storage_fraction": None if frac is None or math.isinf(frac) else float(frac),
        },
    }


def _check_measured(profile: Profile, needed: list[tuple[Cell, str]], opts: tuple) -> None:
    lacking = [(c, o) for c, o in needed if (profile.layout.flat_index(c), o) not in profile.damage]
    if lacking:
        raise ValueError(
            f"the profile lacks {len(lacking)} (cell, option) damages that options={opts} need (first: "
            f"{lacking[:3]}); finish profiling (Profile.missing() lists them) or drop those options"
        )


def _run(profile: Profile, damage, stored, extra, budget: dict, final_option: str, opts: tuple) -> np.ndarray:
    L, fu = profile.layers, OPTION_UNITS[final_option]
    base_damage = math.fsum(profile.final_int2) if final_option == "int2" else 0.0
    m = budget["m_units"]
    cap = None if m is None else m - L * fu
    eps, ukib, kl = budget["eps"], budget["unit_kib"], profile.kl_share
    in_kl = (lambda d: f" ({d / kl:.4g} KL_share)") if kl else (lambda d: "")
    m_text = "no storage budget" if m is None else f"stored <= {m * ukib:g} KiB/token"
    if cap is not None and cap < 0:
        raise ValueError(
            f"the storage budget ({m * ukib:g} KiB/token) is below the final loop's own "
            f"{L * fu * ukib:g} KiB at {final_option!r}; raise max_stored_kib/storage_fraction"
        )
    try:
        choice = _mckp(damage, stored, extra, max_damage=eps, max_stored=cap, base_damage=base_damage)[0]
    except _Infeasible as err:
        if err.min_damage is None:
            least = L * fu + int(np.where(np.isfinite(damage), stored, 10**9).min(axis=1).sum())
            raise ValueError(
                f"no plan fits {m_text}: the least storage with options={opts} and final loop "
                f"{final_option!r} is {least * ukib:g} KiB/token; raise max_stored_kib/storage_fraction "
                "or allow 'share'/'int2'"
            ) from None
        least = err.min_damage
        raise ValueError(
            f"max_damage={eps:.6g}{in_kl(eps)} is infeasible with {m_text}: the minimum achievable "
            f"damage there is {least:.6g}{in_kl(least)} (final loop {base_damage:.4g} included); raise "
            "max_damage to at least that or loosen the storage budget"
        ) from None
    return choice


def _make_plan(profile, options_out, budget, final_option, opts, tau, hot, granularity) -> Plan:
    plan = Plan(
        loops=profile.loops,
        layers=profile.layers,
        options=tuple(options_out),
        tau=tau,
        kv_heads=profile.kv_heads,
        head_dim=profile.head_dim,
    )
    s_units, r_units = plan_units(plan)
    ukib, kl = budget["unit_kib"], profile.kl_share
    dmg = predicted_damage(profile, plan)
    predicted: dict[str, Any] = {
        "damage": dmg,
        "damage_kl_share": dmg / kl if kl else None,
        "damage_final_loop": math.fsum(profile.final_int2) if final_option == "int2" else 0.0,
        "stored_kib": s_units * ukib,
        "read_kib": r_units * ukib,
    }
    if math.isfinite(tau):
        int4_reads = sum(
            1
            for i, o in enumerate(options_out)
            if (
                o == "int4"
                or (o == "share" and options_out[(profile.loops - 1) * profile.layers + i % profile.layers] == "int4")
            )
        )
        predicted["read_kib_v_precision"] = (r_units - (1.0 - hot) * int4_reads) * ukib
        predicted["hot_fraction"] = float(hot)
    exact_vp = "bf16" not in opts and final_option != "bf16"
    provenance = {
        "solver": f"loopkv.planning.knapsack.{'solve' if granularity == 'cell' else 'solve_layerwise'}",
        "method": "exact two-constraint multiple-choice knapsack (DP over byte units), one option per " + granularity,
        "objective": "min read bytes at tau=inf" + (" (also optimal with V precision)" if exact_vp else ""),
        "budgets": budget["record"],
        "final_option": final_option,
        "options": list(opts),
        "profile_hash": profile.content_hash(),
        "profile_provenance": _plain(profile.provenance),
    }
    return dataclasses.replace(plan, predicted=predicted, provenance=provenance)


def _plain(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value
