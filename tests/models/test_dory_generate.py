"""transformers' own DoryForCausalLM through its ``generate`` with a LoopKVCache (tiny random model, fp32, CPU).

Planned cells are the recurrent full-attention layers per loop; the prelude/coda and the sliding-window layers are
fixed exact cells (loopkv/families.py). References: transformers' dense cache for the same call, and for INT4 the
dense cache with every history page a decode token reads at a planned index replaced by the codec's round trip
(page ``p`` holds positions ``32 + 32p .. 32 + 32p + 31``; a token whose row then holds ``n`` tokens reads pages
``p < (n - 288) // 32``; prefill attends exactly). Skipped without Dory (transformers < 5.24).
"""

from __future__ import annotations

import warnings

import pytest
import torch

import loopkv
from loopkv.families import DORY_MIN_TRANSFORMERS, layout_of
from loopkv.models.ouro import OuroConfig
from loopkv.ops import codec
from tests.tolerances import LOGITS_FP32_ATOL, LOGITS_FP32_RTOL

try:
    from transformers import DoryConfig, DoryForCausalLM
    from transformers.cache_utils import DynamicCache
except ImportError:  # transformers < 5.24 has no Dory
    pytest.skip(f"needs transformers >= {DORY_MIN_TRANSFORMERS} (Dory)", allow_module_level=True)

VOCAB, LOOPS = 61, 3
PAGE, SINK, READ_FROM = 32, 32, 288  # a row of n tokens reads pages p < (n - READ_FROM) // PAGE
# prelude: full, sliding; core (run LOOPS times): full, sliding, full; coda: sliding, full
LAYER_TYPES = ["full_attention", "sliding_attention", "full_attention", "sliding_attention", "full_attention",
               "sliding_attention", "full_attention"]


def tiny_config(mode: str = "per_loop", window: int = 512) -> DoryConfig:
    config = DoryConfig(num_hidden_layers=7, n_input_layers=2, n_output_layers=2, n_recurrent_loops=LOOPS,
                        hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=32, vocab_size=VOCAB, sliding_window=window, layer_types=LAYER_TYPES,
                        recurrent_kv_cache_mode=mode)
    config._attn_implementation = "sdpa"
    return config


def build(mode: str = "per_loop", window: int = 512) -> DoryForCausalLM:
    torch.manual_seed(0)
    model = DoryForCausalLM(tiny_config(mode, window)).eval()
    with torch.no_grad():  # the default init holds the nGPT scales at one value: spread them a little
        for p in model.parameters():
            if p.dim() == 1:
                p.mul_(1 + 0.3 * torch.randn_like(p))
        model.lm_head.logit_scale.mul_(100)  # logits of order 1, as a trained model's (the init's are ~0.02)
    return model


@pytest.fixture(scope="module")
def model():
    return build()


def _generate(model, ids, new, cache=None, mask=None, keyword="cache"):
    """Greedy tokens and logits. The dense reference (``cache=None``) runs with SDPA, a LoopKVCache with "loopkv"."""
    model.set_attn_implementation("sdpa" if cache is None or isinstance(cache, DynamicCache) else "loopkv")
    cache = DynamicCache(config=model.config) if cache is None else cache
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # 5.24 deprecates past_key_values= for cache=
        out = model.generate(ids, attention_mask=mask, **{keyword: cache}, max_new_tokens=new, do_sample=False,
                             output_logits=True, return_dict_in_generate=True, eos_token_id=None, pad_token_id=0)
    return out.sequences[:, ids.shape[1]:], torch.stack(out.logits, 1)


def _cache(model, plan, length, batch=1):
    return loopkv.LoopKVCache(plan, config=model.config, max_batch_size=batch, max_cache_len=length,
                              dtype=torch.float32, device="cpu")


def _prompt(n, seed=0, batch=1):
    return torch.randint(3, VOCAB, (batch, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("keyword", ["cache", "past_key_values"])
def test_bf16_plan_equals_dense_cache_over_a_window_exit(model, keyword):
    """Every cell exact: the same tokens and logits as the dense cache, with rows reaching 319 and 320 tokens."""
    ids, new = _prompt(312, seed=1), 12
    ref_tokens, ref_logits = _generate(model, ids, new)
    plan = loopkv.Plan.from_config(model.config, option="bf16")
    assert (plan.family, plan.loops, plan.layers) == ("dory", LOOPS, 2)
    cache = _cache(model, plan, 312 + new)
    assert len(cache.layers) == 7 + (LOOPS - 1) * 3  # Dory's own per_loop count: no copies appended
    tokens, logits = _generate(model, ids, new, cache, keyword=keyword)
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(logits, ref_logits, atol=LOGITS_FP32_ATOL, rtol=LOGITS_FP32_RTOL)


def test_left_padded_rows_equal_the_dense_cache(model):
    ids, new = _prompt(24, seed=2, batch=3), 8
    mask = torch.ones_like(ids)
    mask[1, :7], mask[2, :19] = 0, 0
    ref_tokens, ref_logits = _generate(model, ids, new, mask=mask)
    plan = loopkv.Plan.from_config(model.config, option="bf16")
    tokens, logits = _generate(model, ids, new, _cache(model, plan, 24 + new, batch=3), mask=mask)
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(logits, ref_logits, atol=LOGITS_FP32_ATOL, rtol=LOGITS_FP32_RTOL)


class CodecHistoryCache(DynamicCache):
    """Dory's dense cache, except that at ``planned`` indices a decode token reads its history pages as the
    codec's round trip (K per channel over the page, V per token in groups of 32 channels); batch 1."""

    def __init__(self, config, planned: set[int], bits: int) -> None:
        super().__init__(config=config)
        self.planned, self.bits = planned, bits

    def update(self, key, value, layer_idx, *args, **kwargs):
        k, v = super().update(key, value, layer_idx, *args, **kwargs)  # [1, H, n, D]
        pages = max(0, (k.shape[2] - READ_FROM) // PAGE)
        if layer_idx not in self.planned or key.shape[2] != 1 or not pages:
            return k, v
        k, v = k.clone(), v.clone()
        for p in range(pages):
            at = slice(SINK + PAGE * p, SINK + PAGE * (p + 1))
            k[:, :, at] = codec.dequantize_k(*codec.quantize_k(k[:, :, at], self.bits))
            v[:, :, at] = codec.dequantize_v(*codec.quantize_v(v[:, :, at], self.bits))
        return k, v


def test_int4_plan_reads_history_through_the_codec(model):
    """INT4 in every planned cell (no V precision): the dense cache with the codec's round trip on every history page
    a planned index reads, within fp32 noise; the fixed cells stay exact; and away from the exact model once pages
    are read."""
    ids, new = _prompt(312, seed=3), 16
    layout = layout_of(model.config)
    planned = {layout.flat_index(c) for c in layout}
    assert planned == {2, 4, 7, 9, 10, 12}  # core layers 2 and 4; loops 1, 2 at 7 + (t - 1) * 3 + j
    ref_tokens, ref_logits = _generate(model, ids, new, CodecHistoryCache(model.config, planned, bits=4))
    plan = loopkv.Plan.from_config(model.config, option="int4")
    tokens, logits = _generate(model, ids, new, _cache(model, plan, 312 + new))
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(logits, ref_logits, atol=LOGITS_FP32_ATOL, rtol=LOGITS_FP32_RTOL)
    _, exact = _generate(model, ids, new)
    first_read = 320 - ids.shape[1]  # the step whose row first holds 320 tokens reads page 0
    torch.testing.assert_close(logits[:, :first_read], exact[:, :first_read], atol=LOGITS_FP32_ATOL,
                               rtol=LOGITS_FP32_RTOL)
    assert (logits[:, first_read:] - exact[:, first_read:]).abs().max() > 10 * LOGITS_FP32_ATOL


def test_a_plan_with_shared_loops_generates(model):
    """per_loop with loops 0 and 1 reading the last loop's pages (what last_loop mode saves, served): runs, and
    is the dense model's output while no page has left the window (a share cell's sink and window are its own)."""
    ids, new = _prompt(20, seed=4), 8
    plan = loopkv.Plan.from_config(model.config, option="int4", shared_loops=[0, 1])
    assert plan.bytes_per_token(model.config).stored_kib == pytest.approx(
        2 * loopkv.planning.bytes.option_kib("int4", model.config))  # the last loop's 2 cells only
    tokens, logits = _generate(model, ids, new, _cache(model, plan, 20 + new))
    ref_tokens, ref_logits = _generate(model, ids, new)
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(logits, ref_logits, atol=LOGITS_FP32_ATOL, rtol=LOGITS_FP32_RTOL)


def test_last_loop_mode_is_refused_naming_per_loop():
    config = tiny_config("last_loop")
    plan = loopkv.Plan.from_config(config, option="bf16")
    with pytest.raises(ValueError, match=r"loops \[0, 1\] read the last loop's cache.*recurrent_kv_cache_mode = "
                                         r"'per_loop'"):
        loopkv.LoopKVCache(plan, config=config, max_batch_size=1, max_cache_len=64, device="cpu")


def test_sliding_layers_refuse_rows_longer_than_the_window():
    config = tiny_config(window=64)
    plan = loopkv.Plan.from_config(config, option="bf16")
    loopkv.LoopKVCache(plan, config=config, max_batch_size=1, max_cache_len=64, device="cpu")
    with pytest.raises(ValueError, match="max_cache_len <= 64"):
        loopkv.LoopKVCache(plan, config=config, max_batch_size=1, max_cache_len=65, device="cpu")


def test_a_plan_for_another_family_is_refused(model):
    """Shapes alike (3 loops x 2 planned layers, 2 KV heads x 32), families not: refused both ways."""
    ouro = OuroConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, total_ut_steps=LOOPS)
    ouro_plan, dory_plan = (loopkv.Plan.from_config(c, option="bf16") for c in (ouro, model.config))
    assert (ouro_plan.loops, ouro_plan.layers) == (dory_plan.loops, dory_plan.layers)
    with pytest.raises(ValueError, match="made for a ouro model and the model is a dory model"):
        _cache(model, ouro_plan, 40)
    with pytest.raises(ValueError, match="made for a dory model and the model is a ouro model"):
        loopkv.LoopKVCache(dory_plan, config=ouro, max_batch_size=1, max_cache_len=40, dtype=torch.float32,
                           device="cpu")
    assert loopkv.Plan.from_json_str(dory_plan.to_json_str()) == dory_plan  # the family survives the file


@pytest.mark.parametrize("option", ["int4", "int2", "bf16"])
def test_allocated_history_is_the_byte_model_with_the_fixed_slots(model, option):
    """The cache's pools per history token (measured from its tensors) are the plan's planned cells plus the fixed
    exact slots (2 exact, 2 + 3 loops x 1 sliding: 7 slots of 2 x 2 x 32 fp32 elements = 3.5 KiB per token)."""
    plan = loopkv.Plan.from_config(model.config, option=option)
    modeled = plan.bytes_per_token(model.config, dtype_bytes=4)
    assert modeled.fixed_kib == pytest.approx(7 * 2 * 2 * 32 * 4 / 1024)
    assert loopkv.planning.bytes.fixed_kib(model.config, dtype_bytes=4) == modeled.fixed_kib
    report = _cache(model, plan, 400, batch=2).memory_report()
    assert report.history_stored_kib == pytest.approx(modeled.stored_kib + modeled.fixed_kib, rel=1e-12)
    assert report.model_stored_kib == pytest.approx(report.history_stored_kib, rel=1e-12)
