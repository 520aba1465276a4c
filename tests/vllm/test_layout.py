"""A plan mapped onto vLLM's KV cache (loopkv/vllm/layout.py), against the byte model and the format; no vLLM."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loopkv.cells import Cell
from loopkv.format import PAGE, pool_field_shapes
from loopkv.models.ouro import OuroConfig
from loopkv.planning.bytes import KIB, option_kib
from loopkv.planning.plan import Plan
from loopkv.vllm.cells import CellExact
from loopkv.vllm.layout import block_bytes, kv_layout, layer_name, parse_layer_name, rank_kv_heads
from loopkv.vllm.layout import exact_bytes_per_request as rank_exact_bytes

OURO_1P4B = OuroConfig()  # 4 loops x 24 layers, 16 KV heads of 128


def test_ouro_1p4b_blocks():
    # one 32-token block of one cell: BF16 8 KiB/token, INT4 2.5, INT2 1.5 (the README's per-token figures) x 32
    expected = {"bf16": 256 * KIB, "int4": 80 * KIB, "int2": 48 * KIB}
    for option, size in expected.items():
        layout = kv_layout(Plan.from_config(OURO_1P4B, option=option), OURO_1P4B)
        assert {c.block_bytes for c in layout} == {size}
        assert block_bytes(layout) == 96 * size
    shared = kv_layout(Plan.from_config(OURO_1P4B, option="int4", shared_loops=[2]), OURO_1P4B)
    assert block_bytes(shared) == 72 * 80 * KIB  # 180 KiB per token stored, the paper's "third loop shared"


def test_int4_block_is_its_pool_fields():
    # independent of page_bytes: the INT4 pool's fields, counted by hand (K codes 4 bits, V two 2-bit planes, fp16
    # scale and zero per K channel and per V token-group)
    h, d = 16, 128
    shapes = pool_field_shapes(4, 1, h, d)
    by_hand = PAGE * h * d // 2 + 2 * 2 * h * d + 2 * PAGE * h * d // 4 + 2 * 2 * PAGE * h * (d // 32)
    assert by_hand == sum(
        (2 if n.endswith(("scale", "zero")) else 1) * math.prod(s) for n, s in shapes.items())
    layout = kv_layout(Plan.from_config(OURO_1P4B, option="int4"), OURO_1P4B)
    assert layout[0].block_bytes == by_hand


def _config(loops, layers, kv_heads, head_dim):
    return OuroConfig(total_ut_steps=loops, num_hidden_layers=layers, num_attention_heads=kv_heads,
                      num_key_value_heads=kv_heads, head_dim=head_dim, hidden_size=kv_heads * head_dim,
                      intermediate_size=32, vocab_size=32)


@st.composite
def plans(draw):
    loops, layers = draw(st.integers(1, 4)), draw(st.integers(1, 5))
    kv_heads, head_dim = draw(st.sampled_from([1, 2, 4, 6])), draw(st.sampled_from([32, 64, 96, 128]))
    config = _config(loops, layers, kv_heads, head_dim)
    rows = [[draw(st.sampled_from(["bf16", "int4", "int2"] + (["share"] if t < loops - 1 else [])))
             for _ in range(layers)] for t in range(loops)]
    return config, Plan.from_grid(rows, kv_heads=kv_heads, head_dim=head_dim)


@settings(max_examples=60, deadline=None)
@given(plans(), st.sampled_from([1, 2, 4]))
def test_blocks_are_the_byte_models_bytes(case, tp):
    config, plan = case
    layout = kv_layout(plan, config, tensor_parallel_size=tp)
    heads = rank_kv_heads(config.num_key_value_heads, tp)
    # over all cells: stored KiB per token (byte model) x 32 tokens, scaled to this rank's heads
    stored = plan.bytes_per_token(config).stored_kib * KIB * PAGE * heads / config.num_key_value_heads
    assert block_bytes(layout) == pytest.approx(stored, rel=1e-12)
    for c in layout:
        assert c.layer_name == f"model.layers.{c.cell.loop * plan.layers + c.cell.layer}.self_attn.attn"
        assert c.kv_heads == heads
        assert c.block_bytes == option_kib(c.option, config) * KIB * PAGE * heads / config.num_key_value_heads
        if c.option == "share":
            assert not c.stores
            assert c.source == layer_name(Cell(plan.loops - 1, c.cell.layer), plan.layers)
        else:
            assert c.stores
            assert c.source == c.layer_name
    # what the backend allocates per request: K and V of SINK + RING slots in every cell (loopkv.vllm.cells.CellExact)
    assert rank_exact_bytes(plan, config, tensor_parallel_size=tp) == (
        CellExact.nbytes(1, heads, config.head_dim) * plan.loops * plan.layers)


def test_exact_parts_per_request_on_ouro_1p4b():
    plan = Plan.from_config(OURO_1P4B, option="int4")
    # 96 cells x (SINK 32 + RING 288) slots x 8 KiB (K and V, 16 heads x 128, BF16): 240 MiB per request
    assert rank_exact_bytes(plan, OURO_1P4B) == 96 * 320 * 8 * KIB == 240 * KIB * KIB
    assert rank_exact_bytes(plan, OURO_1P4B, tensor_parallel_size=2) == 120 * KIB * KIB


def test_layer_names_round_trip():
    for cell in Plan.from_config(OURO_1P4B, option="bf16").layout:
        name = layer_name(cell, 24)
        assert parse_layer_name(name, loops=4, layers=24) == cell
        assert parse_layer_name("language_model." + name, loops=4, layers=24) == cell
    assert layer_name(Cell(3, 23), 24) == "model.layers.95.self_attn.attn"
    with pytest.raises(ValueError, match="outside the 4 x 24 cells"):
        parse_layer_name("model.layers.96.self_attn.attn", loops=4, layers=24)
    with pytest.raises(ValueError, match="not a vLLM Ouro attention layer name"):
        parse_layer_name("model.layers.3.mlp", loops=4, layers=24)
    with pytest.raises(ValueError, match="outside a model of 24 layers"):
        layer_name(Cell(0, 24), 24)


def test_a_plan_for_another_model_is_refused():
    plan = Plan.from_config(_config(2, 3, 2, 64), option="int4")
    with pytest.raises(ValueError, match="does not fit the model"):
        kv_layout(plan, OURO_1P4B)
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive int"):
        kv_layout(Plan.from_config(OURO_1P4B, option="int4"), OURO_1P4B, tensor_parallel_size=0)
