"""The exact planner: a multiple-choice knapsack with two resources (paper §3.1).

Paper §3.1, eq. (2): every cell ``c`` takes one option ``o`` with stored bytes ``s_o``, read bytes ``r_o``
and damage ``d[c, o]`` (the profile's single-cell KL), and the plan solves

    min  sum_c r_{o(c)}   s.t.  sum_c d[c, o(c)] <= eps,   sum_c s_{o(c)} <= M      (objective "read")
    min  sum_c s_{o(c)}   s.t.  sum_c d[c, o(c)] <= eps,   sum_c r_{o(c)} <= R      (objective "stored")

The second is the objective the paper uses for models trained to share (Dory's planes, Appendix G). Both
budgets are optional, and either objective takes both.

**The final loop is in the sum.** Its cells (the sources ``share`` cells read) take an option from
``final_options`` (INT4 by default, the paper's source) and their damage counts in ``eps``: the profile
measures the final loop's INT4 and INT2 per layer, so ``eps = 0`` with ``bf16`` offered gives an all-exact
plan. A profile made before the final loop's INT4 was profiled counts it as 0 and the plan says so
(``predicted["uncounted"]``, :func:`prediction_notes`, an :class:`UncountedDamageWarning`).

**Shares and their source.** A ``share`` cell stores 0 and reads its source's bytes. Its damage was
measured with the source at the profile's ``share_source`` (INT4 by default), so the solver offers ``share``
at a layer only where the final loop's cell takes that option; the final option is chosen per layer,
together with the layer's cells (one DP branch per final option, :mod:`loopkv.planning.mckp`).

**Per-cell constraints.** ``fix`` / ``forbid`` rules (:mod:`loopkv.planning.constraints`) restrict what
chosen cells may take: ``fix="2:*=share"`` (loop 2 shares, 0-based), ``forbid="*:7=int2"``.

Byte unit. Per token and cell a cell with ``E = 2 * kv_heads * head_dim`` K/V elements stores 16 (bf16), 5
(int4) or 3 (int2) bits per element, metadata included (:mod:`loopkv.format`), so one bit per element is
an integer unit of ``E / 8`` bytes (0.5 KiB for Ouro-1.4B), :func:`loopkv.planning.bytes.unit_kib`.
Budgets in KiB are rounded *down* to whole units.

V precision (finite ``tau``, one per plan or per loop) saves the lo plane, 1 unit, on ``1 - hot_fraction``
of the tokens of every INT4 read by a cell of a loop with a finite tau (own INT4, a share of an INT4
source, the final loop's own INT4). Reads are counted with it: the read objective and budget are the
expected read at ``hot_fraction``, which the DP counts exactly in units of ``1/q`` for ``hot_fraction =
p/q``, ``q <= 12`` (another hot fraction is solved at the nearest such ``p/q``, recorded as
``provenance["hot_fraction_solved"]``).

Damage budgets are compared with a relative tolerance of ``DAMAGE_RTOL`` (1e-9), so that a budget equal
to some plan's summed damage admits that plan whatever the summation order. Ties go to the least
damage, then the least of the other resource.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

from loopkv.cells import Cell
from loopkv.format import OPTIONS, stored_bits_per_element
from loopkv.planning import bytes as _bytes
from loopkv.planning.mckp import DAMAGE_RTOL, OBJECTIVES
from loopkv.planning.plan import Plan
from loopkv.planning.profile_data import Profile

__all__ = [
    "DAMAGE_RTOL", "DEFAULT_FINAL_OPTIONS", "DEFAULT_OPTIONS", "FINAL_OPTIONS", "OBJECTIVES", "OPTION_UNITS",
    "PRESETS", "UncountedDamageWarning", "plan_units", "predicted_damage", "prediction_notes", "solve",
    "solve_layerwise", "solve_preset", "unit_kib_of",
]

# Bits per K/V element, metadata included (from the storage format). 1 unit = 1 bit per element = E/8 bytes.
OPTION_UNITS = {o: int(stored_bits_per_element(o)) for o in ("bf16", "int4", "int2")}
SOLVER_OPTIONS = OPTIONS
FINAL_OPTIONS = tuple(o for o in OPTIONS if o != "share")  # the final loop is the source shared cells read
DEFAULT_OPTIONS = ("int4", "int2", "share")
DEFAULT_FINAL_OPTIONS = ("int4",)
DAMAGE_UNITS = ("abs", "kl_share")
HOT_DENOMINATOR = 12  # hot fractions are solved exactly as p/q with q <= this
_KIB_RTOL = 1e-9  # a KiB budget within this of a whole unit counts as that unit (float round-off)
# Presets (paper §3.1). R: read-optimized, damage <= 1.19 KL_share, no storage budget. M: memory-
# optimized, damage <= 2.0 KL_share and storage <= 0.65 of uniform INT4 storage (156 of 240 KiB per
# token on Ouro-1.4B, the paper's budget).
PRESETS: Mapping[str, Mapping[str, Any]] = {
    "r": {"max_damage": 1.19, "damage_unit": "kl_share"},
    "m": {"max_damage": 2.0, "damage_unit": "kl_share", "storage_fraction": 0.65},
}


class UncountedDamageWarning(UserWarning):
    """A plan's predicted damage leaves out a damage its profile does not hold (see Profile.uncounted)."""


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
    """The sum of ``plan``'s single-cell damages from ``profile``, every cell including the final loop's:
    what the solver records as ``predicted["damage"]``. :func:`prediction_notes` says what it leaves out."""
    _check_shape(profile, plan)
    layout = profile.layout
    return math.fsum(profile.damage_of(layout.cell(i), o) for i, o in enumerate(plan.options))


def prediction_notes(profile: Profile, plan: Any) -> list[str]:
    """What :func:`predicted_damage` does not count exactly for ``plan``, one sentence each: the final
    loop's INT4 where the profile did not measure it, and ``share`` cells whose source takes another option
    than the one their damage was measured with (priced with the measured share damage)."""
    _check_shape(profile, plan)
    T, L, layout = plan.loops, plan.layers, profile.layout
    notes = []
    missing = [layer for layer in range(L) if plan.options[(T - 1) * L + layer] == "int4"
               and not profile.is_counted(Cell(T - 1, layer), "int4")]
    if missing:
        where = "every layer" if len(missing) == L else f"layers {missing}"
        notes.append(f"the final loop's own INT4 damage (loop {T - 1}, {where}) is not in the profile and counts "
                     "as 0; re-profile with this loopkv to count it")
    odd = sorted({layout.cell(i).layer for i, o in enumerate(plan.options)
                  if o == "share" and plan.options[(T - 1) * L + i % L] != profile.share_source})
    if odd:
        notes.append(f"share cells at layers {odd} read a final-loop cell that is not {profile.share_source!r}, the "
                     "source their damage was measured with; their damage is that measurement (an approximation)")
    return notes


# ------------------------------------------------------------------------------------------- public API
def solve(
    profile: Profile,
    *,
    max_damage: float,
    max_stored_kib: float | None = None,
    storage_fraction: float | None = None,
    max_read_kib: float | None = None,
    objective: str = "read",
    options: Sequence[str] = DEFAULT_OPTIONS,
    final_options: Sequence[str] | None = None,
    final_option: str | None = None,
    fix: Any = None,
    forbid: Any = None,
    damage_unit: str = "abs",
    tau: float | Sequence[float] = math.inf,
    hot_fraction: float = 1.0,
) -> Plan:
    """The plan with the least read (or stored) bytes per token whose summed damage and bytes fit the budgets.

    max_damage: the damage budget ``eps`` for the whole cache, final loop included, in nats/token
        (``damage_unit="abs"``) or in units of ``profile.kl_share`` (``"kl_share"``); ``math.inf``: none.
    max_stored_kib: storage budget ``M`` in KiB per history token over all cells, or
    storage_fraction: ``M`` as a fraction of uniform INT4 storage (0.65 on Ouro-1.4B = 156 KiB). At most
        one of the two; neither: no storage budget.
    max_read_kib: read budget in KiB per history token (with V precision at ``hot_fraction`` when on).
    objective: ``"read"`` (minimise read bytes, the paper's planner) or ``"stored"`` (minimise stored bytes).
    options: the options the non-final cells may take, from ``bf16, int4, int2, share``.
    final_options: the options the final loop's cells may take, from ``bf16, int4, int2`` (default
        ``("int4",)``); ``final_option`` is the one-option shorthand.
    fix, forbid: per-cell rules (:mod:`loopkv.planning.constraints`), e.g. ``fix="2:*=share"``.
    tau, hot_fraction: the plan's V precision threshold (one number or one per loop) and the expected
        fraction of hot tokens, used for the reads (module docstring).

    Returns a :class:`~loopkv.planning.plan.Plan` with ``predicted`` (damage, damage_kl_share,
    damage_final_loop, stored_kib, read_kib, ...) and ``provenance`` (solver, objective, budgets, rules,
    profile hash). Raises ValueError when the budgets are infeasible, stating the least damage (or bytes)
    achievable.
    """
    from loopkv.planning.knapsack_problem import Problem  # it builds on this module's names

    return Problem.make(profile, locals(), granularity="cell").run()


def solve_layerwise(profile: Profile, *, max_damage: float, **kwargs: Any) -> Plan:
    """The paper's layer-only ablation (Appendix D): :func:`solve` with one option per layer, the same for
    the non-final loops. Cells named by a ``fix`` rule are not tied to their layer (so "layer-only with loop
    2 shared" is ``solve_layerwise(profile, ..., fix="2:*=share")``); ``forbid`` rules restrict the tied
    cells' common option. The final loop's cells are chosen per layer as in :func:`solve`."""
    args = {**_SOLVE_DEFAULTS, **kwargs, "max_damage": max_damage}
    unknown = sorted(set(kwargs) - set(_SOLVE_DEFAULTS))
    if unknown:
        raise ValueError(f"solve_layerwise got unknown argument(s) {unknown}; it takes solve()'s")
    from loopkv.planning.knapsack_problem import Problem

    return Problem.make(profile, args, granularity="layer").run()


def solve_preset(profile: Profile, preset: str, **overrides: Any) -> Plan:
    """The paper's presets (§3.1), solved on ``profile``:

    * ``"r"`` (LoopKV-R, read-optimized): damage <= 1.19 KL_share, no storage budget;
    * ``"m"`` (LoopKV-M, memory-optimized): damage <= 2.0 KL_share and storage <= 0.65 of uniform INT4
      storage (156 KiB per token on Ouro-1.4B's 240).

    ``overrides`` are :func:`solve` keywords (e.g. ``tau``, ``options``, ``fix``, ``max_stored_kib``, which
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


_SOLVE_DEFAULTS = {
    "max_stored_kib": None, "storage_fraction": None, "max_read_kib": None, "objective": "read",
    "options": DEFAULT_OPTIONS, "final_options": None, "final_option": None, "fix": None, "forbid": None,
    "damage_unit": "abs", "tau": math.inf, "hot_fraction": 1.0,
}


# ------------------------------------------------------------------------------------------- internals
def _check_shape(profile: Profile, plan: Any) -> None:
    if (plan.loops, plan.layers) != (profile.loops, profile.layers):
        raise ValueError(
            f"plan has loops={plan.loops}, layers={plan.layers} but the profile has loops={profile.loops}, "
            f"layers={profile.layers}; use the profile of the plan's model"
        )


def _plain(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value

