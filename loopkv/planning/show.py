"""Human views of plans and profiles: a text grid (``loopkv show``) and PNG heatmaps.

``format_plan`` prints the plan as a loops x layers grid of one-letter codes, like the paper's Figure 6,
with per-loop counts, stored/read KiB per history token and the predicted damage. ``plot_plan`` and
``plot_profile`` draw PNG heatmaps; matplotlib is imported only when they are called (install it with
``pip install 'loopkv[plot]'``) and no global pyplot state is touched.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from typing import Any

from loopkv.planning import correction as _correction
from loopkv.planning.bytes import ModelShape, unit_kib
from loopkv.planning.knapsack import OPTION_UNITS, plan_units, predicted_damage, prediction_notes
from loopkv.planning.plan import PLAN_TYPE, Plan
from loopkv.planning.profile_data import PROFILE_TYPE, Profile, config_shape

CODES = {"bf16": "B", "int4": "4", "int2": "2", "share": "S"}
LEGEND = {
    "bf16": "exact (bf16)",
    "int4": "own INT4 codes",
    "int2": "own INT2 codes",
    "share": "shares the final loop",
}
# Heatmap colours per option (colour-blind-safe Okabe-Ito picks), in CODES order.
COLORS = {"bf16": "#999999", "int4": "#0072B2", "int2": "#E69F00", "share": "#009E73"}


def format_plan(plan: Any, *, config_or_shape: Any = None, profile: Profile | None = None) -> str:
    """The plan as text: a loops x layers grid of codes (B bf16, 4 int4, 2 int2, S share), per-loop
    option counts (and damage, given ``profile``), a legend, stored/read KiB per history token and the
    predicted damage.

    config_or_shape: a model config / ModelShape / mapping (see
        :func:`loopkv.planning.profile_data.config_shape`) for the byte totals when the plan does not
        record ``kv_heads`` and ``head_dim``; it must match the plan's loops and layers.
    profile: when given, the predicted damage is recomputed from it (and shown per loop).
    """
    T, L = plan.loops, plan.layers
    shape = _shape(plan, config_or_shape, profile)
    width = len(str(L - 1))
    label = max(len(f"loop {T - 1} (final)"), len("layer"))
    lines = [f"loopkv plan: {_family_text(plan.family)}{T} loops x {L} layers ({T * L} cells), {_tau_text(plan)}"]
    for digit in range(width):
        head = "layer" if digit == width - 1 else ""
        lines.append(f"{head:<{label}}  " + "".join(str(layer).rjust(width)[digit] for layer in range(L)))
    per_loop_damage = _per_loop_damage(profile, plan)
    for t in range(T):
        row = plan.options[t * L : (t + 1) * L]
        name = f"loop {t} (final)" if t == T - 1 else f"loop {t}"
        counts = ", ".join(f"{o} {row.count(o)}" for o in CODES if row.count(o))
        extra = f"  damage {per_loop_damage[t]}" if per_loop_damage else ""
        lines.append(f"{name:<{label}}  " + "".join(CODES[o] for o in row) + f"   {counts}{extra}")
    used = [o for o in CODES if o in plan.options]
    lines.append("legend: " + ", ".join(f"{CODES[o]} = {o} ({LEGEND[o]})" for o in used))
    if shape is not None:
        ukib = unit_kib(ModelShape(T, L, *shape))
        stored, read = plan_units(plan)
        uniform = T * L * OPTION_UNITS["int4"]
        text = f"stored / read: {stored * ukib:g} / {read * ukib:g} KiB per history token"
        lines.append(text + f" (uniform INT4: {uniform * ukib:g} / {uniform * ukib:g}; {stored / uniform:.3f} of its "
                     "storage)")
        vp = plan.predicted.get("read_kib_v_precision")
        if vp is not None:
            lines.append(
                f"read with V precision: {vp:g} KiB at hot fraction {plan.predicted.get('hot_fraction', 1.0):.3g}"
            )
    else:
        lines.append("stored / read: unknown KV shape (pass config_or_shape= or a profile)")
    lines.extend(_damage_lines(plan, profile))
    budgets = plan.provenance.get("budgets") if isinstance(plan.provenance, Mapping) else None
    if budgets:
        shown = {k: v for k, v in budgets.items() if v is not None}
        lines.append("budgets: " + ", ".join(f"{k}={_num(v)}" for k, v in shown.items()))
    return "\n".join(lines)


def _family_text(family: str) -> str:
    """``"huginn model, "`` for a family other than Ouro (whose files say nothing of it), else nothing."""
    return "" if family == "ouro" else f"{family} model, "


def format_profile(profile: Profile) -> str:
    """A text summary of a profile: completeness, the unit, and per option and loop the summed and
    largest single-cell damage (in KL_share units when the unit is known)."""
    T, L = profile.loops, profile.layers
    kl = profile.kl_share
    unit = "KL_share" if kl else "nats/token"
    scale = 1.0 / kl if kl else 1.0
    missing = profile.missing()
    lines = [
        f"loopkv profile: {_family_text(profile.family)}{T} loops x {L} layers, {profile.kv_heads} KV heads x "
        f"{profile.head_dim}",
        f"kl_share: {kl if kl is not None else 'not measured'}; "
        + ("complete" if profile.is_complete else f"partial: {len(missing)} (cell, option) pairs missing"),
        f"damage per loop ({unit}): sum over layers / largest cell [layer]",
    ]
    for option in profile.options:
        for t in range(T - 1):
            lines.append(_loop_summary(profile, option, t, scale))
    for option in profile.final_options:
        lines.append(_loop_summary(profile, option, T - 1, scale) + "  (final loop)")
    lines += [f"not counted in plans from this profile: {note}" for note in profile.uncounted()]
    prov = {k: v for k, v in profile.provenance.items() if not isinstance(v, (Mapping, list, tuple))}
    if prov:
        lines.append("provenance: " + ", ".join(f"{k}={v}" for k, v in prov.items()))
    return "\n".join(lines)


def plot_plan(plan: Any, path: str | os.PathLike, *, title: str | None = None) -> None:
    """Write a PNG heatmap of the plan (rows: loops, columns: layers; colour and letter per option)."""
    mpl = _matplotlib()
    T, L = plan.loops, plan.layers
    order = list(CODES)
    grid = [[order.index(plan.options[t * L + layer]) for layer in range(L)] for t in range(T)]
    fig = mpl["Figure"](figsize=(max(4.0, 0.32 * L + 1.5), 0.45 * T + 1.4))
    ax = fig.add_subplot()
    cmap = mpl["ListedColormap"]([COLORS[o] for o in order])
    ax.imshow(grid, cmap=cmap, vmin=-0.5, vmax=len(order) - 0.5, aspect="auto")
    for t in range(T):
        for layer in range(L):
            ax.text(
                layer,
                t,
                CODES[plan.options[t * L + layer]],
                ha="center",
                va="center",
                fontsize=7,
                color="white",
            )
    ax.set_xticks(range(L))
    ax.set_xticklabels([str(i) for i in range(L)], fontsize=6)
    ax.set_yticks(range(T))
    ax.set_yticklabels([f"loop {t}" + (" (final)" if t == T - 1 else "") for t in range(T)], fontsize=7)
    ax.set_xlabel("layer")
    handles = [mpl["Patch"](color=COLORS[o], label=f"{CODES[o]} {o}") for o in order if o in plan.options]
    ax.legend(handles=handles, loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=7, frameon=False)
    if title is None:
        pred = plan.predicted
        parts = []
        if "stored_kib" in pred:
            parts.append(f"{pred['stored_kib']:g} / {pred['read_kib']:g} KiB")
        if pred.get("damage_kl_share") is not None:
            parts.append(f"damage {pred['damage_kl_share']:.3g} KL_share")
        title = " · ".join(parts) or "loopkv plan"
    ax.set_title(title, fontsize=9)
    fig.savefig(os.fspath(path), dpi=150, bbox_inches="tight")


def plot_profile(profile: Profile, path: str | os.PathLike) -> None:
    """Write a PNG with one heatmap per profiled option: damage per cell (rows: loops, columns: layers),
    one log colour scale for all panels, in KL_share units when known; the final loop's INT2 row is
    drawn under the INT2 panel's planned loops. Unmeasured cells are blank, zeros take the scale's
    minimum."""
    mpl = _matplotlib()
    np = mpl["np"]
    T, L = profile.loops, profile.layers
    kl = profile.kl_share
    scale = 1.0 / kl if kl else 1.0
    grids = {}
    for option in profile.options:
        rows = list(range(T - 1)) + ([T - 1] if option in profile.final_options else [])
        grid = np.full((len(rows), L), np.nan)  # [rows, L]
        for r, t in enumerate(rows):
            for layer in range(L):
                value = profile.damage.get((t * L + layer, option))
                if value is not None:
                    grid[r, layer] = value * scale
        grids[option] = (rows, grid)
    values = np.concatenate([g.ravel() for _, g in grids.values()]) if grids else np.zeros(0)
    positive = values[np.isfinite(values) & (values > 0)]
    norm = None
    if positive.size and positive.max() > positive.min():
        norm = mpl["LogNorm"](vmin=positive.min(), vmax=positive.max())
    fig = mpl["Figure"](figsize=(max(4.0, 0.3 * L + 2.5), (0.35 * T + 1.0) * max(1, len(grids)) + 0.5))
    for i, (option, (rows, grid)) in enumerate(grids.items()):
        ax = fig.add_subplot(len(grids), 1, i + 1)
        if norm is not None:
            grid = np.where(grid == 0, positive.min(), grid)
        image = ax.imshow(grid, aspect="auto", cmap="viridis", norm=norm)
        fig.colorbar(image, ax=ax, label="KL_share" if kl else "nats/token")
        ax.set_yticks(range(len(rows)))
        ax.set_yticklabels([f"loop {t}" + (" (final)" if t == T - 1 else "") for t in rows], fontsize=7)
        ax.set_xticks(range(L))
        ax.set_xticklabels([str(x) for x in range(L)], fontsize=6)
        ax.set_title(f"single-cell damage: {option}", fontsize=9)
    fig.tight_layout()
    fig.savefig(os.fspath(path), dpi=120)


def show_file(
    path: str | os.PathLike,
    *,
    config: Any = None,
    profile: Profile | str | os.PathLike | None = None,
    png: str | os.PathLike | None = None,
) -> str:
    """What ``loopkv show PATH`` prints: the plan grid or the profile summary of a loopkv JSON file
    (recognised by its ``_type``), optionally also writing a PNG heatmap to ``png``. ``profile`` may be a
    Profile or a path to one, used for a plan's predicted damage."""
    with open(path, encoding="utf-8") as f:
        obj = json.load(f)
    kind = obj.get("_type") if isinstance(obj, Mapping) else None
    if kind == PROFILE_TYPE:
        prof = Profile.from_dict(obj)
        if png is not None:
            plot_profile(prof, png)
        return format_profile(prof)
    if kind == PLAN_TYPE:
        plan = Plan.from_dict(obj)
        if profile is not None and not isinstance(profile, Profile):
            profile = Profile.from_json(profile)
        if png is not None:
            plot_plan(plan, png)
        return format_plan(plan, config_or_shape=config, profile=profile)
    raise ValueError(f"{os.fspath(path)} is not a loopkv plan or profile (its _type is {kind!r})")


# ------------------------------------------------------------------------------------------ internals
def _matplotlib() -> dict[str, Any]:
    try:
        import numpy as np
        from matplotlib.colors import ListedColormap, LogNorm
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError as err:
        raise ImportError(
            "plotting needs matplotlib, which is not installed: pip install 'loopkv[plot]' (or pip install matplotlib)"
        ) from err
    return {"Figure": Figure, "ListedColormap": ListedColormap, "LogNorm": LogNorm, "Patch": Patch, "np": np}


def _shape(plan: Any, config_or_shape: Any, profile: Profile | None) -> tuple[int, int] | None:
    if config_or_shape is not None:
        loops, layers, kv_heads, head_dim = config_shape(config_or_shape)
        if (loops, layers) != (plan.loops, plan.layers):
            raise ValueError(
                f"config_or_shape has loops={loops}, layers={layers} but the plan has loops={plan.loops}, "
                f"layers={plan.layers}; pass the config of the plan's model"
            )
        return kv_heads, head_dim
    if plan.kv_heads is not None and plan.head_dim is not None:
        return plan.kv_heads, plan.head_dim
    if profile is not None:
        return profile.kv_heads, profile.head_dim
    return None


def _per_loop_damage(profile: Profile | None, plan: Any) -> list[str] | None:
    if profile is None:
        return None
    predicted_damage(profile, plan)  # shape check with a clear error
    kl, L = profile.kl_share, plan.layers
    out = []
    for t in range(plan.loops):
        total = math.fsum(profile.damage_of(profile.layout.cell(t * L + i), plan.options[t * L + i]) for i in range(L))
        out.append(f"{total / kl:.3g} KL_share" if kl else f"{total:.3g}")
    return out


def _tau_text(plan: Any) -> str:
    taus = getattr(plan, "taus", (plan.tau,))
    if len(set(taus)) == 1:
        return f"tau={taus[0]:g}"
    return "tau per loop: " + ", ".join(f"{t:g}" for t in taus)


def _damage_lines(plan: Any, profile: Profile | None) -> list[str]:
    """The predicted damage: the sum of single-cell KLs, the same with the paper's additivity correction,
    and what the sum leaves out."""
    if profile is not None:
        damage, kl = predicted_damage(profile, plan), profile.kl_share
        notes = prediction_notes(profile, plan)
    else:
        damage = plan.predicted.get("damage")
        rel = plan.predicted.get("damage_kl_share")
        kl = damage / rel if damage is not None and rel else None
        notes = list(plan.predicted.get("uncounted") or ())
    if damage is None:
        return ["predicted damage: unknown (pass the profile)"]

    def amount(x: float) -> str:
        return f"{x:.4g} nats/token" + (f" = {x / kl:.4g} KL_share" if kl else "")

    corr = _correction.PAPER
    lines = [f"predicted damage (sum of single-cell KLs, final loop included): {amount(damage)}",
             f"  with the additivity correction (x{corr.factor(plan):.2f}, {_correction.family(plan)} plan; "
             f"{corr.source}): {amount(corr.predict(plan, damage))}"]
    return lines + [f"  not counted: {note}" for note in notes]


def _loop_summary(profile: Profile, option: str, t: int, scale: float) -> str:
    L = profile.layers
    values = [(profile.damage.get((t * L + layer, option)), layer) for layer in range(L)]
    measured = [(v * scale, layer) for v, layer in values if v is not None]
    name = f"  {option:<5} loop {t}:"
    if not measured:
        return f"{name} not measured"
    top, where = max(measured)
    gap = f" ({L - len(measured)} missing)" if len(measured) < L else ""
    return f"{name} {math.fsum(v for v, _ in measured):.4g} / {top:.4g} [{where}]{gap}"


def _num(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)
