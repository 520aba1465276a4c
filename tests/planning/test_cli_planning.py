"""The planner's command-line options end to end on a tiny checkpoint: profile --generate, plan --fix /
--forbid / --objective / per-loop --tau, eval --random with the additivity correction."""

from __future__ import annotations

import json
import math

import pytest
import torch

from loopkv.cli import main
from loopkv.planning.plan import Plan
from loopkv.planning.profile_data import Profile
from loopkv.planning.profiler import documents_hash
from tests.planning.test_profile import LAYERS, LOOPS, tiny_model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt")
    model = tiny_model()
    model.config.bos_token_id, model.config.eos_token_id, model.config.pad_token_id = 1, 2, 3
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def profiled(checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("prof") / "profile.json"
    args = ["profile", str(checkpoint), "--generate", "2", "--length", "330", "--options", "int4,share",
            "--final-options", "int4", "--out", str(out), "--quiet"]
    assert main(args) == 0
    return out, args


def test_profile_generates_its_documents_beside_it(profiled, capsys):
    out, args = profiled
    docs = torch.load(out.parent / "profile.generated.pt", weights_only=True)
    assert docs.shape == (2, 330)
    meta = json.loads((out.parent / "profile.generated.json").read_text())
    assert meta["settings"]["length"] == 330
    assert meta["documents"] == 2
    prof = Profile.from_json(out)
    assert prof.provenance["documents_hash"] == documents_hash(list(docs))
    assert prof.final_options == ("int4",)
    assert prof.final_int4 is not None
    capsys.readouterr()
    assert main([*args, "--resume"]) == 0  # the documents are read back, not sampled again
    assert "2 generated documents" in capsys.readouterr().out
    assert main(["profile", "x", "--length", "330", "--out", str(out.parent / "o.json")]) == 2


def test_plan_rules_objective_and_per_loop_tau(profiled, tmp_path, capsys):
    out, _ = profiled
    plan_path = tmp_path / "plan.json"
    assert main(["plan", str(out), "--max-damage", "inf", "--objective", "stored", "--options", "int4,share",
                 "--fix", "1:1=share", "--forbid", "*:0=share", "--tau", "10,inf,inf", "--out", str(plan_path)]) == 0
    text = capsys.readouterr().out
    assert "tau per loop: 10, inf, inf" in text
    assert "additivity correction" in text
    plan = Plan.from_json(plan_path)
    assert plan.taus == (10.0, math.inf, math.inf)
    assert LAYERS == 2
    assert plan.grid()[:2] == [["int4", "share"], ["int4", "share"]]  # layer 0: share forbidden; (1, 1) fixed
    assert main(["plan", str(out), "--max-damage", "inf", "--options", "int4,share", "--fix", "1:*=share",
                 "--forbid", "*:0=share", "--out", str(plan_path)]) == 2
    assert "leaves cell (1, 0) no option" in capsys.readouterr().err
    assert plan.provenance["objective"].startswith("min stored bytes")
    assert main(["plan", str(out), "--preset", "r", "--fix", f"{LOOPS - 1}:*=share", "--out", str(plan_path)]) == 2
    assert "final loop" in capsys.readouterr().err
    for bad, message in ((["--fix", "1:*"], "LOOPS:LAYERS=OPTIONS"), (["--tau", "1,x"], "one per loop")):
        with pytest.raises(SystemExit) as exit_:  # argparse refuses the argument itself
            main(["plan", str(out), "--preset", "r", *bad, "--out", str(plan_path)])
        assert exit_.value.code == 2
        assert message in capsys.readouterr().err


def test_eval_reports_the_corrected_prediction(checkpoint, profiled, tmp_path, capsys):
    out, _ = profiled
    plan_path, report = tmp_path / "r.json", tmp_path / "eval.json"
    assert main(["plan", str(out), "--preset", "r", "--options", "int4,share", "--out", str(plan_path)]) == 0
    capsys.readouterr()
    assert main(["eval", str(checkpoint), "--plan", str(plan_path), "--profile", str(out), "--random", "2",
                 "--documents", str(out.parent / "profile.generated.pt"), "--max-positions", "4", "--quiet",
                 "--json", str(report)]) == 0
    text = capsys.readouterr().out
    assert "predicted: sum  corrected" in text
    data = json.loads(report.read_text())["additivity"]
    assert data["fitted"] == [True, False, False]  # fitted on the named plan, scored on the random ones
    assert len(data["corrected"]) == 3
    # a frozen correction from that file is applied as given
    assert main(["eval", str(checkpoint), "--plan", str(plan_path), "--profile", str(out), "--correction",
                 str(report), "--documents", str(out.parent / "profile.generated.pt"), "--max-positions", "4",
                 "--quiet"]) == 0
    assert f"{data['correction']['own']:.3g} S without shared cells" in capsys.readouterr().out
