"""A user's own checkpoint: ``AutoModelForCausalLM`` after ``loopkv.models.register_ouro()``, and MODEL as a folder or
a Hub id already in the local Hub cache (looked up offline, never downloaded) for ``loopkv profile/eval``."""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

import loopkv
from loopkv.models.checkpoints import CheckpointError, check_ouro_checkpoint, checkpoint_folder
from loopkv.models.ouro import OuroConfig, OuroForCausalLM
from loopkv.models.small import SMALL_DIR, encode, load_small

LOOPS, LAYERS, VOCAB = 2, 2, 97
REPO = pathlib.Path(__file__).resolve().parents[2]


def tiny_model() -> OuroForCausalLM:
    torch.manual_seed(0)
    cfg = OuroConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=LAYERS,
                     num_attention_heads=2, num_key_value_heads=2, head_dim=32, total_ut_steps=LOOPS,
                     max_position_embeddings=1024, rope_theta=10000.0)
    return OuroForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> pathlib.Path:
    path = tmp_path_factory.mktemp("tiny_ouro")
    tiny_model().save_pretrained(path)
    return path


def fake_hub_cache(root: pathlib.Path, repo_id: str, checkpoint: pathlib.Path, *, commit: str = "0" * 40) -> None:
    """``root`` laid out as the Hub's cache after ``hf download repo_id``: the files under ``blobs/<sha256>``, the
    snapshot ``snapshots/<commit>/`` of symlinks to them, and ``refs/main`` naming the commit."""
    repo = root / ("models--" + repo_id.replace("/", "--"))
    (repo / "blobs").mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for file in checkpoint.iterdir():
        data = file.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / file.name).symlink_to(os.path.relpath(blob, snapshot))


# ------------------------------------------------------------------------------------------- AutoModel
def test_auto_classes_load_a_saved_checkpoint_after_register_ouro(saved):
    """Round trip: save_pretrained, then the Auto classes give back the same OuroForCausalLM (weights, logits)."""
    loopkv.models.register_ouro()
    assert isinstance(AutoConfig.from_pretrained(saved), OuroConfig)
    model = AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32).eval()
    assert type(model) is OuroForCausalLM
    original = tiny_model()
    want, got = original.state_dict(), model.state_dict()
    assert want.keys() == got.keys()
    assert all(torch.equal(want[k], got[k]) for k in want)
    ids = torch.randint(3, VOCAB, (2, 9))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, original(ids).logits)


def test_auto_classes_load_the_small_model_and_its_tokenizer():
    loopkv.models.register_ouro()
    model = AutoModelForCausalLM.from_pretrained(SMALL_DIR, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(SMALL_DIR)
    prompt = "def add(a, b):\n    return"
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    assert torch.equal(ids[0], encode(prompt))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, load_small()(ids).logits)


def test_the_documented_call_is_what_auto_classes_need():
    """In a fresh interpreter, ``import loopkv`` registers nothing (transformers does not know "ouro") and
    ``loopkv.models.register_ouro()`` is the one call that makes AutoModelForCausalLM load the folder."""
    code = textwrap.dedent(f"""
        import torch
        from transformers import AutoModelForCausalLM
        import loopkv
        try:
            AutoModelForCausalLM.from_pretrained({str(SMALL_DIR)!r})
        except ValueError as err:
            print("refused:", "ouro" in str(err))
        loopkv.models.register_ouro()
        model = AutoModelForCausalLM.from_pretrained({str(SMALL_DIR)!r}, dtype=torch.float32)
        print("loaded:", type(model).__name__)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:2] == ["refused: True", "loaded: OuroForCausalLM"]


# ------------------------------------------------------------------------------ folder or Hub id, offline
def test_a_hub_id_in_the_local_cache_resolves_to_its_snapshot(saved, tmp_path):
    fake_hub_cache(tmp_path / "hub", "org/tiny", saved, commit="abc123" * 6 + "abcd")
    folder = checkpoint_folder("org/tiny", cache_dir=tmp_path / "hub")
    assert pathlib.Path(folder) == tmp_path / "hub" / "models--org--tiny" / "snapshots" / ("abc123" * 6 + "abcd")
    model = OuroForCausalLM.from_pretrained(folder, dtype=torch.float32, local_files_only=True).eval()
    ids = torch.randint(3, VOCAB, (1, 7))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, tiny_model()(ids).logits)
    assert checkpoint_folder(str(saved), cache_dir=tmp_path / "hub") == str(saved)  # a folder is itself


def test_what_is_not_there_is_refused_by_name(saved, tmp_path):
    hub = tmp_path / "hub"
    fake_hub_cache(hub, "org/tiny", saved)
    with pytest.raises(CheckpointError, match="neither a checkpoint directory nor 'small'") as info:
        checkpoint_folder("org/missing", cache_dir=hub)
    message = str(info.value)
    assert "not in the local Hub cache" in message
    assert str(hub) in message
    assert "hf download org/missing" in message
    with pytest.raises(CheckpointError, match="no such folder"):
        checkpoint_folder(str(tmp_path / "nowhere"), cache_dir=hub)
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(CheckpointError, match="is a file, not a checkpoint folder"):
        checkpoint_folder(str(tmp_path / "weights.bin"), cache_dir=hub)
    (hub / "models--org--tiny" / "snapshots" / ("0" * 40) / "config.json").unlink()
    with pytest.raises(CheckpointError, match="has no config.json"):
        checkpoint_folder("org/tiny", cache_dir=hub)


def test_another_architecture_is_refused_by_its_model_type(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(CheckpointError, match="'llama' checkpoint"):
        check_ouro_checkpoint(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "ouro"}))
    check_ouro_checkpoint(str(tmp_path))


def test_cli_takes_a_hub_id_from_the_local_cache_offline(saved, tmp_path):
    """``loopkv eval org/tiny`` with HF_HOME pointing at a cache that holds it (HF_HUB_OFFLINE=1: any network access
    would fail), and a refusal, exit 2 and one line, for an id the cache does not hold."""
    fake_hub_cache(tmp_path / "hf" / "hub", "org/tiny", saved)
    loopkv.Plan.uniform(loops=LOOPS, layers=LAYERS, option="int4").to_json(tmp_path / "plan.json")
    torch.save(torch.randint(3, VOCAB, (330,), generator=torch.Generator().manual_seed(1)), tmp_path / "doc.pt")
    code = textwrap.dedent("""
        import sys
        from loopkv.cli import main
        common = ["--plan", "plan.json", "--documents", "doc.pt", "--max-positions", "4", "--quiet", "--device", "cpu"]
        print("codes", main(["eval", "org/tiny", *common]), main(["eval", "org/missing", *common]),
              main(["profile", "org/missing", "--out", "profile.json"]))
    """)
    env = dict(os.environ, HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1")
    env.pop("HF_HUB_CACHE", None)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, env=env,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert "codes 0 2 2" in out.stdout, out.stdout + out.stderr
    assert "plan.json: KL" in out.stdout
    errors = [line for line in out.stderr.splitlines() if ": error: " in line]
    assert len(errors) == 2, out.stderr
    for command, line in zip(("eval", "profile"), errors, strict=True):
        assert line.startswith(f"loopkv {command}: error: MODEL 'org/missing' is neither a checkpoint directory")
        assert str(tmp_path / "hf" / "hub") in line
    assert not (tmp_path / "profile.json").exists()
