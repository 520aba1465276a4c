"""transformers' own DoryForCausalLM through its ``generate`` with a LoopKVCache (tiny random model, fp32, CPU).

Planned cells are the recurrent full-attention layers per loop; the prelude/coda full-attention layers are fixed exact
cells and every sliding layer a ring of its window (loopkv/families.py, loopkv/cache/window.py); the sliding window
here (16) is far shorter than the rows. In ``last_loop`` mode the earlier loops read the last loop's cache
(loopkv/cache/last_loop.py). References: transformers' dense cache for the same call, and for INT4 the dense cache
with every history page a decode token reads at a planned index replaced by the codec's round trip
(``tests.cache.driver.CodecHistoryCache``). Skipped without Dory (transformers < 5.24).
"""

from __future__ import annotations

import warnings

import pytest
import torch

import loopkv
from loopkv.cache.paging import pool_pages_for
from loopkv.families import DORY_MIN_TRANSFORMERS, layout_of
from loopkv.format import page_bytes
from loopkv.models.ouro import OuroConfig
from loopkv.ops import codec
from loopkv.planning.bytes import exact_bytes
from tests.cache.driver import CodecHistoryCache
from tests.cache.test_short_cache import allocated_bytes
from tests.tolerances import LOGITS_FP32_ATOL, LOGITS_FP32_RTOL

try:
    from transformers import DoryConfig, DoryForCausalLM
    from transformers.cache_utils import DynamicCache
except ImportError:  # transformers < 5.24 has no Dory
    pytest.skip(f"needs transformers >= {DORY_MIN_TRANSFORMERS} (Dory)", allow_module_level=True)

VOCAB, LOOPS, WINDOW = 61, 3, 16
# prelude: full, sliding; core (run LOOPS times): full, sliding, full; coda: sliding, full
LAYER_TYPES = ["full_attention", "sliding_attention", "full_attention", "sliding_attention", "full_attention",
               "sliding_attention", "full_attention"]


def tiny_config(mode: str = "per_loop", window: int = WINDOW) -> DoryConfig:
    config = DoryConfig(num_hidden_layers=7, n_input_layers=2, n_output_layers=2, n_recurrent_loops=LOOPS,
                        hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=32, vocab_size=VOCAB, sliding_window=window, layer_types=LAYER_TYPES,
                        recurrent_kv_cache_mode=mode)
    config._attn_implementation = "sdpa"
    return config


def build(mode: str = "per_loop", window: int = WINDOW) -> DoryForCausalLM:
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


def test_int4_plan_reads_history_through_the_codec(model):
    """INT4 in every planned cell (no V precision): the dense cache with the codec's round trip on every history page
    a planned index reads, within fp32 noise; the fixed cells stay exact; and away from the exact model once pages
    are read."""
    ids, new = _prompt(312, seed=3), 16
    layout = layout_of(model.config)
    planned = {layout.flat_index(c) for c in layout}
    assert planned == {2, 4, 7, 9, 10, 12}  # core layers 2 and 4; loops 1, 2 at 7 + (t - 1) * 3 + j
    ref_tokens, ref_logits = _generate(model, ids, new, CodecHistoryCache(dict.fromkeys(planned, 4),
                                                                          config=model.config))
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


def test_a_plan_for_another_family_is_refused(model):
    """Shapes alike (3 loops x 2 planned layers, 2 KV heads x 32), families not: refused both ways."""
    ouro = OuroConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, total_ut_steps=LOOPS)
    ouro_plan, dory_plan = (loopkv.Plan.from_config(c, option="bf16") for c in (ouro, model.config))
    assert (ouro_plan.loops, ouro_plan.layers) == (dory_plan.loops, dory_plan.layers)
    with pytest.raises(ValueError, match="made for the ouro family and the model is of the dory family"):
        _cache(model, ouro_plan, 40)
    with pytest.raises(ValueError, match="made for the dory family and the model is of the ouro family"):
        loopkv.LoopKVCache(dory_plan, config=ouro, max_batch_size=1, max_cache_len=40, dtype=torch.float32,
                           device="cpu")
    assert loopkv.Plan.from_json_str(dory_plan.to_json_str()) == dory_plan  # the family survives the file


@pytest.mark.parametrize("option", ["int4", "int2", "bf16"])
def test_allocated_history_is_the_byte_model_with_the_fixed_slots(model, option):
    """The cache's pools per history token (measured from its tensors) are the plan's planned cells plus the fixed
    exact slots (the 2 prelude/coda full-attention layers: 2 slots of 2 x 2 x 32 fp32 elements = 1 KiB per token);
    the sliding layers' windows store no history."""
    plan = loopkv.Plan.from_config(model.config, option=option)
    modeled = plan.bytes_per_token(model.config, dtype_bytes=4)
    assert modeled.fixed_kib == pytest.approx(2 * 2 * 2 * 32 * 4 / 1024)
    assert loopkv.planning.bytes.fixed_kib(model.config, dtype_bytes=4) == modeled.fixed_kib
    report = _cache(model, plan, 400, batch=2).memory_report()
    assert report.history_stored_kib == pytest.approx(modeled.stored_kib + modeled.fixed_kib, rel=1e-12)
    assert report.model_stored_kib == pytest.approx(report.history_stored_kib, rel=1e-12)


def _bytes_by_hand(config, plan, max_cache_len: int, rows: int) -> int:
    """What a Dory cache of fp32 rows must hold, counted from the layout's rules (not from loopkv's allocator): a
    cell keeps a sink and ring of every position it can hold exactly (all of a short row, else 32 + 288) and its
    pool (pages of 32 tokens, reserved per row), a sliding layer ``min(window, max_cache_len)`` positions, each with
    int32 lengths per row."""
    heads, head_dim, item = config.num_key_value_heads, config.head_dim, 4
    pages = max(0, (max_cache_len + 1 - 288) // 32)
    slots = max_cache_len if not pages else 32 + 288
    layout = layout_of(config)
    options = [plan.option(c) for c in layout if c not in layout.reads_without_update] + ["bf16"] * 2
    code_bits = {"bf16": 8 * item, "int4": 5, "int2": 3}  # codes plus fp16 scales and zeros per element
    total = 0
    for option in options:
        total += rows * (2 * heads * head_dim * item * slots + 4)
        if option != "share":
            total += rows * pages * (4 + 2 * heads * 32 * head_dim * code_bits[option] // 8)  # table entry, page
    windows = len(layout.fixed("window"))
    total += windows * rows * (2 * heads * head_dim * item * min(WINDOW, max_cache_len) + 4)
    return total


@pytest.mark.parametrize("mode", ["per_loop", "last_loop"])
@pytest.mark.parametrize("max_cache_len", [9, 40, 400])
def test_memory_report_is_what_is_allocated(mode, max_cache_len):
    """Bytes held by the cache's tensors == memory_report() == the count by hand (windows of min(16, n) positions,
    no pages for them), and the exact parts == the byte model's exact_bytes."""
    config = tiny_config(mode)
    plan = loopkv.Plan.from_config(config, option="int4", shared_loops=[0, 1] if mode == "last_loop" else None)
    rows = 4  # int32 lengths of 16 bytes: a stacked buffer pads each cell's slice to 16 bytes
    cache = loopkv.LoopKVCache(plan, config=config, max_batch_size=rows, max_cache_len=max_cache_len,
                               dtype=torch.float32, device="cpu")
    report = cache.memory_report()
    assert allocated_bytes(cache) == report.total_bytes == _bytes_by_hand(config, plan, max_cache_len, rows)
    assert report.exact == exact_bytes(config, rows=rows, max_cache_len=max_cache_len, dtype_bytes=4)


def test_a_budget_buys_pages_of_the_planned_cells_and_the_fixed_exact_slots():
    """pool_pages_for prices a page in every own pool: 6 INT4 planned cells and the 2 prelude/coda BF16 slots (the
    sliding windows have none); the cache it sizes fits the budget, and one more page would not."""
    config = tiny_config()
    plan = loopkv.Plan.from_config(config, option="int4")
    budget = 3 * 2**20
    pages = pool_pages_for(plan, config, budget_bytes=budget, max_batch_size=2, dtype_bytes=4)
    cache = loopkv.LoopKVCache(plan, config=config, max_batch_size=2, max_cache_len=700, dtype=torch.float32,
                               device="cpu", pool_pages=pages)
    report = cache.memory_report()
    indexing = report.by_component["page_table"] + report.by_component["lengths"]
    per_page = 6 * page_bytes(4, 2, 32, exact_bytes=4) + 2 * page_bytes(16, 2, 32, exact_bytes=4)
    assert budget - per_page < report.total_bytes - indexing <= budget


def test_the_window_is_what_the_sliding_layers_see():
    """The same weights with a window longer than the rows answer differently: the tests above, whose rows outgrow
    the window of 16, compare what the window lets through."""
    ids, new = _prompt(30, seed=5), 4
    _, narrow = _generate(build(window=WINDOW), ids, new)
    _, wide = _generate(build(window=512), ids, new)
    assert (narrow - wide).abs().max() > 100 * LOGITS_FP32_ATOL


def test_a_later_turn_equals_the_dense_cache(model):
    """A second generate on the same cache (several new tokens on non-empty cells, sliding windows included): the
    dense cache's tokens and logits for both turns."""
    ids, new = _prompt(20, seed=6), 6
    plan = loopkv.Plan.from_config(model.config, option="bf16")
    cache, dense = _cache(model, plan, 20 + 2 * new + 20), DynamicCache(config=model.config)
    tokens, logits = _generate(model, ids, new, cache)
    ref_tokens, ref_logits = _generate(model, ids, new, dense)
    assert torch.equal(tokens, ref_tokens)
    ids = torch.cat([ids, tokens, _prompt(20, seed=7)], 1)  # the next turn: 21 new tokens, more than the window
    tokens, logits = _generate(model, ids, new, cache)
    ref_tokens, ref_logits = _generate(model, ids, new, dense)
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(logits, ref_logits, atol=LOGITS_FP32_ATOL, rtol=LOGITS_FP32_RTOL)


# ---- last_loop: only the last loop writes; the earlier loops read its cache ------------------------------------
@pytest.fixture(scope="module")
def last_loop_model():
    return build("last_loop")


@pytest.mark.parametrize(("prompt", "new", "batch"), [(24, 8, 3), (312, 12, 1)])
def test_last_loop_mode_equals_the_dense_cache(last_loop_model, prompt, new, batch):
    """A plan whose earlier loops share (they store nothing) gives the dense last_loop cache's tokens and logits:
    left-padded rows past the window, and a row past the first window exit (the earlier loops read the last loop's
    pages). The modes answer differently, so the earlier loops do read the last loop's past."""
    model = last_loop_model
    ids = _prompt(prompt, seed=8, batch=batch)
    mask = torch.ones_like(ids)
    if batch > 1:
        mask[1, :7], mask[2, :19] = 0, 0
    ref_tokens, ref_logits = _generate(model, ids, new, mask=mask)
    plan = loopkv.Plan.from_config(model.config, option="bf16", shared_loops=[0, 1])
    cache = _cache(model, plan, prompt + new, batch=batch)
    assert len(cache.layers) == 7  # one index per physical layer: the earlier loops have none
    tokens, logits = _generate(model, ids, new, cache, mask=mask)
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(logits, ref_logits, atol=LOGITS_FP32_ATOL, rtol=LOGITS_FP32_RTOL)
    if batch > 1:
        per_loop = build("per_loop")
        _, other = _generate(per_loop, ids, new, mask=mask)
        assert (other - ref_logits).abs().max() > 100 * LOGITS_FP32_ATOL


class StoredCodecCache(DynamicCache):
    """Dory's dense cache for ``last_loop`` mode, with the history pages of the ``planned`` indices *stored* as the
    codec's round trip once complete (page ``p``, positions ``32 + 32p .. 63 + 32p``, when the row reaches
    ``319 + 32p`` tokens; read as history from ``320 + 32p`` on), so that the earlier loops, which read the stored
    tensors, see what the last loop's reads see. Prefill attends exactly; batch 1."""

    def __init__(self, config, planned: set[int], bits: int) -> None:
        super().__init__(config=config)
        self.bits, self.stored = bits, dict.fromkeys(planned, 0)

    def update(self, key, value, layer_idx, *args, **kwargs):
        k, v = super().update(key, value, layer_idx, *args, **kwargs)  # the stored tensors, [1, H, n, D]
        if layer_idx not in self.stored:
            return k, v
        n = k.shape[2]
        read_k, read_v = k.clone(), v.clone()  # this read: exact, but for the pages it reads as history
        complete = max(0, (n + 1 - 288) // 32)
        for p in range(self.stored[layer_idx], complete):
            at = slice(32 + 32 * p, 64 + 32 * p)
            k[:, :, at] = codec.dequantize_k(*codec.quantize_k(k[:, :, at], self.bits))
            v[:, :, at] = codec.dequantize_v(*codec.quantize_v(v[:, :, at], self.bits))
        self.stored[layer_idx] = max(self.stored[layer_idx], complete)
        history = slice(32, 32 + 32 * max(0, (n - 288) // 32)) if key.shape[2] == 1 else slice(0, 0)
        read_k[:, :, history], read_v[:, :, history] = k[:, :, history], v[:, :, history]
        return read_k, read_v


def test_last_loop_int4_reads_the_last_loops_pages_through_the_codec(last_loop_model):
    """INT4 in the last loop, the earlier loops shared: the dense last_loop cache whose complete pages are stored as
    the codec's round trip (every loop reads them so), within fp32 noise; away from the exact model once pages are
    read."""
    model, ids, new = last_loop_model, _prompt(312, seed=10), 16
    layout = layout_of(model.config)
    planned = {layout.flat_index(c) for c in layout if c.loop == layout.final_loop}
    assert planned == {2, 4}
    ref_tokens, ref_logits = _generate(model, ids, new, StoredCodecCache(model.config, planned, bits=4))
    plan = loopkv.Plan.from_config(model.config, option="int4", shared_loops=[0, 1])
    tokens, logits = _generate(model, ids, new, _cache(model, plan, 312 + new))
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(logits, ref_logits, atol=LOGITS_FP32_ATOL, rtol=LOGITS_FP32_RTOL)
    _, exact = _generate(model, ids, new)
    assert (logits - exact).abs().max() > 10 * LOGITS_FP32_ATOL


def test_last_loop_mode_refuses_a_plan_that_stores_the_earlier_loops():
    config = tiny_config("last_loop")
    plan = loopkv.Plan.from_config(config, option="bf16")
    with pytest.raises(ValueError, match=r"loops \[0, 1\] read the last loop's cache.*shared_loops=\[0, 1\]"):
        loopkv.LoopKVCache(plan, config=config, max_batch_size=1, max_cache_len=64, device="cpu")


def test_last_loop_mode_refuses_a_later_turn_before_writing(last_loop_model):
    plan = loopkv.Plan.from_config(last_loop_model.config, option="bf16", shared_loops=[0, 1])
    cache = _cache(last_loop_model, plan, 40)
    ids = _prompt(10, seed=9)
    tokens, _ = _generate(last_loop_model, ids, 3, cache)
    held = [cache.storage(i).lengths.clone() for i in range(len(cache.layers))]
    with pytest.raises(ValueError, match=r"last_loop mode \(a later turn\).*cache.reset\(\)"):
        _generate(last_loop_model, torch.cat([ids, tokens, ids], 1), 2, cache)
    assert all(torch.equal(cache.storage(i).lengths, h) for i, h in enumerate(held))


@pytest.mark.parametrize(("mode", "backend"), [
    ("per_loop", "aot_eager"), ("last_loop", "aot_eager"),
    pytest.param("per_loop", "inductor", marks=pytest.mark.slow)])
def test_a_compiled_decode_step_is_one_graph_equal_to_eager(mode, backend, error_on_recompile):
    """A whole Dory model's decode step under ``torch.compile(fullgraph=True)``: fixed exact cells, sliding rings,
    planned INT4 cells (in last_loop mode the earlier loops reading the last loop's cells), over 30 steps that
    wrap the rings and quantize two pages (rows of 300 to 330 tokens): one graph, equal to eager. aot_eager
    functionalizes the cache's mutating ops as inductor does, without its code generation."""
    from torch._dynamo.utils import counters

    model = build(mode)
    shared = list(range(LOOPS - 1)) if mode == "last_loop" else None
    plan = loopkv.Plan.from_config(model.config, option="int4", **({"shared_loops": shared} if shared else {}))
    compiled_cache, eager_cache = (_cache(model, plan, 400, batch=2) for _ in range(2))
    model.set_attn_implementation("loopkv")
    ids = _prompt(300, seed=9, batch=2)

    def step(tok, pos):
        return model(input_ids=tok, position_ids=pos, cache=compiled_cache).logits

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend=backend)
    counters.clear()
    with torch.no_grad():
        for cache in (compiled_cache, eager_cache):
            model(input_ids=ids, cache=cache)
        tok = ids[:, -1:].contiguous()
        for i in range(30):
            pos = torch.full((2, 1), 300 + i)
            got = compiled(tok, pos)
            want = model(input_ids=tok, position_ids=pos, cache=eager_cache).logits
            torch.testing.assert_close(got, want, atol=LOGITS_FP32_ATOL, rtol=LOGITS_FP32_RTOL)
            tok = got[:, -1].argmax(-1, keepdim=True)
    assert compiled_cache.get_seq_length() == 330
    assert counters["stats"]["unique_graphs"] == 1
    assert not counters["graph_break"]
