"""Decode-only engine steps through loopkv/serving/decode_graphs.py: padded to a bucket (CPU: eagerly, the path a
graph replays) and, on CUDA, captured once per bucket and replayed: the tokens equal those of the eager padded steps
(which tests/serving/test_transformers_cb.py checks against each request generated alone)."""

import pytest
import torch
from transformers import GenerationConfig

import loopkv
from loopkv.serving import transformers_cb
from loopkv.serving.decode_graphs import DecodeGraphs, bucket, buckets
from loopkv.serving.transformers_cb import engine_cache, engine_config
from tests.cache.driver import tiny_ouro
from tests.serving.test_transformers_cb import needs_engine


def test_buckets_are_powers_of_two_then_multiples_of_eight():
    assert [bucket(t) for t in range(1, 10)] == [1, 2, 4, 4, 8, 8, 8, 8, 16]
    for t in range(1, 200):
        b = bucket(t)
        assert t <= b < max(2 * t, t + 8)
        assert b & (b - 1) == 0 if t <= 8 else b % 8 == 0


def test_capture_needs_a_cuda_device():
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        DecodeGraphs(max_rows=4, device="cpu", capture=True)


def _serve(model, plan, prompts, *, cuda_graphs, new=24, chunk=0):
    """Each prompt's tokens through an engine of 5 slots warmed up by transformers' ``manager.warmup()`` first, and
    the engine cache with the buckets it had captured when the warm-up ended. ``chunk``: chunked prefill, this many
    prompt tokens per step (0: whole prompts)."""
    gen = GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=-1, pad_token_id=0)
    cb = engine_config(pool_pages=96, max_len=512, max_slots=5, chunked_prefill=chunk > 0,
                       max_batch_tokens=5 + chunk if chunk else None)
    with engine_cache(plan, max_slots=5, max_len=512, cuda_graphs=cuda_graphs, chunked_prefill=chunk > 0) as built:
        manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)
        try:
            manager.warmup()
            (engine,) = built
            warmed = engine.graphs.captured
            assert not engine.steps
            manager.start()
            for i, ids in enumerate(prompts):
                manager.add_request(ids, request_id=f"r{i}", max_new_tokens=new)
            out = {r.request_id: r for r in (manager.get_result(timeout=300) for _ in prompts) if r is not None}
        finally:
            manager.stop(block=True)
            model.destroy_cached_continuous_batching_manager()
    assert all(o.error is None for o in out.values())
    return {rid: o.generated_tokens for rid, o in out.items()}, engine, warmed


@needs_engine
@pytest.mark.gpu
@pytest.mark.parametrize("per_loop", [["int4", "int2"], ["share", "int4"]])
def test_captured_decode_steps_equal_eager_ones(per_loop):
    """Five requests of different lengths finish at different steps, so decode steps run at buckets 8, 4, 2 and 1;
    every bucket's graph is captured by the warm-up, before the first request, and replayed after."""
    model = tiny_ouro(head_dim=128, device="cuda")
    plan = loopkv.Plan.from_loops(loops=2, layers=2, per_loop=per_loop, tau=14.0)
    prompts = [[3 + (5 * i + j) % 90 for j in range(n)] for i, n in enumerate((400, 33, 290, 7, 120))]
    captured, engine, warmed = _serve(model, plan, prompts, cuda_graphs=True)
    assert warmed == buckets(5) == [1, 2, 4, 8]
    assert engine.graphs.captured == warmed  # nothing captured while serving
    pool = engine.graphs.pool_bytes()
    print(f"warm-up {engine.warm_up_s:.2f} s, graphs' pool {pool / 2**20:.1f} MiB")
    assert pool > 0
    eager, engine, warmed = _serve(model, plan, prompts, cuda_graphs=False)
    assert warmed == engine.graphs.captured == []
    assert captured == eager  # the same padded steps, replayed (the CPU tests check these against generate alone)
    assert all(len(tokens) == 24 for tokens in captured.values())


@needs_engine
@pytest.mark.gpu
@pytest.mark.parametrize("per_loop", [["int4", "int2"], ["share", "int4"]])
def test_prompts_in_chunks_on_cuda_give_the_tokens_of_whole_prompts(per_loop):
    """On CUDA, the five requests with chunked prefill (64 prompt tokens per step: the 400-, 290- and 120-token prompts
    in chunks, one at a time, through the scratch) generate the tokens they generate with every prompt in one pass."""
    model = tiny_ouro(head_dim=128, device="cuda")
    plan = loopkv.Plan.from_loops(loops=2, layers=2, per_loop=per_loop, tau=14.0)
    prompts = [[3 + (5 * i + j) % 90 for j in range(n)] for i, n in enumerate((400, 33, 290, 7, 120))]
    whole, _, _ = _serve(model, plan, prompts, cuda_graphs=True)
    chunked, engine, _ = _serve(model, plan, prompts, cuda_graphs=True, chunk=64)
    assert [engine.lives[f"r{i}"][0][0][1] < len(p) for i, p in enumerate(prompts)] == [True, False, True, False,
                                                                                         True]  # in chunks
    assert chunked == whole


def test_buckets_lists_every_bucket_up_to_max_rows():
    for n in (1, 3, 5, 8, 9, 43):
        assert buckets(n) == sorted({bucket(t) for t in range(1, n + 1)})
    assert buckets(43) == [1, 2, 4, 8, 16, 24, 32, 40, 48]


def _tensors(engine):
    """Every tensor of the engine cache's storage (each device's stacked buffers: sink, window, lengths, page tables,
    pools and the trash page; each cell's own views) and its decode steps' fixed tensors."""
    named = {f"shard{i}.{j}": t for i, shard in enumerate(engine.cache._shards) for j, t in enumerate(shard.tensors())}
    named |= {f"cell{c}.{n}": t for c, layer in enumerate(engine.cache.layers)
              for n, t in layer.storage.own_tensors().items()}
    steps = engine._decode_steps
    return named | {"decode.buf": steps._buf, "decode.decoding": steps._decoding, "decode.largest": steps.largest}


@needs_engine
@pytest.mark.parametrize(("per_loop", "pool", "max_slots"), [
    (["share", "int4"], 40, 5),  # a shared pool (its trash page), buckets 8, 4, 2, 1
    (["int2", "bf16"], None, 9),  # every row's pages reserved; bf16 pages; buckets 16, 8, 4, 2, 1
])
def test_warm_up_runs_every_bucket_and_leaves_the_cache_bitwise_as_it_was(per_loop, pool, max_slots):
    """The warm-up's step decodes no row: after it every storage tensor is bitwise what it was before (a copy taken
    before, compared tensor by tensor), and every bucket has run once (counted at the model's forward)."""
    model = tiny_ouro()
    plan = loopkv.Plan.from_loops(loops=2, layers=2, per_loop=per_loop, tau=14.0)
    max_len = 512
    engine = transformers_cb.engine_class()(
        plan, config=model.config, max_slots=max_slots, max_len=max_len,
        pool_pages=pool or max_slots * max_len // 32, max_batch_tokens=max_len + max_slots, dtype=torch.float32,
        device="cpu")
    before = {name: t.clone() for name, t in _tensors(engine).items()}
    widths = []
    hook = model.model.register_forward_pre_hook(lambda m, args, kw: widths.append(kw["input_ids"].shape[1]),
                                                 with_kwargs=True)
    try:
        engine.warm_up(model)
        engine.warm_up(model)  # once per cache
    finally:
        hook.remove()
    assert widths == buckets(max_slots)[::-1]  # largest first
    assert engine.warm_up_s is not None
    assert not engine.steps
    after = _tensors(engine)
    assert after.keys() == before.keys()
    for name, t in before.items():
        assert torch.equal(after[name], t), name


@needs_engine
def test_after_the_engines_warm_up_each_request_is_generate_alone():
    """``manager.warmup()`` (transformers' own, before the engine starts) warms loopkv's cache up before any step;
    the requests served after it are what ``generate`` gives each alone through a LoopKVCache with the same plan."""
    model = tiny_ouro()
    plan = loopkv.Plan.from_loops(loops=2, layers=2, per_loop=["share", "int4"], tau=14.0)
    prompts = [[3 + (5 * i + j) % 90 for j in range(n)] for i, n in enumerate((300, 33, 7))]
    gen = GenerationConfig(max_new_tokens=10, do_sample=False, eos_token_id=-1, pad_token_id=0)
    cb = engine_config(pool_pages=64, max_len=512, max_slots=3)
    with engine_cache(plan, max_slots=3, max_len=512) as built:
        manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)
        try:
            manager.warmup()
            (engine,) = built
            assert engine.warm_up_s is not None
            assert not engine.steps  # before the first step
            manager.start()
            for i, ids in enumerate(prompts):
                manager.add_request(ids, request_id=f"r{i}", max_new_tokens=10)
            results = {r.request_id: r for r in (manager.get_result(timeout=120) for _ in prompts) if r is not None}
        finally:
            manager.stop(block=True)
            model.destroy_cached_continuous_batching_manager()
    for i, prompt in enumerate(prompts):
        cache = loopkv.LoopKVCache(plan, config=model.config, max_batch_size=1, max_cache_len=512,
                                   dtype=torch.float32, device="cpu")
        alone = model.generate(torch.tensor([prompt]), past_key_values=cache, max_new_tokens=10, do_sample=False,
                               eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        assert results[f"r{i}"].generated_tokens == alone, i
