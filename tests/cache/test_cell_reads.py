"""LoopKVCache driven cell by cell: stored state and attention vs float64 recomputation (docs/design.md)."""

import math

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import loopkv
from loopkv.format import PAGE, SINK, n_pages
from loopkv.ops import codec
from tests.cache.driver import (
    attention64,
    cold_tokens,
    decode,
    effective_kv,
    left_pad,
    prefill,
    tiny_config,
    write_token,
)
from tests.tolerances import ATTN_FP32_ATOL, ATTN_FP32_RTOL

D = 32
SCALE = D**-0.5


def _run(plan, lens, steps, *, check_every=25, cell=0, max_len=None, seed=0):
    """Prefill rows of lengths ``lens`` (left-padded), decode ``steps`` tokens, compare with float64."""
    g = torch.Generator().manual_seed(seed)
    cfg = tiny_config(loops=plan.loops, layers=plan.layers, head_dim=D)
    max_len = max_len or max(lens) + steps
    cache = loopkv.LoopKVCache(plan, config=cfg, max_batch_size=len(lens), max_cache_len=max_len, device="cpu")
    S = max(lens)
    seqs_k = [torch.randn(2, n, D, generator=g) for n in lens]
    seqs_v = [torch.randn(2, n, D, generator=g) for n in lens]
    k, mask = left_pad(seqs_k, S)
    v, _ = left_pad(seqs_v, S)
    for c in range(plan.loops * plan.layers):  # every cell gets the same prompt (final loop first is not needed)
        prefill(cache, c, torch.randn(len(lens), 4, S, D, generator=g), k, v, mask, SCALE)
    for step in range(steps):
        q = torch.randn(len(lens), 4, 1, D, generator=g)
        kd, vd = torch.randn(len(lens), 2, 1, D, generator=g), torch.randn(len(lens), 2, 1, D, generator=g)
        outs = [decode(cache, c, q, kd, vd, SCALE) for c in range(plan.loops * plan.layers)]
        if step % check_every == check_every - 1 or step == steps - 1:  # after the step: every cell holds its token
            for c in (cell,) if isinstance(cell, int) else cell:
                ref, _ = attention64(cache, c, q[:, :, 0], SCALE, plan.tau_of(plan.layout.cell(c)))
                torch.testing.assert_close(outs[c].double(), ref, atol=ATTN_FP32_ATOL, rtol=ATTN_FP32_RTOL)
    return cache


@pytest.mark.parametrize(
    ("option", "tau"), [("bf16", math.inf), ("int4", math.inf), ("int4", 14.0), ("int4", 0.0), ("int2", math.inf)]
)
def test_decode_matches_float64_recompute(option, tau):
    plan = loopkv.Plan.uniform(loops=1, layers=1, option=option, tau=tau)
    cache = _run(plan, lens=[1, 33, 300], steps=60)
    assert cache.storage(0).lengths.tolist() == [61, 93, 360]


def test_each_loop_reads_at_its_own_tau():
    """A plan with V precision per loop (off in loop 0, tau = 0 in loop 1, so cold tokens exist): each cell's
    decode equals the float64 read at its own loop's threshold (at tau = 0 most history is cold, so reading loop 1 at
    loop 0's threshold would fail)."""
    plan = loopkv.Plan.uniform(loops=2, layers=1, option="int4", tau=(math.inf, 0.0))
    assert plan.taus == (math.inf, 0.0)
    cache = _run(plan, lens=[300, 400], steps=30, check_every=10, cell=(0, 1))
    assert cache.taus == (math.inf, 0.0)


def test_shared_cell_reads_final_loop_pages():
    plan = loopkv.Plan.share_loop(loops=2, layers=1, shared_loops=(0,), option="int4", tau=14.0)
    cache = _run(plan, lens=[290, 300], steps=60, cell=0)  # cell (0, 0) shares (1, 0), read first in a step
    shared, source = cache.storage(0), cache.storage(1)
    assert shared.k_pages is source.k_pages
    assert shared.page_table is source.page_table
    assert shared.win_k is not source.win_k  # its own exact window


def test_history_is_really_quantized_within_bound():
    """Decode tokens that left the window differ from the exact K/V, by no more than the codec bound."""
    plan = loopkv.Plan.uniform(loops=2, layers=2, option="int4")
    g = torch.Generator().manual_seed(1)
    cfg = tiny_config(head_dim=D)
    cache = loopkv.LoopKVCache(plan, config=cfg, max_batch_size=1, max_cache_len=420, device="cpu")
    ks, vs = torch.randn(1, 2, 420, D, generator=g), torch.randn(1, 2, 420, D, generator=g)
    for t in range(420):  # decode only: every page is quantized on the device at its window exit
        write_token(cache, 0, ks[:, :, t : t + 1], vs[:, :, t : t + 1])
    K, V, _, _, hist = effective_kv(cache, 0, 0)
    npg = n_pages(420)
    assert int(hist.sum()) == PAGE * npg == 128
    err_k = (K - ks[0].double()).abs()
    err_v = (V - vs[0].double()).abs()
    assert err_k[:, hist].max() > 0
    assert err_v[:, hist].max() > 0
    assert err_k[:, ~hist].max() == 0  # sink and window stay exact
    assert err_v[:, ~hist].max() == 0
    st_ = cache.storage(0)
    for p in range(npg):
        pos = slice(SINK + PAGE * p, SINK + PAGE * (p + 1))
        k_scale = st_.k_scale[p].double()  # [H, D]
        # half a step of the stored scale, plus the fp16 rounding of zero and scale (2**-11 relative)
        bound_k = k_scale[:, None, :] * 0.5 + 2**-10 * (ks[0][:, pos].abs().double() + k_scale[:, None, :] * 15)
        assert (err_k[:, pos] <= bound_k).all()
        v_scale = st_.v_scale[p].double().repeat_interleave(codec.GROUP, -1)  # [H, PAGE, D]
        bound_v = v_scale * 0.5 + 2**-10 * (vs[0][:, pos].abs().double() + v_scale * 15)
        assert (err_v[:, pos] <= bound_v).all()
    # the stored codes are exactly the codec's encoding of the page's exact tokens
    ref = codec.encode_pages(ks[0][:, SINK : SINK + PAGE].unsqueeze(0), vs[0][:, SINK : SINK + PAGE].unsqueeze(0), 4)
    assert torch.equal(ref.k_codes[0], st_.k_pages[0])
    assert torch.equal(ref.v_hi[0], st_.v_hi[0])
    assert torch.equal(ref.v_lo[0], st_.v_lo[0])
    assert torch.equal(ref.v_scale[0], st_.v_scale[0])


def test_rows_equal_their_batch_one_outputs():
    lens = [3, 40, 300, 700]
    plan = loopkv.Plan.uniform(loops=1, layers=1, option="int4", tau=14.0)
    cfg = tiny_config(loops=1, layers=1, head_dim=D)
    g = torch.Generator().manual_seed(2)
    S = max(lens)
    ks = [torch.randn(2, n, D, generator=g) for n in lens]
    vs = [torch.randn(2, n, D, generator=g) for n in lens]
    qs = torch.randn(len(lens), 4, S, D, generator=g)
    steps = [(torch.randn(len(lens), 4, 1, D, generator=g), torch.randn(len(lens), 2, 1, D, generator=g),
              torch.randn(len(lens), 2, 1, D, generator=g)) for _ in range(40)]

    def run(rows):
        cache = loopkv.LoopKVCache(plan, config=cfg, max_batch_size=len(rows), max_cache_len=S + 40, device="cpu")
        sub = [lens[r] for r in rows]
        k, mask = left_pad([ks[r] for r in rows], max(sub))
        v, _ = left_pad([vs[r] for r in rows], max(sub))
        pre = prefill(cache, 0, qs[rows][:, :, -max(sub):], k, v, mask, SCALE)
        outs = [decode(cache, 0, q[rows], kd[rows], vd[rows], SCALE) for q, kd, vd in steps]
        return pre, torch.stack(outs, 1)

    _, batch_out = run(list(range(len(lens))))
    for r in range(len(lens)):
        _, single = run([r])
        torch.testing.assert_close(batch_out[r : r + 1], single, atol=1e-6, rtol=1e-6)


@settings(max_examples=5, deadline=None)
@example(tau=0.0, seed=1, spread=4.0)
@given(tau=st.sampled_from([0.0, 1.0, 3.0, 6.0]), seed=st.integers(0, 10_000), spread=st.floats(0.5, 4.0))
def test_proposition_1_bound(tau, seed, spread):
    """|o_tau - o_inf| <= 1.5 * sum_cold a_j * sigma_j, per output channel (paper §3.3, Proposition 1)."""
    g = torch.Generator().manual_seed(seed)
    cfg = tiny_config(loops=1, layers=1, head_dim=D)
    caches = {}
    for t in (tau, math.inf):
        plan = loopkv.Plan.uniform(loops=1, layers=1, option="int4", tau=t)
        caches[t] = loopkv.LoopKVCache(plan, config=cfg, max_batch_size=1, max_cache_len=360, device="cpu")
    ks = torch.randn(1, 2, 360, D, generator=g) * spread
    vs = torch.randn(1, 2, 360, D, generator=g)
    q = torch.randn(1, 4, D, generator=g) * spread
    for t in range(360):
        for c in caches.values():
            write_token(c, 0, ks[:, :, t : t + 1], vs[:, :, t : t + 1])
    o_tau = caches[tau].read_cell(0, q, scale=SCALE).double()
    o_inf = caches[math.inf].read_cell(0, q, scale=SCALE).double()
    ref_tau, weights = attention64(caches[tau], 0, q, SCALE, tau)
    ref_inf, _ = attention64(caches[math.inf], 0, q, SCALE, math.inf)
    K, _, _, Vs, hist = effective_kv(caches[tau], 0, 0)
    a = weights[0]  # [H, g, n]
    sigma = Vs.repeat_interleave(codec.GROUP, -1)  # [H, n, D]
    s = torch.einsum("hgd,hnd->hgn", q[0].double().view(2, 2, D), K) * SCALE
    cold_tok = cold_tokens(s, hist, tau)
    if (tau, seed, spread) == (0.0, 1, 4.0):
        assert cold_tok.any()  # the explicit example exercises the bound on real cold tokens
    bound = 1.5 * torch.einsum("hgn,hnd->hgd", a * cold_tok[:, None, :], sigma).reshape(4, D)
    delta = (o_tau - o_inf)[0]
    assert (delta.abs() <= bound + 1e-5).all()
    # and the float64 recomputations agree with the op for both readers
    torch.testing.assert_close(o_tau, ref_tau, atol=ATTN_FP32_ATOL, rtol=ATTN_FP32_RTOL)
    torch.testing.assert_close(o_inf, ref_inf, atol=ATTN_FP32_ATOL, rtol=ATTN_FP32_RTOL)


def test_tau_inf_is_bit_identical_to_plain_int4_and_tau_changes_output():
    cfg = tiny_config(loops=1, layers=1, head_dim=D)
    g = torch.Generator().manual_seed(3)
    ks, vs = torch.randn(1, 2, 450, D, generator=g), torch.randn(1, 2, 450, D, generator=g)
    q = torch.randn(1, 4, D, generator=g) * 3
    outs = {}
    for tau in (math.inf, 0.0):
        cache = loopkv.LoopKVCache(loopkv.Plan.uniform(loops=1, layers=1, option="int4", tau=tau), config=cfg,
                                   max_batch_size=1, max_cache_len=450, device="cpu")
        for t in range(450):
            write_token(cache, 0, ks[:, :, t : t + 1], vs[:, :, t : t + 1])
        outs[tau] = cache.read_cell(0, q, scale=SCALE)
        st_ = cache.storage(0)
        plain = torch.ops.loopkv.cell_attention(q, st_.sink_k, st_.sink_v, st_.win_k, st_.win_v, st_.lengths,
                                                st_.page_table, *st_.pool(), 4, math.inf, SCALE)
        if math.isinf(tau):
            assert torch.equal(outs[tau], plain)
    assert not torch.equal(outs[math.inf], outs[0.0])  # tau=0 marks tokens cold: the output moves


def test_reset_reuses_the_same_tensors_and_forgets():
    """After reset(), the same cache object gives bit-identical outputs to a fresh cache."""
    plan = loopkv.Plan.uniform(loops=1, layers=2, option="int4", tau=14.0)
    used = _run(plan, lens=[300, 50], steps=40, check_every=1000)
    ptrs = [t.data_ptr() for layer in used.layers for t in layer.storage.own_tensors().values()]
    used.reset()
    assert used.get_seq_length() == 0
    assert [t.data_ptr() for layer in used.layers for t in layer.storage.own_tensors().values()] == ptrs
    g = torch.Generator().manual_seed(7)
    k, mask = left_pad([torch.randn(2, n, D, generator=g) for n in (330, 30)], 330)
    v, _ = left_pad([torch.randn(2, n, D, generator=g) for n in (330, 30)], 330)
    q = torch.randn(2, 4, 330, D, generator=g)
    steps = [torch.randn(2, 4, 1, D, generator=g) for _ in range(3)]
    fresh = loopkv.LoopKVCache(plan, config=tiny_config(loops=1, layers=2, head_dim=D), max_batch_size=2,
                               max_cache_len=used.max_cache_len, device="cpu")
    outs = []
    for cache in (used, fresh):
        prefill(cache, 0, q, k, v, mask, SCALE)
        outs.append([decode(cache, 0, s, s[:, :2], s[:, 2:], SCALE) for s in steps])
    for a, b in zip(*outs, strict=True):
        assert torch.equal(a, b)


def test_values_the_codec_cannot_store_are_refused_not_saturated():
    """K/V beyond fp16's range or non-finite would saturate the INT4 scales (1e5 decodes as 65508; Inf spoils its
    group): a quantized cell refuses them, at prefill before anything is written, and in eager decode at the step's
    count, naming the cell; a bf16 cell stores them exactly."""
    cfg = tiny_config(loops=1, layers=2, head_dim=D)
    plan = loopkv.Plan.from_grid([["int4", "bf16"]])
    g = torch.Generator().manual_seed(9)
    k, mask = left_pad([torch.randn(2, 40, D, generator=g)], 40)
    v, _ = left_pad([torch.randn(2, 40, D, generator=g)], 40)
    q = torch.randn(1, 4, 40, D, generator=g)
    for bad in (1e5, math.inf, math.nan):
        cache = loopkv.LoopKVCache(plan, config=cfg, max_batch_size=1, max_cache_len=100, device="cpu")
        k_bad = k.clone()
        k_bad[0, 1, 7, 3] = bad
        prefill(cache, 1, q, k_bad, v, mask, SCALE)  # the bf16 cell holds it exactly
        assert cache.storage(1).sink_k[0, 1, 7, 3].item() == bad or math.isnan(bad)
        with pytest.raises(ValueError, match=r"cells \[0\] were given K/V values the INT4/INT2 codec cannot store"):
            prefill(cache, 0, q, k_bad, v, mask, SCALE)
        assert cache.storage(0).lengths.tolist() == [0]  # nothing written
    cache = loopkv.LoopKVCache(plan, config=cfg, max_batch_size=1, max_cache_len=100, device="cpu")
    for c in (0, 1):
        prefill(cache, c, q, k, v, mask, SCALE)
    token = torch.randn(1, 2, 1, D, generator=g)
    token_bad = token.clone()
    token_bad[0, 0, 0, 0] = -1e6
    decode(cache, 0, q[:, :, :1], token_bad, token, SCALE)
    with pytest.raises(ValueError, match=r"cells \[0\]"):
        decode(cache, 1, q[:, :, :1], token, token, SCALE)  # the step's last cell counts the step
    cache.reset()
    for c in (0, 1):
        prefill(cache, c, q, k, v, mask, SCALE)
        decode(cache, c, q[:, :, :1], token, token, SCALE)  # after reset the cache works again
    assert cache.get_seq_length() == 41


def test_the_reference_read_follows_the_tokens_held_not_the_table(monkeypatch):
    """A cache sized for 5,000 tokens holding 400: the CPU reference gathers the 3 pages a row holds, not the
    table's 146 slots, so a step's cost follows the tokens held."""
    from loopkv.ops import cell_attention as ca

    gathered = []
    real = ca._decode_pages
    monkeypatch.setattr(ca, "_decode_pages", lambda *a: (gathered.append(a[7].shape), real(*a))[1])
    plan = loopkv.Plan.uniform(loops=1, layers=1, option="int4")
    cache = _run(plan, lens=[400], steps=1, max_len=5000)
    assert cache.storage(0).page_table.shape[1] == (5001 - 288) // 32  # the table: 147 page slots per row
    assert gathered
    assert {s[1] for s in gathered} == {3}  # pages held: (401 - 288) // 32
