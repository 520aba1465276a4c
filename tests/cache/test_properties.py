"""Random sequences of cache operations, checked against independent references (Hypothesis).

Operations: prefill with random left padding, decode steps, multi-token continuations, ``reset`` and a new
request with another batch size, ``reorder_cache`` (valid and invalid beam indices), ``batch_repeat_interleave``
and ``batch_select_indices``, and requests past ``max_batch_size`` / ``max_cache_len``. Two properties:

* an all-bf16 plan on a tiny random Ouro equals transformers' dense ``DynamicCache`` driven with the same
  operations: logits after every operation that produces them, and the positions held (``get_seq_length``);
* an INT4 plan (tau 14), its cells driven directly with random q/k/v: every output equals a float64 read computed
  from the test's own record of each row's exact tokens (pages encoded by the codec), the stored state equals that
  record (exact parts bit for bit, pages as the codec encodes them), and each decode step's outputs equal the float64
  read of the stored state (``attention64``).

In both, every operation either is accepted and matches, or is refused with a ValueError / NotImplementedError /
RuntimeError whose message names the problem, and then leaves every tensor of the cache and its length unchanged.
Which requests are refused is decided by the test from its own record (capacity, batch), not by asking the cache.
"""

from __future__ import annotations

import math
import re

import pytest
import torch
from hypothesis import HealthCheck, currently_in_test_context, given, settings
from hypothesis import event as _hypothesis_event
from hypothesis import strategies as st

import loopkv
from loopkv.cache.attention import loopkv_attention
from loopkv.format import PAGE, SINK, n_pages, stored_pages
from loopkv.models.ouro import OuroConfig, OuroForCausalLM
from loopkv.models.ouro_config import dense_cache
from loopkv.ops import codec
from tests.cache.driver import attention64, cold_tokens, decode, effective_kv, left_pad, prefill, tiny_config
from tests.tolerances import ATTN_FP32_ATOL, ATTN_FP32_RTOL, LOGITS_FP32_ATOL, LOGITS_FP32_RTOL

LOOPS, LAYERS, MAX_BATCH = 2, 2, 3
HQ, H, D = 4, 2, 32
SCALE = D**-0.5
TAU = 14.0
VOCAB = 97
CELLS = LOOPS * LAYERS

# Prompt lengths: short ones (sink only), ones around the first window exits (page 0 is quantized at 319 tokens, read
# as history from 320; page 1 at 351 / 352) so that prefill writes pages and decode quantizes them, and the boundaries.
PROMPT = st.one_of(st.integers(1, 40), st.integers(300, 352), st.sampled_from([32, 33, 318, 319, 320, 350, 351]))
MAX_LEN = st.integers(300, 400)  # small enough that capacity refusals occur
# the queries' scale in the INT4 property: at 6 the scores spread enough that tau = 14 marks history tokens cold
SPREAD = st.sampled_from([1.0, 6.0])
# (operation, weight) for a cache holding a batch
OPS = ["decode"] * 4 + ["continue"] * 2 + ["reorder"] * 2 + ["bad_reorder", "repeat", "select", "reset"]
ALLOWED = (ValueError, NotImplementedError, RuntimeError)


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Thousands of tiny ops: one intra-op thread. On a busy 2-core machine, two threads waiting on each other made
    a decode step of the tiny model 100-200x slower (0.8 s instead of 4 ms)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def event(name: str) -> None:
    """Statistics (``--hypothesis-show-statistics``); a no-op in the scripted examples."""
    if currently_in_test_context():
        _hypothesis_event(name)


class _Script:
    """Stands in for ``st.data()`` with fixed values, drawn in order: an explicit operation sequence."""

    def __init__(self, *values):
        self.values = list(values)

    def draw(self, strategy):
        return self.values.pop(0)


# ---- refusals leave the cache as it was -------------------------------------------------------------------
def _snapshot(cache) -> tuple[list[dict[str, torch.Tensor]], int]:
    return ([{n: t.clone() for n, t in layer.storage.own_tensors().items()} for layer in cache.layers],
            cache.get_seq_length())


def _assert_unchanged(cache, snap) -> None:
    tensors, length = snap
    for idx, (layer, before) in enumerate(zip(cache.layers, tensors, strict=True)):
        for name, t in layer.storage.own_tensors().items():
            assert torch.equal(t, before[name]), f"a refused operation changed cell {idx}'s {name}"
    assert cache.get_seq_length() == length


def _attempt(cache, refuse: str | None, fn):
    """Run ``fn``. ``refuse``: None if it must be accepted, else a regex its error message must match (then the
    cache must be unchanged). Returns fn's result, or None when refused."""
    if refuse is None:
        return fn()
    snap = _snapshot(cache)
    with pytest.raises(ALLOWED) as info:
        fn()
    event(f"refused: {type(info.value).__name__}: {refuse}")
    assert re.search(refuse, str(info.value)), f"unclear refusal: {info.value!r}"
    _assert_unchanged(cache, snap)
    return None


def _bad_beam_idx(draw, batch: int) -> tuple[torch.Tensor, str]:
    """A beam index that does not select rows of the current batch, and what the refusal must name."""
    kind = draw(st.sampled_from(["outside", "negative", "too_long", "float", "2d"]))
    good = draw(st.lists(st.integers(0, batch - 1), min_size=1, max_size=MAX_BATCH))
    if kind == "outside":  # a row this batch does not have (empty, or never part of it)
        pos = draw(st.integers(0, len(good) - 1))
        good[pos] = draw(st.integers(batch, MAX_BATCH + 2))
        return torch.tensor(good), "beam_idx"
    if kind == "negative":
        good[draw(st.integers(0, len(good) - 1))] = -1
        return torch.tensor(good), "beam_idx"
    if kind == "too_long":
        return torch.zeros(MAX_BATCH + 1, dtype=torch.long), "max_batch_size"
    if kind == "float":
        return torch.tensor(good, dtype=torch.float32), "beam_idx"
    return torch.tensor([good]), "beam_idx"


def _event_pages(held: list[int], new: int) -> None:
    """Statistics (``--hypothesis-show-statistics``): pages quantized by decode or continuation, pages read."""
    if any(stored_pages(n + new) > stored_pages(n) for n in held):
        event("a page left the window during decode/continuation")
    event(f"history pages read: {max(n_pages(n + new) for n in held)}")


def _refuse_other_batch_ops(cache, draw, op: str, batch: int) -> None:
    """``batch_repeat_interleave`` / ``batch_select_indices``: not supported, refused with the alternative."""
    if op == "repeat":
        repeats = draw(st.integers(1, 3))
        _attempt(cache, "batch", lambda: cache.batch_repeat_interleave(repeats))
    else:
        idx = torch.tensor(draw(st.lists(st.integers(0, batch - 1), min_size=1, max_size=batch)))
        _attempt(cache, "batch", lambda: cache.batch_select_indices(idx))


# ---- bf16 plan vs transformers' DynamicCache, through the model -------------------------------------------
@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    cfg = OuroConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=LAYERS,
                     num_attention_heads=HQ, num_key_value_heads=H, head_dim=D, total_ut_steps=LOOPS,
                     max_position_embeddings=4096, rope_theta=10000.0)
    return OuroForCausalLM(cfg).eval()


class _Dense:
    """The reference: the model on a fresh ``DynamicCache`` per request, and each row's tokens and mask."""

    def __init__(self, model):
        self.model = model
        self.cache = None
        self.mask = None  # [B, positions held] (0 = left pad)
        self.held = []  # tokens (not pads) per row

    def forward(self, ids, mask):
        with torch.no_grad():
            return self.model(input_ids=ids, attention_mask=mask, past_key_values=self.cache).logits


def _forward_both(model, cache, ref: _Dense, ids, mask, refuse: str | None, compare):
    """The same forward on the LoopKVCache and (if accepted) on the dense cache; logits equal where ``compare``."""
    with torch.no_grad():
        got = _attempt(cache, refuse, lambda: model(input_ids=ids, attention_mask=mask, past_key_values=cache).logits)
    if refuse is not None:
        return False
    want = ref.forward(ids, mask)
    torch.testing.assert_close(got[compare], want[compare], atol=LOGITS_FP32_ATOL, rtol=LOGITS_FP32_RTOL)
    return True


def _bf16_ops(model, data, seed: int, max_len: int, n_ops: int) -> None:
    g = torch.Generator().manual_seed(seed)
    plan = loopkv.Plan.uniform(loops=LOOPS, layers=LAYERS, option="bf16")
    cache = loopkv.LoopKVCache(plan, config=model.config, max_batch_size=MAX_BATCH, max_cache_len=max_len,
                               dtype=torch.float32, device="cpu")
    ref = _Dense(model)
    draw = data.draw
    for _ in range(n_ops):
        op = "prefill" if ref.cache is None else draw(st.sampled_from(OPS))
        event(f"op: {op}")
        B = len(ref.held)
        if op == "prefill":  # a new request on an empty cache: any batch size, random left padding
            B = draw(st.integers(1, MAX_BATCH + 1))
            lens = draw(st.lists(PROMPT, min_size=B, max_size=B))
            S = max(lens)
            ids = torch.randint(3, VOCAB, (B, S), generator=g)
            mask = torch.ones(B, S, dtype=torch.long)
            for b, n in enumerate(lens):
                mask[b, : S - n] = 0
            ids = ids.masked_fill(mask == 0, 0)
            refuse = "max_batch_size" if B > MAX_BATCH else "max_cache_len" if S > max_len else None
            ref.cache = dense_cache(model.config)
            if _forward_both(model, cache, ref, ids, mask, refuse, mask.bool()):
                ref.mask, ref.held = mask, lens
            else:
                ref.cache = None
        elif op in ("decode", "continue"):
            steps, S = (draw(st.integers(1, 16)), 1) if op == "decode" else (1, draw(st.integers(2, 40)))
            for _ in range(steps):
                refuse = "max_cache_len" if max(ref.held) + S > max_len else None
                ids = torch.randint(3, VOCAB, (B, S), generator=g)
                mask = torch.cat([ref.mask, torch.ones(B, S, dtype=torch.long)], dim=1)
                if not _forward_both(model, cache, ref, ids, mask, refuse, slice(None)):
                    break
                _event_pages(ref.held, S)
                ref.mask, ref.held = mask, [n + S for n in ref.held]
        elif op == "reorder":  # beam search: any rows of the batch, the batch may shrink or grow
            idx = torch.tensor(draw(st.lists(st.integers(0, B - 1), min_size=1, max_size=MAX_BATCH)))
            cache.reorder_cache(idx)
            ref.cache.reorder_cache(idx)
            ref.mask, ref.held = ref.mask[idx], [ref.held[i] for i in idx.tolist()]
        elif op == "bad_reorder":
            idx, words = _bad_beam_idx(draw, B)
            _attempt(cache, words, lambda idx=idx: cache.reorder_cache(idx))
        elif op in ("repeat", "select"):
            _refuse_other_batch_ops(cache, draw, op, B)
        elif op == "reset":
            cache.reset()
            ref.cache, ref.mask, ref.held = None, None, []
        assert cache.get_seq_length() == (ref.cache.get_seq_length() if ref.cache is not None else 0)


_BF16_GIVEN = given(data=st.data(), seed=st.integers(0, 2**16), max_len=MAX_LEN, n_ops=st.integers(3, 12))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@_BF16_GIVEN
def test_bf16_plan_follows_the_dense_cache(model, data, seed, max_len, n_ops):
    _bf16_ops(model, data, seed, max_len, n_ops)


@pytest.mark.slow
@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@_BF16_GIVEN
def test_bf16_plan_follows_the_dense_cache_many(model, data, seed, max_len, n_ops):
    _bf16_ops(model, data, seed, max_len, n_ops)


def test_bf16_plan_follows_the_dense_cache_on_window_boundaries(model):
    """One fixed sequence, run every time: prompts of 319 and 351 tokens (prefill writes the page that the next token
    reads, decision D1), a beam reorder of rows with pages that drops a row, a refused index of the dropped row, a
    continuation past page 2's exit, a smaller batch after reset, and a continuation refused at max_cache_len."""
    script = _Script(3, [319, 351, 20], "decode", 2, "reorder", [1, 0], "decode", 1, "bad_reorder", "outside", [0, 1],
                     0, 2, "continue", 40, "reset", 1, [350], "decode", 3, "continue", 48)
    _bf16_ops(model, script, seed=0, max_len=400, n_ops=10)
    assert not script.values


def test_bf16_plan_after_reset_a_smaller_batch_holds_only_its_own_positions(model):
    """``reset`` forgets every row's left pads: after a request whose third row was padded by 295 positions, a
    one-row request of 20 tokens holds 20 positions, as the dense cache does (pads kept from the old request would
    make ``get_seq_length`` 295, and transformers would then feed the new request's tokens from the wrong place)."""
    script = _Script(3, [300, 300, 5], "reset", 1, [20], "decode", 2)
    _bf16_ops(model, script, seed=0, max_len=400, n_ops=4)
    assert not script.values


# ---- INT4 plan, cells driven directly, vs float64 reads ---------------------------------------------------
def _expected_kv(k: torch.Tensor, v: torch.Tensor):
    """One row of one cell from its exact tokens k, v [H, n, D]: float64 (K, V, V of a cold token, is_history [n]),
    the history pages as the codec encodes them."""
    n = k.shape[1]
    npg = n_pages(n)
    K, V = k.double(), v.double()
    Vc = V.clone()
    hist = torch.zeros(n, dtype=torch.bool)
    if npg:
        pos = slice(SINK, SINK + PAGE * npg)
        hist[pos] = True
        pk = k[:, pos].unflatten(1, (npg, PAGE)).transpose(0, 1)  # [npg, H, PAGE, D]
        pv = v[:, pos].unflatten(1, (npg, PAGE)).transpose(0, 1)
        c = codec.encode_pages(pk, pv, 4)
        kh = codec.unpack(c.k_codes, 4).double() * c.k_scale.double()[:, :, None] + c.k_zero.double()[:, :, None]
        vs = c.v_scale.double().repeat_interleave(codec.GROUP, -1)
        vz = c.v_zero.double().repeat_interleave(codec.GROUP, -1)
        hi, lo = codec.unpack(c.v_hi, 2).double(), codec.unpack(c.v_lo, 2).double()

        def flat(t):  # [npg, H, PAGE, D] -> [H, npg * PAGE, D]
            return t.permute(1, 0, 2, 3).reshape(H, npg * PAGE, D)

        K, V = K.clone(), V.clone()
        K[:, pos], V[:, pos], Vc[:, pos] = flat(kh), flat((4 * hi + lo) * vs + vz), flat((4 * hi + 1.5) * vs + vz)
    return K, V, Vc, hist


def _expected_read(k: torch.Tensor, v: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """float64 read of one row holding exact tokens k, v [H, n, D] (V precision at TAU): q [HQ, D] -> [HQ, D]."""
    K, V, Vc, hist = _expected_kv(k, v)
    s = torch.einsum("hgd,hnd->hgn", q.double().view(H, HQ // H, D), K) * SCALE
    cold = cold_tokens(s, hist, TAU)
    if cold.any():
        event("cold history tokens read")
    V = torch.where(cold[..., None], Vc, V)
    return torch.einsum("hgn,hnd->hgd", torch.softmax(s, dim=-1), V).reshape(HQ, D)


def _exact_prompt_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal float64 attention of one row's prompt: q [HQ, n, D], k, v [H, n, D] -> [n, HQ, D]."""
    n = k.shape[1]
    kk, vv = (t.double().repeat_interleave(HQ // H, dim=0) for t in (k, v))
    s = torch.einsum("hid,hjd->hij", q.double(), kk) * SCALE
    s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), -math.inf)
    return torch.einsum("hij,hjd->ihd", torch.softmax(s, dim=-1), vv)


def _check_stored(cache, tokens) -> None:
    """Every cell's stored rows equal the record: exact parts bit for bit, pages as the codec encodes them."""
    for c in range(CELLS):
        lengths = cache.storage(c).lengths
        # rows past the batch hold nothing (a reorder to fewer rows empties them), so no later index can pick them up
        assert lengths[len(tokens[c]):].eq(0).all(), "rows outside the batch still hold tokens"
        for b, (k, v) in enumerate(tokens[c]):
            assert int(lengths[b]) == k.shape[1]
            K, V, Vc, _, hist = effective_kv(cache, c, b)
            K_, V_, Vc_, hist_ = _expected_kv(k, v)
            assert torch.equal(hist, hist_)
            assert torch.equal(K, K_), f"cell {c} row {b}: stored K differs from the row's tokens"
            assert torch.equal(V, V_), f"cell {c} row {b}: stored V differs from the row's tokens"
            assert torch.equal(Vc, Vc_)


def _randn(g, *shape, spread=1.0):
    return torch.randn(*shape, generator=g) * spread


def _int4_prefill(cache, tokens, draw, g, max_len, spread):
    B = draw(st.integers(1, MAX_BATCH + 1))
    lens = draw(st.lists(PROMPT, min_size=B, max_size=B))
    S = max(lens)
    refuse = "max_batch_size" if B > MAX_BATCH else "max_cache_len" if S > max_len else None
    new = []
    for c in range(CELLS):
        ks, vs = [_randn(g, H, n, D) for n in lens], [_randn(g, H, n, D) for n in lens]
        k, mask = left_pad(ks, S)
        v, _ = left_pad(vs, S)
        q = _randn(g, B, HQ, S, D, spread=spread)
        out = _attempt(cache, refuse, lambda c=c, q=q, k=k, v=v, mask=mask: prefill(cache, c, q, k, v, mask, SCALE))
        if refuse is not None:
            return False  # refused at the first cell, before anything was written
        for b, n in enumerate(lens):
            want = _exact_prompt_attention(q[b, :, S - n:], ks[b], vs[b])
            torch.testing.assert_close(out[b, S - n:].double(), want, atol=ATTN_FP32_ATOL, rtol=ATTN_FP32_RTOL)
        new.append(list(zip(ks, vs, strict=True)))
    tokens[:] = new
    return True


def _int4_step(cache, tokens, S, g, max_len, spread):
    """S tokens per row on every cell (S = 1: a decode step; S > 1: a continuation, token by token)."""
    B = len(tokens[0])
    held = [k.shape[1] for k, _ in tokens[0]]
    refuse = "max_cache_len" if max(held) + S > max_len else None
    queries = []
    for c in range(CELLS):
        q, k, v = _randn(g, B, HQ, S, D, spread=spread), _randn(g, B, H, S, D), _randn(g, B, H, S, D)

        def run(c=c, q=q, k=k, v=v):  # -> [B, S, HQ, D]
            if S == 1:
                return decode(cache, c, q, k, v, SCALE)[:, None]
            hk, hv = cache.update(k, v, c)
            return loopkv_attention(None, q, hk, hv, None, scaling=SCALE)[0]

        # the capacity check is the first cell's; the others run as in a model's step (a snapshot would look at the
        # cache from the host, which counts the cells read so far: the path of cells driven one at a time)
        out = _attempt(cache, refuse, run) if c == 0 else run()
        if out is None:
            return False
        for b in range(B):
            k0, v0 = tokens[c][b]
            for i in range(S):
                want = _expected_read(torch.cat([k0, k[b, :, : i + 1]], 1), torch.cat([v0, v[b, :, : i + 1]], 1),
                                      q[b, :, i])
                torch.testing.assert_close(out[b, i].double(), want, atol=ATTN_FP32_ATOL, rtol=ATTN_FP32_RTOL)
            tokens[c][b] = (torch.cat([k0, k[b]], 1), torch.cat([v0, v[b]], 1))
        queries.append((out, q))
    _event_pages(held, S)
    if S == 1:  # the step is complete: each cell's output is the float64 read of what it now stores
        for c, (out, q) in enumerate(queries):
            ref, _ = attention64(cache, c, q[:, :, 0], SCALE, TAU)
            torch.testing.assert_close(out[:, 0].double(), ref, atol=ATTN_FP32_ATOL, rtol=ATTN_FP32_RTOL)
    return True


def _int4_ops(data, seed: int, max_len: int, n_ops: int) -> None:
    g = torch.Generator().manual_seed(seed)
    plan = loopkv.Plan.uniform(loops=LOOPS, layers=LAYERS, option="int4", tau=TAU)
    cache = loopkv.LoopKVCache(plan, config=tiny_config(loops=LOOPS, layers=LAYERS, heads=HQ, kv_heads=H, head_dim=D),
                               max_batch_size=MAX_BATCH, max_cache_len=max_len, device="cpu")
    tokens: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in range(CELLS)]  # per cell, per row: k, v
    draw = data.draw
    for _ in range(n_ops):
        op = "prefill" if not tokens[0] else draw(st.sampled_from(OPS))
        event(f"op: {op}")
        B = len(tokens[0])
        if op == "prefill":
            _int4_prefill(cache, tokens, draw, g, max_len, draw(SPREAD))
        elif op == "decode":
            for _ in range(draw(st.integers(1, 16))):
                if not _int4_step(cache, tokens, 1, g, max_len, draw(SPREAD)):
                    break
        elif op == "continue":
            _int4_step(cache, tokens, draw(st.integers(2, 24)), g, max_len, draw(SPREAD))
        elif op == "reorder":
            idx = draw(st.lists(st.integers(0, B - 1), min_size=1, max_size=MAX_BATCH))
            cache.reorder_cache(torch.tensor(idx))
            tokens[:] = [[rows[i] for i in idx] for rows in tokens]
        elif op == "bad_reorder":
            idx, words = _bad_beam_idx(draw, B)
            _attempt(cache, words, lambda idx=idx: cache.reorder_cache(idx))
        elif op in ("repeat", "select"):
            _refuse_other_batch_ops(cache, draw, op, B)
        elif op == "reset":
            cache.reset()
            tokens[:] = [[] for _ in range(CELLS)]
        _check_stored(cache, tokens)


_INT4_GIVEN = given(data=st.data(), seed=st.integers(0, 2**16), max_len=MAX_LEN, n_ops=st.integers(3, 12))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@_INT4_GIVEN
def test_int4_cells_match_float64_reads(data, seed, max_len, n_ops):
    _int4_ops(data, seed, max_len, n_ops)


@pytest.mark.slow
@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@_INT4_GIVEN
def test_int4_cells_match_float64_reads_many(data, seed, max_len, n_ops):
    _int4_ops(data, seed, max_len, n_ops)


def test_int4_cells_match_float64_reads_on_window_boundaries():
    """The bf16 property's fixed sequence for the INT4 cells (query spreads drawn where the queries are)."""
    script = _Script(6.0, 3, [319, 351, 20], "decode", 2, 6.0, 1.0, "reorder", [1, 0], "decode", 1, 6.0,
                     "bad_reorder", "outside", [0, 1], 0, 2, "continue", 40, 6.0, "reset", 1.0, 1, [350],
                     "decode", 3, 6.0, 6.0, 6.0, "continue", 48, 1.0)
    _int4_ops(script, seed=0, max_len=400, n_ops=10)
    assert not script.values
