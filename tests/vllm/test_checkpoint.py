"""A checkpoint of loopkv's Ouro (``OuroForCausalLM.save_pretrained``, as bench_vllm's real-weight check writes it),
read by vLLM 0.26 (skipped without vLLM): vLLM's own loader (``DefaultModelLoader.load_weights``, strict: every
parameter must come from the file) fills vLLM's Ouro from loopkv's parameter names, and the served model's prompt
logits equal loopkv's Ouro's.

CPU, float32, a tiny Ouro: vLLM's Ouro is built by the plugin with a uniform-INT4 plan (loopkv's cells run on CPU,
vLLM's own attention backends do not), and a prompt on an empty slot is attended exactly (SDPA), so its logits are the
dense model's up to float32 rounding."""

import json

import pytest
import torch

from loopkv.models.ouro import OuroConfig, OuroForCausalLM
from loopkv.planning.plan import Plan


def test_vllm_loads_a_saved_checkpoint_as_loopkvs_ouro(tmp_path):
    pytest.importorskip("vllm")
    from vllm.config import (
        CacheConfig,
        CompilationConfig,
        CompilationMode,
        DeviceConfig,
        LoadConfig,
        SchedulerConfig,
        VllmConfig,
        set_current_vllm_config,
    )
    from vllm.distributed import parallel_state
    from vllm.engine.arg_utils import EngineArgs
    from vllm.forward_context import set_forward_context
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.v1.attention.backend import CommonAttentionMetadata
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.worker.gpu.attn_utils import get_kv_cache_spec, init_attn_backend, init_kv_cache

    import loopkv.models
    from loopkv.vllm.layout import block_bytes, kv_layout
    from loopkv.vllm.model import LoopKVOuroForCausalLM

    loopkv.models.register_ouro()
    config = OuroConfig(num_hidden_layers=2, hidden_size=256, num_attention_heads=2, num_key_value_heads=2,
                        head_dim=128, intermediate_size=64, vocab_size=128, total_ut_steps=2,
                        tie_word_embeddings=False)
    d = config.to_dict()
    d.update(architectures=["OuroForCausalLM"], model_type="ouro", dtype="float32")
    torch.manual_seed(0)
    ours = OuroForCausalLM(config).float().eval()
    # transformers' init leaves the norms at one and the gate's bias at zero: make every tensor distinct, so that
    # a norm or projection vLLM read under another name shows in the logits, then save (vLLM reads config.json as
    # its own Ouro's: the architecture and model type written in)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in ours.named_parameters():
            if p.dim() == 1:
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=gen) if "norm" in name
                        else 0.1 * torch.randn(p.shape, generator=gen))
    ours.save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(d))

    plan = Plan.from_config(config, option="int4")
    model_config = EngineArgs(model=str(tmp_path), load_format="safetensors", dtype="float32",
                              skip_tokenizer_init=True, max_model_len=512).create_model_config()
    vc = VllmConfig(model_config=model_config, device_config=DeviceConfig(device="cpu"),
                    cache_config=CacheConfig(block_size=32, enable_prefix_caching=False),
                    scheduler_config=SchedulerConfig(max_num_seqs=1, max_model_len=512, is_encoder_decoder=False,
                                                     enable_chunked_prefill=False, max_num_batched_tokens=512),
                    compilation_config=CompilationConfig(mode=CompilationMode.NONE, custom_ops=["none"]),
                    load_config=LoadConfig(load_format="safetensors"),
                    additional_config={"loopkv_plan": plan.to_dict()})
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                                    distributed_init_method=f"file://{tmp_path}/dist")
    names = [f"model.layers.{i}.self_attn.attn" for i in range(4)]
    ids = torch.randint(1, 128, (40,), generator=torch.Generator().manual_seed(0))
    with set_current_vllm_config(vc):
        if not parallel_state.model_parallel_is_initialized():
            parallel_state.initialize_model_parallel(1, 1)
        model = LoopKVOuroForCausalLM(vllm_config=vc)
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(float("nan"))  # a parameter the loader misses cannot pass for a loaded one
        get_model_loader(vc.load_config).load_weights(model, model_config)  # strict: raises on a missed tensor
        assert all(torch.isfinite(p).all() for p in model.parameters())
        layout = kv_layout(plan, config, dtype_bytes=4)
        groups = kv_cache_utils.get_kv_cache_groups(vc, get_kv_cache_spec(vc))
        kv_config = kv_cache_utils.get_kv_cache_config_from_groups(vc, groups, 20 * block_bytes(layout))
        attn_groups, _, block_sizes = init_attn_backend(kv_config, vc, torch.device("cpu"))
        init_kv_cache([], vc.compilation_config.static_forward_context, kv_config, attn_groups,
                      torch.device("cpu"), "auto", block_sizes, vc)
        n = len(ids)
        qsl = torch.tensor([0, n], dtype=torch.int32)
        common = CommonAttentionMetadata(
            query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=torch.tensor([n], dtype=torch.int32),
            num_reqs=1, num_actual_tokens=n, max_query_len=n, max_seq_len=n,
            block_table_tensor=torch.arange(3, 3 + 16, dtype=torch.int32)[None],
            slot_mapping=torch.zeros(n, dtype=torch.long))
        meta = attn_groups[0][0].get_metadata_builder(0).build(0, common)
        with torch.no_grad(), set_forward_context({nm: meta for nm in names}, vc,
                                                  slot_mapping={nm: common.slot_mapping for nm in names}):
            served = model.compute_logits(model(ids, torch.arange(n)))
    with torch.no_grad():
        want = ours(input_ids=ids[None]).logits[0]
    # transformers' init (std 0.02): logits of std about 0.02 x sqrt(hidden), 0.3 here (vLLM's dummy weights: 1e-3
    # and below), so the comparison below can fail
    assert float(want.std()) > 0.1
    torch.testing.assert_close(served.float(), want, atol=1e-4, rtol=1e-4)  # float32, order of operations apart
