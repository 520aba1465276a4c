"""A later turn (several tokens on a non-empty cache) in one pass equals decoding it token by token.

The reference is the decode path itself (one token per step through ``token_attention_`` and ``advance_``): the
served semantics. The one-pass continuation must give every token the same attention (fp32, different summation
order) and leave the cell bit for bit in the same state (sink, ring, lengths, page codes).
"""

import math

import pytest
import torch

import loopkv
from loopkv.cache.attention import loopkv_attention
from loopkv.cache.continuation import share_limit
from loopkv.format import WINDOW
from tests.cache.driver import decode, left_pad, prefill, tiny_config, tiny_ouro
from tests.tolerances import ATTN_FP32_ATOL, ATTN_FP32_RTOL, LOGITS_FP32_ATOL, LOGITS_FP32_RTOL

H, HQ, D = 2, 4, 32
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
STATE = ("sink_k", "sink_v", "win_k", "win_v", "lengths", "k_pages", "k_scale", "k_zero", "v_hi", "v_lo", "v_scale",
         "v_zero")


def _two_caches(plan, lengths, max_len=1200, seed=0, device="cpu", head_dim=D):
    g = torch.Generator().manual_seed(seed)
    cfg = tiny_config(loops=plan.loops, layers=plan.layers, head_dim=head_dim)
    caches = [loopkv.LoopKVCache(plan, config=cfg, max_batch_size=len(lengths), max_cache_len=max_len, device=device)
              for _ in range(2)]
    longest = max(lengths)
    k, mask = left_pad([torch.randn(H, n, head_dim, generator=g) for n in lengths], longest)
    v, _ = left_pad([torch.randn(H, n, head_dim, generator=g) for n in lengths], longest)
    q = torch.randn(len(lengths), HQ, longest, head_dim, generator=g)
    k, v, q, mask = k.to(device), v.to(device), q.to(device), mask.to(device)
    for cache in caches:
        for cell in range(plan.loops * plan.layers):
            prefill(cache, cell, q, k, v, mask, 0.3)
    return caches


def _turn(batch, new, seed=1, device="cpu", head_dim=D):
    g = torch.Generator().manual_seed(seed)
    return tuple(t.to(device) for t in (torch.randn(batch, HQ, new, head_dim, generator=g) * 3,
                                        torch.randn(batch, H, new, head_dim, generator=g),
                                        torch.randn(batch, H, new, head_dim, generator=g)))


@pytest.mark.parametrize(("option", "tau", "lengths", "new"), [
    ("int4", 14.0, [300, 340, 20], 70),  # rows before, across and well inside the first pages; a short row
    ("int4", math.inf, [300, 340, 20], 70),
    ("int4", 2.0, [300, 340, 20], 70),  # many cold tokens
    ("int2", math.inf, [300, 340, 20], 70),
    ("bf16", math.inf, [300, 340, 20], 70),
    ("int4", 14.0, [5, 319, 700], 400),  # longer than the ring: the turn's own early tokens become history
])
@pytest.mark.parametrize(("device", "head_dim"), [
    ("cpu", D), pytest.param("cuda", 128, marks=[pytest.mark.gpu, CUDA]),  # CUDA: decode through the Triton kernels
])
def test_one_pass_equals_decoding_token_by_token(option, tau, lengths, new, device, head_dim):
    plan = loopkv.Plan.uniform(loops=1, layers=1, option=option, tau=tau)
    one_pass, stepped = _two_caches(plan, lengths, device=device, head_dim=head_dim)
    q, k, v = _turn(len(lengths), new, device=device, head_dim=head_dim)
    hk, hv = one_pass.update(k, v, 0)
    out, _ = loopkv_attention(None, q, hk, hv, None, scaling=0.3)
    ref = torch.stack([decode(stepped, 0, q[:, :, i:i + 1], k[:, :, i:i + 1], v[:, :, i:i + 1], 0.3)
                       for i in range(new)], dim=1)
    if device == "cpu":
        torch.testing.assert_close(out, ref, atol=ATTN_FP32_ATOL, rtol=ATTN_FP32_RTOL)
    else:  # a token whose score sits on the cold threshold can flip between the Triton reader and the dense pass,
        # which round scores differently (3 of 614,400 outputs by up to 2.9e-5 at the H200): a bound on how many
        far = ~torch.isclose(out, ref, atol=ATTN_FP32_ATOL, rtol=ATTN_FP32_RTOL)
        assert far.float().mean() < 1e-4
        torch.testing.assert_close(out, ref, atol=1e-3, rtol=1e-2)
    a, b = one_pass.storage(0), stepped.storage(0)
    for name in STATE:
        assert torch.equal(getattr(a, name), getattr(b, name)), name


def test_a_share_cell_continues_within_its_limit_and_refuses_beyond_it():
    """A share cell reads pages its source (the final loop) encodes; pages of its source's ring are encoded for it,
    pages of the new tokens cannot be, so a turn longer than share_limit is refused before anything is written."""
    plan = loopkv.Plan.from_loops(loops=2, layers=1, per_loop=["share", "int4"])
    one_pass, stepped = _two_caches(plan, [400, 333])
    limit = min(share_limit(400, 400), share_limit(333, 333))
    assert WINDOW <= limit < WINDOW + 32
    q, k, v = _turn(2, limit + 1)
    before = {n: getattr(one_pass.storage(0), n).clone() for n in STATE}
    hk, hv = one_pass.update(k, v, 0)
    with pytest.raises(ValueError, match="share"):
        loopkv_attention(None, q, hk, hv, None, scaling=0.3)
    for name, t in before.items():
        assert torch.equal(getattr(one_pass.storage(0), name), t), name
    one_pass.reset()
    one_pass, stepped = _two_caches(plan, [400, 333])
    q, k, v = q[:, :, :limit], k[:, :, :limit], v[:, :, :limit]
    outs = []
    for cell in (0, 1):  # the share cell first, then its source, as the model runs them
        hk, hv = one_pass.update(k, v, cell)
        outs.append(loopkv_attention(None, q, hk, hv, None, scaling=0.3)[0])
    refs = [[], []]
    for i in range(limit):  # decode steps: every cell, in order, per token
        for cell in (0, 1):
            refs[cell].append(decode(stepped, cell, q[:, :, i:i + 1], k[:, :, i:i + 1], v[:, :, i:i + 1], 0.3))
    for cell in (0, 1):
        torch.testing.assert_close(outs[cell], torch.stack(refs[cell], 1), atol=ATTN_FP32_ATOL, rtol=ATTN_FP32_RTOL)


@pytest.fixture(scope="module")
def model():
    return tiny_ouro()


@pytest.mark.parametrize("per_loop", [["int4", "int4"], ["share", "int2"]])
def test_a_later_turn_through_the_model_equals_feeding_it_token_by_token(model, per_loop):
    """Ouro with a 300-token second turn: one forward (split by the model into pieces the share cells can take)
    gives the logits that 300 one-token forwards give, and leaves the cache holding the same tokens."""
    plan = loopkv.Plan.from_loops(loops=2, layers=2, per_loop=per_loop, tau=14.0)
    ids = torch.randint(3, 97, (2, 640), generator=torch.Generator().manual_seed(7))
    caches = [loopkv.LoopKVCache(plan, config=model.config, max_batch_size=2, max_cache_len=700,
                                 dtype=torch.float32, device="cpu") for _ in range(2)]
    with torch.no_grad():
        for cache in caches:
            model(input_ids=ids[:, :340], past_key_values=cache)
        logits = model(input_ids=ids[:, 340:], past_key_values=caches[0]).logits
        ref = torch.cat([model(input_ids=ids[:, i:i + 1], past_key_values=caches[1]).logits
                         for i in range(340, 640)], dim=1)
    torch.testing.assert_close(logits, ref, atol=LOGITS_FP32_ATOL, rtol=LOGITS_FP32_RTOL)
    for cell in range(4):  # the model's K/V differ by fp32 rounding between the two ways; the lengths do not
        a, b = caches[0].storage(cell), caches[1].storage(cell)
        assert torch.equal(a.lengths, b.lengths)
        for name in ("sink_k", "sink_v", "win_k", "win_v"):
            torch.testing.assert_close(getattr(a, name), getattr(b, name), atol=LOGITS_FP32_ATOL, rtol=LOGITS_FP32_RTOL)
