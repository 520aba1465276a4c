"""The loopkv command line end to end on a tiny checkpoint: profile -> plan -> show -> eval."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest
import torch

from loopkv.cli import main
from loopkv.planning.plan import Plan
from loopkv.planning.profile_data import Profile
from loopkv.planning.profiler import documents_hash
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


# ------------------------------------------------------------------- user errors: exit 2, one line, no traceback
def one_error_line(capsys, *needles: str) -> str:
    """The stderr of a refused command: exactly one line, ``loopkv COMMAND: error: ...``, with every needle
    (besides transformers' progress bar when a checkpoint was loaded)."""
    err = capsys.readouterr().err
    lines = [line for line in err.strip().splitlines() if not line.startswith("Loading weights")]
    assert len(lines) == 1, err
    assert lines[0].startswith("loopkv "), err
    assert ": error: " in lines[0], err
    for needle in needles:
        assert needle in lines[0], err
    return lines[0]


def small_profile(kl_share: float = 1.0) -> Profile:
    rng = np.random.default_rng(0)
    damage = {o: rng.uniform(0.01, 1.0, (LOOPS - 1, LAYERS)) for o in ("int4", "int2", "share")}
    return Profile.from_arrays(loops=LOOPS, layers=LAYERS, kv_heads=2, head_dim=32, damage=damage,
                               final_int2=[0.5] * LAYERS, kl_share=kl_share)


@pytest.fixture
def no_work(monkeypatch):
    """Fails the test if a command loads a model: what is refused must be refused before the work."""
    def load_model(*args, **kwargs):
        raise AssertionError("the command loaded the model before refusing its arguments")

    monkeypatch.setattr("loopkv.cli.load_model", load_model)


def test_version(capsys):
    import loopkv

    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"loopkv {loopkv.__version__}"


def test_max_damage_is_in_kl_share_with_and_without_preset(tmp_path, capsys):
    """--max-damage is in KL_share whether or not --preset is given (it was nats with --preset)."""
    path = tmp_path / "p.json"
    small_profile(kl_share=0.5).to_json(path)  # 3 KL_share = 1.5 nats: the two readings give different plans
    with_preset, without = tmp_path / "a.json", tmp_path / "b.json"
    assert main(["plan", str(path), "--preset", "r", "--max-damage", "3", "--out", str(with_preset)]) == 0
    assert main(["plan", str(path), "--max-damage", "3", "--out", str(without)]) == 0
    a, b = Plan.from_json(with_preset), Plan.from_json(without)
    assert a.predicted["damage_kl_share"] <= 3 * (1 + 1e-9)
    assert a.options == b.options
    assert main(["plan", str(path), "--preset", "r", "--max-damage", "3", "--damage-unit", "abs",
                 "--out", str(with_preset)]) == 0
    assert Plan.from_json(with_preset).predicted["damage_kl_share"] > 3  # 3 nats = 6 KL_share: a looser plan
    capsys.readouterr()
    assert main(["plan", str(path), "--preset", "r", "--damage-unit", "abs", "--out", str(with_preset)]) == 2
    one_error_line(capsys, "--damage-unit", "pass --max-damage")


def test_plan_records_the_demos_tau_by_default(tmp_path):
    from loopkv.demo import TAU

    path, plan = tmp_path / "p.json", tmp_path / "plan.json"
    small_profile().to_json(path)
    assert main(["plan", str(path), "--preset", "m", "--out", str(plan)]) == 0
    assert Plan.from_json(plan).tau == TAU == 14.0
    assert main(["plan", str(path), "--preset", "m", "--tau", "inf", "--out", str(plan)]) == 0
    assert Plan.from_json(plan).tau == float("inf")


def test_folders_and_unreadable_files_are_named(checkpoint, tmp_path, capsys, no_work):
    folder = tmp_path / "folder"
    folder.mkdir()
    plan = tmp_path / "plan.json"
    Plan.uniform(loops=LOOPS, layers=LAYERS).to_json(plan)
    assert main(["plan", str(folder), "--preset", "r", "--out", str(plan)]) == 2
    one_error_line(capsys, f"PROFILE {folder} is a folder", "pass the file")
    assert main(["show", str(folder)]) == 2
    one_error_line(capsys, f"FILE {folder} is a folder")
    assert main(["eval", str(checkpoint), "--plan", str(folder)]) == 2
    one_error_line(capsys, f"--plan {folder} is a folder")
    assert main(["show", str(tmp_path / "missing.json")]) == 2
    one_error_line(capsys, "missing.json does not exist", "check the path")
    for name, content, needle in [("empty.json", b"", "is not valid JSON (empty)"),
                                  ("cut.json", plan.read_bytes()[:60], "is not valid JSON (Expecting"),
                                  ("binary.json", bytes(range(128, 256)), "is not a text file")]:
        bad = tmp_path / name
        bad.write_bytes(content)
        assert main(["show", str(bad)]) == 2
        one_error_line(capsys, f"FILE {bad}", needle)
        assert main(["plan", str(bad), "--preset", "r", "--out", str(plan)]) == 2
        one_error_line(capsys, f"PROFILE {bad}", needle)
        assert main(["eval", str(checkpoint), "--plan", str(bad)]) == 2
        one_error_line(capsys, f"--plan {bad}", needle)


def test_plan_file_schema_errors(tmp_path, capsys):
    """_version must be the integer 1 (JSON true and 1.0 are not), loops an integer, provenance an object;
    each refusal names the file and the field."""
    good = Plan.uniform(loops=LOOPS, layers=LAYERS).to_dict()
    cases = [(("_version",), True, "_version True is not supported"),
             (("_version",), 1.0, "_version 1.0 is not supported"),
             (("_data", "loops"), str(LOOPS), f"'loops' must be an integer >= 1 (a JSON number), got '{LOOPS}'"),
             (("_data", "provenance"), ["a"], "'provenance' must be a JSON object (or null), got a list"),
             (("_data", "predicted"), "x", "'predicted' must be a JSON object (or null), got a str")]
    path = tmp_path / "plan.json"
    for keys, value, message in cases:
        envelope = json.loads(json.dumps(good))
        target = envelope
        for key in keys[:-1]:
            target = target[key]
        target[keys[-1]] = value
        path.write_text(json.dumps(envelope))
        assert main(["show", str(path)]) == 2
        one_error_line(capsys, f"FILE {path}", message)
    path.write_text(json.dumps(good))
    assert main(["show", str(path)]) == 0


def test_model_device_and_document_errors(checkpoint, tmp_path, capsys):
    plan = tmp_path / "plan.json"
    Plan.uniform(loops=LOOPS, layers=LAYERS).to_json(plan)
    empty = tmp_path / "empty_model"
    empty.mkdir()
    assert main(["eval", str(empty), "--plan", str(plan)]) == 2
    one_error_line(capsys, "has no config.json", "save_pretrained")
    for device, needle in [("nonsense", "is not a torch device"), ("meta", "holds no data"),
                           ("cuda:99", "CUDA GPU")]:
        assert main(["eval", str(checkpoint), "--plan", str(plan), "--device", device]) == 2
        one_error_line(capsys, "--device", device, needle, "pass")

    docs = tmp_path / "docs"
    docs.mkdir()
    cases = [("dict.pt", lambda p: torch.save({"ids": tiny_documents(1, 400)}, p), "holds a dict"),
             ("big.pt", lambda p: torch.save(torch.tensor([3, 5, 500]), p), "token id 500"),
             ("neg.npy", lambda p: np.save(p, np.array([3, -1, 4])), "token id -1"),
             ("float.npy", lambda p: np.save(p, np.ones(400)), "not integer token ids"),
             ("cube.pt", lambda p: torch.save(torch.ones(2, 2, 2, dtype=torch.long), p), "3-D tensor"),
             ("junk.pt", lambda p: p.write_bytes(b"not a tensor"), "cannot be read as token ids")]
    for name, write, needle in cases:
        write(docs / name)
        assert main(["eval", str(checkpoint), "--plan", str(plan), "--documents", str(docs / name), "--quiet"]) == 2
        one_error_line(capsys, f"--documents {docs / name}", needle)
    assert main(["eval", str(checkpoint), "--plan", str(plan), "--documents", str(docs), "--quiet"]) == 2
    one_error_line(capsys, f"--documents {docs} is a folder")


def test_ctrl_c_is_one_line_and_exit_130(checkpoint, documents, tmp_path, capsys, monkeypatch):
    out = tmp_path / "p.json"

    def interrupted_profile(model, docs, *, out, **kwargs):
        Profile.partial(loops=LOOPS, layers=LAYERS, kv_heads=2, head_dim=32).to_json(out)  # saved after a batch
        raise KeyboardInterrupt

    monkeypatch.setattr("loopkv.planning.profiler.profile", interrupted_profile)
    assert main(["profile", str(checkpoint), "--documents", *documents, "--out", str(out), "--quiet"]) == 130
    lines = [line for line in capsys.readouterr().err.strip().splitlines() if not line.startswith("Loading weights")]
    assert lines == [f"loopkv profile: interrupted; the partial profile is saved in {out}: rerun with --resume to "
                     "continue it"]


def test_output_paths_are_checked_before_the_work(checkpoint, documents, tmp_path, capsys, no_work):
    plan = tmp_path / "plan.json"
    Plan.uniform(loops=LOOPS, layers=LAYERS).to_json(plan)
    missing = tmp_path / "missing"
    assert main(["eval", str(checkpoint), "--plan", str(plan), "--json", str(missing / "x.json")]) == 2
    one_error_line(capsys, f"--json {missing / 'x.json'}", f"the folder {missing} does not exist", "create it")
    assert main(["profile", str(checkpoint), "--documents", *documents, "--out", str(missing / "p.json")]) == 2
    one_error_line(capsys, f"--out {missing / 'p.json'}", "does not exist")
    assert main(["profile", str(checkpoint), "--out", str(tmp_path)]) == 2
    one_error_line(capsys, f"--out {tmp_path} is a folder", "profile.json")
    prof = tmp_path / "prof.json"
    small_profile().to_json(prof)
    assert main(["plan", str(prof), "--preset", "r", "--out", str(missing / "plan.json")]) == 2
    one_error_line(capsys, "does not exist")
    assert main(["show", str(plan), "--png", str(missing / "heat")]) == 2
    one_error_line(capsys, f"--png {missing / 'heat.png'}", "does not exist")


def test_show_png_prints_the_path_it_wrote(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Plan.uniform(loops=LOOPS, layers=LAYERS).to_json("plan.json")
    assert main(["show", "plan.json", "--png", "heat"]) == 0
    assert capsys.readouterr().out.strip().endswith("wrote heat.png")
    assert (tmp_path / "heat.png").stat().st_size > 0
    assert not (tmp_path / "heat").exists()


# ---- The planner's command-line options end to end on a tiny checkpoint: profile --generate, plan --fix /
# --forbid / --objective / per-loop --tau, eval --random with the additivity correction.
@pytest.fixture(scope="module")
def planner_checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt")
    model = tiny_model()
    model.config.bos_token_id, model.config.eos_token_id, model.config.pad_token_id = 1, 2, 3
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def profiled(planner_checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("prof") / "profile.json"
    args = ["profile", str(planner_checkpoint), "--generate", "2", "--length", "330", "--options", "int4,share",
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


def test_eval_reports_the_corrected_prediction(planner_checkpoint, profiled, tmp_path, capsys):
    out, _ = profiled
    plan_path, report = tmp_path / "r.json", tmp_path / "eval.json"
    assert main(["plan", str(out), "--preset", "r", "--options", "int4,share", "--out", str(plan_path)]) == 0
    capsys.readouterr()
    assert main(["eval", str(planner_checkpoint), "--plan", str(plan_path), "--profile", str(out), "--random", "2",
                 "--documents", str(out.parent / "profile.generated.pt"), "--max-positions", "4", "--quiet",
                 "--json", str(report)]) == 0
    text = capsys.readouterr().out
    assert "predicted: sum  corrected" in text
    data = json.loads(report.read_text())["additivity"]
    assert data["fitted"] == [True, False, False]  # fitted on the named plan, scored on the random ones
    assert len(data["corrected"]) == 3
    # a frozen correction from that file is applied as given
    assert main(["eval", str(planner_checkpoint), "--plan", str(plan_path), "--profile", str(out), "--correction",
                 str(report), "--documents", str(out.parent / "profile.generated.pt"), "--max-positions", "4",
                 "--quiet"]) == 0
    assert f"{data['correction']['own']:.3g} S without shared cells" in capsys.readouterr().out


# ------------------------------------------------------------------------------ profile --exact-on, --tf32
def test_profile_exact_on_and_tf32_reach_the_profiler(checkpoint, documents, tmp_path, capsys, monkeypatch):
    import loopkv.planning.profiler as profiler

    real, seen = profiler.profile, []

    def spy(model, docs, **kwargs):
        seen.append((kwargs["exact_on"], kwargs["tf32"]))
        return real(model, docs, **kwargs)

    monkeypatch.setattr("loopkv.planning.profiler.profile", spy)
    plain, moved, tf32 = tmp_path / "plain.json", tmp_path / "moved.json", tmp_path / "tf32.json"
    assert main(["profile", str(checkpoint), "--documents", *documents, "--out", str(plain), "--quiet"]) == 0
    assert main(["profile", str(checkpoint), "--documents", *documents, "--out", str(moved), "--quiet",
                 "--exact-on", "cpu"]) == 0
    assert main(["profile", str(checkpoint), "--documents", *documents, "--out", str(tf32), "--quiet",
                 "--tf32"]) == 0
    capsys.readouterr()
    assert seen == [(None, False), ("cpu", False), (None, True)]
    assert Profile.from_json(moved).damage == Profile.from_json(plain).damage  # where it is kept changes nothing
    assert Profile.from_json(tf32).provenance["settings"]["tf32"] is True
    assert "tf32" not in Profile.from_json(plain).provenance["settings"]


def test_profile_exact_on_is_checked_before_the_work(checkpoint, documents, tmp_path, capsys, no_work):
    out = tmp_path / "p.json"
    assert main(["profile", str(checkpoint), "--documents", *documents, "--out", str(out), "--exact-on",
                 "nowhere"]) == 2
    one_error_line(capsys, "--exact-on 'nowhere' is not a torch device", "pass cpu")
    if not torch.cuda.is_available():
        assert main(["profile", str(checkpoint), "--documents", *documents, "--out", str(out), "--exact-on",
                     "cuda"]) == 2
        one_error_line(capsys, "--exact-on cuda: torch sees no CUDA GPU", "pass --exact-on cpu")
    assert not out.exists()
