"""LoopKVCache inside model.generate() on loopkv's Ouro (tiny random model, fp32, CPU)."""

import pytest
import torch

import loopkv
from loopkv.models.ouro import OuroConfig, OuroForCausalLM
from tests.cache.driver import tiny_config
from tests.tolerances import ATTN_FP32_ATOL, ATTN_FP32_RTOL, LOGITS_FP32_ATOL, LOGITS_FP32_RTOL

LOOPS, LAYERS = 2, 2
QUANTIZED_PLANS = [
    loopkv.Plan.uniform(loops=LOOPS, layers=LAYERS, option="int4", tau=14.0),
    loopkv.Plan.from_loops(loops=LOOPS, layers=LAYERS, per_loop=["share", "int2"]),
]


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    cfg = OuroConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=LAYERS,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=32, total_ut_steps=LOOPS,
                     max_position_embeddings=4096, rope_theta=10000.0)
    return OuroForCausalLM(cfg).eval()


def _generate(model, ids, new, cache=None, mask=None):
    out = model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=new, do_sample=False,
                         output_logits=True, return_dict_in_generate=True, eos_token_id=None, pad_token_id=0)
    return out.sequences[:, ids.shape[1]:], torch.stack(out.logits, 1)


def _cache(model, plan, batch, length):
    return loopkv.LoopKVCache(plan, config=model.config, max_batch_size=batch, max_cache_len=length,
                              dtype=torch.float32, device="cpu")


@pytest.mark.parametrize("prompt", [1, 31, 32, 33, 300, 1000])
def test_bf16_plan_equals_dense_cache(model, prompt):
    """Every cell exact: tokens identical and logits equal to the dense reference over 100 steps
    that cross window exits (a page leaves the window every 32 tokens once 320 are held)."""
    ids = torch.randint(3, 97, (1, prompt), generator=torch.Generator().manual_seed(prompt))
    ref_tokens, ref_logits = _generate(model, ids, 100)
    cache = _cache(model, loopkv.Plan.uniform(loops=LOOPS, layers=LAYERS, option="bf16"), 1, prompt + 100)
    tokens, logits = _generate(model, ids, 100, cache)
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(logits, ref_logits, atol=LOGITS_FP32_ATOL, rtol=LOGITS_FP32_RTOL)
    assert cache.get_seq_length() == prompt + 99  # the last generated token is never fed back


@pytest.mark.parametrize("plan", QUANTIZED_PLANS, ids=["int4-tau14", "share+int2"])
def test_left_padded_rows_equal_batch_one(model, plan):
    lens = [3, 40, 300, 700]
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 97, (n,), generator=g) for n in lens]
    S = max(lens)
    ids = torch.zeros(len(lens), S, dtype=torch.long)
    mask = torch.zeros(len(lens), S, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, S - len(p):] = p
        mask[b, S - len(p):] = 1
    new = 40
    tokens, logits = _generate(model, ids, new, _cache(model, plan, len(lens), S + new), mask)
    for b, p in enumerate(prompts):
        t1, l1 = _generate(model, p[None], new, _cache(model, plan, 1, len(p) + new))
        assert torch.equal(tokens[b], t1[0])
        torch.testing.assert_close(logits[b], l1[0], atol=LOGITS_FP32_ATOL, rtol=LOGITS_FP32_RTOL)


def test_quantized_history_changes_logits_only_after_pages_exist(model):
    """Before any page leaves the window everything is exact; afterwards INT2 history moves the logits."""
    ids = torch.randint(3, 97, (1, 280), generator=torch.Generator().manual_seed(3))
    _, ref = _generate(model, ids, 60)
    plan = loopkv.Plan.uniform(loops=LOOPS, layers=LAYERS, option="int2")
    _, got = _generate(model, ids, 60, _cache(model, plan, 1, 340))
    # positions 280..319 hold < 320 tokens: no page has left the window yet
    torch.testing.assert_close(got[:, :39], ref[:, :39], atol=LOGITS_FP32_ATOL, rtol=LOGITS_FP32_RTOL)
    assert (got[:, 41:] - ref[:, 41:]).abs().max() > 1e-3


def test_reuse_after_reset_equals_fresh_cache(model):
    plan = loopkv.Plan.uniform(loops=LOOPS, layers=LAYERS, option="int4", tau=14.0)
    cache = _cache(model, plan, 1, 400)
    first = torch.randint(3, 97, (1, 330), generator=torch.Generator().manual_seed(4))
    second = torch.randint(3, 97, (1, 300), generator=torch.Generator().manual_seed(5))
    _generate(model, first, 30, cache)
    cache.reset()
    tokens, logits = _generate(model, second, 30, cache)
    t_fresh, l_fresh = _generate(model, second, 30, _cache(model, plan, 1, 400))
    assert torch.equal(tokens, t_fresh)
    assert torch.equal(logits, l_fresh)


def test_continuing_a_used_cache_equals_the_full_forward(model):
    """A second prompt on a used cache continues it token by token (the served semantics)."""
    plan = loopkv.Plan.uniform(loops=LOOPS, layers=LAYERS, option="bf16")
    cache = _cache(model, plan, 1, 200)
    ids = torch.randint(3, 97, (1, 50), generator=torch.Generator().manual_seed(6))
    model(input_ids=ids[:, :30], past_key_values=cache)
    logits = model(input_ids=ids[:, 30:], past_key_values=cache).logits
    ref = model(input_ids=ids).logits[:, 30:]
    torch.testing.assert_close(logits, ref, atol=LOGITS_FP32_ATOL, rtol=LOGITS_FP32_RTOL)


def test_memory_matches_byte_model_for_1000_tokens(model):
    plan = loopkv.Plan.uniform(loops=LOOPS, layers=LAYERS, option="int4")
    cache = _cache(model, plan, 2, 1000)
    report = cache.memory_report()
    shape_kib = plan.bytes_per_token(model.config, dtype_bytes=4).stored_kib
    assert report.history_stored_kib == pytest.approx(shape_kib, rel=1e-12)
    # 22 pages per row hold the tokens between the 32-token sink and the >= 256-token window
    pages = cache.storage(0).page_table.shape[1]
    assert pages == (1000 - 288) // 32 == 22
    pool_bytes = sum(t.numel() * t.element_size() for t in cache.storage(0).pool())
    assert pool_bytes == 2 * pages * 32 * shape_kib * 1024 / (LOOPS * LAYERS)
    assert report.total_bytes == sum(report.by_cell)


def test_errors_name_the_problem(model):
    cfg = model.config
    with pytest.raises(ValueError, match="loops=3"):
        loopkv.LoopKVCache(loopkv.Plan.uniform(loops=3, layers=LAYERS), config=cfg, max_batch_size=1,
                           max_cache_len=10, device="cpu")
    with pytest.raises(ValueError, match="max_batch_size"):
        loopkv.LoopKVCache(loopkv.Plan.uniform(loops=LOOPS, layers=LAYERS), config=cfg, max_batch_size=0,
                           max_cache_len=10, device="cpu")
    with pytest.raises(ValueError, match="head_dim=48"):
        loopkv.LoopKVCache(loopkv.Plan.uniform(loops=2, layers=2), config=tiny_config(head_dim=48),
                           max_batch_size=1, max_cache_len=10, device="cpu")
    with pytest.raises(ValueError, match="dtype"):
        loopkv.LoopKVCache(loopkv.Plan.uniform(loops=LOOPS, layers=LAYERS), config=cfg, max_batch_size=1,
                           max_cache_len=10, dtype=torch.int8, device="cpu")
    cache = _cache(model, loopkv.Plan.uniform(loops=LOOPS, layers=LAYERS), 1, 40)
    ids = torch.randint(3, 97, (2, 5))
    with pytest.raises(ValueError, match="max_batch_size=1"):
        model(input_ids=ids, past_key_values=cache)
    with pytest.raises(ValueError, match="max_cache_len"):
        model.generate(ids[:1], past_key_values=cache, max_new_tokens=50, do_sample=False)
    bf16_cache = loopkv.LoopKVCache(loopkv.Plan.uniform(loops=LOOPS, layers=LAYERS), config=cfg, max_batch_size=1,
                                    max_cache_len=40, dtype=torch.bfloat16, device="cpu")
    with pytest.raises(ValueError, match="bfloat16"):
        model(input_ids=ids[:1], past_key_values=bf16_cache)
    with pytest.raises(NotImplementedError, match="crop"):
        cache.crop(3)
    right_padded = torch.tensor([[1, 1, 1, 0]])
    with pytest.raises(ValueError, match="left padding"):
        model(input_ids=ids[:1, :4], attention_mask=right_padded, past_key_values=_cache(
            model, loopkv.Plan.uniform(loops=LOOPS, layers=LAYERS), 1, 40))


def test_decode_past_max_cache_len_is_refused_in_eager(model):
    cache = _cache(model, loopkv.Plan.uniform(loops=LOOPS, layers=LAYERS), 1, 12)
    ids = torch.randint(3, 97, (1, 12))
    model(input_ids=ids, past_key_values=cache)
    with pytest.raises(ValueError, match="max_cache_len=12"):
        model(input_ids=ids[:, :1], past_key_values=cache)


def test_reorder_cache_gathers_rows_exactly(model):
    plan = loopkv.Plan.uniform(loops=LOOPS, layers=LAYERS, option="int4", tau=14.0)
    g = torch.Generator().manual_seed(8)
    a, b = torch.randint(3, 97, (1, 350), generator=g), torch.randint(3, 97, (1, 350), generator=g)
    cache = _cache(model, plan, 2, 400)
    model(input_ids=torch.cat([a, b]), past_key_values=cache)
    cache.reorder_cache(torch.tensor([1, 1]))
    swapped = _cache(model, plan, 2, 400)
    model(input_ids=torch.cat([b, b]), past_key_values=swapped)
    nxt = torch.randint(3, 97, (2, 1), generator=g)
    pos = torch.full((2, 1), 350)
    got = model(input_ids=nxt, past_key_values=cache, position_ids=pos).logits
    want = model(input_ids=nxt, past_key_values=swapped, position_ids=pos).logits
    assert torch.equal(got, want)  # an exact gather of codes and scales: nothing re-quantized
    assert cache.get_seq_length() == 351


def test_no_host_sync_while_a_cuda_graph_is_captured(model, monkeypatch):
    """Under capture (simulated: the capture query answers True) the cache neither syncs for its length
    (a 0-d tensor comes back, as while compiling) nor runs the eager overflow check; outside capture the
    length is an int and the check refuses a full row (a CUDA-graph capture fails on that int)."""
    from loopkv.cache import layer as loop_cache

    cache = _cache(model, loopkv.Plan.uniform(loops=LOOPS, layers=LAYERS), 1, 12)
    ids = torch.randint(3, 97, (1, 12))
    model(input_ids=ids, past_key_values=cache)
    assert cache.get_seq_length() == 12
    assert isinstance(cache.get_seq_length(), int)
    monkeypatch.setattr(loop_cache, "_capturing", lambda device: True)
    held = cache.get_seq_length()
    assert isinstance(held, torch.Tensor)
    assert int(held) == 12
    k = torch.zeros(1, 2, 1, 32)
    cache.update(k, k, 0)  # no eager check (no sync) under capture; generate() refuses overlong requests up front
    monkeypatch.setattr(loop_cache, "_capturing", lambda device: False)
    with pytest.raises(ValueError, match="max_cache_len=12"):
        cache.update(k, k, 0)


MIXED_PLAN = loopkv.Plan.from_loops(loops=LOOPS, layers=LAYERS, per_loop=["share", "int4"], tau=14.0)


@pytest.mark.parametrize("plan", [*QUANTIZED_PLANS, MIXED_PLAN], ids=["int4-tau14", "share+int2", "share+int4"])
def test_a_decode_step_counts_every_cell_once(model, plan):
    """Two rows of different lengths, 70 decode steps across window exits: after each decode step's last cell, one
    ``advance_`` per kind of pool over every cell (the prompt is written by prefill), and the rows hold their
    tokens."""
    g = torch.Generator().manual_seed(6)
    ids = torch.randint(3, 97, (2, 300), generator=g)
    mask = torch.ones(2, 300, dtype=torch.long)
    mask[1, :17] = 0  # row 1 is 17 tokens shorter: its window exits fall on other steps
    cache = _cache(model, plan, 3, 400)
    steps = []
    advance = cache._advance
    cache._advance = lambda shard, batch, lengths, groups: (steps.append((batch, groups)),
                                                            advance(shard, batch, lengths, groups))[1]
    _generate(model, ids, 70, cache, mask)
    (shard,) = cache._shards  # one device
    assert steps == [(2, shard.groups)] * 69
    assert cache.storage(0).lengths.tolist()[:2] == [300 + 69, 283 + 69]


def test_cells_driven_one_at_a_time_are_counted_and_read_exactly(model):
    """A second update of a cell before its read is an error that names the fix. A caller that drives cells one at
    a time (a cell three times before the others, then whole steps) reads what the float64 recomputation of the
    stored state gives, because each new update of a cell already read, and every host-side look, counts the
    tokens read so far first."""
    from tests.cache.driver import attention64, decode

    cache = _cache(model, MIXED_PLAN, 2, 400)
    k = torch.zeros(2, 2, 1, 32)
    cache.update(k, k, 0)
    with pytest.raises(RuntimeError, match="updated again before"):
        cache.update(k, k, 0)
    cache.reset()
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(3, 97, (2, 318), generator=g)
    model(input_ids=ids, past_key_values=cache)  # prefill: 318 tokens, the next token quantizes page 0
    for c in [0, 0, 0, 1, 2, 3, 0, 1, 2, 3]:
        q = torch.randn(2, 4, 1, 32, generator=g)
        kv = torch.randn(2, 2, 1, 32, generator=g), torch.randn(2, 2, 1, 32, generator=g)
        out = decode(cache, c, q, *kv, 32**-0.5)
        want, _ = attention64(cache, c, q[:, :, 0], 32**-0.5, MIXED_PLAN.tau)
        torch.testing.assert_close(out.double(), want, atol=ATTN_FP32_ATOL, rtol=ATTN_FP32_RTOL)
    assert [cache.storage(c).lengths.tolist() for c in range(4)] == [[322, 322], [320, 320], [320, 320], [320, 320]]


def test_constructor_arguments_are_checked_before_anything_is_allocated(model):
    """Each bad argument is refused by name with the fix; integer-like sizes (numpy, torch) and dtype names are
    taken; a cache larger than the memory free on its device is refused with both numbers before any allocation."""
    import numpy as np

    plan = loopkv.Plan.uniform(loops=LOOPS, layers=LAYERS)
    kw = dict(config=model.config, device="cpu")
    with pytest.raises(ValueError, match="plan must be a loopkv.Plan"):
        loopkv.LoopKVCache(None, max_batch_size=1, max_cache_len=10, **kw)
    for bad in (True, 0, 2.0, "2"):
        with pytest.raises(ValueError, match="max_batch_size must be a positive int"):
            loopkv.LoopKVCache(plan, max_batch_size=bad, max_cache_len=10, **kw)
    with pytest.raises(ValueError, match="max_cache_len must be a positive int"):
        loopkv.LoopKVCache(plan, max_batch_size=1, max_cache_len=-5, **kw)
    cache = loopkv.LoopKVCache(plan, max_batch_size=np.int64(2), max_cache_len=torch.tensor(40), dtype="float16", **kw)
    assert (cache.max_batch_size, cache.max_cache_len, cache.dtype) == (2, 40, torch.float16)
    assert type(cache.max_batch_size) is int
    with pytest.raises(ValueError, match="float32, bfloat16, float16"):
        loopkv.LoopKVCache(plan, max_batch_size=1, max_cache_len=10, dtype="int8", **kw)
    with pytest.raises(ValueError, match=r"needs [0-9.]+ GiB on cpu, which has [0-9.]+ GiB free"):
        loopkv.LoopKVCache(plan, max_batch_size=64, max_cache_len=10**9, **kw)


def test_a_second_turn_on_left_padded_rows_equals_a_fresh_generate(model):
    """Every row left-padded, then a second ``generate`` on history + new tokens: the cache counts positions as a
    dense cache does (pads included), so transformers feeds only the new tokens and the result equals one generate
    over the whole conversation on a fresh cache."""
    plan = loopkv.Plan.uniform(loops=LOOPS, layers=LAYERS, option="bf16")
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(3, 97, (2, 30), generator=g)
    mask = torch.ones(2, 30, dtype=torch.long)
    mask[0, :3], mask[1, :5] = 0, 0  # every row padded
    ids = ids.masked_fill(mask == 0, 0)
    cache = _cache(model, plan, 2, 80)
    first, _ = _generate(model, ids, 8, cache, mask)
    assert cache.get_seq_length() == 30 + 7  # as the dense cache counts: padded prompt + generated tokens fed back
    turn = torch.cat([ids, first, torch.randint(3, 97, (2, 6), generator=g)], dim=1)
    turn_mask = torch.cat([mask, torch.ones(2, 14, dtype=torch.long)], dim=1)
    tokens, logits = _generate(model, turn, 8, cache, turn_mask)
    fresh_tokens, fresh_logits = _generate(model, turn, 8, _cache(model, plan, 2, 80), turn_mask)
    assert torch.equal(tokens, fresh_tokens)
    torch.testing.assert_close(logits, fresh_logits, atol=LOGITS_FP32_ATOL, rtol=LOGITS_FP32_RTOL)


def test_a_later_turn_with_rows_the_cache_never_held_is_refused(model):
    """``num_return_sequences=2`` on a cache that holds one row's conversation would decode row 1 without its
    history; it is refused before anything is written, and the cache still continues the row it holds."""
    plan = loopkv.Plan.uniform(loops=LOOPS, layers=LAYERS, option="bf16")
    cache = _cache(model, plan, 2, 120)
    ids = torch.randint(3, 97, (1, 40), generator=torch.Generator().manual_seed(12))
    first, _ = _generate(model, ids, 5, cache)
    turn = torch.cat([ids, first, torch.randint(3, 97, (1, 6))], dim=1)
    with pytest.raises(ValueError, match=r"rows \[1\] of this 2-row batch hold no tokens"):
        model.generate(turn, past_key_values=cache, max_new_tokens=4, do_sample=True, num_return_sequences=2,
                       pad_token_id=0)
    assert cache.get_seq_length() == 44
    _generate(model, turn, 4, cache)  # the same row continues
    assert cache.get_seq_length() == 51 + 3  # the turn (40 + 5 + 6 tokens) and 3 of the 4 generated


def test_a_continuation_past_max_cache_len_is_refused_before_it_writes(model):
    """Several tokens on a non-empty cache that would pass max_cache_len are refused whole: nothing is dropped."""
    cache = _cache(model, loopkv.Plan.uniform(loops=LOOPS, layers=LAYERS), 1, 40)
    model(input_ids=torch.randint(3, 97, (1, 30)), past_key_values=cache)
    with pytest.raises(ValueError, match="exceed max_cache_len=40"):
        model(input_ids=torch.randint(3, 97, (1, 300)), past_key_values=cache)
    assert cache.get_seq_length() == 30


def test_a_step_with_fewer_rows_than_the_cache_holds_is_refused(model):
    """Rows past the step's batch that still hold tokens would be left behind silently (a dense cache raises on the
    mismatch): a decode step or a continuation of fewer rows is refused, before anything is written, until
    ``reorder_cache`` drops the rows (emptying them) or ``reset()``."""
    cache = _cache(model, loopkv.Plan.uniform(loops=LOOPS, layers=LAYERS, option="int4"), 2, 60)
    ids = torch.randint(3, 97, (2, 20), generator=torch.Generator().manual_seed(13))
    model(input_ids=ids, past_key_values=cache)
    pos = torch.full((1, 1), 20)
    with pytest.raises(ValueError, match=r"this step has 1 rows but rows \[1\] of the cache still hold tokens"):
        model(input_ids=ids[:1, :1], position_ids=pos, past_key_values=cache)
    with pytest.raises(ValueError, match=r"rows \[1\] of the cache still hold tokens"):
        model(input_ids=ids[:1, :3], past_key_values=cache)
    assert cache.storage(0).lengths.tolist() == [20, 20]
    cache.reorder_cache(torch.tensor([0]))
    assert cache.storage(0).lengths.tolist() == [20, 0]
    model(input_ids=ids[:1, :1], position_ids=pos, past_key_values=cache)
    assert cache.get_seq_length() == 21
