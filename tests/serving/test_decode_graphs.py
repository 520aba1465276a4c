"""Decode-only engine steps through loopkv/serving/decode_graphs.py: padded to a bucket (CPU: eagerly, the path a
graph replays) and, on CUDA, captured once per bucket and replayed: the tokens equal those of the eager padded steps
(which tests/serving/test_transformers_cb.py checks against each request generated alone)."""

import pytest
from transformers import GenerationConfig

import loopkv
from loopkv.serving.decode_graphs import DecodeGraphs, bucket
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


def _serve(model, plan, prompts, *, cuda_graphs, new=24):
    gen = GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=-1, pad_token_id=0)
    cb = engine_config(pool_pages=96, max_len=512, max_slots=5)
    with engine_cache(plan, max_slots=5, max_len=512, cuda_graphs=cuda_graphs) as built:
        out = model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cb)
    (engine,) = built
    return {rid: o.generated_tokens for rid, o in out.items()}, engine


@needs_engine
@pytest.mark.gpu
@pytest.mark.parametrize("per_loop", [["int4", "int2"], ["share", "int4"]])
def test_captured_decode_steps_equal_eager_ones(per_loop):
    """Five requests of different lengths finish at different steps, so decode steps run at buckets 8, 4, 2 and 1;
    each bucket is captured once and replayed after."""
    model = tiny_ouro(head_dim=128, device="cuda")
    plan = loopkv.Plan.from_loops(loops=2, layers=2, per_loop=per_loop, tau=14.0)
    prompts = [[3 + (5 * i + j) % 90 for j in range(n)] for i, n in enumerate((400, 33, 290, 7, 120))]
    captured, engine = _serve(model, plan, prompts, cuda_graphs=True)
    assert engine.graphs.captured  # decode steps ran as graphs
    eager, engine = _serve(model, plan, prompts, cuda_graphs=False)
    assert not engine.graphs.captured
    assert captured == eager  # the same padded steps, replayed (the CPU tests check these against generate alone)
    assert all(len(tokens) == 24 for tokens in captured.values())
