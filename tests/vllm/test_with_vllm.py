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


# ---- the uniform-INT4 backend (loopkv/vllm/backend.py): its spec in vLLM's pool, its builder and impl

@pytest.fixture
def backend(vllm_kv):
    from loopkv.vllm import backend

    return backend


def _paper_like_plans():
    # LoopKV-R's kind (int4, int2, bf16 cells) and LoopKV-M's (the third loop shared too) on Ouro-1.4B's shape
    grid = [list(row) for row in Plan.from_config(OURO_1P4B, option="int4").grid()]
    grid[0][:4], grid[3][:2] = ["int2", "bf16", "int2", "bf16"], ["bf16", "int2"]
    shared = [row if t != 2 else ["share"] * 24 for t, row in enumerate(grid)]
    return [Plan.from_grid(g, kv_heads=16, head_dim=128) for g in (grid, shared)]


@pytest.mark.parametrize("plan", _paper_like_plans(), ids=["mixed", "mixed-shared"])
def test_the_plan_spec_is_one_group_sized_by_the_layout(vllm_kv, backend, plan):
    # the holder's one spec (every other cell shares its tensor): vLLM's grouping gives one group, one block table,
    # and its pool divides the memory by the plan's bytes per block
    layout = kv_layout(plan, OURO_1P4B)
    spec = backend.LoopKVPageSpec(block_size=32, num_kv_heads=16, head_size=128, dtype=torch.uint8,
                                  loopkv_block_bytes=block_bytes(layout))
    kv_cache_utils, _ = vllm_kv
    groups = kv_cache_utils.get_kv_cache_groups(_vllm_config(), {"model.layers.0.self_attn.attn": spec})
    available = 40 * 1024**3 + 12345
    config = kv_cache_utils.get_kv_cache_config_from_groups(_vllm_config(), groups, available)
    assert len(groups) == 1
    assert groups[0].kv_cache_spec.page_size_bytes == block_bytes(layout)
    assert config.num_blocks == available // block_bytes(layout)
    stored = {"bf16": 256, "int4": 80, "int2": 48, "share": 0}
    assert block_bytes(layout) == sum(stored[plan.option(c)] for c in plan.layout) * 1024  # per block, by hand
    assert [t.size for t in config.kv_cache_tensors] == [block_bytes(layout) * config.num_blocks]
    assert backend.LoopKVBackend.get_kv_cache_shape(config.num_blocks, 32, 16, 128) == (config.num_blocks, -1)
    with pytest.raises(ValueError, match="--block-size 32"):
        backend.LoopKVBackend.get_kv_cache_shape(10, 16, 16, 128)


def test_plan_spec_merge_keeps_its_page(backend):
    spec = backend.LoopKVPageSpec(block_size=32, num_kv_heads=2, head_size=64, dtype=torch.uint8,
                                  loopkv_block_bytes=12345)
    merged = backend.LoopKVPageSpec.merge([spec, spec])
    assert merged == spec
    assert merged.page_size_bytes == 12345
    other = dataclasses.replace(spec, loopkv_block_bytes=999)
    with pytest.raises(ValueError, match="different blocks"):
        backend.LoopKVPageSpec.merge([spec, other])


@pytest.mark.parametrize("pad", [False, True], ids=["eager", "padded-to-capture-sizes"])
def test_builder_and_impl_equal_loopkv_cache(backend, pad):
    # vLLM's CommonAttentionMetadata -> LoopKVMetadataBuilder.build -> LoopKVImpl.forward, over the scheduled
    # steps of tests/vllm/test_cells.py, against each request's LoopKVCache; pad: every step of single tokens given as
    # vLLM gives a full CUDA graph's batch (model runner V2's prepare_inputs: requests padded to a capture size with
    # no tokens, query_start_loc repeating the last value, seq_len 0, a block table row of zeros, num_actual_tokens
    # the padded count), and its decode read's inputs always the same tensors
    import math

    from vllm.v1.attention.backend import CommonAttentionMetadata

    from loopkv.format import page_bytes
    from loopkv.vllm.cells import CellExact
    from loopkv.vllm.layout import PoolRef
    from tests.vllm.test_cells import (
        CAPTURE_SIZES,
        CONFIG,
        HQ,
        MAX_LEN,
        MAX_TOKENS,
        NUM_BLOCKS,
        SCALE,
        SLOTS,
        D,
        H,
        check_storage,
        run_scenario,
    )

    tau = 2.0
    plan = Plan.from_config(CONFIG, option="int4", tau=tau)
    vllm_config = SimpleNamespace(scheduler_config=SimpleNamespace(max_num_seqs=SLOTS,
                                                                   max_num_batched_tokens=MAX_TOKENS),
                                  model_config=SimpleNamespace(max_model_len=MAX_LEN))
    size = page_bytes(4, H, D)
    spec = backend.LoopKVPageSpec(block_size=32, num_kv_heads=H, head_size=D, dtype=torch.uint8,
                                  loopkv_block_bytes=size)
    builder = backend.LoopKVMetadataBuilder(spec, ["model.layers.0.self_attn.attn"], vllm_config, torch.device("cpu"))
    impl = backend.LoopKVImpl(HQ, D, SCALE, num_kv_heads=H)
    cell = CellExact.allocate(SLOTS, H, D, dtype=torch.float32)
    ref = PoolRef(bits=4, offset=0, size=size, owner="model.layers.0.self_attn.attn")
    layer = SimpleNamespace(loopkv_exact=lambda: cell, loopkv_tau=tau, loopkv_pool=ref,
                            loopkv_source_exact=lambda: None)
    kv = torch.zeros(NUM_BLOCKS, page_bytes(4, H, D), dtype=torch.uint8)
    assert builder.state.page_table.shape == (SLOTS, math.ceil(MAX_LEN / 32) - 1)
    gen = torch.Generator().manual_seed(1)
    addresses = set()

    def forward(qsl, seq_lens, first, table, q, k, v, out):
        n, T = len(seq_lens), qsl[-1]
        size = T
        if pad and T == n:  # a uniform decode batch, padded as model runner V2 pads it
            size = min(c for c in CAPTURE_SIZES if c >= n)
            qsl, seq_lens = qsl + [T] * (size - n), seq_lens + [0] * (size - n)
            table = torch.cat([table, torch.zeros(size - n, table.shape[1], dtype=table.dtype)])
            q, k, v = (torch.cat([x[:, :T], torch.randn(1, size - T, *x.shape[2:], generator=gen)], dim=1)
                       for x in (q, k, v))
        qsl_t = torch.tensor(qsl, dtype=torch.int32)
        common = CommonAttentionMetadata(
            query_start_loc=qsl_t, query_start_loc_cpu=qsl_t, seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            num_reqs=len(seq_lens), num_actual_tokens=size, max_query_len=int((qsl_t[1:] - qsl_t[:-1]).max()),
            max_seq_len=max(seq_lens), block_table_tensor=table, slot_mapping=torch.zeros(size, dtype=torch.long))
        meta = builder.build(0, common)
        if meta.step.decode is not None and not meta.step.prompts:
            addresses.add(tuple(t.data_ptr() for t in vars(meta.step.decode).values()))
        # vLLM's layer passes q, k, v and the output as [T, heads, head_size] views
        wide = torch.full((size, HQ, D), float("nan"))
        impl.forward(layer, q[0, :size], k[0, :size], v[0, :size], kv, meta, wide)
        assert size == T or not wide[T:].any()  # padded tokens: zeros
        out[0, :T] = wide[:T]

    engine, refs = run_scenario(plan, forward)
    check_storage(engine, refs, builder.state.slot_map, cell, impl.pool(kv, ref, torch.float32))
    assert len(addresses) == 1
    assert impl.forward(layer, None, None, None, kv, None, out := torch.ones(3)) is out
    assert not out.any()


def test_impl_refuses_what_it_does_not_serve(backend):
    with pytest.raises(ValueError, match="without \\['sliding_window'\\]"):
        backend.LoopKVImpl(4, 32, 0.1, num_kv_heads=2, sliding_window=128)


@pytest.mark.parametrize("grid", [[["int4", "int4"], ["int4", "int4"]], [["int2", "int4"], ["bf16", "int2"]],
                                  [["share", "int2"], ["bf16", "int4"]]], ids=["int4", "mixed", "shared"])
def test_vllm_ouro_with_a_plan_serves_loopkv_cells(backend, tmp_path, grid):
    # vLLM's own Ouro built by LoopKVOuroForCausalLM with a plan (uniform INT4; int2, int4 and bf16 cells; a share
    # cell at (0, 0), the layer whose tensor every cell shares), its KV specs, groups, pool, attention groups and
    # tensors made by vLLM's own functions (the model runner V2's), run eagerly on CPU through vLLM's Attention layer
    # (vLLM's native ops, dummy weights): every cell is loopkv's, and over a prompt and decode steps each cell's
    # output equals LoopKVCache's for the same q/k/v, read in the model's order
    import json
    import math

    from vllm.config import (
        CacheConfig,
        CompilationConfig,
        CompilationMode,
        CUDAGraphMode,
        DeviceConfig,
        SchedulerConfig,
        VllmConfig,
        set_current_vllm_config,
    )
    from vllm.distributed import parallel_state
    from vllm.engine.arg_utils import EngineArgs
    from vllm.forward_context import set_forward_context
    from vllm.model_executor.model_loader.weight_utils import initialize_dummy_weights
    from vllm.v1.attention.backend import AttentionCGSupport, CommonAttentionMetadata
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.worker.gpu.attn_utils import get_kv_cache_spec, init_attn_backend, init_kv_cache

    import loopkv.models
    from loopkv.cache.attention import loopkv_attention
    from loopkv.cache.loop_cache import LoopKVCache
    from loopkv.vllm.model import LoopKVOuroForCausalLM

    loopkv.models.register_ouro()
    config = OuroConfig(num_hidden_layers=2, hidden_size=256, num_attention_heads=2, num_key_value_heads=2,
                        head_dim=128, intermediate_size=64, vocab_size=128, total_ut_steps=2)
    d = config.to_dict()
    d.update(architectures=["OuroForCausalLM"], model_type="ouro")
    (tmp_path / "config.json").write_text(json.dumps(d))
    plan = Plan.from_grid(grid, kv_heads=2, head_dim=128, tau=3.0)
    model_config = EngineArgs(model=str(tmp_path), load_format="dummy", dtype="float32", skip_tokenizer_init=True,
                              max_model_len=1024).create_model_config()
    vc = VllmConfig(model_config=model_config, device_config=DeviceConfig(device="cpu"),
                    cache_config=CacheConfig(block_size=32, enable_prefix_caching=False),
                    scheduler_config=SchedulerConfig(max_num_seqs=2, max_model_len=1024, is_encoder_decoder=False,
                                                     enable_chunked_prefill=False, max_num_batched_tokens=1024),
                    compilation_config=CompilationConfig(mode=CompilationMode.NONE, custom_ops=["none"]),
                    additional_config={"loopkv_plan": plan.to_dict()})
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                                    distributed_init_method=f"file://{tmp_path}/dist")
    with set_current_vllm_config(vc):
        if not parallel_state.model_parallel_is_initialized():
            parallel_state.initialize_model_parallel(1, 1)
        model = LoopKVOuroForCausalLM(vllm_config=vc)
        initialize_dummy_weights(model, model_config, low=-0.3, high=0.3)  # K, V of order 1, not vLLM's 1e-3
        specs = get_kv_cache_spec(vc)
        names = [f"model.layers.{i}.self_attn.attn" for i in range(4)]  # cell t * L + l
        layout = kv_layout(plan, config, dtype_bytes=4)
        assert list(specs) == [names[0]]  # the holder; the others share its tensor
        assert type(specs[names[0]]) is backend.LoopKVPageSpec
        assert specs[names[0]].page_size_bytes == block_bytes(layout)
        groups = kv_cache_utils.get_kv_cache_groups(vc, specs)
        kv_config = kv_cache_utils.get_kv_cache_config_from_groups(vc, groups, 40 * block_bytes(layout) + 5)
        assert kv_config.num_blocks == 40
        attn_groups, cg_support, block_sizes = init_attn_backend(kv_config, vc, torch.device("cpu"))
        assert [[sorted(g.layer_names) for g in gs] for gs in attn_groups] == [[names]]  # one builder for all
        # the support vLLM reads from the builder, and the graph modes its config resolves from it (model runner V2)
        assert cg_support.min_cg_support == AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
        for mode, compile_mode in (("FULL_DECODE_ONLY", CompilationMode.NONE),
                                   ("FULL_AND_PIECEWISE", CompilationMode.VLLM_COMPILE)):
            cc = CompilationConfig(mode=compile_mode, cudagraph_mode=mode, cudagraph_capture_sizes=[1, 2])
            resolved = cc.resolve_cudagraph_mode_and_sizes(cg_support.min_cg_support, cg_support.min_cg_attn_backend,
                                                           1, use_v2_model_runner=True, kv_cache_config=kv_config,
                                                           max_num_reqs=2)
            assert resolved == CUDAGraphMode[mode]
        kv = init_kv_cache([], vc.compilation_config.static_forward_context, kv_config, attn_groups,
                           torch.device("cpu"), "auto", block_sizes, vc)
        assert {t.data_ptr() for t in kv.values()} == {kv[names[0]].data_ptr()}
        assert tuple(kv[names[0]].shape) == (40, block_bytes(layout))
        builder = attn_groups[0][0].get_metadata_builder(0)
        seen = []  # (layer name, q, k, v, out) in the model's order
        for name in names:
            layer = vc.compilation_config.static_forward_context[name]
            assert isinstance(layer, backend.LoopKVAttention)
            assert layer.loopkv_tau == 3.0
            assert layer.kv_sharing_target_layer_name == (None if name == names[0] else names[0])
            forward = layer.impl.forward

            def recording(lay, q, k, v, kv, meta, output, *rest, _forward=forward, **kw):
                out = _forward(lay, q, k, v, kv, meta, output, *rest, **kw)
                n = real[0]  # the step's tokens (not vLLM's padding); 0 in a dummy run
                if n:
                    seen.append((lay.layer_name, q[:n].clone(), k[:n].clone(), v[:n].clone(), out[:n].clone()))
                return out

            layer.impl.forward = recording

        real, decodes = [0], []
        table = torch.arange(7, 7 + 20, dtype=torch.int32)[None]

        def run(common, ids, positions, meta):
            with set_forward_context({nm: meta for nm in names}, vc, slot_mapping={nm: common.slot_mapping
                                                                                    for nm in names}):
                return model(torch.tensor(ids), positions)

        def step(ids, start, size=None):
            # one request's tokens; size: a decode batch padded to a capture size as model runner V2 pads it
            n = len(ids)
            size = size or n
            qsl = torch.tensor([0] + [n] * size, dtype=torch.int32)
            seq_lens = torch.tensor([start + n] + [0] * (size - 1), dtype=torch.int32)
            common = CommonAttentionMetadata(
                query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=seq_lens, num_reqs=size,
                num_actual_tokens=max(n, size), max_query_len=n, max_seq_len=start + n,
                block_table_tensor=torch.cat([table, torch.zeros(size - 1, 20, dtype=torch.int32)]),
                slot_mapping=torch.zeros(max(n, size), dtype=torch.long))
            real[0] = n
            ids = ids + [0] * (size - n)
            positions = torch.cat([torch.arange(start, start + n), torch.zeros(size - n, dtype=torch.long)])
            meta = builder.build(0, common)
            if meta.step.decode is not None:
                decodes.append(meta.step.decode)
            return run(common, ids, positions, meta)[:n]

        def capture_run(size):
            # what model runner V2 builds and runs to capture a decode graph (InputBatch.make_dummy, the dummy block
            # tables: rows of zeros): every request one token, seq_len 1
            qsl = torch.arange(size + 1, dtype=torch.int32)
            common = CommonAttentionMetadata(
                query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=torch.ones(size, dtype=torch.int32),
                num_reqs=size, num_actual_tokens=size, max_query_len=1, max_seq_len=1024,
                block_table_tensor=torch.zeros(size, 20, dtype=torch.int32),
                slot_mapping=torch.zeros(size, dtype=torch.long))
            meta = builder.build_for_cudagraph_capture(common)
            assert meta.step.decode is not None
            assert not meta.step.prompts
            real[0] = 0
            run(common, [0] * size, torch.zeros(size, dtype=torch.long), meta)
            return meta

        captured = capture_run(2)
        gen = torch.Generator().manual_seed(0)
        hidden = step(torch.randint(1, 128, (330,), generator=gen).tolist(), 0)
        for i in range(3):  # the third decode token makes the row 333 long: page 0 was quantized at 319
            if i == 1:
                capture_run(2)  # between live steps too: it writes nothing a live request reads
            size = 2 if i != 1 else None  # padded as a graph of 2 requests replays it
            hidden = step([int(hidden[-1].abs().argmax()) % 127 + 1], 330 + i, size)
        assert {tuple(t.data_ptr() for t in vars(d).values()) for d in decodes} == {
            tuple(t.data_ptr() for t in vars(captured.step.decode).values())}
        assert torch.isfinite(hidden).all()
    cache = LoopKVCache(plan, config=config, max_batch_size=1, max_cache_len=1024, dtype=torch.float32, device="cpu")
    assert [s[0] for s in seen] == names * 4  # 4 forwards, every cell once per forward, loop by loop
    for name, q, k, v, out in seen:
        handle, _ = cache.update(k.transpose(0, 1)[None], v.transpose(0, 1)[None], names.index(name))
        want, _ = loopkv_attention(None, q.transpose(0, 1)[None], handle, handle, None, scaling=128**-0.5)
        assert 0.1 < float(v.abs().mean()) < 10
        assert 0.01 < float(want.abs().mean()) < 10
        torch.testing.assert_close(out.view(want[0].shape), want[0], atol=1e-5, rtol=1e-5, msg=name)
    assert math.isfinite(float(cache.storage(1).k_scale.float().abs().max()))  # cell (0, 1) is quantized in all


def test_the_holder_must_be_built_first(backend):
    # every cell shares the tensor of the first layer vLLM's Ouro builds: a vLLM building another cell first is refused
    from loopkv.vllm.model import _cell_factory

    config = OuroConfig(num_hidden_layers=2, hidden_size=256, num_attention_heads=2, num_key_value_heads=2,
                        head_dim=128, intermediate_size=64, vocab_size=128, total_ut_steps=2)
    plan = Plan.from_config(config, option="int4")
    make = _cell_factory(plan, kv_layout(plan, config), {})
    with pytest.raises(RuntimeError, match="built model.layers.1.self_attn.attn before layer 0"):
        make(2, 128, 1.0, prefix="model.layers.1.self_attn.attn")
    make = _cell_factory(plan, kv_layout(plan, config), {0: object()})
    with pytest.raises(RuntimeError, match="built model.layers.0.self_attn.attn again"):
        make(2, 128, 1.0, prefix="model.layers.0.self_attn.attn")
