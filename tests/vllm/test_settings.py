"""The plan setting of loopkv's vLLM plugin and its start-up checks (loopkv/vllm/settings.py); no vLLM needed."""

import json
import logging
import subprocess
import sys

import pytest

from loopkv.models.ouro import OuroConfig
from loopkv.planning.plan import Plan
from loopkv.vllm.settings import PLAN_ENV, PLAN_KEY, check_engine, load_plan, validate_for_vllm


@pytest.fixture
def config():
    return OuroConfig(total_ut_steps=4, num_hidden_layers=6, hidden_size=256, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=64, intermediate_size=64, vocab_size=64)


@pytest.fixture
def plan_file(tmp_path, config):
    plan = Plan.from_config(config, option="int4", shared_loops=[1])
    path = tmp_path / "plan.json"
    plan.to_json(path)
    return plan, path


def test_no_setting_no_plan():
    assert load_plan(None, environ={}) is None
    assert load_plan({"other": 1}, environ={PLAN_ENV: ""}) is None


def test_plan_from_env_from_key_and_from_an_object(plan_file):
    plan, path = plan_file
    assert load_plan(None, environ={PLAN_ENV: str(path)}) == plan
    assert load_plan({PLAN_KEY: str(path), "other": 1}, environ={}) == plan
    assert load_plan({PLAN_KEY: json.loads(path.read_text())}, environ={}) == plan


def test_both_spellings_refused(plan_file):
    _, path = plan_file
    with pytest.raises(ValueError, match=f"set twice.*unset {PLAN_ENV}"):
        load_plan({PLAN_KEY: str(path)}, environ={PLAN_ENV: str(path)})


@pytest.mark.parametrize("where", ["env", "key"])
def test_missing_file_names_the_setting(tmp_path, where):
    missing = str(tmp_path / "nope.json")
    args = ({PLAN_KEY: missing}, {}) if where == "key" else (None, {PLAN_ENV: missing})
    name = PLAN_KEY if where == "key" else PLAN_ENV
    with pytest.raises(ValueError, match=f"{name}.*not a file.*loopkv plan"):
        load_plan(args[0], environ=args[1])


def test_bad_files_and_values(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not a loopkv plan file"):
        load_plan(None, environ={PLAN_ENV: str(bad)})
    bad.write_text(json.dumps({"_type": "something else"}))
    with pytest.raises(ValueError, match="not a loopkv plan"):
        load_plan(None, environ={PLAN_ENV: str(bad)})
    with pytest.raises(ValueError, match="path to a plan JSON file or a plan's JSON object"):
        load_plan({PLAN_KEY: 3}, environ={})
    with pytest.raises(ValueError, match="additional_config is a list"):
        load_plan([PLAN_KEY], environ={})


def test_a_fitting_plan_passes(config, plan_file):
    plan, _ = plan_file
    validate_for_vllm(plan, config)
    validate_for_vllm(plan, config, tensor_parallel_size=2, kv_cache_dtype="bfloat16")
    validate_for_vllm(plan, config, tensor_parallel_size=4)  # 2 KV heads replicated over 4 ranks, as vLLM does


@pytest.mark.parametrize(("change", "message"), [
    (dict(total_ut_steps=3), "loops=4 but the model has total_ut_steps=3"),
    (dict(num_hidden_layers=5), "layers=6 but the model has num_hidden_layers=5"),
    (dict(num_key_value_heads=4), "kv_heads=2 but the model has num_key_value_heads=4"),
])
def test_shape_mismatch_named(config, plan_file, change, message):
    plan, _ = plan_file
    for name, value in change.items():
        setattr(config, name, value)
    with pytest.raises(ValueError, match=message):
        validate_for_vllm(plan, config)


def test_vllm_head_dim_differs_from_the_config(config):
    config.head_dim = 128  # vLLM's Ouro uses hidden_size // heads = 64 whatever head_dim says
    plan = Plan.from_config(config, option="bf16")
    with pytest.raises(ValueError, match="config.head_dim=128 but vLLM's Ouro uses hidden_size // num_attention_heads "
                                         "= 64"):
        validate_for_vllm(plan, config)


def test_tensor_parallel_and_kv_dtype(config, plan_file):
    plan, _ = plan_file
    with pytest.raises(ValueError, match="2 KV heads split over tensor_parallel_size=3"):
        validate_for_vllm(plan, config, tensor_parallel_size=3)
    with pytest.raises(ValueError, match="kv-cache-dtype fp8 quantizes"):
        validate_for_vllm(plan, config, kv_cache_dtype="fp8")


def test_not_ouro(plan_file):
    plan, _ = plan_file
    llama_like = OuroConfig()
    llama_like.total_ut_steps = None
    with pytest.raises(ValueError, match="no total_ut_steps.*serves Ouro"):
        validate_for_vllm(plan, llama_like)


def test_engine_settings_for_loopkv_cells(config):
    int4, bf16 = Plan.from_config(config, option="int4"), Plan.from_config(config, option="bf16")
    shared = Plan.from_config(config, option="int4", shared_loops=[2])
    check_engine(int4, block_size=32, prefix_caching=False, speculative=False, chunked_prefill=True)
    check_engine(bf16, block_size=16, prefix_caching=True, speculative=True,  # vLLM's own cells: anything goes
                 chunked_prefill=True, kv_sharing_fast_prefill=True)
    with pytest.raises(ValueError, match="--block-size is 16: pass --block-size 32.*--no-enable-prefix-caching.*"
                                         "speculative.*kv_sharing_fast_prefill"):
        check_engine(int4, block_size=16, prefix_caching=True, speculative=True, kv_sharing_fast_prefill=True)
    with pytest.raises(ValueError, match="--block-size is None"):
        check_engine(int4, block_size=None, prefix_caching=False, speculative=False)
    # share cells: a prompt's later chunks at most WINDOW (256) tokens
    check_engine(shared, block_size=32, prefix_caching=False, speculative=False, chunked_prefill=False)
    check_engine(shared, block_size=32, prefix_caching=False, speculative=False, chunked_prefill=True,
                 long_prefill_token_threshold=256)
    for threshold in (0, 257):
        with pytest.raises(ValueError, match="chunked prefill is on.*--no-enable-chunked-prefill.*threshold 256"):
            check_engine(shared, block_size=32, prefix_caching=False, speculative=False, chunked_prefill=True,
                         long_prefill_token_threshold=threshold)


def test_chunked_prefill_is_served_with_a_warning(config, caplog):
    int4, bf16 = Plan.from_config(config, option="int4"), Plan.from_config(config, option="bf16")
    with caplog.at_level(logging.WARNING, logger="loopkv.vllm.settings"):
        check_engine(int4, block_size=32, prefix_caching=False, speculative=False, chunked_prefill=False)
        check_engine(bf16, block_size=32, prefix_caching=False, speculative=False, chunked_prefill=True)
        assert not caplog.records  # whole prompts, or vLLM's own cells
        check_engine(int4, block_size=32, prefix_caching=False, speculative=False, chunked_prefill=True)
    assert len(caplog.records) == 1
    assert "--no-enable-chunked-prefill" in caplog.records[0].getMessage()


def test_importing_the_plugin_package_imports_no_vllm():
    code = ("import sys, loopkv, loopkv.vllm, loopkv.vllm.plugin, loopkv.vllm.settings, loopkv.vllm.layout, "
            "loopkv.vllm.cells; "
            "assert 'vllm' not in sys.modules, 'vllm imported'; assert 'triton' not in sys.modules; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
