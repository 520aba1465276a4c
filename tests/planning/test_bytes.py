"""The byte model against the paper's figures (Table 8, Table 12, Appendix C), the codec's storage, and the bytes a
LoopKVCache allocates for its rows' exact parts (Ouro, Dory in both cache modes, Huginn)."""

import math
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import loopkv
from loopkv.format import BITS, PAGE, RING, SINK, page_bytes
from loopkv.ops import codec
from loopkv.planning import (
    ExactBytes,
    ModelShape,
    Plan,
    exact_bytes,
    exact_bytes_per_request,
    lo_plane_kib,
    option_kib,
    unit_kib,
)
from loopkv.planning.bytes import KIB
from tests.cache.driver import tiny_config
from tests.cache.test_short_cache import allocated_bytes

OURO_1_4B = ModelShape(loops=4, layers=24, kv_heads=16, head_dim=128)
T, L = 4, 24


def ouro_config(**overrides):
    """An Ouro-1.4B-like transformers config (only the fields the byte model reads)."""
    fields = dict(
        total_ut_steps=4, num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=16,
        hidden_size=2048, head_dim=128,
    )
    fields.update(overrides)
    return SimpleNamespace(**fields)


# (per-loop options, loops 1-based in the paper) -> (stored KiB, read KiB), paper Table 12 / §2.2
PAPER_PLANS = [
    (["int4"] * 4, 240.0, 240.0),  # KIVI-4
    (["bf16"] * 4, 768.0, 768.0),  # BF16
    (["int4", "int4", "share", "int4"], 180.0, 240.0),  # KIVI-4 + loop-3 sharing
    (["int4", "int2", "share", "int4"], 156.0, 216.0),  # INT4/INT2 + sharing
    (["int2", "int2", "share", "int4"], 132.0, 192.0),  # INT2 + sharing
]


@pytest.mark.parametrize(("per_loop", "stored", "read"), PAPER_PLANS)
def test_paper_plans_reproduce_table_12(per_loop, stored, read):
    plan = Plan.from_loops(loops=T, layers=L, per_loop=per_loop)
    b = plan.bytes_per_token(OURO_1_4B)
    assert (b.stored_kib, b.read_kib) == (stored, read)
    # the same from a transformers-style config
    b2 = plan.bytes_per_token(ouro_config())
    assert (b2.stored_kib, b2.read_kib) == (stored, read)


def test_share_loop_preset_is_the_paper_plan():
    b = Plan.share_loop(loops=T, layers=L).bytes_per_token(OURO_1_4B)
    assert (b.stored_kib, b.read_kib) == (180.0, 240.0)


def test_per_option_costs_appendix_c():
    assert option_kib("bf16", OURO_1_4B) == 8.0
    assert option_kib("int4", OURO_1_4B) == 2.5
    assert option_kib("int2", OURO_1_4B) == 1.5
    assert option_kib("share", OURO_1_4B) == 0.0
    assert option_kib("bf16", OURO_1_4B, dtype_bytes=4) == 16.0
    assert lo_plane_kib(OURO_1_4B) == 0.5


@pytest.mark.parametrize("hot", [0.0, 1 / 6, 0.5, 0.9, 1.0])
def test_v_precision_uniform_int4(hot):
    plan = Plan.uniform(loops=T, layers=L, option="int4", tau=14.0)
    b = plan.bytes_per_token(OURO_1_4B, hot_fraction=hot)
    assert b.stored_kib == 240.0
    assert b.read_kib == pytest.approx(240.0 - 96 * 0.5 * (1 - hot), abs=1e-9)


def test_v_precision_applies_to_int4_reads_only():
    # loop 1 int4, loop 2 int2, loop 3 shares loop 4's int4, loop 4 int4, all cold (hot fraction 0):
    # reads 216 - 0.5 KiB for each INT4 read (loops 1, 3, 4: 72 cells) = 180; int2 and storage unchanged.
    plan = Plan.from_loops(loops=T, layers=L, per_loop=["int4", "int2", "share", "int4"], tau=10.0)
    b = plan.bytes_per_token(OURO_1_4B, hot_fraction=0.0)
    assert (b.stored_kib, b.read_kib) == (156.0, 216.0 - 72 * 0.5)
    # a share cell reading an int2 source gets no V precision saving
    mixed = ["int4"] * (2 * L) + ["share"] * L + ["int2"] * L
    b = Plan(loops=T, layers=L, options=mixed, tau=10.0).bytes_per_token(OURO_1_4B, hot_fraction=0.0)
    assert b.read_kib == 2 * L * 2.0 + L * 1.5 + L * 1.5
    # bf16 cells are never affected
    b = Plan.uniform(loops=T, layers=L, option="bf16", tau=10.0).bytes_per_token(OURO_1_4B, hot_fraction=0.0)
    assert b.read_kib == 768.0


def test_hot_fraction_errors():
    plan = Plan.uniform(loops=T, layers=L)
    with pytest.raises(ValueError, match="tau=inf"):
        plan.bytes_per_token(OURO_1_4B, hot_fraction=0.5)
    with pytest.raises(ValueError, match=r"hot_fraction must be a number in \[0, 1\]"):
        Plan.uniform(loops=T, layers=L, tau=14).bytes_per_token(OURO_1_4B, hot_fraction=1.5)


def test_exact_parts_of_ouro_1p4b():
    """One BF16 request of Ouro-1.4B: 96 cells of 32 sink + 288 ring slots at 8 KiB per token and cell = 240 MiB of
    K/V. The paper's 216 MiB (§2.3, Appendix C) counts the sink and window tokens (32 + 256); the ring allocates one
    page more, the page being filled before it is quantized. Padding: each cell's 4-byte length alone is rounded up
    to 16 bytes (12 bytes x 96 cells); at 4 rows (the lengths fill 16 bytes) there is none."""
    token = T * L * option_kib("bf16", OURO_1_4B) * KIB  # K and V of one token in every cell
    one = exact_bytes(OURO_1_4B)
    assert one.kv == (SINK + RING) * token == 240 * 2**20
    assert one.kv - PAGE * token == 216 * 2**20  # the paper's sink and window
    assert (one.lengths, one.padding) == (96 * 4, 96 * 12)
    assert exact_bytes_per_request(OURO_1_4B) == one.total == 240 * 2**20 + 1536
    assert exact_bytes(OURO_1_4B, rows=4) == ExactBytes(kv=4 * one.kv, lengths=4 * one.lengths, padding=0)
    assert exact_bytes(OURO_1_4B, dtype_bytes=4).kv == 480 * 2**20
    assert exact_bytes(ouro_config(), rows=3) == exact_bytes(OURO_1_4B, rows=3)  # a config: the same layout
    # a short cache (no page is ever stored) holds the slots its tokens can fill: 100 per cell
    assert exact_bytes(OURO_1_4B, max_cache_len=100).kv == 100 * token


def test_exact_bytes_refuse_bad_arguments():
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="rows must be a positive int"):
            exact_bytes(OURO_1_4B, rows=bad)
        with pytest.raises(ValueError, match="max_cache_len must be a positive int"):
            exact_bytes(OURO_1_4B, max_cache_len=bad)
    with pytest.raises(ValueError, match="dtype_bytes must be a positive int"):
        exact_bytes(OURO_1_4B, dtype_bytes=0)


# ---- the exact parts against a LoopKVCache's tensors: tiny configs of each family, no model


def _ouro(odd: bool = False):
    """The tests' tiny Ouro config; ``odd``: 1 KV head of 4 channels, so that short caches' sink and ring slices do
    not fill whole 16-byte rows in BF16 either."""
    config = tiny_config(heads=4, kv_heads=1, head_dim=4) if odd else tiny_config()
    return config, Plan.from_loops(loops=2, layers=2, per_loop=["bf16", "bf16"] if odd else ["share", "int4"])


def _dory(mode: str):
    """A tiny transformers Dory (7 layers: 2 input, 3 recurrent run 3 times, 2 output; sliding layers among each,
    window 16), in ``mode``; skipped below transformers 5.24."""
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "DoryConfig"):
        pytest.skip("needs transformers >= 5.24 (Dory)")
    types = ["full_attention", "sliding_attention"] * 3 + ["full_attention"]
    config = transformers.DoryConfig(
        num_hidden_layers=7, n_input_layers=2, n_output_layers=2, n_recurrent_loops=3, hidden_size=64,
        intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=61,
        sliding_window=16, layer_types=types, recurrent_kv_cache_mode=mode)
    shared = [0, 1] if mode == "last_loop" else None
    return config, Plan.from_config(config, option="int4", shared_loops=shared)


def _huginn():
    """The tiny Huginn of tests/models/test_huginn.py (1 prelude, 2 core run 3 times, 1 coda layer)."""
    from loopkv.models.huginn import HuginnConfig
    from tests.models.test_huginn import released_config

    config = HuginnConfig(**{k: v for k, v in released_config().items() if k not in ("architectures", "auto_map")})
    return config, Plan.from_config(config, option="int4", shared_loops=[0])


FAMILIES = {"ouro": _ouro, "ouro-odd": lambda: _ouro(odd=True), "dory-per_loop": lambda: _dory("per_loop"),
            "dory-last_loop": lambda: _dory("last_loop"), "huginn": _huginn}


def _held(cache) -> ExactBytes:
    """The exact parts a cache holds, from its tensors: K/V and lengths from the sizes of every cache index's sink,
    window and lengths tensors; the padding from the storages behind them (each stacked buffer once) less those."""
    storages, kv, lengths = {}, 0, 0
    for i in range(len(cache.layers)):
        st = cache.storage(i)
        for name in ("sink_k", "sink_v", "win_k", "win_v", "lengths"):
            t = getattr(st, name)
            size = t.numel() * t.element_size()
            lengths, kv = (lengths + size, kv) if name == "lengths" else (lengths, kv + size)
            storage = t.untyped_storage()
            storages[storage.data_ptr() if storage.nbytes() else (i, name)] = storage.nbytes()
    return ExactBytes(kv=kv, lengths=lengths, padding=sum(storages.values()) - kv - lengths)


@pytest.mark.parametrize("max_cache_len", [9, 40, 400])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_exact_bytes_are_what_a_cache_allocates(family, max_cache_len):
    """3 rows (int32 lengths of 12 bytes: every stacked cell's slice is padded), a cache that stores pages (400) and
    short ones (40: a ring of 8; 9: inside the sink, shorter than Dory's window of 16): the byte model equals the
    cache's tensors, and memory_report() reports every byte of storage, padding included."""
    config, plan = FAMILIES[family]()
    dtype = torch.bfloat16 if family == "ouro-odd" else torch.float32
    cache = loopkv.LoopKVCache(plan, config=config, max_batch_size=3, max_cache_len=max_cache_len, dtype=dtype,
                               device="cpu")
    held = _held(cache)
    assert held.padding > 0
    assert exact_bytes(config, rows=3, max_cache_len=max_cache_len, dtype_bytes=dtype.itemsize) == held
    report = cache.memory_report()
    assert report.exact == report.model_exact == held
    assert report.total_bytes == sum(report.by_cell) == sum(report.by_component.values()) == allocated_bytes(cache)


def test_unit_is_half_a_kib():
    assert unit_kib(OURO_1_4B) == 0.5
    assert unit_kib(ouro_config()) == 0.5
    # Dory-like GQA shape: 4 KV heads of 256 -> E = 2048 elements -> 256 bytes = 0.25 KiB
    assert unit_kib(ModelShape(loops=4, layers=2, kv_heads=4, head_dim=256)) == 0.25


def test_model_shape_from_config_fallbacks():
    cfg = ouro_config(num_key_value_heads=None, head_dim=None)
    assert ModelShape.from_config(cfg) == ModelShape(4, 24, 16, 2048 // 16)
    with pytest.raises(ValueError, match="total_ut_steps"):
        ModelShape.from_config(SimpleNamespace(num_hidden_layers=2))
    with pytest.raises(ValueError, match="ModelShape.kv_heads must be a positive int"):
        ModelShape(4, 24, 0, 128)


def test_config_none_uses_the_plans_shape():
    plan = Plan.uniform(loops=T, layers=L, kv_heads=16, head_dim=128)
    assert plan.bytes_per_token().stored_kib == 240.0
    with pytest.raises(ValueError, match="records kv_heads and head_dim"):
        Plan.uniform(loops=T, layers=L).bytes_per_token()


def test_bytes_refuse_a_plan_for_another_model():
    with pytest.raises(ValueError, match="layers=24 but the model has num_hidden_layers=12"):
        Plan.uniform(loops=T, layers=L).bytes_per_token(ModelShape(4, 12, 16, 128))


@pytest.mark.parametrize("bits", [4, 2])
def test_codec_storage_agrees_with_the_model(bits):
    """What the codec actually stores per token (codes + scales + zeros) equals the byte model."""
    heads, dim = 2, 64
    k = torch.randn(heads, PAGE, dim)
    v = torch.randn(heads, PAGE, dim)
    pages = codec.encode_pages(k, v, bits)
    nbytes = sum(t.numel() * t.element_size() for t in pages)
    shape = ModelShape(loops=1, layers=1, kv_heads=heads, head_dim=dim)
    assert nbytes / PAGE == option_kib(f"int{bits}", shape) * 1024
    if bits == 4:  # the lo plane V precision skips
        assert pages.v_lo.numel() / PAGE == lo_plane_kib(shape) * 1024


@pytest.mark.parametrize("option", ["bf16", "int4", "int2"])
@pytest.mark.parametrize(("kv_heads", "head_dim"), [(1, 32), (2, 64), (16, 128), (4, 256)])
def test_option_cost_is_a_pool_page_per_token(option, kv_heads, head_dim):
    """What a cell stores per token is what one page of its pool holds (loopkv.format), divided by PAGE."""
    shape = ModelShape(loops=1, layers=1, kv_heads=kv_heads, head_dim=head_dim)
    assert option_kib(option, shape) * 1024 * PAGE == page_bytes(BITS[option], kv_heads, head_dim)
    assert option_kib(option, shape, dtype_bytes=4) * 1024 * PAGE == page_bytes(
        BITS[option], kv_heads, head_dim, exact_bytes=4)


@st.composite
def plans(draw):
    loops = draw(st.integers(1, 4))
    layers = draw(st.integers(1, 5))
    cells = []
    for t in range(loops):
        allowed = ["bf16", "int4", "int2"] + (["share"] if t < loops - 1 else [])
        cells += draw(st.lists(st.sampled_from(allowed), min_size=layers, max_size=layers))
    one = st.sampled_from([math.inf, 0.0, 14.0])
    tau = draw(st.one_of(one, st.lists(one, min_size=loops, max_size=loops)))  # one, or one per loop
    return Plan(loops=loops, layers=layers, options=cells, tau=tau)


@settings(max_examples=60, deadline=None)
@given(
    plan=plans(),
    kv_heads=st.sampled_from([1, 2, 16]),
    head_dim=st.sampled_from([32, 96, 128]),
    hot=st.floats(0.0, 1.0),
)
def test_property_stored_le_read_and_share_stores_nothing(plan, kv_heads, head_dim, hot):
    shape = ModelShape(plan.loops, plan.layers, kv_heads, head_dim)
    hot = hot if plan.v_precision else 1.0
    b = plan.bytes_per_token(shape, hot_fraction=hot)
    assert len(b.per_cell) == plan.loops * plan.layers
    unit = unit_kib(shape)
    lo = lo_plane_kib(shape)
    for i, (stored, read) in enumerate(b.per_cell):
        option = plan.options[i]
        final_cell = (plan.loops - 1) * plan.layers + i % plan.layers
        source = plan.options[final_cell] if option == "share" else option
        assert stored == (0.0 if option == "share" else option_kib(option, shape))
        reader_vp = math.isfinite(plan.taus[i // plan.layers])  # the reading cell's loop, also for a share
        cold = (1 - hot) * lo if (reader_vp and source == "int4") else 0.0
        assert read == pytest.approx(option_kib(source, shape) - cold)
        if hot == 1.0:
            assert stored <= read
        assert stored / unit == int(stored / unit)  # a whole number of byte units
    assert b.stored_kib == pytest.approx(sum(s for s, _ in b.per_cell))
    assert b.read_kib == pytest.approx(sum(r for _, r in b.per_cell))
    if hot == 1.0 or hot == 0.0:
        assert b.read_kib / unit == int(b.read_kib / unit)
    if hot == 1.0:
        assert b.stored_kib <= b.read_kib


def test_v_precision_per_loop_reads():
    """Paper Table 14's arm: KIVI-4 + loop-3 sharing (1-based) with V precision in loops 1-2 only. Per token,
    loops 0-1 read INT4 less the cold lo plane (48 x (2.5 - 5/6 x 0.5) KiB at hot fraction 1/6), the shared
    loop 2 and the final loop read plain INT4 (48 x 2.5 KiB); V precision in every loop saves the shared loop's
    and the final loop's lo plane too."""
    shape = ModelShape(loops=4, layers=24, kv_heads=16, head_dim=128)
    per_loop = Plan.share_loop(loops=4, layers=24, tau=(14, 14, math.inf, math.inf))
    everywhere = Plan.share_loop(loops=4, layers=24, tau=14)
    assert per_loop.bytes_per_token(shape, hot_fraction=1 / 6).read_kib == pytest.approx(48 * (2.5 - 5 / 12) + 120)
    assert everywhere.bytes_per_token(shape, hot_fraction=1 / 6).read_kib == pytest.approx(96 * (2.5 - 5 / 12))
    assert per_loop.bytes_per_token(shape).stored_kib == 180.0
    from loopkv.planning.bytes import per_token

    with pytest.raises(ValueError, match="one bool per loop"):
        per_token(per_loop.options, 24, shape, v_precision=(True, False))
