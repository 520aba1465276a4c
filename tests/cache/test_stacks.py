"""The cells' tensors are slices of a few stacks, and a compiled step lifts the stacks, not every cell's views; every
tensor a compiled step lifts is a static address, and none aliases another."""

import torch
import torch._dynamo

import loopkv
from loopkv.cache.storage import OWN_FIELDS, POOL_FIELDS, is_placeholder, nbytes
from loopkv.models.ouro import OuroConfig, OuroForCausalLM
from tests.cache.driver import tiny_config


def _mixed_plan(layers: int) -> loopkv.Plan:
    """Loop 0 shares the final loop's pages, loop 1 mixes BF16 / INT2 / INT4 pools, loop 2 (final) is INT4."""
    mid = [("bf16", "int2", "int4")[i % 3] for i in range(layers)]
    return loopkv.Plan.from_grid([["share"] * layers, mid, ["int4"] * layers], tau=14.0)


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def test_cells_are_views_of_the_stacks_and_allocate_nothing_else():
    plan = _mixed_plan(3)
    cfg = tiny_config(loops=3, layers=3, head_dim=32)
    cache = loopkv.LoopKVCache(plan, config=cfg, max_batch_size=3, max_cache_len=700, device="cpu")
    (shard,) = cache._shards  # one device: one shard of stacks
    stacks = shard.stacks
    slices = 0
    for idx, layer in enumerate(cache.layers):
        st = layer.storage
        for name in OWN_FIELDS:
            assert _same_memory(getattr(st, name), stacks.own[name])
            assert getattr(st, name).data_ptr() == stacks.own_slice(name, idx).data_ptr()
            assert getattr(st, name).shape == stacks.own_slice(name, idx).shape
        bits, j = stacks.pool_of[idx]
        assert bits == st.read_bits
        for name in ("page_table", *POOL_FIELDS):
            t, buf = getattr(st, name), stacks.pools[bits][name]
            assert is_placeholder(t) == is_placeholder(buf)
            if not is_placeholder(t):  # pool_slice is what a compiled step reads (LoopKVCache._rows)
                assert _same_memory(t, buf)
                assert t.data_ptr() == stacks.pool_slice(bits, name, j).data_ptr()
                assert t.shape == stacks.pool_slice(bits, name, j).shape
        # every slice starts on 16 bytes (Triton specializes pointers on it: one binary for every cell)
        assert all(t.data_ptr() % 16 == 0 for t in st.own_tensors().values() if not is_placeholder(t))
        slices += len(OWN_FIELDS) + (8 if st.own_bits else 0)
    for idx, layer in enumerate(cache.layers):  # a share cell holds its source's tensors, as before the stacks
        st = layer.storage
        if st.option == "share":
            src = cache.storage(cache.layout.source(cache.layout.cell(idx)))
            assert st.k_pages is src.k_pages
            assert st.page_table is src.page_table
    rows, per_row = cache.storage(0).page_table.shape
    identity = torch.arange(rows * per_row, dtype=torch.int32).view(rows, per_row)
    for layer in cache.layers:  # every pool's page table is the identity mapping, as allocate_cell's
        assert torch.equal(layer.storage.page_table, identity)
    own = sum(nbytes(t) for layer in cache.layers for t in layer.storage.own_tensors().values())
    total = sum(nbytes(t) for t in stacks.tensors())
    assert own <= total < own + 16 * slices  # nothing but the slices and their padding to 16 bytes


def _graph_inputs(layers: int) -> tuple[int, int, list[str], list[list[str]]]:
    """(graph inputs, parameters, the cache's inputs not marked static, groups of inputs sharing memory) of a
    compiled decode step of a tiny Ouro with ``layers`` layers x 3 loops."""
    torch.manual_seed(0)
    cfg = OuroConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=32, total_ut_steps=3,
                     max_position_embeddings=4096, rope_theta=10000.0)
    model = OuroForCausalLM(cfg).eval()
    cache = loopkv.LoopKVCache(_mixed_plan(layers), config=cfg, max_batch_size=2, max_cache_len=400,
                               dtype=torch.float32, device="cpu")
    with torch.no_grad():
        model(input_ids=torch.randint(3, 97, (2, 40)), past_key_values=cache)
    seen = {}

    def backend(gm, example_inputs):
        seen["inputs"] = len(example_inputs)
        seen["params"] = sum(isinstance(x, torch.nn.Parameter) for x in example_inputs)
        seen["dynamic"] = [_source(n) for n in gm.graph.find_nodes(op="placeholder")
                           if "cache" in _source(n) and not n.meta.get("tensor_dict", {}).get(STATIC)]
        by_memory = {}
        for node, x in zip(gm.graph.find_nodes(op="placeholder"), example_inputs, strict=True):
            if isinstance(x, torch.Tensor) and x.numel():
                by_memory.setdefault(x.untyped_storage().data_ptr(), []).append(_source(node))
        seen["aliased"] = [names for names in by_memory.values() if len(names) > 1]
        return gm.forward

    def step(ids, pos):
        return model(input_ids=ids, position_ids=pos, past_key_values=cache).logits

    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(step, backend=backend, fullgraph=True)(torch.randint(3, 97, (2, 1)), torch.full((2, 1), 40))
    return seen["inputs"], seen["params"], seen["dynamic"], seen["aliased"]


STATIC = "_dynamo_static_input_type"  # what torch._dynamo.mark_static_address sets on a tensor


def _source(node) -> str:
    src = getattr(node, "_dynamo_source", None)
    if src is None:
        return ""
    return src.name if isinstance(src.name, str) else src.name()  # a property in newer torch


def test_a_compiled_step_lifts_the_stacks_not_every_cells_tensors():
    """With a set of tensors per cell, a cell would add 5 graph inputs, 13 with its own pool (1,310 inputs for
    Ouro-1.4B's 96 cells under LoopKV-M); with the stacks the cache's inputs do not grow with the number of cells."""
    small, large = _graph_inputs(2), _graph_inputs(4)  # 6 and 12 cells
    cache_inputs = [n - params for n, params, _, _ in (small, large)]
    assert cache_inputs[0] == cache_inputs[1]
    # 5 exact-part stacks, 3 pool kinds x 8 fields, the advance's cell and pool indices per kind of pool (4 kinds
    # here) and its empty placeholder, a few more (ids, positions, ...)
    assert cache_inputs[0] <= 48


def test_every_cache_tensor_a_compiled_step_lifts_is_a_static_address():
    """CUDA-graph trees capture a step that mutates an input only if that input is a static address; one unmarked
    tensor (e.g. the empty placeholders of INT2's lo plane and BF16's scales, which ``advance_`` declares mutated)
    makes ``reduce-overhead`` skip CUDA graphs for the whole step."""
    _, _, dynamic, aliased = _graph_inputs(3)
    assert dynamic == []
    # and no two inputs share memory: AOTAutograd would merge them into a synthetic base and, in torch 2.11-2.13,
    # drop the static marks of every input (as it did with cell 0's lengths view beside the lengths stack)
    assert aliased == []
