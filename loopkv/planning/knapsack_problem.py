"""The planner's problem builder: arguments, budgets, prices and DP groups (see :mod:`loopkv.planning.knapsack`).

:class:`Problem` checks :func:`~loopkv.planning.knapsack.solve`'s arguments, prices every allowed (cell,
option) in units of ``1/q`` byte units (``hot_fraction = p/q``), builds one DP group per layer with one
branch per option of the layer's final-loop cell, runs :func:`loopkv.planning.mckp.solve` and turns its
choice into a :class:`~loopkv.planning.plan.Plan` with its predicted figures and provenance.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Sequence
from fractions import Fraction
from typing import Any

from loopkv.cells import Cell
from loopkv.planning import constraints as _rules
from loopkv.planning import mckp
from loopkv.planning.knapsack import (
    DAMAGE_UNITS,
    DEFAULT_FINAL_OPTIONS,
    FINAL_OPTIONS,
    HOT_DENOMINATOR,
    OBJECTIVES,
    OPTION_UNITS,
    SOLVER_OPTIONS,
    UncountedDamageWarning,
    _plain,
    plan_units,
    predicted_damage,
    prediction_notes,
    unit_kib_of,
)
from loopkv.planning.plan import Plan, _check_tau
from loopkv.planning.profile_data import Profile

_KIB_RTOL = 1e-9  # a KiB budget within this of a whole unit counts as that unit (float round-off)
ItemMeta = tuple[tuple[int, ...], tuple[str, ...]]  # (flat cell indices, option per choice)


@dataclasses.dataclass
class Problem:
    profile: Profile
    granularity: str  # "cell" or "layer"
    objective: str
    options: tuple[str, ...]
    final_options: tuple[str, ...]
    allowed: dict[int, tuple[str, ...]]
    tied: dict[int, tuple[int, ...]]  # layerwise: per layer, the non-final cells that share one option
    rules: dict[str, list[str]]
    budget: dict
    tau: float | tuple[float, ...]
    hot: float
    p: int
    q: int

    # ------------------------------------------------------------------------------ arguments
    @classmethod
    def make(cls, profile: Profile, args: dict, *, granularity: str) -> Problem:
        if not isinstance(profile, Profile):
            raise ValueError(f"profile must be a loopkv.planning.Profile, got {type(profile).__name__}")
        if args["objective"] not in OBJECTIVES:
            raise ValueError(f"objective must be one of {OBJECTIVES} (what to minimise), got {args['objective']!r}")
        opts = _menu(args["options"], SOLVER_OPTIONS, "options")
        finals = _final_menu(profile, args["final_options"], args["final_option"])
        tau = _check_tau(args["tau"], profile.loops)
        taus = tau if isinstance(tau, tuple) else (tau,) * profile.loops
        p, q = _hot_ratio(args["hot_fraction"], any(math.isfinite(t) for t in taus))
        layout = profile.layout
        allowed = _rules.allowed_options(layout, opts, finals, fix=args["fix"], forbid=args["forbid"])
        rules = {k: _rules.describe(_rules.as_rules(args[k], k)) for k in ("fix", "forbid")}
        tied = {}
        if granularity == "layer":
            fixed = _rules.fixed_cells(layout, args["fix"])
            tied = {layer: tuple(t * profile.layers + layer for t in range(profile.loops - 1)
                                 if t * profile.layers + layer not in fixed) for layer in range(profile.layers)}
        problem = cls(profile, granularity, args["objective"], opts, finals, allowed, tied, rules, {}, tau,
                      float(args["hot_fraction"]), p, q)
        problem.budget = problem._budgets(args)
        problem._check_measured()
        return problem

    def _budgets(self, args: dict) -> dict:
        profile, unit = self.profile, args["damage_unit"]
        max_damage, max_kib, frac, max_read = (args["max_damage"], args["max_stored_kib"], args["storage_fraction"],
                                               args["max_read_kib"])
        if unit not in DAMAGE_UNITS:
            raise ValueError(f"damage_unit must be one of {DAMAGE_UNITS}, got {unit!r}")
        if not isinstance(max_damage, (int, float)) or math.isnan(max_damage) or max_damage < 0:
            raise ValueError(f"max_damage must be a number >= 0 (math.inf: no damage budget), got {max_damage!r}")
        if unit == "kl_share" and profile.kl_share is None:
            raise ValueError("damage_unit='kl_share' needs the profile's kl_share; measure it, or damage_unit='abs'")
        eps = float(max_damage) * (profile.kl_share if unit == "kl_share" else 1.0)
        if max_kib is not None and frac is not None:
            raise ValueError("pass max_stored_kib or storage_fraction, not both")
        ukib = unit_kib_of(profile)
        m_units = _units(max_kib, "max_stored_kib", 1.0 / ukib)
        uniform_int4 = profile.loops * profile.layers * OPTION_UNITS["int4"]
        if frac is not None:
            m_units = _units(frac, "storage_fraction (of uniform INT4 storage)", uniform_int4)
        r_cap = _units(max_read, "max_read_kib", self.q / ukib)  # in 1/q units (reads with V precision)
        kl = profile.kl_share
        return {
            "eps": eps, "m_units": m_units, "r_cap": r_cap, "unit_kib": ukib,
            "record": {
                "max_damage": None if math.isinf(eps) else eps,
                "max_damage_kl_share": None if math.isinf(eps) or not kl else eps / kl,
                "damage_unit": unit,
                "max_stored_kib": None if m_units is None else m_units * ukib,
                "storage_fraction": None if frac is None or math.isinf(frac) else float(frac),
                "max_read_kib": None if r_cap is None else r_cap / self.q * ukib,
            },
        }

    def _check_measured(self) -> None:
        profile, layout = self.profile, self.profile.layout
        final = profile.loops - 1
        if "int2" in self.final_options and any(
                "int2" in self.allowed[layout.flat_index(Cell(final, layer))] for layer in range(profile.layers)) \
                and profile.final_int2 is None:
            raise ValueError("the final loop may take 'int2' but the profile has no final-loop INT2 damages "
                             "(final_int2); profile the final loop at int2, or leave int2 out of final_options")
        lacking = [(layout.cell(i), o) for i, opts in self.allowed.items() for o in opts
                   if o != "bf16" and profile.is_counted(layout.cell(i), o) and (i, o) not in profile.damage]
        if lacking:
            raise ValueError(
                f"the profile lacks {len(lacking)} (cell, option) damages that the options and rules allow "
                f"(first: {lacking[:3]}); finish profiling (Profile.missing() lists them), or drop or forbid "
                "those options"
            )

    # ------------------------------------------------------------------------------ prices and groups
    def _price(self, index: int, option: str, final: str) -> mckp.Choice:
        """(damage, stored, read) of ``option`` at cell ``index`` when its layer's final cell takes ``final``;
        bytes in units of ``1/q`` byte units."""
        cell = self.profile.layout.cell(index)
        read_option = final if option == "share" else option
        stored = 0 if option == "share" else self.q * OPTION_UNITS[option]
        read = self.q * OPTION_UNITS[read_option]
        if read_option == "int4" and math.isfinite(self._tau(cell.loop)):
            read -= self.q - self.p
        return self.profile.damage_of(cell, option), stored, read

    def _tau(self, loop: int) -> float:
        return self.tau[loop] if isinstance(self.tau, tuple) else self.tau

    def _item(self, cells: Sequence[int], final: str, *, only: str | None = None) -> tuple[list, ItemMeta]:
        """One DP item: ``cells`` take one option together (one cell, or a layer's tied cells); ``only``: the
        item of the final cell, fixed to its branch's option."""
        common = [o for o in self.allowed[cells[0]] if all(o in self.allowed[i] for i in cells)]
        usable = [o for o in common if (o != "share" or final == self.profile.share_source) and o == (only or o)]
        choices = []
        for option in usable:
            prices = [self._price(i, option, final) for i in cells]
            choices.append((math.fsum(d for d, _, _ in prices), sum(s for _, s, _ in prices),
                            sum(r for _, _, r in prices)))
        return choices, (tuple(cells), tuple(usable))

    def groups(self) -> tuple[list, list[list[list[ItemMeta]]]]:
        """Per layer one group: per final option one branch of items (final cell first)."""
        T, L = self.profile.loops, self.profile.layers
        groups, meta = [], []
        for layer in range(L):
            fi = (T - 1) * L + layer
            nonfinal = [t * L + layer for t in range(T - 1)]
            if self.granularity == "layer":
                units = [(i,) for i in nonfinal if i not in self.tied[layer]]
                units += [self.tied[layer]] if self.tied[layer] else []
            else:
                units = [(i,) for i in nonfinal]
            branches, metas = [], []
            for final in self.allowed[fi]:
                items = [self._item((fi,), final, only=final)] + [self._item(u, final) for u in units]
                if all(choices for choices, _ in items):
                    branches.append([c for c, _ in items])
                    metas.append([m for _, m in items])
            if not branches:
                raise ValueError(self._no_branch_message(layer, units))
            groups.append(branches)
            meta.append(metas)
        return groups, meta

    def _no_branch_message(self, layer: int, units) -> str:
        T, L = self.profile.loops, self.profile.layers
        fi = (T - 1) * L + layer
        stuck = [self.profile.layout.cell(u[0]) for u in units
                 if all(o == "share" for o in self.allowed[u[0]])]
        return (
            f"no plan can serve layer {layer}: cells {[tuple(c) for c in stuck] or 'of this layer'} may only 'share', "
            f"and a share is priced only where the final loop's cell takes {self.profile.share_source!r} (the source "
            f"the profile measured shares with), but cell ({T - 1}, {layer}) may take only {self.allowed[fi]}; "
            "change the fix/forbid rules or final_options"
        )

    # ------------------------------------------------------------------------------ solve
    def run(self) -> Plan:
        groups, meta = self.groups()
        b, q = self.budget, self.q
        caps = {"max_stored": None if b["m_units"] is None else b["m_units"] * q,
                "max_read": b["r_cap"]}
        try:
            sol = mckp.solve(groups, objective=self.objective, max_damage=b["eps"], **caps)
        except mckp.Infeasible as err:
            raise ValueError(self._infeasible_message(err, groups)) from None
        options = [""] * (self.profile.loops * self.profile.layers)
        for layer_meta, branch, picks in zip(meta, sol.branches, sol.options, strict=True):
            for (cells, names), j in zip(layer_meta[branch], picks, strict=True):
                for i in cells:
                    options[i] = names[j]
        return self._make_plan(options, sol.read / q)

    def _caps_text(self) -> str:
        b = self.budget
        parts = [f"stored <= {b['m_units'] * b['unit_kib']:g} KiB/token" if b["m_units"] is not None else "",
                 f"read <= {b['r_cap'] / self.q * b['unit_kib']:g} KiB/token" if b["r_cap"] is not None else ""]
        return " and ".join(p for p in parts if p) or "no byte budget"

    def _infeasible_message(self, err: mckp.Infeasible, groups) -> str:
        ukib, kl, eps = self.budget["unit_kib"] / self.q, self.profile.kl_share, self.budget["eps"]
        in_kl = (lambda d: f" ({d / kl:.4g} KL_share)") if kl else (lambda d: "")
        if err.min_damage is None:
            least = [sum(min(sum(min(c[k] for c in item) for item in br) for br in g) for g in groups) for k in (1, 2)]
            return (f"no plan fits {self._caps_text()}: with these options, final options and rules the least "
                    f"storage is {least[0] * ukib:g} KiB/token and the least read {least[1] * ukib:g} KiB/token; "
                    "raise the budget, or allow 'share'/'int2' or fewer fixed cells")
        least = err.min_damage
        hint = "" if "bf16" in self.options and "bf16" in self.final_options else ", or offer 'bf16'"
        return (f"max_damage={eps:.6g}{in_kl(eps)} is infeasible with {self._caps_text()}: the minimum achievable "
                f"damage there is {least:.6g}{in_kl(least)} (the final loop's included); raise max_damage to at "
                f"least that, loosen the byte budgets{hint}")

    def _make_plan(self, options: list[str], read_objective_units: float) -> Plan:
        profile, ukib = self.profile, self.budget["unit_kib"]
        plan = Plan(loops=profile.loops, layers=profile.layers, options=tuple(options), tau=self.tau,
                    kv_heads=profile.kv_heads, head_dim=profile.head_dim, family=profile.family)
        s_units, r_units = plan_units(plan)
        dmg, kl, L = predicted_damage(profile, plan), profile.kl_share, profile.layers
        final_cells = range((profile.loops - 1) * L, profile.loops * L)
        predicted: dict[str, Any] = {
            "damage": dmg, "damage_kl_share": dmg / kl if kl else None,
            "damage_final_loop": math.fsum(profile.damage_of(profile.layout.cell(i), options[i]) for i in final_cells),
            "stored_kib": s_units * ukib, "read_kib": r_units * ukib,
        }
        if plan.v_precision:
            predicted["read_kib_v_precision"] = read_objective_units * ukib
            predicted["hot_fraction"] = self.hot
        notes = prediction_notes(profile, plan)
        if notes:
            predicted["uncounted"] = notes
            warnings.warn("the plan's predicted damage leaves out: " + "; ".join(notes), UncountedDamageWarning,
                          stacklevel=4)
        return dataclasses.replace(plan, predicted=predicted, provenance=self._provenance())

    def _provenance(self) -> dict[str, Any]:
        vp = any(math.isfinite(self._tau(t)) for t in range(self.profile.loops))
        objective = f"min {self.objective} bytes" + (f" (reads with V precision at hot fraction {self.p}/{self.q})"
                                                      if vp else "")
        what = "cell" if self.granularity == "cell" else "layer (non-final loops; the final loop per cell)"
        return {
            "solver": f"loopkv.planning.knapsack.{'solve' if self.granularity == 'cell' else 'solve_layerwise'}",
            "method": f"exact two-resource multiple-choice knapsack (DP over byte units), one option per {what}",
            "objective": objective,
            "budgets": self.budget["record"],
            "options": list(self.options),
            "final_options": list(self.final_options),
            "fix": self.rules["fix"],
            "forbid": self.rules["forbid"],
            "hot_fraction_solved": self.p / self.q if vp else None,
            "share_source": self.profile.share_source,
            "profile_hash": self.profile.content_hash(),
            "profile_provenance": _plain(self.profile.provenance),
        }


# ------------------------------------------------------------------------------------------- helpers
def _menu(options: Any, valid: Sequence[str], name: str) -> tuple[str, ...]:
    opts = (options,) if isinstance(options, str) else tuple(options)
    if not opts or len(set(opts)) != len(opts) or any(o not in valid for o in opts):
        raise ValueError(f"{name} must be distinct values from {tuple(valid)}, got {options!r}")
    return opts


def _final_menu(profile: Profile, final_options: Any, final_option: Any) -> tuple[str, ...]:
    if final_options is not None and final_option is not None:
        raise ValueError("pass final_options or final_option (one option), not both")
    if final_option is not None:
        if final_option not in FINAL_OPTIONS:
            raise ValueError(
                f"final_option must be one of {FINAL_OPTIONS} (the final loop cannot share), got {final_option!r}"
            )
        return (final_option,)
    if final_options is None:
        return DEFAULT_FINAL_OPTIONS
    return _menu(final_options, FINAL_OPTIONS, "final_options (the final loop cannot share)")


def _hot_ratio(hot: Any, v_precision: bool) -> tuple[int, int]:
    """``hot_fraction`` as ``p/q`` with ``q <= HOT_DENOMINATOR`` (1/1 without V precision)."""
    if isinstance(hot, bool) or not isinstance(hot, (int, float)) or not 0.0 <= hot <= 1.0:
        raise ValueError(f"hot_fraction must be in [0, 1], got {hot!r}")
    if not v_precision:
        if hot != 1.0:
            raise ValueError(f"hot_fraction={hot} needs V precision; pass a finite tau or leave hot_fraction=1.0")
        return 1, 1
    frac = Fraction(hot).limit_denominator(HOT_DENOMINATOR)
    return frac.numerator, frac.denominator


def _units(value: Any, name: str, per: float) -> int | None:
    """A budget as whole units (rounded down); None for no budget (None or inf)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) or value < 0:
        raise ValueError(f"{name} must be a number >= 0, got {value!r}")
    return None if math.isinf(value) else math.floor(value * per * (1 + _KIB_RTOL))
