"""A step's new prompts written together (loopkv/cache/slots.py ``PrefillStep``) and the once-per-step check of their
tokens (loopkv/serving/engine_cache.py): the same storage as ``LoopKVCache.prefill_cell`` per prompt, bit for bit,
and an uncodable prompt token refused with the cache's error, nothing of its step left stored."""

import copy

import pytest
import torch
from transformers import GenerationConfig

import loopkv
from loopkv.cache import slots
from loopkv.cache.storage import OWN_FIELDS, POOL_FIELDS
from loopkv.serving.transformers_cb import engine_cache, engine_config
from tests.cache.driver import tiny_config, tiny_ouro
from tests.serving.test_transformers_cb import needs_engine

H, D = 2, 32


@pytest.mark.parametrize(("per_loop", "max_len", "pool", "lengths"), [
    (["share", "int4"], 800, 60, (5, 40, 300, 330, 351)),  # pages, a page boundary, the ring wrapping
    (["int2", "bf16"], 800, None, (1, 32, 289, 415, 700)),  # every row's pages reserved; bf16 pages
    (["int4", "int4"], 200, None, (3, 64, 150, 199, 200)),  # a short cache (no pages, fewer ring slots)
])
def test_a_steps_prompts_written_together_equal_prefill_cell_per_prompt(per_loop, max_len, pool, lengths):
    plan = loopkv.Plan.from_loops(loops=2, layers=1, per_loop=per_loop, tau=14.0)
    cfg = tiny_config(loops=2, layers=1, head_dim=D)
    caches = [loopkv.LoopKVCache(plan, config=cfg, max_batch_size=6, max_cache_len=max_len, dtype=torch.float32,
                                 device="cpu", pool_pages=pool) for _ in range(2)]
    rows = [3, 0, 5, 1, 2]
    g = torch.Generator().manual_seed(0)
    total = sum(lengths) + 7  # the packed batch, with tokens of no prompt between and after
    k = torch.randn(len(plan.options), total, H, D, generator=g)
    v = torch.randn(len(plan.options), total, H, D, generator=g)
    segments, start = [], 2
    for row, n in zip(rows, lengths, strict=True):
        segments.append((row, start, n))
        start += n + 1
    assert start <= total
    reference, packed = caches
    for row, _, n in segments:  # pages given out in the same order (prefill_cell reserves per prompt)
        packed.reserve({row: n})
    step = slots.PrefillStep.build(segments, device="cpu")
    for cell in range(len(plan.options)):
        for row, start, n in segments:
            seg = slice(start, start + n)
            reference.prefill_cell(cell, k[cell, seg].transpose(0, 1)[None], v[cell, seg].transpose(0, 1)[None],
                                   torch.zeros(1, dtype=torch.long), rows=[row])
        slots.prefill_step(packed, cell, step, k[cell], v[cell])
    for cell in range(len(plan.options)):
        a, b = reference.storage(cell), packed.storage(cell)
        for name in (*OWN_FIELDS, "page_table", *POOL_FIELDS):
            assert torch.equal(getattr(a, name), getattr(b, name)), (cell, name)
    assert reference.storage(0).lengths.tolist() == [lengths[rows.index(r)] if r in rows else 0 for r in range(6)]


@needs_engine
def test_an_uncodable_prompt_token_fails_its_step_and_leaves_nothing_stored():
    """A token whose K/V are NaN (its embedding is NaN) in an INT4 plan: found at the step's end, the step raises the
    cache's error naming the cells, the engine fails the request, and the slot and every page are back."""
    model = copy.deepcopy(tiny_ouro())
    with torch.no_grad():
        model.model.embed_tokens.weight[96] = float("nan")
    plan = loopkv.Plan.uniform(loops=2, layers=2, option="int4", tau=14.0)
    gen = GenerationConfig(max_new_tokens=4, do_sample=False, eos_token_id=-1, pad_token_id=0)
    cb = engine_config(pool_pages=40, max_len=512, max_slots=2)
    with engine_cache(plan, max_slots=2, max_len=512) as built:
        manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)
        manager.start()
        try:
            manager.add_request([5] * 300 + [96] + [7] * 40, request_id="bad", max_new_tokens=4)
            result = manager.get_result(timeout=120)
        finally:
            manager.stop(block=True)
            model.destroy_cached_continuous_batching_manager()
    (engine,) = built
    assert result is not None
    assert result.request_id == "bad"
    assert "the INT4/INT2 codec cannot store" in str(result.error)
    assert "cells [0, 1, 2, 3]" in str(result.error)
    assert engine.cache.pages_in_use == 0
    assert engine.free_block_count() == engine.num_blocks
    assert all(not engine.cache.storage(c).lengths.any() for c in range(4))
