"""A Huginn plan for T core steps served for calls of r < T steps: ``LoopKVCache(plan, config=..., loops=r)``.

The rule under test (docs/design.md, "Huginn: recurrent depth"): steps ``0 .. r-2`` store as the plan gives them, step
``r - 1`` (the last step the call runs) stores as the plan's final step ``T - 1``, and every ``share`` cell reads step
``r - 1``'s pages at its core layer. The reference states that rule from the plan's grid by hand and serves it with
transformers' dense cache, every history page a decode token reads replaced by the codec's round trip of its
source's page (``tests.cache.driver.CodecHistoryCache``); it never calls ``Plan.for_loops``.
"""

from __future__ import annotations

import math

import pytest
import torch

import loopkv
from loopkv.models.huginn import HuginnCells
from loopkv.models.ouro import OuroConfig
from tests.cache.driver import CodecHistoryCache
from tests.models.test_huginn import VOCAB, build_model, released_config
from tests.tolerances import LOGITS_FP32_ATOL, LOGITS_FP32_RTOL

T = 4
BITS = {"int4": 4, "int2": 2, "bf16": 16}
# T = 4 steps x 2 core layers; every step before the last has a share cell, at both layers between them
GRID = [["share", "int4"],
        ["int4", "share"],
        ["share", "int2"],
        ["int2", "int4"]]  # the final step: the source of every share cell of a T-step call
# the prompt's prefill stores pages 0 and 1 (the source step's; a share cell stores none), every decode token reads
# them, and decoding quantizes page 2 (at 383 tokens) and reads it (the last token, at 384)
PROMPT, NEW = 375, 10


@pytest.fixture(scope="module")
def model():
    """The tiny Huginn of test_huginn (1 prelude, 2 core, 1 coda layers, 2 heads x 32) with T = 4."""
    return build_model(released_config(mean_recurrence=T))


def _plan(model, tau=math.inf):
    return loopkv.Plan.from_grid(GRID, family="huginn", tau=tau)


def _cache(model, plan, length, **kwargs):
    return loopkv.LoopKVCache(plan, config=model.config, max_batch_size=1, max_cache_len=length,
                              dtype=torch.float32, device="cpu", **kwargs)


def _generate(model, ids, cache=None, **kwargs):
    out = model.generate(ids, past_key_values=cache, max_new_tokens=NEW, do_sample=False, output_logits=True,
                         return_dict_in_generate=True, eos_token_id=None, pad_token_id=0,
                         state_generator=torch.Generator().manual_seed(7), **kwargs)
    return out.sequences[:, ids.shape[1]:], torch.stack(out.logits, 1)


def _prompt(seed):
    return torch.randint(3, VOCAB, (1, PROMPT), generator=torch.Generator().manual_seed(seed))


def _reference(model, steps):
    """The dense cache for a call of ``steps`` steps served by the rule: per cache index the bits of its pages, and
    each share index's source (step ``steps - 1`` at its core layer)."""
    cells = HuginnCells.of(model.config)
    rows = GRID[:steps - 1] + [GRID[-1]]  # the last step run stores as the final step
    bits, sources = {}, {}
    for t, row in enumerate(rows):
        for j, option in enumerate(row):
            index = cells.core_index(t, j)
            if option == "share":
                bits[index], sources[index] = 0, cells.core_index(steps - 1, j)
            else:
                bits[index] = BITS[option]
    return CodecHistoryCache(bits, sources)


@pytest.mark.parametrize("steps", [2, 3, T])
def test_share_cells_read_the_last_step_the_call_runs(model, steps):
    """r = 2, 3 on a T = 4 plan (and r = T): the dense cache of that r with the codec's round trip on exactly the
    history pages the served cache reads, share cells reading step r-1's, within fp32 noise; away from the exact
    model once pages are read (the check can fail)."""
    ids = _prompt(seed=steps)
    ref_tokens, ref_logits = _generate(model, ids, _reference(model, steps), num_steps=steps)
    cache = _cache(model, _plan(model), PROMPT + NEW, loops=steps)
    assert len(cache.layers) == HuginnCells.of(model.config).num_indices(steps)  # only the r steps' cells
    tokens, logits = _generate(model, ids, cache, num_steps=steps)
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(logits, ref_logits, atol=LOGITS_FP32_ATOL, rtol=LOGITS_FP32_RTOL)
    _, exact = _generate(model, ids, num_steps=steps)
    first_read = 1  # the first logits come from the prompt, whose attention is exact; every decode token reads pages
    torch.testing.assert_close(logits[:, :first_read], exact[:, :first_read], atol=LOGITS_FP32_ATOL,
                               rtol=LOGITS_FP32_RTOL)
    assert (logits[:, first_read:] - exact[:, first_read:]).abs().max() > 10 * LOGITS_FP32_ATOL


def test_the_full_count_is_the_plan_itself(model):
    """loops = T is the cache without loops=: the same plan object, layout and logits."""
    plan = _plan(model)
    assert plan.for_loops(T) is plan
    ids = _prompt(seed=11)
    plain, built = _cache(model, plan, PROMPT + NEW), _cache(model, plan, PROMPT + NEW, loops=T)
    assert built.plan is plan
    assert built.layout == plain.layout
    assert torch.equal(_generate(model, ids, plain)[1], _generate(model, ids, built)[1])


def test_for_loops_keeps_the_first_steps_and_the_final_one():
    """Plan.for_loops(r): rows 0..r-2 and the final row, with their taus; predicted is dropped, provenance says T."""
    taus = (1.0, 2.0, 3.0, 4.0)
    plan = loopkv.Plan.from_grid(GRID, family="huginn", tau=taus, predicted={"damage": 1.0})
    for r in (1, 2, 3):
        served = plan.for_loops(r)
        assert (served.loops, served.layers, served.family) == (r, 2, "huginn")
        assert served.grid() == GRID[:r - 1] + [GRID[-1]]
        assert served.taus == taus[:r - 1] + taus[-1:]
        assert dict(served.predicted) == {}
        assert served.provenance["for_loops_of"] == T
    for bad in (0, T + 1, 2.0, True):
        with pytest.raises(ValueError, match=r"loops must be an int in \[1, 4\]"):
            plan.for_loops(bad)


def test_a_cache_for_r_steps_stores_the_served_plan(model):
    """A cache for r = 2 allocates the served plan: step 1 with the final step's options (an INT2 pool at layer 0
    that step 0's share cell reads, INT4 at layer 1)."""
    cache = _cache(model, _plan(model), PROMPT + NEW, loops=2)
    assert cache.plan.grid() == [GRID[0], GRID[-1]]
    cells = HuginnCells.of(model.config)
    share, source = cache.storage(cells.core_index(0, 0)), cache.storage(cells.core_index(1, 0))
    assert (share.own_bits, share.read_bits, source.own_bits) == (0, 2, 2)
    assert share.k_pages.data_ptr() == source.k_pages.data_ptr()  # the source's pool itself
    assert cache.storage(cells.core_index(1, 1)).own_bits == 4


def test_counts_the_cache_cannot_serve_are_refused(model):
    plan, ids = _plan(model), _prompt(seed=5)[:, :8]
    with pytest.raises(ValueError, match=r"steps \[0, 1\] of its plan 'share' step 3's pages.*loops=2"):
        model.generate(ids, past_key_values=_cache(model, plan, 40), num_steps=2, max_new_tokens=2)
    two = _cache(model, plan, 40, loops=2)
    with pytest.raises(ValueError, match="num_steps=3, but this cache serves at most 2 core steps"):
        model.generate(ids, past_key_values=two, num_steps=3, max_new_tokens=2)
    with pytest.raises(ValueError, match=r"num_steps=1 on a cache built for 2 core steps: steps \[0\]"):
        model(ids, past_key_values=two, num_steps=1)
    with pytest.raises(ValueError, match="num_steps=4, but this cache serves at most 2"):
        model(ids, past_key_values=two)  # the config's default r is T
    with pytest.raises(ValueError, match=r"loops must be an int in \[1, 4\]"):
        _cache(model, plan, 40, loops=T + 1)
    ouro = OuroConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=2, total_ut_steps=T)
    with pytest.raises(ValueError, match="models of the ouro family run all 4 loops"):
        loopkv.LoopKVCache(loopkv.Plan.from_config(ouro, option="int4"), config=ouro, max_batch_size=1,
                           max_cache_len=40, dtype=torch.float32, device="cpu", loops=2)


def test_a_later_turn_reads_the_last_step_run(model):
    """A later turn in one forward on a cache for r = 2 (share cells encode the pages they read from step 1's ring,
    across page 0) equals decoding the turn token by token, which the tests above check against the dense cache."""
    plan, steps = _plan(model), 2
    first, turn = _prompt(seed=12)[:, :300], _prompt(seed=13)[:, :40]
    one_pass, stepped = (_cache(model, plan, 340, loops=steps) for _ in range(2))
    with torch.no_grad():
        model(first, past_key_values=one_pass, num_steps=steps, init_scale=0.0)
        got = model(turn, past_key_values=one_pass, num_steps=steps, init_scale=0.0).logits
        model(first, past_key_values=stepped, num_steps=steps, init_scale=0.0)
        want = torch.cat([model(turn[:, i:i + 1], past_key_values=stepped, num_steps=steps, init_scale=0.0).logits
                          for i in range(turn.shape[1])], 1)
    torch.testing.assert_close(got, want, atol=LOGITS_FP32_ATOL, rtol=LOGITS_FP32_RTOL)
