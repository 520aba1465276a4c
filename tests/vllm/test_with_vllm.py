"""loopkv's layout against vLLM 0.26's own KV-cache code, and the plugin's registration (skipped without vLLM).

CPU only: vLLM's spec classes, its grouping of layers and its sizing of the pool are plain Python."""

import dataclasses
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from loopkv.models.ouro import OuroConfig
from loopkv.planning.plan import Plan
from loopkv.vllm import plugin
from loopkv.vllm.layout import block_bytes, kv_layout

OURO_1P4B = OuroConfig()
PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def test_entry_point_and_extra_declared():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    meta = tomllib.loads(PYPROJECT.read_text())["project"]
    assert meta["entry-points"]["vllm.general_plugins"] == {"loopkv": "loopkv.vllm.plugin:register"}
    assert meta["optional-dependencies"]["vllm"] == [f"vllm{plugin.SUPPORTED_VLLM}"]


@pytest.mark.parametrize("version", ["0.26.0", "0.26.3", "0.26.0+cu130", "0.26.1rc1"])
def test_supported_versions(version):
    plugin.check_vllm_version(version)


@pytest.mark.parametrize("version", ["0.25.9", "0.27.0", "1.0.0", "0.13.0"])
def test_unsupported_versions_named(version):
    with pytest.raises(RuntimeError, match=rf"supports vllm>=0.26,<0.27 and vLLM {version} is installed"):
        plugin.check_vllm_version(version)
    with pytest.raises(RuntimeError, match="cannot read"):
        plugin.check_vllm_version("not a version")


@pytest.fixture
def vllm_kv():
    pytest.importorskip("vllm")
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    return kv_cache_utils, FullAttentionSpec


def _vllm_config():
    # the fields vLLM's grouping and sizing read (kv_cache_utils.get_kv_cache_groups / _config_from_groups)
    return SimpleNamespace(scheduler_config=SimpleNamespace(disable_hybrid_kv_cache_manager=False),
                           cache_config=SimpleNamespace(num_gpu_blocks_override=None), kv_transfer_config=None)


def test_bf16_block_is_vllms_page(vllm_kv):
    kv_cache_utils, full_spec = vllm_kv
    for tp in (1, 2, 32):
        layout = kv_layout(Plan.from_config(OURO_1P4B, option="bf16"), OURO_1P4B, tensor_parallel_size=tp)
        spec = full_spec(block_size=32, num_kv_heads=layout[0].kv_heads, head_size=128, dtype=torch.bfloat16)
        assert layout[0].block_bytes == spec.page_size_bytes


def test_layer_index_is_vllms(vllm_kv):
    from vllm.model_executor.models.utils import extract_layer_index

    for cell in kv_layout(Plan.from_config(OURO_1P4B, option="bf16"), OURO_1P4B):
        assert extract_layer_index(cell.layer_name) == cell.cell.loop * 24 + cell.cell.layer


def _pool(vllm_kv, layout, spec_of):
    kv_cache_utils, _ = vllm_kv
    specs = {c.layer_name: spec_of(c) for c in layout if c.stores}
    groups = kv_cache_utils.get_kv_cache_groups(_vllm_config(), specs)
    available = 40 * 1024**3 + 12345
    return specs, groups, kv_cache_utils.get_kv_cache_config_from_groups(_vllm_config(), groups, available), available


def test_all_bf16_plan_is_one_group_sized_by_the_layout(vllm_kv):
    _, full_spec = vllm_kv
    layout = kv_layout(Plan.from_config(OURO_1P4B, option="bf16"), OURO_1P4B)
    specs, groups, config, available = _pool(
        vllm_kv, layout, lambda c: full_spec(block_size=32, num_kv_heads=c.kv_heads, head_size=c.head_dim,
                                             dtype=torch.bfloat16))
    assert len(groups) == 1
    assert sorted(groups[0].layer_names) == sorted(specs)
    assert config.num_blocks == available // block_bytes(layout)
    assert {t.size for t in config.kv_cache_tensors} == {layout[0].block_bytes * config.num_blocks}


def test_per_cell_page_sizes_share_one_block_table(vllm_kv):
    # the design's claim (docs/vllm.md): cells whose specs are full-attention specs of different page sizes (the
    # plan's bytes per block) fall in one group, one block table, and vLLM divides its memory by the sum of the
    # storing cells' block bytes. PageSpec stands for the quantized backend's spec, which is not built.
    _, full_spec = vllm_kv

    @dataclasses.dataclass(frozen=True, kw_only=True)
    class PageSpec(full_spec):
        bytes_per_block: int = 0

        @property
        def real_page_size_bytes(self) -> int:
            return self.bytes_per_block

        @classmethod
        def merge(cls, specs):
            # FullAttentionSpec.merge compares AttentionSpec's fields only and rebuilds the spec without this one:
            # unmerged, cells of different options would count as one spec of the default size (docs/vllm.md)
            assert len({s.bytes_per_block for s in specs}) == 1, "different block bytes"
            return dataclasses.replace(super().merge(specs), bytes_per_block=specs[0].bytes_per_block)

    plan = Plan.from_config(OURO_1P4B, option="int4", shared_loops=[2])
    grid = [list(row) for row in plan.grid()]
    grid[0][:4] = ["int2", "bf16", "int2", "bf16"]
    plan = Plan.from_grid(grid, kv_heads=16, head_dim=128)
    layout = kv_layout(plan, OURO_1P4B)
    specs, groups, config, available = _pool(
        vllm_kv, layout, lambda c: PageSpec(block_size=32, num_kv_heads=c.kv_heads, head_size=c.head_dim,
                                            dtype=torch.uint8, bytes_per_block=c.block_bytes))
    assert len(specs) == 72  # the 24 shared cells have no spec
    assert len(groups) == 1
    assert sorted(groups[0].layer_names) == sorted(specs)
    assert config.num_blocks == available // block_bytes(layout)
    sizes = {t.shared_by[0]: t.size for t in config.kv_cache_tensors}
    assert sizes == {c.layer_name: c.block_bytes * config.num_blocks for c in layout if c.stores}


def test_register_is_idempotent_and_serves_ouro_through_loopkv(vllm_kv, monkeypatch, tmp_path):
    from vllm import ModelRegistry

    arch = plugin.OURO_ARCHITECTURE
    monkeypatch.setitem(ModelRegistry.models, arch, ModelRegistry.models[arch])  # vLLM's Ouro back afterwards
    monkeypatch.setattr(plugin, "_registered", False)
    monkeypatch.delenv("LOOPKV_PLAN", raising=False)
    plugin.register()
    plugin.register()
    entry = ModelRegistry.models[plugin.OURO_ARCHITECTURE]
    assert f"{entry.module_name}:{entry.class_name}" == plugin.MODEL_CLASS

    monkeypatch.setattr(plugin, "_registered", False)
    monkeypatch.setenv("LOOPKV_PLAN", str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match="LOOPKV_PLAN names .* not a file"):
        plugin.register()


def test_vllm_builds_ouro_from_loopkvs_class(vllm_kv, monkeypatch, tmp_path):
    # vLLM's own resolution (model config from a folder, architecture to class, its inspection of the class)
    import json

    from vllm import ModelRegistry
    from vllm.engine.arg_utils import EngineArgs

    import loopkv.models

    arch = plugin.OURO_ARCHITECTURE
    monkeypatch.setitem(ModelRegistry.models, arch, ModelRegistry.models[arch])
    monkeypatch.setattr(plugin, "_registered", False)
    monkeypatch.delenv("LOOPKV_PLAN", raising=False)
    plugin.register()
    loopkv.models.register_ouro()
    config = OuroConfig(num_hidden_layers=2, hidden_size=256, num_attention_heads=2, num_key_value_heads=2,
                        head_dim=128, intermediate_size=64, vocab_size=128).to_dict()
    config.update(architectures=[arch], model_type="ouro")
    (tmp_path / "config.json").write_text(json.dumps(config))
    model_config = EngineArgs(model=str(tmp_path), load_format="dummy", dtype="bfloat16", skip_tokenizer_init=True,
                              max_model_len=1024).create_model_config()
    cls, resolved = ModelRegistry.resolve_model_cls(model_config.architectures, model_config=model_config)
    assert resolved == arch
    assert f"{cls.__module__}:{cls.__name__}" == plugin.MODEL_CLASS
    from vllm.model_executor.models.ouro import OuroForCausalLM

    assert issubclass(cls, OuroForCausalLM)
