"""The decode step compiles to one graph: no graph breaks, no recompiles, window exits and reset included."""

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

import loopkv
from tests.cache.driver import tiny_ouro
from tests.tolerances import LOGITS_FP32_ATOL, LOGITS_FP32_RTOL


@pytest.mark.parametrize("backend", ["inductor"])
def test_decode_step_is_one_graph_across_exits_and_reset(backend, error_on_recompile):
    model = tiny_ouro()
    cfg = model.config
    plan = loopkv.Plan.from_loops(loops=2, layers=2, per_loop=["share", "int4"], tau=14.0)
    compiled_cache, eager_cache = (
        loopkv.LoopKVCache(plan, config=cfg, max_batch_size=2, max_cache_len=700, dtype=torch.float32, device="cpu")
        for _ in range(2)
    )

    def step(ids, pos):
        return model(input_ids=ids, position_ids=pos, past_key_values=compiled_cache).logits

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend=backend)
    counters.clear()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for run, prompt in enumerate((280, 250)):  # two "generate calls" on the same cache objects
            for cache in (compiled_cache, eager_cache):
                cache.reset()
            ids = torch.randint(3, 97, (2, prompt), generator=g)
            model(input_ids=ids, past_key_values=compiled_cache)
            if run == 1:
                model(input_ids=ids, past_key_values=eager_cache)
            tok = torch.randint(3, 97, (2, 1), generator=g)
            for i in range(310 if run == 0 else 100):  # run 0: 590 tokens held, 9 window exits
                pos = torch.full((2, 1), prompt + i)
                got = compiled(tok, pos)
                if run == 1 and i >= 60:  # the compiled step equals eager across window exits (352, 384 held)
                    want = model(input_ids=tok, position_ids=pos, past_key_values=eager_cache).logits
                    torch.testing.assert_close(got, want, atol=LOGITS_FP32_ATOL, rtol=LOGITS_FP32_RTOL)
                elif run == 1:
                    model(input_ids=tok, position_ids=pos, past_key_values=eager_cache)
                tok = got[:, -1].argmax(-1, keepdim=True)
    assert compiled_cache.get_seq_length() == 350
    assert counters["stats"]["unique_graphs"] == 1
    assert not counters["graph_break"]
    assert counters["stats"]["calls_captured"] > 0


def test_one_compiled_step_serves_caches_of_three_lengths():
    """transformers keeps one compiled forward per model, so caches of other ``max_cache_len`` reach the same compiled
    function. A cache's tensors are marked static, so dynamo recompiles for new shapes instead of making them dynamic
    (which failed in dynamo's guard building: "sources must not be empty for symbol"), and no size of a cell's view is
    a Python int of the cache: at the third length dynamo made such ints dynamic and the ops' fake kernels failed on
    the symbolic views. One short cache (no pages) among them."""
    model = tiny_ouro()
    cfg = model.config
    plan = loopkv.Plan.from_loops(loops=2, layers=2, per_loop=["int4", "int4"], tau=14.0)

    def step(ids, pos, cache):
        return model(input_ids=ids, position_ids=pos, past_key_values=cache).logits

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True)
    ids = torch.randint(3, 97, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        for length in (400, 64, 700):
            caches = [loopkv.LoopKVCache(plan, config=cfg, max_batch_size=2, max_cache_len=length,
                                         dtype=torch.float32, device="cpu") for _ in range(2)]
            for cache in caches:
                model(input_ids=ids, past_key_values=cache)
            tok = ids[:, -1:]
            for i in range(3):
                pos = torch.full((2, 1), 9 + i)
                got = compiled(tok, pos, caches[0])
                want = model(input_ids=tok, position_ids=pos, past_key_values=caches[1]).logits
                torch.testing.assert_close(got, want, atol=LOGITS_FP32_ATOL, rtol=LOGITS_FP32_RTOL)
                tok = got[:, -1].argmax(-1, keepdim=True)
