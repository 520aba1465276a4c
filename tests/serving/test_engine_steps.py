"""A step's new prompts written together (loopkv/cache/slots.py ``PrefillStep``) and the once-per-step check of their
tokens (loopkv/serving/engine_cache.py): the same storage as ``LoopKVCache.prefill_cell`` per prompt, bit for bit,
and a request whose prompt or decode token is uncodable failed alone with an error that says so, nothing of it left
stored, the others going on as if it had not come."""

import contextlib
import copy

import pytest
import torch
from transformers import GenerationConfig

import loopkv
from loopkv.cache import checks, slots
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
def test_an_uncodable_prompt_token_fails_its_request_alone_and_leaves_nothing_stored():
    """A token whose K/V are NaN (its embedding is NaN) in an INT4 plan, in a prompt that shares its step with
    another: found at the step's end, that request alone fails with an error naming it and the cells, after its
    first token; the engine goes on; the other request, and a third that takes the failed one's slot, are each
    ``generate`` alone; the slots and every page are back at the end."""
    model = copy.deepcopy(tiny_ouro())
    with torch.no_grad():
        model.model.embed_tokens.weight[96] = float("nan")
    plan = loopkv.Plan.uniform(loops=2, layers=2, option="int4", tau=14.0)
    prompts = {"ok": [5 + j % 80 for j in range(30)], "bad": [5] * 300 + [96] + [7] * 40, "next": [9, 8, 7, 6] * 5}
    new = 6
    gen = GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=-1, pad_token_id=0)
    cb = engine_config(pool_pages=40, max_len=512, max_slots=2)
    with engine_cache(plan, max_slots=2, max_len=512) as built:
        manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)
        manager.start()
        try:
            for rid, ids in prompts.items():
                manager.add_request(ids, request_id=rid, max_new_tokens=new)
            results = {r.request_id: r for r in (manager.get_result(timeout=120) for _ in prompts) if r is not None}
            assert manager.is_running()
        finally:
            manager.stop(block=True)
            model.destroy_cached_continuous_batching_manager()
    (engine,) = built
    bad = results["bad"]
    assert "the INT4/INT2 codec cannot store" in str(bad.error)
    assert "request bad: its prompt gave cells [0, 1, 2, 3]" in str(bad.error)
    assert len(bad.generated_tokens) == 1  # failed once the engine had counted its prompt's token
    assert engine.lives["bad"] == [[(0, 341)]]
    assert (1, 20) in [(d, n) for _, d, n in engine.steps]  # next's prompt beside ok's decode: in bad's slot
    for rid in ("ok", "next"):
        assert results[rid].error is None
        cache = loopkv.LoopKVCache(plan, config=model.config, max_batch_size=1, max_cache_len=512,
                                   dtype=torch.float32, device="cpu")
        alone = model.generate(torch.tensor([prompts[rid]]), past_key_values=cache, max_new_tokens=new,
                               do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(prompts[rid]):].tolist()
        assert results[rid].generated_tokens == alone, rid
    assert engine.cache.pages_in_use == 0
    assert engine.free_block_count() == engine.num_blocks
    assert engine.requests_held == 0
    assert all(not engine.cache.storage(c).lengths.any() for c in range(4))


def test_a_bf16_value_beyond_fp16s_range_is_uncodable():
    """65536 is a bf16 value beyond fp16's largest (65504), which rounds to 65536 in bf16: compared in bf16 it would
    pass."""
    x = torch.tensor([65280.0, 65536.0, -65536.0, float("inf"), float("nan"), 1.0], dtype=torch.bfloat16)
    assert checks.uncodable(x).tolist() == [False, True, True, True, True, False]
    assert checks.uncodable(x.float()).tolist() == [False, True, True, True, True, False]


@contextlib.contextmanager
def _nan_at_position(model, position):
    """The model's input embedding is NaN for every token at ``position`` (so its K/V are NaN in every cell)."""
    seen = {}

    def positions(module, args, kwargs):
        seen["position_ids"] = kwargs["position_ids"]

    def poison(module, args, out):
        return torch.where((seen["position_ids"] == position)[..., None], float("nan"), out)

    hooks = [model.model.register_forward_pre_hook(positions, with_kwargs=True),
             model.model.embed_tokens.register_forward_hook(poison)]
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()


def _alone(model, plan, prompt, new):
    cache = loopkv.LoopKVCache(plan, config=model.config, max_batch_size=1, max_cache_len=512, dtype=torch.float32,
                               device="cpu")
    return model.generate(torch.tensor([prompt]), past_key_values=cache, max_new_tokens=new, do_sample=False,
                          eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()


PLAN = loopkv.Plan.from_loops(loops=2, layers=2, per_loop=["share", "int4"], tau=14.0)
PROMPTS = {"bad": [3 + (5 * j) % 90 for j in range(300)], "ok1": [3 + (7 * j) % 90 for j in range(40)],
           "ok2": [3 + (11 * j) % 90 for j in range(12)]}
NEW = 10


def _serve_with_a_nan_decode_token(model, *, cuda_graphs):
    """PROMPTS through two slots, the first's third decode token (position 302) NaN: each request's result, and the
    engine cache, whose every page and slot must be back. The engine goes on."""
    gen = GenerationConfig(max_new_tokens=NEW, do_sample=False, eos_token_id=-1, pad_token_id=0)
    cb = engine_config(pool_pages=40, max_len=512, max_slots=2)
    with engine_cache(PLAN, max_slots=2, max_len=512, cuda_graphs=cuda_graphs) as built, \
            _nan_at_position(model, 302):
        manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)
        manager.start()  # no manager.warmup(): the first forward warms the cache up
        try:
            for rid, ids in PROMPTS.items():
                manager.add_request(ids, request_id=rid, max_new_tokens=NEW)
            results = {r.request_id: r for r in (manager.get_result(timeout=300) for _ in PROMPTS) if r is not None}
            assert manager.is_running()  # the engine goes on
        finally:
            manager.stop(block=True)
            model.destroy_cached_continuous_batching_manager()
    (engine,) = built
    assert engine.warm_up_s is not None
    bad = results["bad"]
    assert "the INT4/INT2 codec cannot store" in str(bad.error)
    assert "request bad: its token at position 302 gave cells [2, 3]" in str(bad.error)  # the share cells store none
    assert len(bad.generated_tokens) == 3  # the tokens before the step that read position 302
    assert results["ok1"].error is None
    assert results["ok2"].error is None
    assert engine.lives["ok2"][0][0] == (0, 12)  # admitted once, into the slot the failed request left
    assert engine.cache.pages_in_use == 0
    assert engine.free_block_count() == engine.num_blocks
    assert engine.requests_held == 0
    return {rid: r.generated_tokens for rid, r in results.items()}, engine


@needs_engine
def test_an_uncodable_decode_token_fails_its_request_alone():
    """Three requests through two slots; the first's third decode token is NaN. It fails alone with the uncodable
    error, naming the INT4 cells, before that token's output counts: its tokens are what it generates alone up to
    there. Its slot goes to the third request; the other two are each what ``generate`` gives them alone."""
    model = tiny_ouro()
    tokens, _ = _serve_with_a_nan_decode_token(model, cuda_graphs=False)
    assert tokens["bad"] == _alone(model, PLAN, PROMPTS["bad"], NEW)[:3]
    for rid in ("ok1", "ok2"):
        assert tokens[rid] == _alone(model, PLAN, PROMPTS[rid], NEW), rid


@needs_engine
@pytest.mark.gpu
def test_an_uncodable_decode_token_fails_its_request_alone_in_a_captured_step():
    """The same on CUDA, the NaN token read inside a replayed graph: the same tokens as the eager padded steps (which
    the CPU test checks against generate alone)."""
    model = tiny_ouro(head_dim=128, device="cuda")
    captured, engine = _serve_with_a_nan_decode_token(model, cuda_graphs=True)
    assert engine.graphs.captured == [1, 2]
    eager, engine = _serve_with_a_nan_decode_token(model, cuda_graphs=False)
    assert engine.graphs.captured == []
    assert captured == eager
