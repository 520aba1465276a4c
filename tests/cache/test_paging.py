"""A shared page pool (``LoopKVCache(pool_pages=N)``): pages handed to rows as they grow, freed on release.

Checked against the cache that reserves every row's pages (same ops, so exactly equal outputs), against brute-force
bookkeeping of the allocator, and against the byte model for the budget.
"""

import random

import pytest
import torch

import loopkv
from loopkv.cache.paging import PagePool, PoolFull, pool_pages_for
from loopkv.format import page_bytes, stored_pages
from loopkv.planning.bytes import exact_bytes
from tests.cache.driver import tiny_ouro
from tests.tolerances import LOGITS_FP32_ATOL, LOGITS_FP32_RTOL

PLAN = loopkv.Plan.from_loops(loops=2, layers=2, per_loop=["share", "int4"], tau=14.0)


@pytest.fixture(scope="module")
def model():
    return tiny_ouro()


def _cache(model, pool_pages=None, rows=2, length=700):
    return loopkv.LoopKVCache(PLAN, config=model.config, max_batch_size=rows, max_cache_len=length,
                              dtype=torch.float32, device=model.device, pool_pages=pool_pages)


def _generate(model, cache, ids, mask, new):
    out = model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=new, do_sample=False,
                         eos_token_id=None, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    return out.sequences, torch.stack(out.logits)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")])])
def test_a_pool_sized_to_the_rows_generates_what_reserved_pages_do_in_less_memory(model, device):
    if device == "cuda":  # the Triton kernels (head_dim 64)
        model = tiny_ouro(head_dim=64, device=device)
    ids = torch.randint(3, 97, (2, 400), generator=torch.Generator().manual_seed(1)).to(device)
    mask = torch.ones_like(ids)
    mask[1, :150] = 0  # rows of 400 and 250 tokens; generate feeds 59 of the 60 new ones
    need = stored_pages(400 + 59) + stored_pages(250 + 59)
    reserved, pooled = _cache(model), _cache(model, pool_pages=need)
    want = _generate(model, reserved, ids, mask, 60)
    got = _generate(model, pooled, ids, mask, 60)
    assert torch.equal(want[0], got[0])
    if device == "cpu":  # the same ops on the same values
        assert torch.equal(want[1], got[1])
    else:  # the Triton reader splits a row's pages by the pool's size: another summation order
        torch.testing.assert_close(want[1], got[1], atol=LOGITS_FP32_ATOL, rtol=LOGITS_FP32_RTOL)
    assert pooled.pages_in_use == need == 5
    assert pooled.memory_report().total_bytes < reserved.memory_report().total_bytes
    held = [pooled._pool.held(b) for b in (0, 1)]
    pooled.release([0])
    assert pooled.pages_in_use == need - len(held[0])
    assert pooled.storage(0).lengths.tolist() == [0, 309]
    pooled.reset()
    assert pooled.pages_in_use == 0


def test_a_full_pool_refuses_before_anything_is_written(model):
    ids = torch.randint(3, 97, (1, 360), generator=torch.Generator().manual_seed(2))
    small = _cache(model, pool_pages=1, rows=1)
    with pytest.raises(PoolFull, match="pool_pages"):  # 360 tokens store 2 pages
        model(input_ids=ids, past_key_values=small)
    assert small.pages_in_use == 0
    assert all(int(layer.storage.lengths.max()) == 0 for layer in small.layers)
    # exactly enough for a 350-token prompt (1 page); the decode step to 351 tokens stores page 2 (it is quantized
    # at 319 + 32 = 351) and is refused at its host check, before any cell writes
    exact = _cache(model, pool_pages=stored_pages(350), rows=1)
    model(input_ids=ids[:, :350], past_key_values=exact)
    assert stored_pages(351) == exact.pages_in_use + 1
    before = [layer.storage.lengths.clone() for layer in exact.layers]
    with pytest.raises(PoolFull):
        model(input_ids=ids[:, 350:351], past_key_values=exact)
    assert all(torch.equal(layer.storage.lengths, b) for layer, b in zip(exact.layers, before, strict=True))


def test_the_allocator_against_brute_force_bookkeeping():
    rng = random.Random(0)
    pool = PagePool(pages=40, rows=6, per_row=12)
    held = {b: [] for b in range(6)}
    for _ in range(2000):
        b = rng.randrange(6)
        if rng.random() < 0.25:
            assert pool.release(b) == held[b]
            held[b] = []
        else:
            want = {r: rng.randrange(13) for r in rng.sample(range(6), rng.randrange(1, 4))}
            extra = sum(max(0, n - len(held[r])) for r, n in want.items())
            free = 40 - sum(map(len, held.values()))
            if extra > free:
                with pytest.raises(PoolFull):
                    pool.ensure(want)
            else:
                for r, p, page in pool.ensure(want):
                    assert p == len(held[r])
                    held[r].append(page)
        pages = [p for ps in held.values() for p in ps]
        assert len(pages) == len(set(pages)) == pool.in_use  # no page held twice, nothing lost
        assert all(0 <= p < 40 for p in pages)
        assert all(pool.held(r) == ps for r, ps in held.items())


def test_a_budget_buys_the_pages_it_can_hold(model):
    """Everything the cache allocates but its page tables (its exact parts with their lengths and padding, the pools
    with the trash page) fits the budget, and one more page would not."""
    budget = 3 * 2**20
    pages = pool_pages_for(PLAN, model.config, budget_bytes=budget, max_batch_size=2, dtype_bytes=4)
    cache = _cache(model, pool_pages=pages)
    report = cache.memory_report()
    per_page = 2 * page_bytes(4, 2, 32, exact_bytes=4)  # two int4 pools (the final loop; loop 0 shares)
    assert budget - per_page < report.total_bytes - report.by_component["page_table"] <= budget
    with pytest.raises(ValueError, match="does not cover"):
        pool_pages_for(PLAN, model.config, budget_bytes=2**16, max_batch_size=2, dtype_bytes=4)


@pytest.mark.parametrize("length", [1, 31, 32, 33, 100, 318, 319, 700])
def test_exact_bytes_are_what_a_cache_allocates(model, length):
    """A short cache (at most 318 tokens: no page) allocates the sink and ring slots its tokens can fill, a longer one
    32 + 288: the byte model agrees with the sink and ring tensors of every cell, share cells included, and with
    their int32 lengths (2 rows: 8 bytes, each cell's padded to 16)."""
    cache = _cache(model, rows=2, length=length)
    kv = sum(getattr(cache.storage(i), name).nbytes for i in range(len(cache.layers))
             for name in ("sink_k", "sink_v", "win_k", "win_v"))
    assert kv == 4 * 2 * 2 * 2 * 32 * 4 * (length if length <= 318 else 32 + 288)  # 4 cells, K+V, 2 rows, 2 heads x 32
    model_bytes = exact_bytes(model.config, rows=2, max_cache_len=length, dtype_bytes=4)
    assert (model_bytes.kv, model_bytes.lengths, model_bytes.padding) == (kv, 4 * 2 * 4, 4 * 8)
    assert cache.memory_report().exact == model_bytes


def test_what_a_shared_pool_cannot_do_is_refused(model, monkeypatch):
    cache = _cache(model, pool_pages=10)
    with pytest.raises(NotImplementedError, match="beam search"):
        cache.reorder_cache(torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="not a row"):
        cache.release([2])
    # so transformers' generate decodes it eagerly instead of compiling its forward (on CUDA it would)
    assert not cache.is_compileable
    assert _cache(model).is_compileable
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    q, k = torch.zeros(2, 4, 32), torch.zeros(2, 2, 1, 32)
    with pytest.raises(NotImplementedError, match="compile"):
        cache.decode_cell(len(cache.layers) - 1, q, k, k, scale=1.0)
