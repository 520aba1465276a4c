"""The profiler on Dory's and Huginn's layouts against the served cache built by hand, in float64.

Reference: the model's own forward with a dense cache: prefill of the first 320 tokens (exact), then one token at a
time, where one planned cache index reads its history pages as the codec's round trip (page ``p`` holds positions
``32 + 32p .. 32 + 32p + 31``; a token whose row then holds ``n`` tokens reads pages ``p < (n - 288) // 32``) of its
own K/V (INT4) or of the final loop's cell at its layer (``share`` of an INT4 source). The KL against the exact
forward, averaged over positions 320.., must equal the profiler's damage of that (cell, option), measured by its
dense simulation (one forward of the whole document). Dory is skipped below transformers 5.24.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
from transformers.cache_utils import DynamicCache

from loopkv.cells import Cell
from loopkv.ops import codec
from loopkv.planning.looped import STATE_SEED, model_layout
from loopkv.planning.profiler import _Runner
from loopkv.planning.simulate import served_attention_enabled

PAGE, SINK, READ_FROM, PREFILL = 32, 32, 288, 320
N = 360  # queries 320..351 read one history page, 352..359 two


@functools.cache
def huginn64():
    from tests.models.test_huginn import build_model, released_config

    return build_model(released_config(), dtype=torch.float64)


@functools.cache
def _dory64():
    from tests.models.test_dory_generate import build

    return build(window=64).double()  # sliding layers that slide within the document


def dory64():
    try:
        from transformers import DoryForCausalLM  # noqa: F401
    except ImportError:
        pytest.skip("Dory needs transformers >= 5.24")
    return _dory64()


BUILDERS = {"huginn": huginn64, "dory": dory64}


class CodecHistoryCache(DynamicCache):
    """A dense cache in which decode tokens read index ``index``'s history pages as the codec's round trip of
    ``source``'s pages (its own for INT4) at ``bits``."""

    def __init__(self, index: int, source: int, bits: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.index, self.source, self.bits = index, source, bits

    def update(self, key, value, layer_idx, *args, **kwargs):
        k, v = super().update(key, value, layer_idx, *args, **kwargs)
        pages = max(0, (k.shape[2] - READ_FROM) // PAGE)
        if layer_idx != self.index or key.shape[2] != 1 or not pages:
            return k, v
        k_src, v_src = self.layers[self.source].keys, self.layers[self.source].values
        k, v = k.clone(), v.clone()
        for p in range(pages):
            at = slice(SINK + PAGE * p, SINK + PAGE * (p + 1))
            k[:, :, at] = codec.dequantize_k(*codec.quantize_k(k_src[:, :, at], self.bits))
            v[:, :, at] = codec.dequantize_v(*codec.quantize_v(v_src[:, :, at], self.bits))
        return k, v


def _dense(model, **kwargs):
    config = model.config if model.config.model_type == "dory" else None  # Dory's sliding layers keep a window
    return CodecHistoryCache(**kwargs, config=config) if config is not None else CodecHistoryCache(**kwargs)


def _call(model, ids, cache, states, start):
    """One forward of ``ids`` at positions ``start..``; a random initial state (Huginn) is ``states``' slice."""
    name = "past_key_values" if model.config.model_type != "dory" else "cache"
    if states is None:
        return model(input_ids=ids, use_cache=True, **{name: cache}).logits
    model.initial_state = lambda embeds, **_: states[:, start : start + embeds.shape[1]]
    try:
        return model(input_ids=ids, use_cache=True, **{name: cache}).logits
    finally:
        del model.initial_state


def hand_damage(model, doc, index, source, bits):
    """KL(exact || served by hand), nats per token over positions 320..N-1, float64."""
    states = None
    if getattr(model.config, "state_init", "zero") != "zero":  # the profiler's one fixed draw for the whole document
        shape = torch.zeros(1, doc.shape[1], model.config.n_embd, dtype=model.dtype)
        states = model.initial_state(shape, generator=torch.Generator().manual_seed(STATE_SEED))
    with torch.no_grad():
        exact = _call(model, doc, _dense(model, index=-1, source=-1, bits=4), states, 0)[0, PREFILL:]
        cache = _dense(model, index=index, source=source, bits=bits)
        _call(model, doc[:, :PREFILL], cache, states, 0)
        served = torch.cat([_call(model, doc[:, i : i + 1], cache, states, i)[0] for i in range(PREFILL, N)])
    p, q = torch.log_softmax(exact.double(), -1), torch.log_softmax(served.double(), -1)  # Dory's logits are fp32
    return float((p.exp() * (p - q)).sum(-1).mean())


class _NoBar:
    def update(self, n):
        pass


@pytest.mark.parametrize("family", ["huginn", "dory"])
@pytest.mark.parametrize(("cell", "option"), [(Cell(1, 1), "int4"), (Cell(0, 1), "share")])
def test_profiled_damage_equals_the_served_cache_by_hand(family, cell, option):
    """A planned cell at INT4, or sharing the final loop's INT4 pages, with every other index exact (prelude, coda
    and sliding layers included): the profiler's damage equals the KL of the hand-built served cache. float64 on
    both sides, different code paths (one dense forward vs prefill + decode): equal to 1e-9 relative."""
    model = BUILDERS[family]()
    layout = model_layout(model)
    index = layout.flat_index(cell)
    source = layout.flat_index(Cell(layout.final_loop, cell.layer)) if option == "share" else index
    vocab = model.config.vocab_size
    doc = torch.randint(3, vocab, (1, N), generator=torch.Generator().manual_seed(1))
    want = hand_damage(model, doc, index, source, 4)

    from loopkv.planning.looped import repeatable_state

    runner = _Runner(model, [doc[0]], loops=layout.loops, layers=layout.layers, tau=math.inf, share_source="int4",
                     share_passes=1, prefill_len=PREFILL, first=PREFILL, layout=layout, start="rows")
    with torch.no_grad(), served_attention_enabled(model), repeatable_state(model):
        (got, _), = runner.measure([(cell, option)], _NoBar())
    assert want > 1e-9  # the pages are read: the damage is real
    assert got == pytest.approx(want, rel=1e-9, abs=0)


@pytest.mark.parametrize("matmul", [False, True])
def test_exact_attention_over_a_sliding_window(matmul):
    """A fixed sliding-window slot attends to its last ``window`` keys (itself included), SDPA and matmul paths,
    against a per-query loop in float64 (GQA: query head h reads KV head h // 2)."""
    from loopkv.planning.simulate import exact_attention

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 50, 8, dtype=torch.float64, generator=gen)
    k, v = (torch.randn(2, 2, 50, 8, dtype=torch.float64, generator=gen) for _ in range(2))
    got = exact_attention(q, k, v, scale=0.3, matmul=matmul, block=16, window=7)
    want = torch.empty_like(q)
    for i in range(50):
        keys = slice(max(0, i - 6), i + 1)
        for h in range(4):
            w = torch.softmax(torch.einsum("bd,bnd->bn", q[:, h, i], k[:, h // 2, keys]) * 0.3, -1)
            want[:, h, i] = torch.einsum("bn,bnd->bd", w, v[:, h // 2, keys])
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def _fp32(family):
    if family == "dory":
        dory64()  # skips below 5.24
        from tests.models.test_dory_generate import build

        return build(window=64)
    from tests.models.test_huginn import build_model, released_config

    return build_model(released_config(state_init="zero"))  # eval's two runs must start from the same state


@pytest.mark.parametrize("family", ["huginn", "dory"])
def test_measured_kl_through_the_real_cache_is_the_profiled_damage(family):
    """One cell at INT4 through a real LoopKVCache (prefill, then token by token; Dory through its 'loopkv'
    attention) = the profiler's damage of that cell; an all-bf16 plan's KL is fp32 round-off. fp32 both sides,
    rel 1e-3 as tests/planning/test_evaluate.py's Ouro check."""
    import loopkv
    from loopkv.planning.evaluate import measure_kl
    from loopkv.planning.profiler import profile

    model = _fp32(family)
    doc = torch.randint(3, model.config.vocab_size, (1, N), generator=torch.Generator().manual_seed(2))
    bf16 = loopkv.Plan.from_config(model.config, option="bf16")
    assert measure_kl(model, bf16, doc, progress=False).kl < 1e-9
    cell = Cell(1, 1)
    options = list(bf16.options)
    options[bf16.layout.flat_index(cell)] = "int4"
    one = loopkv.Plan(loops=bf16.loops, layers=bf16.layers, options=tuple(options), family=bf16.family,
                      kv_heads=bf16.kv_heads, head_dim=bf16.head_dim)
    damage = profile(model, doc, options=("int4",), final_options=(), progress=False).damage_of(cell, "int4")
    measured = measure_kl(model, one, doc, progress=False).kl
    assert measured > 1e-9  # far above the bf16 plan's round-off
    assert measured == pytest.approx(damage, rel=1e-3)
