"""The loopkv command line end to end on a tiny checkpoint: profile -> plan -> show -> eval."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from loopkv.cli import main
from loopkv.planning.plan import Plan
from loopkv.planning.profile_data import Profile
from tests.planning.test_profile import LAYERS, LOOPS, tiny_documents, tiny_model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt")
    tiny_model().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def documents(tmp_path_factory):
    path = tmp_path_factory.mktemp("docs")
    torch.save(tiny_documents(1, 360), path / "a.pt")
    np.save(path / "b.npy", tiny_documents(1, 360, seed=2)[0].numpy())
    return [str(path / "a.pt"), str(path / "b.npy")]


def test_profile_plan_show_eval(checkpoint, documents, tmp_path, capsys):
    prof, plan = tmp_path / "profile.json", tmp_path / "plan.json"
    assert main(["profile", str(checkpoint), "--documents", *documents, "--out", str(prof), "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "cell-option evaluations per second" in out
    p = Profile.from_json(prof)
    assert p.is_complete
    assert p.provenance["n_documents"] == 2
    # an existing profile is not overwritten by accident; --resume continues it (nothing left to do)
    assert main(["profile", str(checkpoint), "--documents", *documents, "--out", str(prof), "--quiet"]) == 2
    assert "--resume" in capsys.readouterr().err
    assert main(["profile", str(checkpoint), "--documents", *documents, "--out", str(prof), "--quiet",
                 "--resume"]) == 0
    assert Profile.from_json(prof).damage == p.damage
    capsys.readouterr()

    assert main(["plan", str(prof), "--preset", "r", "--out", str(plan)]) == 0
    out = capsys.readouterr().out
    assert "stored / read" in out
    assert f"wrote {plan}" in out
    solved = Plan.from_json(plan)
    assert solved.provenance["preset"] == "r"
    assert solved.predicted["damage_kl_share"] <= 1.19 * (1 + 1e-9)

    png = tmp_path / "plan.png"
    assert main(["show", str(plan), "--png", str(png), "--profile", str(prof)]) == 0
    assert "loop 2 (final)" in capsys.readouterr().out
    assert png.stat().st_size > 0
    assert main(["show", str(prof)]) == 0
    assert "kl_share" in capsys.readouterr().out

    results = tmp_path / "eval.json"
    assert main(["eval", str(checkpoint), "--plan", str(plan), "--documents", documents[0], "--profile", str(prof),
                 "--max-positions", "8", "--json", str(results), "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "next-token agreement" in out
    assert "measured/predicted" in out
    data = json.loads(results.read_text())
    assert data["results"][0]["positions"] == 8
    assert data["additivity"]["predicted"][0] == pytest.approx(solved.predicted["damage"])


def test_plan_budgets_and_errors(tmp_path, capsys):
    rng = np.random.default_rng(0)
    damage = {o: rng.uniform(0.01, 1.0, (LOOPS - 1, LAYERS)) for o in ("int4", "int2", "share")}
    prof = Profile.from_arrays(loops=LOOPS, layers=LAYERS, kv_heads=2, head_dim=32, damage=damage,
                               final_int2=[0.5] * LAYERS, kl_share=1.0)
    path, plan = tmp_path / "p.json", tmp_path / "plan.json"
    prof.to_json(path)
    assert main(["plan", str(path), "--max-damage", "inf", "--max-stored-kib", "inf", "--out", str(plan)]) == 0
    assert Plan.from_json(plan).grid()[:-1] == [["int2"] * LAYERS] * (LOOPS - 1)  # no budgets: least reads
    assert main(["plan", str(path), "--max-damage", "inf", "--storage-fraction", "0.5", "--out", str(plan)]) == 0
    assert Plan.from_json(plan).options.count("share") == 3  # 15 units: final loop 10, one int2, shares
    assert main(["plan", str(path), "--max-damage", "3", "--damage-unit", "abs", "--layerwise", "--tau", "14",
                 "--out", str(plan)]) == 0
    assert Plan.from_json(plan).tau == 14.0
    capsys.readouterr()
    assert main(["plan", str(path), "--max-damage", "0.0001", "--out", str(plan)]) == 2
    assert "infeasible" in capsys.readouterr().err
    assert main(["plan", str(path), "--out", str(plan)]) == 2
    assert "--preset" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["plan", str(path), "--preset", "x", "--out", str(plan)])


def test_model_and_document_errors(checkpoint, tmp_path, capsys):
    assert main(["profile", str(tmp_path / "nowhere"), "--out", str(tmp_path / "p.json")]) == 2
    assert "neither a checkpoint directory nor 'small'" in capsys.readouterr().err
    # the default documents are byte tokens, beyond this model's 97-token vocabulary
    assert main(["profile", str(checkpoint), "--out", str(tmp_path / "p.json"), "--doc-len", "400",
                 "--n-documents", "1"]) == 2
    assert "pass --documents" in capsys.readouterr().err
    text = tmp_path / "doc.txt"
    text.write_text("hello " * 100)
    assert main(["profile", str(checkpoint), "--documents", str(text), "--out", str(tmp_path / "p.json")]) == 2
    assert "token-id files" in capsys.readouterr().err
    # a plan or a profile made for another model is refused before anything runs
    plan = tmp_path / "plan.json"
    Plan.uniform(loops=LOOPS + 1, layers=LAYERS).to_json(plan)
    assert main(["eval", str(checkpoint), "--plan", str(plan), "--documents", str(text)]) == 2
    assert "does not fit the model" in capsys.readouterr().err
    prof = tmp_path / "other.json"
    Profile.partial(loops=LOOPS, layers=LAYERS + 1, kv_heads=2, head_dim=32).to_json(prof)
    Plan.uniform(loops=LOOPS, layers=LAYERS).to_json(plan)
    assert main(["eval", str(checkpoint), "--plan", str(plan), "--profile", str(prof), "--documents", str(text)]) == 2
    assert "does not match the model" in capsys.readouterr().err


def test_import_is_light():
    code = "import sys, loopkv.cli; print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
