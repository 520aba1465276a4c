"""Plan: validation, presets, versioned JSON (round trip and hand edits), model checks."""

import copy
import dataclasses
import json
import math
import pickle
import warnings
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import loopkv
from loopkv.cells import Cell
from loopkv.planning import OPTIONS, ModelShape, Plan, PlanEnvironmentWarning

T, L = 4, 24


def ouro_config(**overrides):
    fields = dict(
        total_ut_steps=4, num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=16,
        hidden_size=2048, head_dim=128,
    )
    fields.update(overrides)
    return SimpleNamespace(**fields)


# ---------------------------------------------------------------- construction and access


def test_public_api_names():
    assert loopkv.Plan is Plan
    plan = loopkv.Plan.uniform(loops=4, layers=24, option="int4")
    assert plan.options == ("int4",) * 96
    assert math.isinf(plan.tau)


def test_option_cells_grid_follow_the_flat_index():
    options = [OPTIONS[(i * 7) % 3] for i in range(3 * 5)]  # no share: any loop may hold any of these
    plan = Plan(loops=3, layers=5, options=options)
    for t in range(3):
        for layer in range(5):
            assert plan.option(Cell(t, layer)) == options[t * 5 + layer]
            assert plan.grid()[t][layer] == options[t * 5 + layer]
    for option in OPTIONS:
        assert plan.cells(option) == [Cell(i // 5, i % 5) for i, o in enumerate(options) if o == option]
    assert Plan.from_grid(plan.grid()) == plan


def test_share_cells_read_the_final_loop():
    plan = Plan.share_loop(loops=T, layers=L)
    assert plan.source(Cell(2, 5)) == Cell(3, 5)
    assert plan.source(Cell(1, 5)) == Cell(1, 5)
    assert plan.cells("share") == [Cell(2, layer) for layer in range(L)]


def test_plan_is_frozen_and_hashable():
    plan = Plan.uniform(loops=2, layers=3, provenance={"solver": "test", "budget": [1, 2]})
    with pytest.raises(AttributeError):
        plan.tau = 3.0
    with pytest.raises(TypeError):
        plan.provenance["solver"] = "x"
    with pytest.raises(TypeError):
        plan.provenance["budget"][0] = 5  # nested lists become tuples
    assert hash(plan) == hash(Plan.uniform(loops=2, layers=3))
    assert plan != Plan.uniform(loops=2, layers=3)  # provenance takes part in equality
    assert {plan: 1}[plan] == 1
    # plans pickle and deep-copy (torch.save, copying a cache), equal to the original
    assert pickle.loads(pickle.dumps(plan)) == plan
    assert copy.deepcopy(plan) == plan
    assert dataclasses.replace(plan, tau=3.0).provenance == plan.provenance
    # a list of options is accepted and stored as a tuple
    assert Plan(loops=1, layers=2, options=["int4", "int2"]).options == ("int4", "int2")


# ---------------------------------------------------------------- presets


def test_presets():
    assert Plan.uniform(loops=T, layers=L, option="int2").options == ("int2",) * 96
    assert Plan.uniform(loops=T, layers=L, option="bf16", tau=14).tau == 14.0
    shared = Plan.share_loop(loops=T, layers=L)
    assert shared.grid() == [["int4"] * L, ["int4"] * L, ["share"] * L, ["int4"] * L]
    two = Plan.share_loop(loops=T, layers=L, shared_loops=(1, 2), option="int2")
    assert two.grid() == [["int2"] * L, ["share"] * L, ["share"] * L, ["int2"] * L]
    mixed = Plan.from_loops(loops=T, layers=L, per_loop=["int4", "int2", "share", "int4"], tau=14)
    assert mixed.grid() == [["int4"] * L, ["int2"] * L, ["share"] * L, ["int4"] * L]
    assert mixed.tau == 14.0


def test_from_config():
    cfg = ouro_config()
    plan = Plan.from_config(cfg)
    assert (plan.loops, plan.layers, plan.kv_heads, plan.head_dim) == (4, 24, 16, 128)
    assert plan.options == ("int4",) * 96
    assert Plan.from_config(cfg, shared_loops=(2,)) == Plan.share_loop(
        loops=4, layers=24, kv_heads=16, head_dim=128
    )
    assert Plan.from_config(cfg, per_loop=["int2", "int2", "share", "int4"]).grid()[1] == ["int2"] * 24
    gqa = Plan.from_config(ouro_config(num_key_value_heads=4, head_dim=None, hidden_size=4096))
    assert (gqa.kv_heads, gqa.head_dim) == (4, 256)
    with pytest.raises(ValueError, match="per_loop or shared_loops, not both"):
        Plan.from_config(cfg, per_loop=["int4"] * 4, shared_loops=(2,))


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: Plan.uniform(loops=4, layers=2, option="share"), "uniform option must be"),
        (lambda: Plan.uniform(loops=4, layers=2, option="fp8"), "uniform option must be"),
        (lambda: Plan.uniform(loops=0, layers=2), "loops must be an int >= 1"),
        (lambda: Plan.share_loop(loops=1, layers=2), "share_loop needs loops >= 2"),
        (lambda: Plan.share_loop(loops=4, layers=2, shared_loops=(3,)), r"shared_loops entries .* \[0, 3\)"),
        (lambda: Plan.share_loop(loops=4, layers=2, shared_loops=(-1,)), "shared_loops entries"),
        (lambda: Plan.share_loop(loops=4, layers=2, option="share"), "share_loop option must be"),
        (lambda: Plan.from_loops(loops=4, layers=2, per_loop=["int4"] * 3), "one option per loop"),
        (lambda: Plan.from_loops(loops=2, layers=2, per_loop="ab"), "one option per loop"),
        (lambda: Plan.from_grid([["int4"], ["int4", "int4"]]), "equal length"),
    ],
)
def test_preset_errors(call, message):
    with pytest.raises(ValueError, match=message):
        call()


# ---------------------------------------------------------------- validation errors


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(loops=0, layers=2, options=()), r"Plan.loops must be an int >= 1"),
        (dict(loops=2, layers=True, options=("int4",) * 2), r"Plan.layers must be an int >= 1"),
        (dict(loops=2, layers=2, options="int4"), "sequence of option names"),
        (dict(loops=2, layers=2, options=("int4",) * 3), r"3 entries.*needs 4"),
        (dict(loops=1, layers=2, options=("int4", "fp8")), r"unknown option\(s\) 'fp8'"),
        (dict(loops=2, layers=2, options=("int4",) * 3 + ("share",)), r"final loop \(loop 1, layers \[1\]\)"),
        (dict(loops=1, layers=1, options=("share",)), "the final loop is the source shared cells read"),
        (dict(loops=1, layers=1, options=("int4",), tau=-1.0), "tau must be a number >= 0"),
        (dict(loops=1, layers=1, options=("int4",), tau=math.nan), "tau must be a number >= 0"),
        (dict(loops=1, layers=1, options=("int4",), tau="14"), "tau must be a number >= 0"),
        (dict(loops=1, layers=1, options=("int4",), sink=0), "Plan.sink must be a positive int"),
        (dict(loops=1, layers=1, options=("int4",), group=-32), "Plan.group must be a positive int"),
        (dict(loops=1, layers=1, options=("int4",), window=250), "window=250 must be a multiple of"),
        (dict(loops=1, layers=1, options=("int4",), window=512), r"only sink=32, window=256.*window=512"),
        (dict(loops=1, layers=1, options=("int4",), page=16, window=256), r"page=16"),
        (dict(loops=1, layers=1, options=("int4",), group=64), r"group=64.*defaults"),
        (dict(loops=1, layers=1, options=("int4",), kv_heads=0), "kv_heads must be a positive int or None"),
        (dict(loops=1, layers=1, options=("int4",), head_dim=48), "head_dim=48 is not a multiple"),
        (dict(loops=1, layers=1, options=("int4",), provenance={"x": math.inf}), "JSON has no inf"),
        (dict(loops=1, layers=1, options=("int4",), predicted={"x": object()}), "JSON values only"),
        (dict(loops=1, layers=1, options=("int4",), predicted={1: 2}), "keys must be str"),
    ],
)
def test_validation_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Plan(**kwargs)


def test_bf16_plan_accepts_any_head_dim():
    plan = Plan.uniform(loops=2, layers=2, option="bf16", head_dim=48)
    plan.validate_for(ModelShape(2, 2, 4, 48))


def test_option_and_cells_errors():
    plan = Plan.uniform(loops=2, layers=3)
    with pytest.raises(ValueError, match="outside the layout"):
        plan.option(Cell(2, 0))
    with pytest.raises(ValueError, match="option must be one of"):
        plan.cells("fp8")


# ---------------------------------------------------------------- validate_for


def test_validate_for_accepts_the_matching_model():
    Plan.from_config(ouro_config()).validate_for(ouro_config())
    Plan.uniform(loops=4, layers=24).validate_for(ModelShape(4, 24, 16, 128))


def test_validate_for_names_every_difference():
    plan = Plan.uniform(loops=4, layers=24, kv_heads=16, head_dim=128)
    with pytest.raises(ValueError, match="this plan does not fit the model") as err:
        plan.validate_for(
            ouro_config(total_ut_steps=3, num_hidden_layers=12, num_key_value_heads=8, head_dim=64)
        )
    msg = str(err.value)
    assert "loops=4 but the model has total_ut_steps=3" in msg
    assert "layers=24 but the model has num_hidden_layers=12" in msg
    assert "kv_heads=16 but the model has num_key_value_heads=8" in msg
    assert "head_dim=128 but the model has head_dim=64" in msg
    # only the field that differs
    with pytest.raises(ValueError, match="total_ut_steps=8") as err:
        plan.validate_for(ouro_config(total_ut_steps=8))
    assert "num_hidden_layers" not in str(err.value)


def test_validate_for_head_dim_not_a_multiple_of_32():
    shape = ModelShape(2, 2, 2, 48)
    with pytest.raises(ValueError, match="quantizes cells but head_dim=48 is not a multiple"):
        Plan.uniform(loops=2, layers=2, option="int2").validate_for(shape)
    Plan.uniform(loops=2, layers=2, option="bf16").validate_for(shape)


# ---------------------------------------------------------------- JSON


@st.composite
def plans(draw):
    loops = draw(st.integers(1, 4))
    layers = draw(st.integers(1, 6))
    cells = []
    for t in range(loops):
        allowed = ["bf16", "int4", "int2"] + (["share"] if t < loops - 1 else [])
        cells += draw(st.lists(st.sampled_from(allowed), min_size=layers, max_size=layers))
    one_tau = st.one_of(st.just(math.inf), st.floats(0.0, 64.0), st.integers(0, 30))
    tau = draw(st.one_of(one_tau, st.lists(one_tau, min_size=loops, max_size=loops)))  # one, or one per loop
    kv_heads = draw(st.one_of(st.none(), st.integers(1, 16)))
    head_dim = draw(st.one_of(st.none(), st.sampled_from([32, 64, 96, 128, 256])))
    json_scalar = st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**53), 2**53),
        st.floats(allow_nan=False, allow_infinity=False),
        st.text(max_size=8),
    )
    json_value = st.recursive(
        json_scalar,
        lambda inner: st.one_of(
            st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=5), inner, max_size=3)
        ),
        max_leaves=6,
    )
    provenance = draw(st.dictionaries(st.text(max_size=6), json_value, max_size=3))
    predicted = draw(st.dictionaries(st.text(max_size=6), json_value, max_size=3))
    return Plan(
        loops=loops, layers=layers, options=cells, tau=tau, kv_heads=kv_heads, head_dim=head_dim,
        provenance=provenance, predicted=predicted,
    )


@settings(max_examples=60, deadline=None)
@given(plan=plans())
def test_json_round_trip(plan, tmp_path_factory):
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    plan.to_json(path)
    loaded = Plan.from_json(path)
    assert loaded == plan
    assert loaded.options == plan.options
    assert loaded.tau == plan.tau
    assert loaded.taus == plan.taus
    assert loaded.provenance == plan.provenance
    assert loaded.predicted == plan.predicted
    assert Plan.from_dict(json.loads(json.dumps(plan.to_dict()))) == plan
    # the file is strict JSON (no Infinity/NaN tokens) and shows the grid one loop per line
    text = path.read_text()
    json.loads(text, parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))
    data = json.loads(text)["_data"]
    assert data["cells"] == plan.grid()
    def as_json(t):
        return "inf" if math.isinf(t) else t

    if len(set(plan.taus)) == 1:  # one number, as every plan file before per-loop tau
        assert isinstance(plan.tau, float)
        assert data["tau"] == as_json(plan.tau)
    else:
        assert data["tau"] == [as_json(t) for t in plan.taus]
    for row in plan.grid():
        assert json.dumps(row) in text


def test_json_envelope():
    d = Plan.share_loop(loops=T, layers=L, tau=14).to_dict()
    assert d["_type"] == "loopkv.Plan"
    assert d["_version"] == 1
    assert d["_metadata"] == {"loopkv": loopkv.__version__}
    assert d["_data"]["cells"][2] == ["share"] * L
    assert d["_data"]["tau"] == 14.0


def test_hand_edited_json_loads(tmp_path):
    path = tmp_path / "plan.json"
    Plan.share_loop(loops=T, layers=L).to_json(path)
    text = path.read_text()
    lines = text.splitlines()
    # a person changes loop 0, layer 0 from int4 to bf16 in an editor, and tau from "inf" to 14
    row0 = next(i for i, line in enumerate(lines) if line.strip().startswith('["int4"'))
    lines[row0] = lines[row0].replace('"int4"', '"bf16"', 1)
    edited = "\n".join(lines).replace('"tau": "inf"', '"tau": 14')
    path.write_text(edited)
    plan = Plan.from_json(path)
    assert plan.option(Cell(0, 0)) == "bf16"
    assert plan.option(Cell(0, 1)) == "int4"
    assert plan.tau == 14.0
    assert plan.cells("bf16") == [Cell(0, 0)]
    # tau written as null also means "off"
    data = json.loads(edited)
    data["_data"]["tau"] = None
    assert math.isinf(Plan.from_dict(data).tau)


def test_hand_edit_that_breaks_the_rules_is_refused(tmp_path):
    path = tmp_path / "plan.json"
    Plan.uniform(loops=2, layers=2).to_json(path)
    data = json.loads(path.read_text())
    data["_data"]["cells"][1][0] = "share"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="final loop"):
        Plan.from_json(path)


def _envelope(**data_overrides):
    d = Plan.uniform(loops=2, layers=2).to_dict()
    d["_data"].update(data_overrides)
    return d


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d.update(_version=2), "_version 2 is not supported"),
        (lambda d: d.pop("_version"), "_version None is not supported"),
        (lambda d: d.update(_type="torchao.Config"), "not a loopkv plan file"),
        (lambda d: d.pop("_data"), "no '_data' object"),
        (lambda d: d["_data"].update(tua=3), r"unknown field\(s\) \['tua'\]"),
        (lambda d: d["_data"].pop("cells"), r"lacks \['cells'\]"),
        (lambda d: d["_data"].update(loops=3), "must be 3 rows"),
        (lambda d: d["_data"]["cells"][0].append("int4"), "rows .* of 2 options"),
        (lambda d: d["_data"].update(tau="off"), "'tau' must be a number >= 0"),
        (lambda d: d["_data"].update(tau=-2), "tau must be a number >= 0"),
        (lambda d: d["_data"].update(window=128), "window=128"),
    ],
)
def test_from_dict_errors(mutate, message):
    d = Plan.uniform(loops=2, layers=2).to_dict()
    mutate(d)
    with pytest.raises(ValueError, match=message):
        Plan.from_dict(d)


def test_from_json_str_errors():
    with pytest.raises(ValueError, match="not valid JSON"):
        Plan.from_json_str("{")
    with pytest.raises(ValueError, match="holds a JSON object"):
        Plan.from_json_str("[]")


def test_another_loopkv_version_warns_only():
    d = Plan.uniform(loops=2, layers=2).to_dict()
    d["_metadata"]["loopkv"] = "0.0.1"
    with pytest.warns(PlanEnvironmentWarning, match="written by loopkv 0.0.1"):
        plan = Plan.from_dict(d)
    assert plan == Plan.uniform(loops=2, layers=2)
    # no metadata at all (e.g. a hand-written file) loads silently
    d.pop("_metadata")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Plan.from_dict(d)


def test_per_loop_tau():
    plan = Plan.share_loop(loops=T, layers=L, tau=[10, 10, math.inf, 14])
    assert plan.taus == (10.0, 10.0, math.inf, 14.0)
    assert plan.tau == (10.0, 10.0, math.inf, 14.0)
    assert [plan.tau_for(t) for t in range(T)] == [10.0, 10.0, math.inf, 14.0]
    assert plan.tau_of(Cell(2, 1)) == math.inf  # a share cell reads at its own loop's tau, not its source's
    assert plan.tau_of(Cell(3, 0)) == 14.0
    assert plan.v_precision
    # The same value in every loop is stored as one number (plan.tau stays a float, as before).
    same = Plan.uniform(loops=T, layers=L, tau=(14, 14, 14, 14))
    assert same.tau == 14.0
    assert isinstance(same.tau, float)
    assert same == Plan.uniform(loops=T, layers=L, tau=14.0)
    assert not Plan.uniform(loops=T, layers=L).v_precision
    with pytest.raises(ValueError, match="3 entries but the plan has 4 loops"):
        Plan.uniform(loops=T, layers=L, tau=(1, 2, 3))
    with pytest.raises(ValueError, match="tau must be a number >= 0"):
        Plan.uniform(loops=T, layers=L, tau=(1, 2, 3, -1))
    with pytest.raises(ValueError, match=r"loop must be an int in \[0, 4\)"):
        plan.tau_for(4)


def test_plan_file_from_before_per_loop_tau_loads():
    """A plan file as loopkv wrote it before per-loop tau (tau one number or "inf")."""
    old = {
        "_type": "loopkv.Plan", "_version": 1, "_metadata": {"loopkv": loopkv.__version__},
        "_data": {"loops": 2, "layers": 2, "tau": 14.0, "sink": 32, "window": 256, "page": 32, "group": 32,
                  "kv_heads": 2, "head_dim": 32, "provenance": {"solver": "x"}, "predicted": {"damage": 0.1},
                  "cells": [["int4", "share"], ["int4", "int2"]]},
    }
    plan = Plan.from_json_str(json.dumps(old))
    assert plan.tau == 14.0
    assert plan.taus == (14.0, 14.0)
    assert plan.options == ("int4", "share", "int4", "int2")
    assert plan.to_dict()["_data"] == old["_data"]  # written back the same way
    old["_data"]["tau"] = "inf"
    assert Plan.from_dict(old).taus == (math.inf, math.inf)
    old["_data"]["tau"] = [14, "inf"]
    assert Plan.from_dict(old).taus == (14.0, math.inf)
    old["_data"]["tau"] = [[14]]
    with pytest.raises(ValueError, match="one entry per loop"):
        Plan.from_dict(old)
