"""A later turn (several tokens on a non-empty cache) in one pass equals decoding it token by token.

The reference is the decode path itself (one token per step through ``token_attention_`` and ``advance_``): the
served semantics. The one-pass continuation reads a row's chunk with ``chunk_attention``, whose reference (its CPU
kernel) reads each token as a virtual row of the decode read (``cell_attention``), so on the CPU, where both run the
ops' references, every token's attention equals the decode's bit for bit, and the cell ends bit for bit in the
same state (sink, ring, lengths, page codes). Every virtual row the continuation reads is checked against the decode
op's argument contract (``check_cell_args``), and one small case runs the Triton kernels under the interpreter
(tests/ops/test_chunk_attention.py tests the chunk kernel itself).
"""

import gc
import math
import os

import pytest
import torch

import loopkv
from loopkv.cache.attention import loopkv_attention
from loopkv.cache.continuation import share_limit
from loopkv.format import WINDOW, exact_slots
from loopkv.ops import chunk_attention
from loopkv.ops.cell_attention import cell_attention_reference, check_cell_args
from tests.cache.driver import decode, left_pad, prefill, tiny_config, tiny_ouro
from tests.cache.test_short_cache import triton_on_cpu  # noqa: F401  (the Triton launchers as the CPU kernels)
from tests.tolerances import ATTN_FP32_ATOL, ATTN_FP32_RTOL, LOGITS_FP32_ATOL, LOGITS_FP32_RTOL

H, HQ, D = 2, 4, 32
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
STATE = ("sink_k", "sink_v", "win_k", "win_v", "lengths", "k_pages", "k_scale", "k_zero", "v_hi", "v_lo", "v_scale",
         "v_zero")


@pytest.fixture
def reads():
    """Every ``cell_attention`` call on the CPU while the test runs, checked against the op's argument contract
    (``check_cell_args``: an eager call runs only the reference, which checks nothing) and recorded (its lengths),
    then read by the reference. The continuation's reads are its only ``cell_attention`` calls (decode writes and
    reads with ``token_attention_``)."""
    calls = []

    def checked(q, sink_k, sink_v, win_k, win_v, lengths, page_table, *rest):
        check_cell_args(q, sink_k, sink_v, win_k, win_v, lengths, page_table, rest[:7], rest[7])
        calls.append(lengths.tolist())
        return cell_attention_reference(q, sink_k, sink_v, win_k, win_v, lengths, page_table, *rest)

    lib = torch.library.Library("loopkv", "FRAGMENT")  # the registration lives as long as it does
    torch.library.impl("loopkv::cell_attention", "cpu", checked, lib=lib)
    yield calls
    del lib
    gc.collect()


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


def _one_pass_and_stepped(plan, lengths, new, *, max_len=1200, device="cpu", head_dim=D):
    """The turn's attention through the continuation and through decoding token by token, and the two caches."""
    one_pass, stepped = _two_caches(plan, lengths, max_len=max_len, device=device, head_dim=head_dim)
    q, k, v = _turn(len(lengths), new, device=device, head_dim=head_dim)
    hk, hv = one_pass.update(k, v, 0)
    out, _ = loopkv_attention(None, q, hk, hv, None, scaling=0.3)
    ref = torch.stack([decode(stepped, 0, q[:, :, i:i + 1], k[:, :, i:i + 1], v[:, :, i:i + 1], 0.3)
                       for i in range(new)], dim=1)
    return out, ref, one_pass, stepped


def _assert_same_state(a, b):
    for name in STATE:
        assert torch.equal(getattr(a, name), getattr(b, name)), name


@pytest.mark.parametrize(("option", "tau", "lengths", "new", "max_len"), [
    # rows before, across (h < 320 <= h + S: pages written and first read within the turn) and well inside the first
    # pages; a row whose sink is not yet full
    ("int4", 14.0, [300, 340, 20], 70, 1200),
    ("int4", math.inf, [300, 340, 20], 70, 1200),
    ("int4", 2.0, [300, 340, 20], 70, 1200),  # many cold tokens
    ("int2", math.inf, [300, 340, 20], 70, 1200),
    ("bf16", math.inf, [300, 340, 20], 70, 1200),
    ("int4", 14.0, [5, 319, 700], 400, 1200),  # longer than the ring: the turn's own early tokens become history
    ("int4", 14.0, [20, 150], 100, 250),  # a short cache: no pages, a ring of 218 slots
    ("int2", math.inf, [3, 10], 12, 25),  # a short cache with 25 sink slots and no ring
])
@pytest.mark.parametrize(("device", "head_dim"), [
    ("cpu", D), pytest.param("cuda", 128, marks=[pytest.mark.gpu, CUDA]),  # CUDA: decode through the Triton kernels
])
def test_one_pass_equals_decoding_token_by_token(option, tau, lengths, new, max_len, device, head_dim, reads):
    plan = loopkv.Plan.uniform(loops=1, layers=1, option=option, tau=tau)
    out, ref, one_pass, stepped = _one_pass_and_stepped(plan, lengths, new, max_len=max_len, device=device,
                                                        head_dim=head_dim)
    st = one_pass.storage(0)
    assert tuple(st.sink_k.shape[2:3] + st.win_k.shape[2:3]) == exact_slots(max_len)
    if device == "cpu":  # each token is read by cell_attention's reference over what its decode read: the same
        # values in the same slots (the ring's unread slots are masked), in a batch of virtual rows instead of the
        # cache's rows, which the reference's per-row arithmetic does not see
        assert torch.equal(out, ref)
        assert reads == [list(range(h + 1, h + new + 1)) for h in lengths]  # one call per row: a block of new tokens
    else:  # the chunk kernel reads the turn, the decode kernel each step: other products and sums, so other
        # roundings, and a token whose score sits on the cold threshold can then flip: a bound on how many
        far = ~torch.isclose(out, ref, atol=ATTN_FP32_ATOL, rtol=ATTN_FP32_RTOL)
        assert far.float().mean() < 1e-4
        torch.testing.assert_close(out, ref, atol=1e-3, rtol=1e-2)
    _assert_same_state(st, stepped.storage(0))


def test_blocks_of_virtual_rows_read_as_one(monkeypatch, reads):
    """With a bound on the virtual rows' copies that holds 16 queries, a 70-token turn is read in blocks of 16, 16,
    16, 16 and 6 per row, each query still equal to its decode read."""
    plan = loopkv.Plan.uniform(loops=1, layers=1, option="int4", tau=14.0)
    per_query = 2 * H * (32 + 288) * D * 4  # K and V of a virtual row's sink and ring, fp32
    monkeypatch.setattr(chunk_attention, "_VIRTUAL_ROW_BYTES", 16 * per_query + per_query // 2)
    lengths = [300, 20]
    out, ref, _, _ = _one_pass_and_stepped(plan, lengths, 70)
    assert torch.equal(out, ref)
    assert [len(c) for c in reads] == [16, 16, 16, 16, 6] * 2
    assert sum(reads, []) == [n for h in lengths for n in range(h + 1, h + 71)]


@pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 (set on machines without CUDA)")
@pytest.mark.usefixtures("triton_on_cpu")
def test_triton_kernels_read_the_chunk():
    """The Triton kernels (the ops' CUDA kernels) as the CPU kernels, run by the interpreter: the continuation's read is
    one ``chunk_attention`` launch per row whose arguments the chunk kernel takes (a launcher that fell back to its
    reference would fail), across the quantize boundary with V precision, and the turn reads what decoding it through
    the decode kernels reads (another kernel: other sums, fp32 rounding) and leaves the same state. head_dim 64 (the
    kernels serve 64 to 256), one row, few tokens: the interpreter runs every program in Python."""
    plan = loopkv.Plan.uniform(loops=1, layers=1, option="int4", tau=14.0)
    out, ref, one_pass, stepped = _one_pass_and_stepped(plan, [316], 6, max_len=400, head_dim=64)
    torch.testing.assert_close(out, ref, atol=ATTN_FP32_ATOL, rtol=ATTN_FP32_RTOL)
    _assert_same_state(one_pass.storage(0), stepped.storage(0))


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
    for cell in (0, 1):  # the same reference over the same values, as in test_one_pass_equals_decoding_token_by_token
        assert torch.equal(outs[cell], torch.stack(refs[cell], 1))


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
