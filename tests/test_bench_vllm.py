"""``benchmarks/bench_vllm.py``'s pure parts: the Ouro config.json it writes for vLLM, and its decode-rate arithmetic.
Where vLLM is installed, vLLM's own model config reads the written folder as vLLM's native ``OuroForCausalLM``."""

import importlib
import json
import pathlib
import sys

import pytest

from loopkv.models.ouro import OuroConfig

BENCHMARKS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def bench():
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    return importlib.import_module("bench_vllm")


def test_config_is_bench_decodes_ouro_1p4b(bench, tmp_path):
    folder = bench.write_model_dir(tmp_path / "ouro")
    written = json.loads((folder / "config.json").read_text())
    assert written["architectures"] == ["OuroForCausalLM"]
    assert written["model_type"] == "ouro"
    cfg = OuroConfig.from_pretrained(folder)
    reference = importlib.import_module("bench_decode").ouro_1p4b_config()
    for field in bench.VLLM_OURO_FIELDS:
        assert getattr(cfg, field) == getattr(reference, field), field
    assert (cfg.total_ut_steps, cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim) == (4, 24, 16, 128)
    assert cfg.sliding_window is None  # every cell attends over the whole context
    assert bench.bf16_bytes_per_token() == 768 * 1024  # the README's 768 KiB per token


def test_decode_rate(bench):
    # 7 rows, 256 extra steps in 5.12 s more: 350 tokens/s
    assert bench.decode_tok_s(7, 32, 256, 2.0, 7.12) == pytest.approx(350.0)
    with pytest.raises(ValueError, match="did not take longer"):
        bench.decode_tok_s(1, 32, 256, 3.0, 3.0)


def test_vllm_reads_the_folder_as_its_ouro(bench, tmp_path):
    pytest.importorskip("vllm")
    from vllm.engine.arg_utils import EngineArgs

    import loopkv.models

    loopkv.models.register_ouro()
    folder = bench.write_model_dir(tmp_path / "ouro")
    args = EngineArgs(model=str(folder), load_format="dummy", dtype="bfloat16", skip_tokenizer_init=True,
                      max_model_len=16384 + 512)
    model_config = args.create_model_config()
    assert model_config.architectures == ["OuroForCausalLM"]
    assert model_config.get_head_size() == 128
    assert model_config.hf_config.total_ut_steps == 4
