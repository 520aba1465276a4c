"""``loopkv profile`` -> ``plan`` -> ``show`` through the command line's entry on tiny random Dory and Huginn
checkpoints (``save_pretrained`` folders), and the refusals: a model type the command line does not know, a plan or
profile of one family used on another, Dory's ``last_loop`` cache mode. Dory is skipped below transformers 5.24."""

from __future__ import annotations

import json

import pytest
import torch

import loopkv
from loopkv.cli import load_model, main
from loopkv.planning.looped import model_layout
from loopkv.planning.plan import Plan
from loopkv.planning.profile_data import Profile
from tests.test_cli import one_error_line

DOC_LEN = 352  # > 320: queries from 320 on read a history page


def _huginn(**overrides):
    from tests.models.test_huginn import build_model, released_config

    return build_model(released_config(**overrides))


def _dory(mode: str = "per_loop"):
    try:
        from transformers import DoryForCausalLM  # noqa: F401
    except ImportError:
        pytest.skip("Dory needs transformers >= 5.24")
    from tests.models.test_dory_generate import build

    return build(mode, window=64)


BUILDERS = {"huginn": _huginn, "dory": _dory}
R = {"huginn": "config.mean_recurrence", "dory": "config.n_recurrent_loops"}  # where the profile's loop count is


@pytest.fixture(scope="module", params=["huginn", "dory"])
def checkpoint(request, tmp_path_factory):
    model = BUILDERS[request.param]()
    folder = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(folder / "model")
    docs = torch.randint(3, model.config.vocab_size, (1, DOC_LEN), generator=torch.Generator().manual_seed(0))
    torch.save(docs, folder / "docs.pt")
    return request.param, model, folder


def _generate(model, ids, cache=None):
    """Greedy tokens; Dory reads a LoopKVCache through the "loopkv" attention (its attention follows its config)."""
    if model.config.model_type == "dory":
        model.set_attn_implementation("sdpa" if cache is None else "loopkv")
        call = {"cache": cache}
    else:
        call = {"past_key_values": cache, "state_generator": torch.Generator().manual_seed(3)}
    return model.generate(ids, **call, max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)


def test_profile_plan_show(checkpoint, tmp_path, capsys):
    """The profile's cells are exactly the layout's planned cells, every one measured at every option (the final
    loop at INT4/INT2) with a positive damage; the plan solved from it validates against the model loaded by the
    command line and serves generate: within sink and window (no history page yet) it gives the dense cache's
    tokens."""
    family, model, folder = checkpoint
    prof, plan_path = tmp_path / "profile.json", tmp_path / "plan.json"
    assert main(["profile", str(folder / "model"), "--documents", str(folder / "docs.pt"), "--out", str(prof),
                 "--quiet", "--batch-cells", "17", "--share-passes", "1"]) == 0  # exact below 608 tokens
    assert "wrote" in capsys.readouterr().out
    profile = Profile.from_json(prof)
    layout = model_layout(model)
    assert profile.family == family
    assert (profile.loops, profile.layers) == (layout.loops, layout.layers)
    assert profile.is_complete
    assert profile.missing() == []
    measured = {profile.layout.cell(i) for i, _ in profile.damage}
    assert measured == set(layout)  # every planned cell, nothing else (fixed slots are not cells)
    assert all(v > 0 for v in profile.damage.values())
    described = profile.provenance["layout"]
    assert (described["family"], described["loops"], described["loops_from"]) == (family, layout.loops, R[family])
    assert sum(described["fixed_slots"].values()) == len(layout.fixed())

    # tiny random Dory: one final-loop INT4 cell costs more than KL_share (~1e-7 nats), so a loose budget
    assert main(["plan", str(prof), "--max-damage", "100", "--out", str(plan_path)]) == 0
    capsys.readouterr()
    plan = Plan.from_json(plan_path)
    assert plan.family == family
    assert (plan.loops, plan.layers) == (layout.loops, layout.layers)
    assert set(plan.options) != {"bf16"}
    assert main(["show", str(plan_path), "--profile", str(prof)]) == 0
    assert f"loopkv plan: {family} model, {layout.loops} loops x {layout.layers} layers" in capsys.readouterr().out
    assert main(["show", str(prof)]) == 0
    assert f"loopkv profile: {family} model, {layout.loops} loops x {layout.layers} layers" in capsys.readouterr().out

    loaded = load_model(str(folder / "model"), device="cpu")
    assert type(loaded) is type(model)
    plan.validate_for(loaded.config)
    ids = torch.randint(3, model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(5))
    cache = loopkv.LoopKVCache(plan, config=loaded.config, max_batch_size=1, max_cache_len=64, dtype=torch.float32,
                               device="cpu")
    assert torch.equal(_generate(loaded, ids, cache), _generate(model, ids))


def test_a_plan_or_profile_of_another_family_is_refused(checkpoint, tmp_path, capsys):
    """A plan or profile made for this family, against Ouro's small model (and against the other family): exit 2,
    one line naming both families."""
    family, model, _ = checkpoint
    shape = model_layout(model)
    plan = tmp_path / "plan.json"
    Plan.uniform(loops=shape.loops, layers=shape.layers, family=family).to_json(plan)
    assert main(["eval", "small", "--plan", str(plan), "--doc-len", "400", "--n-documents", "1"]) == 2
    one_error_line(capsys, f"made for the {family} family", "of the ouro family")
    profile = Profile.partial(loops=shape.loops, layers=shape.layers, kv_heads=2, head_dim=32, family=family)
    from loopkv.models.ouro import OuroConfig

    with pytest.raises(ValueError, match=f"made for the {family} family and the model is of the ouro family"):
        profile.validate_for(OuroConfig())
    other = "dory" if family == "huginn" else "huginn"
    with pytest.raises(ValueError, match=f"made for the {other} family and the model is of the {family} family"):
        Plan.uniform(loops=shape.loops, layers=shape.layers, family=other).validate_for(model.config)
    with pytest.raises(ValueError, match=f"made for the {other} family and the model is of the {family} family"):
        Profile.partial(loops=shape.loops, layers=shape.layers, kv_heads=2, head_dim=32,
                        family=other).validate_for(model.config)


def test_eval_refuses_a_random_initial_state(checkpoint, tmp_path, capsys):
    """Huginn's like-init state is drawn anew in every forward: the served and exact runs of ``loopkv eval`` would
    start from different states, so it is refused naming state_init='zero'."""
    family, model, folder = checkpoint
    if family != "huginn":
        pytest.skip("Dory's state is deterministic")
    plan = tmp_path / "plan.json"
    Plan.from_config(model.config).to_json(plan)
    assert main(["eval", str(folder / "model"), "--plan", str(plan), "--documents", str(folder / "docs.pt"),
                 "--quiet"]) == 2
    one_error_line(capsys, "state_init='zero'")


def test_unknown_model_type_is_refused(tmp_path, capsys):
    folder = tmp_path / "llama"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 2}))
    assert main(["profile", str(folder), "--out", str(tmp_path / "p.json")]) == 2
    one_error_line(capsys, "'llama'", "'ouro'", "'dory'", "'huginn_raven'")


def test_dory_last_loop_mode_is_refused(tmp_path, capsys):
    """last_loop: earlier loops read the last loop's cache without writing their own; the profiler says to load
    the model in per_loop mode."""
    _dory("last_loop").save_pretrained(tmp_path / "model")
    docs = torch.randint(3, 50, (1, DOC_LEN))
    torch.save(docs, tmp_path / "docs.pt")
    capsys.readouterr()  # save_pretrained's progress bar
    assert main(["profile", str(tmp_path / "model"), "--documents", str(tmp_path / "docs.pt"),
                 "--out", str(tmp_path / "p.json"), "--quiet"]) == 2
    one_error_line(capsys, "recurrent_kv_cache_mode='per_loop'")
