"""``append_attention`` (append inside the cell-attention launch) against the two ops in turn.

The fused launch must leave the same storage (sink, ring, lengths, pool) as ``append_`` and return what
``cell_attention`` returns after it: the near program that covers the new token reads it from the input, the
append programs write it and encode the page leaving the window, and the last of the row's programs stores the
length. Under the interpreter the programs run one after another in grid order, append programs last, so every
near program reads the ring *before* the token is written: a missing substitution shows as a wrong output.
"""

import math
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")

from loopkv.ops import layout  # noqa: E402
from loopkv.ops import triton_attention as ta  # noqa: E402
from loopkv.ops import triton_quant as tq  # noqa: E402
from tests.ops.test_triton_attention import interpret, make_cell  # noqa: E402

INF = math.inf
MAXP = 3
CAP = layout.capacity(MAXP)
# sink (0, 5, 31: the token lands in the sink), window only, the first window exit (318 -> 319), the first
# history read (319 -> 320), later exits and a full row (left unchanged)
LENGTHS = [0, 5, 31, 290, 318, 319, 350, 382, CAP - 1, CAP]


def split_step(q, kn, vn, st, bits, own_bits, tau, scale, **kw):
    tq.append(kn, vn, *st, own_bits)
    return ta.cell_attention(q, *st, bits, tau, scale, **kw)


def assert_same_state(a, b):
    names = ("sink_k", "sink_v", "win_k", "win_v", "lengths", "page_table", "k_pages", "k_scale", "k_zero", "v_hi",
             "v_lo", "v_scale", "v_zero")
    for name, x, y in zip(names, a, b, strict=True):
        assert torch.equal(x, y), name


# reader cases of the append tests here and in test_step_ops: INT4 with V precision, INT2 with two query heads per
# KV head, the tensor-core reader, BF16 pages, and head_dim 96 (padded channels in the page encoders)
READER_CASES = (("bits", "tau", "far_impl", "group", "dtype", "head_dim"), [
    (4, 14.0, "cc", 1, torch.bfloat16, 64),
    (2, INF, "cc", 2, torch.float32, 64),
    (4, INF, "dot", 4, torch.float32, 64),
    (16, INF, None, 1, torch.float32, 64),
    (4, INF, "cc", 1, torch.bfloat16, 96),
])


@interpret
@pytest.mark.interpret
@pytest.mark.parametrize(*READER_CASES)
def test_fused_append_equals_append_then_attention(bits, tau, far_impl, group, dtype, head_dim):
    """Three decode steps from every length in ``LENGTHS``: outputs and storage bit for bit equal (the fused
    launch encodes pages in slices, ``_encode_page(SLICED=True)``; the two ops the whole page at once)."""
    heads = 2
    st = make_cell(len(LENGTHS), heads, head_dim, MAXP, bits, LENGTHS, dtype=dtype, seed=3 + bits)
    ref = [t.clone() for t in st]
    g = torch.Generator().manual_seed(bits)
    kw = {"splits": 2} | ({"far_impl": far_impl} if far_impl else {})
    for _ in range(3):
        q = torch.randn(len(LENGTHS), heads * group, head_dim, generator=g).to(dtype)
        kn, vn = (torch.randn(len(LENGTHS), heads, 1, head_dim, generator=g).to(dtype) for _ in range(2))
        want = split_step(q, kn, vn, ref, bits, bits, tau, head_dim**-0.5, **kw)
        got = ta.append_attention(q, kn, vn, *st, bits, bits, tau, head_dim**-0.5, **kw)
        assert torch.equal(got, want)
        assert_same_state(st, ref)
    assert st[4].tolist() == [min(n + 3, CAP) for n in LENGTHS]


@interpret
@pytest.mark.interpret
def test_fused_append_of_a_share_cell_writes_no_pool():
    """A ``share`` cell (own_bits 0) appends to its own sink and ring and reads the final loop's pool, which the
    fused launch must not write (its page 1 would be encoded at length 351)."""
    lengths = [350, 319, 20]
    st = make_cell(len(lengths), 2, 64, MAXP, 4, lengths, dtype=torch.bfloat16, seed=9)
    pool_before = [t.clone() for t in st[6:]]
    ref = [t.clone() for t in st]
    q = torch.randn(3, 2, 64).to(torch.bfloat16)
    kn, vn = torch.randn(3, 2, 1, 64).to(torch.bfloat16), torch.randn(3, 2, 1, 64).to(torch.bfloat16)
    want = split_step(q, kn, vn, ref, 4, 0, 14.0, 0.125, splits=2)
    got = ta.append_attention(q, kn, vn, *st, 4, 0, 14.0, 0.125, splits=2)
    assert torch.equal(got, want)
    assert_same_state(st, ref)
    for before, after in zip(pool_before, st[6:], strict=True):
        assert torch.equal(before, after)


@interpret
@pytest.mark.interpret
def test_tokens_the_fused_launch_cannot_take_run_as_two_ops():
    """Tokens in another dtype than the cache's, or with strided channels, fall back to append_ + cell_attention
    (same result); wrong shapes and an own_bits that is neither 0 nor the read bits are errors."""
    st = make_cell(2, 2, 64, MAXP, 4, [300, 340], dtype=torch.bfloat16, seed=5)
    ref = [t.clone() for t in st]
    q = torch.randn(2, 2, 64).to(torch.bfloat16)
    kn, vn = torch.randn(2, 2, 1, 64), torch.randn(2, 2, 1, 64)  # fp32 tokens, bf16 cache
    want = split_step(q, kn, vn, ref, 4, 4, INF, 0.125)
    assert torch.equal(ta.append_attention(q, kn, vn, *st, 4, 4, INF, 0.125), want)
    assert_same_state(st, ref)
    with pytest.raises(ValueError, match="one token per row"):
        ta.append_attention(q, kn[:, :, :0], vn, *st, 4, 4, INF, 0.125)
    with pytest.raises(ValueError, match="own_bits"):
        ta.append_attention(q, kn, vn, *st, 4, 2, INF, 0.125)


@pytest.mark.gpu
@pytest.mark.parametrize(("bits", "tau"), [(4, 14.0), (4, INF), (2, INF)])
def test_gpu_fused_append_equals_append_then_attention(bits, tau):
    """On the GPU the programs of one launch run concurrently, so this is where a race between the append programs
    and the readers would show: 40 decode steps of an Ouro-sized cell (16 KV heads x 128, bf16, 8 rows whose
    lengths cross window exits at different steps), outputs and storage bit for bit equal to the two ops."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    maxp = 12
    lengths = [0, 20, 300, 318, 319, 340, 500, layout.capacity(maxp) - 5]
    st = make_cell(len(lengths), 16, 128, maxp, bits, lengths, dtype=torch.bfloat16, device="cuda", seed=11)
    ref = [t.clone() for t in st]
    g = torch.Generator(device="cuda").manual_seed(bits)
    for _ in range(40):
        q = torch.randn(len(lengths), 16, 128, generator=g, device="cuda").to(torch.bfloat16)
        kn, vn = (torch.randn(len(lengths), 16, 1, 128, generator=g, device="cuda").to(torch.bfloat16)
                  for _ in range(2))
        want = split_step(q, kn, vn, ref, bits, bits, tau, 128**-0.5)
        got = ta.append_attention(q, kn, vn, *st, bits, bits, tau, 128**-0.5)
        assert torch.equal(got, want)
        assert_same_state(st, ref)
