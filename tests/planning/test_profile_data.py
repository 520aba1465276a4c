"""Profile: versioned JSON round trip, model checks, and the partial/resume bookkeeping."""

import json
import math
import os
import tempfile
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loopkv.cells import Cell
from loopkv.planning.profile_data import PROFILE_TYPE, Profile, config_shape

KL = st.floats(0.0, 1e3, allow_nan=False, allow_infinity=False)


@st.composite
def profiles(draw):
    loops = draw(st.integers(2, 4))
    layers = draw(st.integers(1, 5))
    options = tuple(draw(st.permutations(["int4", "int2", "share"]))[: draw(st.integers(0, 3))])
    final_options = draw(st.sampled_from([(), ("int2",), ("int4",), ("int4", "int2")]))
    p = Profile.partial(
        loops=loops,
        layers=layers,
        kv_heads=draw(st.integers(1, 4)),
        head_dim=draw(st.sampled_from([32, 64, 128])),
        options=options,
        final_options=final_options,
        provenance=draw(
            st.dictionaries(
                st.sampled_from(["model_fingerprint", "documents_hash", "device", "date", "documents"]),
                st.one_of(st.text(max_size=8), st.integers(0, 99)),
            )
        ),
    )
    with_docs = draw(st.booleans())
    for cell, option in p.missing():
        if draw(st.booleans()):  # partial profiles too
            docs = draw(st.lists(KL, min_size=1, max_size=3)) if with_docs else None
            p = p.with_damage(cell, option, draw(KL), per_document=docs)
    if draw(st.booleans()):
        p = p.with_kl_share(draw(st.floats(1e-9, 1.0)), per_document=[1e-4, 2e-4] if with_docs else None)
    return p


@settings(max_examples=60, deadline=None)
@given(p=profiles())
def test_json_round_trip(p):
    q = Profile.loads(p.dumps())
    assert q == p
    assert q.content_hash() == p.content_hash()
    assert q.missing() == p.missing()
    assert q.is_complete == p.is_complete
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "profile.json")
        p.to_json(path)
        assert Profile.from_json(path) == p
        assert os.listdir(tmp) == ["profile.json"]  # the atomic write leaves no temporary file


def test_json_is_readable_grid():
    p = Profile.from_arrays(
        loops=3,
        layers=2,
        kv_heads=2,
        head_dim=32,
        damage={"int4": [[0.0, 0.1], [0.2, 0.3]], "share": [[1.0, 2.0], [3.0, 4.0]]},
        final_int2=[5.0, 6.0],
        kl_share=0.5,
        provenance={"model_fingerprint": "abc"},
    )
    obj = json.loads(p.dumps())
    assert obj["_type"] == PROFILE_TYPE
    assert obj["_version"] == 1
    data = obj["_data"]
    assert data["damage"]["int4"] == [[0.0, 0.1], [0.2, 0.3]]  # rows = loops 0..T-2, columns = layers
    assert data["final"]["int2"] == [5.0, 6.0]
    assert p.final_int2 == (5.0, 6.0)
    assert p.damage_of(Cell(1, 0), "share") == 3.0
    assert p.damage_of(Cell(2, 1), "int4") == 0.0  # the final loop at INT4 was not profiled: counted as 0 ...
    assert not p.is_counted(Cell(2, 1), "int4")  # ... and said so
    assert "final loop's own INT4" in p.uncounted()[0]
    assert p.damage_of(Cell(0, 1), "bf16") == 0.0
    assert p.is_complete
    assert p.missing() == []
    # A hand edit is read back; a wrong grid shape is an error naming the option.
    data["damage"]["int4"][0][0] = 0.05
    assert Profile.from_dict(obj).damage_of(Cell(0, 0), "int4") == 0.05
    data["damage"]["int4"] = [[0.0, 0.1]]
    with pytest.raises(ValueError, match="'int4'"):
        Profile.from_dict(obj)


def test_content_hash_changes_with_data():
    base = Profile.from_arrays(loops=2, layers=2, kv_heads=1, head_dim=32, damage={"int4": [[0.1, 0.2]]})
    other = base.with_damage(Cell(0, 0), "int4", 0.15)
    assert base.content_hash() != other.content_hash()
    assert len(base.content_hash()) == 64


@pytest.mark.parametrize(
    ("envelope", "match"),
    [
        ({"_type": "loopkv.Plan", "_version": 1, "_data": {}}, "not a loopkv profile"),
        ({"_type": PROFILE_TYPE, "_version": 2, "_data": {}}, "_version"),
        ([1, 2], "not a loopkv profile"),
    ],
)
def test_schema_errors(envelope, match):
    with pytest.raises(ValueError, match=match):
        Profile.from_dict(envelope)


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("_version", True, "_version True is not supported"),
        ("_version", 1.0, "_version 1.0 is not supported"),
        ("loops", "3", "'loops' must be an integer >= 1"),
        ("layers", 2.0, "'layers' must be an integer >= 1"),
        ("kv_heads", True, "'kv_heads' must be an integer >= 1"),
        ("head_dim", 0, "'head_dim' must be an integer >= 1"),
    ],
)
def test_json_types_refused(field, value, match):
    """Values Python would coerce (JSON true == 1, "3" through int()) are refused, as the Plan JSON refuses them."""
    envelope = Profile.from_arrays(loops=3, layers=2, kv_heads=1, head_dim=32,
                                   damage={"int4": [[0.1, 0.2], [0.3, 0.4]]}).to_dict()
    Profile.from_dict(envelope)  # the unmodified file loads
    (envelope if field.startswith("_") else envelope["_data"])[field] = value
    with pytest.raises(ValueError, match=match):
        Profile.from_dict(envelope)


def test_constructor_refuses_non_int_shape():
    with pytest.raises(ValueError, match=r"Profile.loops must be an int >= 1, got '3'"):
        Profile.partial(loops="3", layers=1, kv_heads=1, head_dim=32)


@pytest.mark.parametrize("value", [-1e-6, math.nan, math.inf])
def test_bad_damage_values(value):
    p = Profile.partial(loops=2, layers=1, kv_heads=1, head_dim=32)
    with pytest.raises(ValueError, match="finite KL >= 0"):
        p.with_damage(Cell(0, 0), "int4", value)


def test_construction_errors():
    with pytest.raises(ValueError, match="options"):
        Profile.partial(loops=2, layers=1, kv_heads=1, head_dim=32, options=("int8",))
    with pytest.raises(ValueError, match="final_options"):
        Profile.partial(loops=2, layers=1, kv_heads=1, head_dim=32, final_options=("share",))
    with pytest.raises(ValueError, match="loops must be >= 2"):
        Profile.partial(loops=1, layers=1, kv_heads=1, head_dim=32)
    p = Profile.partial(loops=2, layers=2, kv_heads=1, head_dim=32, final_options=())
    with pytest.raises(ValueError, match="not a profiled"):
        p.with_damage(Cell(1, 0), "int2", 0.1)  # final loop not profiled at int2 here
    with pytest.raises(ValueError, match="outside"):
        p.with_damage(Cell(2, 0), "int4", 0.1)
    with pytest.raises(ValueError, match="kl_share must be > 0"):
        p.with_kl_share(0.0)
    with pytest.raises(ValueError, match="not in this profile"):
        p.damage_of(Cell(0, 0), "int4")  # not measured yet


def test_validate_for():
    p = Profile.partial(loops=4, layers=24, kv_heads=16, head_dim=128)
    ouro = SimpleNamespace(
        total_ut_steps=4, num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=16, hidden_size=2048
    )
    p.validate_for(ouro)  # head_dim from hidden_size // num_attention_heads
    p.validate_for({"loops": 4, "layers": 24, "kv_heads": 16, "head_dim": 128})
    from loopkv.planning.bytes import ModelShape

    p.validate_for(ModelShape(loops=4, layers=24, kv_heads=16, head_dim=128))
    wrong = SimpleNamespace(total_ut_steps=3, num_hidden_layers=24, num_key_value_heads=8, head_dim=128)
    with pytest.raises(ValueError, match="does not match") as err:
        p.validate_for(wrong)
    assert "loops (total_ut_steps): profile 4, model 3" in str(err.value)
    assert "kv_heads (num_key_value_heads): profile 16, model 8" in str(err.value)
    assert "layers" not in str(err.value)
    with pytest.raises(ValueError, match="total_ut_steps"):
        config_shape(SimpleNamespace(num_hidden_layers=24, num_key_value_heads=16, head_dim=128))


def test_partial_resume_bookkeeping(tmp_path):
    prov = {"model_fingerprint": "m1", "documents_hash": "d1", "device": "cpu"}
    p = Profile.partial(loops=3, layers=2, kv_heads=1, head_dim=32, provenance=prov)
    todo = p.missing()
    # Cell-major order, the options of each cell in order; the final loop at int4 and int2.
    assert todo[:3] == [(Cell(0, 0), "int4"), (Cell(0, 0), "int2"), (Cell(0, 0), "share")]
    assert todo[-4:] == [(Cell(2, 0), "int4"), (Cell(2, 0), "int2"), (Cell(2, 1), "int4"), (Cell(2, 1), "int2")]
    assert len(todo) == 2 * 2 * 3 + 2 * 2
    assert not p.is_complete
    path = tmp_path / "partial.json"
    for i, (cell, option) in enumerate(todo[:5]):  # measure some, save, "crash"
        p = p.with_damage(cell, option, 0.1 * i)
        p.to_json(path)
    resumed = Profile.from_json(path)
    assert resumed.missing() == todo[5:]
    assert resumed.setup_differences(Profile.partial(loops=3, layers=2, kv_heads=1, head_dim=32, provenance=prov)) == []
    other_docs = Profile.partial(loops=3, layers=2, kv_heads=1, head_dim=32, provenance={**prov, "documents_hash": "x"})
    assert any("documents_hash" in d for d in resumed.setup_differences(other_docs))
    other_env = Profile.partial(loops=3, layers=2, kv_heads=1, head_dim=32, provenance={**prov, "device": "cuda"})
    assert resumed.setup_differences(other_env) == []  # the environment does not block resuming
    other_shape = Profile.partial(loops=3, layers=3, kv_heads=1, head_dim=32, provenance=prov)
    assert any("layers" in d for d in resumed.setup_differences(other_shape))
    for cell, option in resumed.missing():
        resumed = resumed.with_damage(cell, option, 0.5)
    assert resumed.missing() == []
    assert not resumed.is_complete  # the unit is still missing
    resumed = resumed.with_kl_share(1e-4)
    assert resumed.is_complete
    assert resumed.final_int2 == (0.5, 0.5)
    assert resumed.final_int4 == (0.5, 0.5)
    assert resumed.uncounted() == ()


def test_profile_is_immutable():
    p = Profile.from_arrays(loops=2, layers=1, kv_heads=1, head_dim=32, damage={"int4": [[0.1]]})
    with pytest.raises(TypeError):
        p.damage[(0, "int4")] = 0.2
    with pytest.raises(AttributeError):
        p.kl_share = 1.0


def test_malformed_data_is_a_value_error():
    obj = json.loads(Profile.partial(loops=2, layers=1, kv_heads=1, head_dim=32).dumps())
    del obj["_data"]["damage"]["share"]
    with pytest.raises(ValueError, match="malformed"):
        Profile.from_dict(obj)


def test_profile_file_from_before_the_final_loops_int4_loads():
    """A profile file as loopkv wrote it before the final loop's INT4 was profiled: it loads, prices the final
    loop's INT4 at 0 and says that it does."""
    old = {"_type": "loopkv.Profile", "_version": 1, "_data": {
        "loops": 2, "layers": 2, "kv_heads": 1, "head_dim": 32, "options": ["int4", "int2", "share"],
        "final_options": ["int2"], "damage": {"int4": [[0.1, 0.2]], "int2": [[1.0, 2.0]], "share": [[3.0, 4.0]]},
        "final": {"int2": [5.0, 6.0]}, "kl_share": 0.5, "provenance": {"settings": {"share_source": "int4"}}}}
    p = Profile.from_dict(old)
    assert p.is_complete
    assert p.final_int2 == (5.0, 6.0)
    assert p.final_int4 is None
    assert p.damage_of(Cell(1, 0), "int4") == 0.0
    assert p.uncounted() == (
        "the final loop's own INT4 damage (loop 1, every layer): not in this profile, counted as 0; re-profile "
        "with this loopkv (final options int4,int2) to count it",
    )
    assert p.share_source == "int4"
    assert json.loads(p.dumps())["_data"]["final"] == {"int2": [5.0, 6.0]}  # written back as it was
