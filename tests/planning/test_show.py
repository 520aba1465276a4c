"""show: the text grid has every cell's code and the right totals; PNGs are written."""

import math
import sys

import numpy as np
import pytest

from loopkv.cells import Cell
from loopkv.planning.knapsack import solve
from loopkv.planning.plan import Plan
from loopkv.planning.profile_data import Profile
from loopkv.planning.show import CODES, format_plan, format_profile, plot_plan, plot_profile, show_file

KL_SHARE = 1.2e-4


def _profile(loops=4, layers=24, seed=0):
    rng = np.random.default_rng(seed)
    grids = {
        o: rng.exponential(s, (loops - 1, layers)) * KL_SHARE
        for o, s in (("int4", 0.005), ("int2", 0.1), ("share", 0.15))
    }
    return Profile.from_arrays(
        loops=loops,
        layers=layers,
        kv_heads=16,
        head_dim=128,
        damage=grids,
        final={"int4": rng.exponential(0.002, layers) * KL_SHARE, "int2": rng.exponential(0.25, layers) * KL_SHARE},
        kl_share=KL_SHARE,
    )


def test_format_plan_paper_plan():
    # The paper's hand-made INT4/INT2 + sharing plan: 156 / 216 KiB (paper Table 12).
    plan = Plan.from_loops(loops=4, layers=24, per_loop=["int4", "int2", "share", "int4"], kv_heads=16, head_dim=128)
    text = format_plan(plan)
    lines = text.splitlines()
    rows = [line for line in lines if line.startswith("loop ")]
    assert len(rows) == 4
    for t, row in enumerate(rows):
        codes = row[len("loop 3 (final)  ") :].split()[0]
        assert codes == "".join(CODES[plan.option(Cell(t, layer))] for layer in range(24))
    assert "(final)" in rows[3]
    assert "156 / 216 KiB" in text
    assert "uniform INT4: 240 / 240" in text
    for code in ("S = share", "2 = int2", "4 = int4"):
        assert code in text
    assert "B = bf16" not in text  # the legend lists the options the plan uses
    assert "predicted damage: unknown" in text
    # Layer header: two digit rows for 24 layers, the ones row under the grid columns.
    ones = next(line for line in lines if line.startswith("layer"))
    assert ones.endswith("012345678901234567890123")


def test_format_plan_solved_with_profile():
    profile = _profile()
    plan = solve(profile, max_damage=2.0, damage_unit="kl_share", storage_fraction=0.65, tau=14.0, hot_fraction=1 / 6)
    text = format_plan(plan, profile=profile)
    pred = plan.predicted
    assert f"{pred['stored_kib']:g} / {pred['read_kib']:g} KiB" in text
    assert f"{pred['damage_kl_share']:.4g} KL_share" in text
    assert f"read with V precision: {pred['read_kib_v_precision']:g} KiB" in text
    assert "max_stored_kib=156" in text
    # Per-loop damages add up to the total, the final loop's included.
    per_loop = [float(line.split("damage ")[1].split()[0]) for line in text.splitlines() if line.startswith("loop ")]
    assert per_loop[-1] > 0
    assert math.fsum(per_loop) == pytest.approx(pred["damage_kl_share"], rel=1e-2)
    # The corrected prediction is the paper's factor for the plan's family.
    factor = 0.97 if "share" in plan.options else 0.73
    assert f"{factor * pred['damage_kl_share']:.4g} KL_share" in text.split("additivity correction")[1]
    assert "not counted" not in text


def test_format_plan_per_loop_tau_and_uncounted_final_loop():
    plan = Plan.from_loops(loops=4, layers=24, per_loop=["int4", "int2", "share", "int4"], kv_heads=16, head_dim=128,
                           tau=(10.0, 10.0, math.inf, math.inf))
    assert "tau per loop: 10, 10, inf, inf" in format_plan(plan)
    old = Profile.from_arrays(loops=4, layers=24, kv_heads=16, head_dim=128, kl_share=KL_SHARE,
                              damage={o: [[1e-6] * 24] * 3 for o in ("int4", "int2", "share")}, final_int2=[1e-6] * 24)
    text = format_plan(plan, profile=old)
    assert "not counted: the final loop's own INT4 damage (loop 3, every layer)" in text
    assert "not counted" in format_profile(old)


def test_format_plan_shape_sources():
    plan = Plan.uniform(loops=4, layers=24, option="bf16")  # records no kv_heads / head_dim
    assert "unknown KV shape" in format_plan(plan)
    shape = {"loops": 4, "layers": 24, "kv_heads": 16, "head_dim": 128}
    text = format_plan(plan, config_or_shape=shape)
    assert "768 / 768 KiB" in text
    assert "B = bf16" in text
    assert "BBBBBBBBBBBBBBBBBBBBBBBB" in text
    with pytest.raises(ValueError, match="config_or_shape"):
        format_plan(plan, config_or_shape={**shape, "layers": 12})
    with pytest.raises(ValueError, match="layers"):
        format_plan(plan, profile=_profile(layers=12))


def test_format_profile():
    profile = _profile(loops=3, layers=4)
    text = format_profile(profile)
    assert "complete" in text
    assert "(final loop)" in text
    partial = Profile.partial(loops=3, layers=4, kv_heads=16, head_dim=128).with_damage(Cell(0, 1), "int4", 1e-5)
    text = format_profile(partial)
    assert "partial: 31 (cell, option) pairs missing" in text  # 8 cells x 3 + 4 final cells x 2, less one
    assert "not measured" in text


def test_show_file(tmp_path):
    profile = _profile(loops=3, layers=4)
    plan = solve(profile, max_damage=math.inf)
    plan_path, profile_path = tmp_path / "plan.json", tmp_path / "profile.json"
    plan.to_json(plan_path)
    profile.to_json(profile_path)
    assert show_file(plan_path, profile=profile_path) == format_plan(plan, profile=profile)
    assert show_file(profile_path) == format_profile(profile)
    other = tmp_path / "other.json"
    other.write_text('{"_type": "something"}')
    with pytest.raises(ValueError, match="not a loopkv plan or profile"):
        show_file(other)


def test_plots_write_png(tmp_path):
    pytest.importorskip("matplotlib")
    profile = _profile()
    plan = solve(profile, max_damage=2.0, damage_unit="kl_share", storage_fraction=0.65)
    for path, draw in (
        (tmp_path / "plan.png", lambda p: plot_plan(plan, p)),
        (tmp_path / "profile.png", lambda p: plot_profile(profile, p)),
    ):
        draw(path)
        data = path.read_bytes()
        assert len(data) > 1000
        assert data[:8] == b"\x89PNG\r\n\x1a\n"
    partial = Profile.partial(loops=3, layers=2, kv_heads=1, head_dim=32).with_damage(Cell(0, 0), "int4", 0.0)
    plot_profile(partial, tmp_path / "partial.png")  # unmeasured cells and all-zero values draw too
    assert (tmp_path / "partial.png").stat().st_size > 0


def test_plot_without_matplotlib_names_the_fix(monkeypatch, tmp_path):
    for name in ("matplotlib", "matplotlib.colors", "matplotlib.figure", "matplotlib.patches"):
        monkeypatch.setitem(sys.modules, name, None)  # import -> ImportError, as if not installed
    plan = Plan.uniform(loops=2, layers=2)
    with pytest.raises(ImportError, match=r"pip install 'loopkv\[plot\]'"):
        plot_plan(plan, tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()
