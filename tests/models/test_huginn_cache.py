"""loopkv's Huginn through ``generate`` with a LoopKVCache: cells (step, core layer), prelude and coda exact.

References: transformers' dense cache for the same call, and for INT4 the dense cache with every history page a
decode token reads replaced by the codec's round trip (``tests.cache.driver.CodecHistoryCache``).
"""

from __future__ import annotations

import pytest
import torch
from transformers.cache_utils import DynamicCache

import loopkv
from loopkv.models.huginn import HuginnCells
from loopkv.models.ouro import OuroConfig
from tests.cache.driver import CodecHistoryCache
from tests.models.test_huginn import STEPS, VOCAB, build_model, released_config
from tests.tolerances import LOGITS_FP32_ATOL, LOGITS_FP32_RTOL


@pytest.fixture(scope="module")
def model():
    """The tiny Huginn of test_huginn (1 prelude, 2 core, 1 coda layers, T = 3, 2 heads x 32) with its weights."""
    return build_model(released_config())


def _generate(model, ids, new, cache=None, **kwargs):
    kwargs.setdefault("state_generator", torch.Generator().manual_seed(7))  # the same random states in every run
    out = model.generate(ids, past_key_values=cache, max_new_tokens=new, do_sample=False, output_logits=True,
                         return_dict_in_generate=True, eos_token_id=None, pad_token_id=0, **kwargs)
    return out.sequences[:, ids.shape[1]:], torch.stack(out.logits, 1)


def _cache(model, plan, length, batch=1):
    return loopkv.LoopKVCache(plan, config=model.config, max_batch_size=batch, max_cache_len=length,
                              dtype=torch.float32, device="cpu")


def _prompt(n, seed=0):
    return torch.randint(3, VOCAB, (1, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(("prompt", "new"), [(5, 8), (314, 10)])
def test_bf16_plan_equals_dense_cache(model, prompt, new):
    """Every cell exact: the same tokens and logits as the dense cache, the second over the first window exit
    (the row reaches 319 and 320 tokens). The random initial state is drawn alike in both runs."""
    ids = _prompt(prompt, seed=prompt)
    ref_tokens, ref_logits = _generate(model, ids, new)
    plan = loopkv.Plan.from_config(model.config, option="bf16")
    assert (plan.family, plan.loops, plan.layers) == ("huginn", STEPS, 2)
    cache = _cache(model, plan, prompt + new)
    assert len(cache.layers) == HuginnCells.of(model.config).num_indices(STEPS)  # planned cells + prelude/coda
    tokens, logits = _generate(model, ids, new, cache)
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(logits, ref_logits, atol=LOGITS_FP32_ATOL, rtol=LOGITS_FP32_RTOL)


def test_int4_plan_reads_history_through_the_codec(model):
    """INT4 in every cell (no V precision): the dense cache with the codec's round trip on every history page a
    token reads, within fp32 noise; and away from the exact model once pages are read."""
    ids, new = _prompt(314, seed=3), 12
    cells = HuginnCells.of(model.config)
    planned = {cells.core_index(t, j): 4 for t in range(STEPS) for j in range(cells.core)}
    ref_tokens, ref_logits = _generate(model, ids, new, CodecHistoryCache(planned))
    plan = loopkv.Plan.from_config(model.config, option="int4")
    tokens, logits = _generate(model, ids, new, _cache(model, plan, 314 + new))
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(logits, ref_logits, atol=LOGITS_FP32_ATOL, rtol=LOGITS_FP32_RTOL)
    _, exact = _generate(model, ids, new)
    first_read = 320 - ids.shape[1]  # the step whose row first holds 320 tokens reads page 0
    torch.testing.assert_close(logits[:, :first_read], exact[:, :first_read], atol=LOGITS_FP32_ATOL,
                               rtol=LOGITS_FP32_RTOL)
    assert (logits[:, first_read:] - exact[:, first_read:]).abs().max() > 10 * LOGITS_FP32_ATOL


def test_share_cells_read_the_last_steps_pages(model):
    """Steps 0 and 1 'share', step 2 (the last) INT2: a shared cell reads step 2's pages at its core layer, with
    its own exact sink and window."""
    ids, new = _prompt(316, seed=4), 8
    cells = HuginnCells.of(model.config)
    last = STEPS - 1
    bits = {cells.core_index(last, j): 2 for j in range(cells.core)}
    sources = {cells.core_index(t, j): cells.core_index(last, j) for t in range(last) for j in range(cells.core)}
    ref_tokens, ref_logits = _generate(model, ids, new, CodecHistoryCache(bits | dict.fromkeys(sources, 0), sources))
    plan = loopkv.Plan.from_config(model.config, option="int2", shared_loops=list(range(last)))
    tokens, logits = _generate(model, ids, new, _cache(model, plan, 316 + new))
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(logits, ref_logits, atol=LOGITS_FP32_ATOL, rtol=LOGITS_FP32_RTOL)


@pytest.mark.parametrize("steps", [2, 4])
def test_two_step_counts_each_give_the_dense_result(model, steps):
    """A plan for T = 4 steps; a call with r <= T uses the first r steps' cells and equals the dense cache's r."""
    big = build_model(released_config(mean_recurrence=4))
    ids = _prompt(20, seed=steps)
    ref_tokens, ref_logits = _generate(big, ids, 8, num_steps=steps)
    cache = _cache(big, loopkv.Plan.from_config(big.config, option="bf16"), 28)
    tokens, logits = _generate(big, ids, 8, cache, num_steps=steps)
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(logits, ref_logits, atol=LOGITS_FP32_ATOL, rtol=LOGITS_FP32_RTOL)
    other = 6 - steps  # the other count gives other logits: r matters
    assert not torch.allclose(_generate(big, ids, 8, num_steps=other)[1], ref_logits)


def test_steps_the_cache_cannot_serve_are_refused(model):
    ids = _prompt(8)
    cache = _cache(model, loopkv.Plan.from_config(model.config, option="bf16"), 40)
    with pytest.raises(ValueError, match=f"num_steps=4, but this cache serves at most {STEPS} core steps"):
        model.generate(ids, past_key_values=cache, num_steps=4, max_new_tokens=2)
    shared = loopkv.Plan.from_config(model.config, option="int4", shared_loops=[0])
    with pytest.raises(ValueError, match=r"steps \[0\] of its plan 'share'.*loops=2"):
        model.generate(ids, past_key_values=_cache(model, shared, 40), num_steps=2, max_new_tokens=2)
    model(ids, past_key_values=cache, num_steps=2)
    with pytest.raises(ValueError, match="holds tokens run with num_steps=2"):
        model(ids[:, :1], past_key_values=cache, num_steps=STEPS)
    cache.reset()
    model(ids, past_key_values=cache, num_steps=STEPS)  # an empty cache takes any r <= T


def test_a_used_cache_takes_its_continuation_only(model):
    """A second generate on a used cache continues the conversation (equal to generating it on a fresh cache);
    an unrelated prompt is refused until reset()."""
    plan = loopkv.Plan.from_config(model.config, option="bf16")
    cache = _cache(model, plan, 40)
    ids = _prompt(6, seed=9)
    first = model.generate(ids, past_key_values=cache, max_new_tokens=4, do_sample=False, init_scale=0.0)
    more = torch.cat([first, _prompt(3, seed=10)], 1)
    again = model.generate(more, past_key_values=cache, max_new_tokens=4, do_sample=False, init_scale=0.0)
    fresh = model.generate(more, past_key_values=_cache(model, plan, 40), max_new_tokens=4, do_sample=False,
                           init_scale=0.0)
    assert torch.equal(again, fresh)
    with pytest.raises(ValueError, match="does not continue them|differs from them"):
        model.generate(_prompt(20, seed=11), past_key_values=cache, max_new_tokens=2, init_scale=0.0)
    cache.reset()
    assert torch.equal(model.generate(more, past_key_values=cache, max_new_tokens=4, do_sample=False,
                                      init_scale=0.0), fresh)


def _turn(model, cache, first, turn):
    """A prompt, then a later turn in one forward; the turn's logits."""
    with torch.no_grad():
        model(first, past_key_values=cache, init_scale=0.0)
        return model(turn, past_key_values=cache, init_scale=0.0).logits


def test_a_long_later_turn_with_share_cells_is_split(model):
    """A share plan takes at most continuation_limit new tokens per forward on a used cache; the model splits a longer
    turn. Below 320 tokens nothing is history, so the turn's logits are the dense cache's."""
    plan = loopkv.Plan.from_config(model.config, option="int4", shared_loops=[0])
    cache = _cache(model, plan, 300)
    first, turn = _prompt(20, seed=12), _prompt(cache.continuation_limit + 10, seed=13)
    torch.testing.assert_close(_turn(model, cache, first, turn), _turn(model, DynamicCache(), first, turn),
                               atol=LOGITS_FP32_ATOL, rtol=LOGITS_FP32_RTOL)


@pytest.mark.slow
def test_a_long_later_turn_equals_decoding_it_token_by_token(model):
    """Across history pages: the split turn reads what decoding its tokens one by one reads."""
    plan = loopkv.Plan.from_config(model.config, option="int4", shared_loops=[0])
    first, turn = _prompt(100, seed=14), _prompt(300, seed=15)
    got = _turn(model, _cache(model, plan, 400), first, turn)
    stepped = _cache(model, plan, 400)
    with torch.no_grad():
        model(first, past_key_values=stepped, init_scale=0.0)
        want = torch.cat([model(turn[:, i:i + 1], past_key_values=stepped, init_scale=0.0).logits
                          for i in range(turn.shape[1])], 1)
    torch.testing.assert_close(got, want, atol=LOGITS_FP32_ATOL, rtol=LOGITS_FP32_RTOL)


def test_a_plan_for_another_family_is_refused(model):
    ouro = OuroConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=2, total_ut_steps=STEPS)
    with pytest.raises(ValueError, match="made for the ouro family and the model is of the huginn family"):
        _cache(model, loopkv.Plan.from_config(ouro, option="bf16"), 40)
    with pytest.raises(ValueError, match="made for the huginn family and the model is of the ouro family"):
        loopkv.LoopKVCache(loopkv.Plan.from_config(model.config, option="bf16"), config=ouro, max_batch_size=1,
                           max_cache_len=40, dtype=torch.float32, device="cpu")
    ouro_cache = loopkv.LoopKVCache(loopkv.Plan.from_config(ouro, option="bf16"), config=ouro, max_batch_size=1,
                                    max_cache_len=40, dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match="laid out for a ouro model, not a Huginn model"):
        model(_prompt(4), past_key_values=ouro_cache)


def test_continuous_batching_refuses_huginn_by_name(model):
    """Serving through transformers' engine is Ouro's only (Huginn's forward does not take the engine's packed
    steps): generate_batch's check names the model."""
    from loopkv.serving.transformers_cb import check_model

    with pytest.raises(NotImplementedError, match="HuginnForCausalLM"):
        check_model(model)


@pytest.mark.slow
def test_decode_step_is_one_graph_equal_to_eager(model, error_on_recompile):
    """The decode step with a share + INT4 plan compiles to one graph (dynamo, fullgraph: no break, no recompile)
    and equals the eager step over the first window exit (the rows pass 319 and 320 tokens)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    plan = loopkv.Plan.from_config(model.config, option="int4", shared_loops=[0])
    compiled_cache, eager_cache = (_cache(model, plan, 400, batch=2) for _ in range(2))

    def step(ids, pos):
        return model(input_ids=ids, position_ids=pos, past_key_values=compiled_cache, init_scale=0.0).logits

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="eager")
    counters.clear()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        ids = torch.randint(3, VOCAB, (2, 300), generator=g)
        for cache in (compiled_cache, eager_cache):
            model(input_ids=ids, past_key_values=cache, init_scale=0.0)
        tok = torch.randint(3, VOCAB, (2, 1), generator=g)
        for i in range(24):
            pos = torch.full((2, 1), 300 + i)
            got = compiled(tok, pos)
            want = model(input_ids=tok, position_ids=pos, past_key_values=eager_cache, init_scale=0.0).logits
            torch.testing.assert_close(got, want, atol=LOGITS_FP32_ATOL, rtol=LOGITS_FP32_RTOL)
            tok = got[:, -1].argmax(-1, keepdim=True)
    assert compiled_cache.get_seq_length() == 324
    assert counters["stats"]["unique_graphs"] == 1
    assert not counters["graph_break"]
