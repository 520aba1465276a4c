"""Triton fused cell attention (``cell_attention``, ``token_attention_``) against float64 re-computations of the same
stored state, in every launch the table (``loopkv/ops/triton_config.py``) gives.

Interpreted tests run on CPU under ``TRITON_INTERPRET=1`` (set below before ``loopkv.ops.triton_attention`` is
imported, on machines without CUDA; Triton reads it when the kernels are decorated). GPU tests (``@pytest.mark.gpu``)
run the compiled kernels at real shapes, and the decode step inside a CUDA graph.

Tolerances (tests/tolerances.py): fp32 inputs run every product in fp32 (``ATTN_FP32_*``); 16-bit inputs on the
tensor-core reader round ``q * k_scale`` and ``p * v_scale`` to fp16, far below the bf16 rounding of the output
that ``ATTN_BF16_*`` allows; the CUDA-core reader (16-bit inputs, one or two query heads per KV head) sums K's
products in fp16 pairs: its own tier, ``ATTN_K16_*``.
"""

import dataclasses
import math
import os
import warnings

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")

from loopkv.format import RING, capacity, n_pages  # noqa: E402
from loopkv.ops import codec, triton_config  # noqa: E402
from loopkv.ops import triton_attention as ta  # noqa: E402
from loopkv.ops.cell_attention import cell_attention_reference  # noqa: E402
from loopkv.ops.step_ops import token_attention_reference  # noqa: E402
from loopkv.ops.triton_counters import counters  # noqa: E402
from tests.tolerances import (  # noqa: E402
    ATTN_BF16_ATOL,
    ATTN_BF16_RTOL,
    ATTN_FP32_ATOL,
    ATTN_FP32_RTOL,
    ATTN_K16_ATOL,
    ATTN_K16_REL_L2,
)

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
interpret = pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 (set on machines without CUDA)")
INF = math.inf


def make_cell(batch, heads, head_dim, maxp, bits, lengths, *, dtype=torch.float32, device="cpu",
              pool_pages=None, page_table=None, seed=0):
    """Storage of one cell in the op's argument order (after q): sink_k, sink_v, win_k, win_v, lengths,
    page_table, k_pages, k_scale, k_zero, v_hi, v_lo, v_scale, v_zero. Pages are real codes of random
    K (per-channel offsets and spreads, like real keys) and V; bits 0: no pool (empty placeholders)."""
    g = torch.Generator(device=device).manual_seed(seed)  # on the device: real shapes build in seconds
    n = batch * maxp if pool_pages is None else pool_pages

    def rnd(*shape):
        return torch.randn(*shape, generator=g, device=device)

    exact = [rnd(batch, heads, 32, head_dim), rnd(batch, heads, 32, head_dim),
             rnd(batch, heads, RING, head_dim), rnd(batch, heads, RING, head_dim)]
    exact[0] += rnd(1, heads, 1, head_dim)  # a shared per-channel offset in the sink keys
    if page_table is None:
        page_table = torch.arange(batch * maxp).view(batch, maxp).flip(1).contiguous()
    k = rnd(n, heads, 32, head_dim) * (0.5 + 2 * torch.rand(n, heads, 1, head_dim, generator=g, device=device))
    k += rnd(n, heads, 1, head_dim)
    v = rnd(n, heads, 32, head_dim)
    f16, u8 = {"dtype": torch.float16, "device": device}, {"dtype": torch.uint8, "device": device}
    if bits == 0:
        pool = [torch.empty(0, **u8)] * 7
    elif bits == 16:
        pool = [k.to(dtype), torch.empty(0, **f16), torch.empty(0, **f16), v.to(dtype), torch.empty(0, **u8),
                torch.empty(0, **f16), torch.empty(0, **f16)]
    else:
        pool = list(codec.encode_pages(k.to(dtype), v.to(dtype), bits))
    st = [t.to(dtype) for t in exact] + [torch.tensor(lengths, dtype=torch.int32, device=device),
                                         page_table.int().to(device)] + pool
    return [t.to(device) for t in st]


def upcast(st):
    """The stored state with its exact parts in float64 (codes, scales and fp16 fields as stored)."""
    return [t.double() if t.is_floating_point() and t.dtype != torch.float16 else t.clone() for t in st]


def reference64(q, st, bits, tau, scale):
    """The reference on the same stored state, in float64 (exact parts and q upcast; codes as stored)."""
    return cell_attention_reference(q.double(), *upcast(st), bits, tau, scale)


def reads_k16(q, bits, group):
    """Whether the table gives this call the CUDA-core reader, whose K products are summed in fp16 pairs."""
    launch = triton_config.launch_config(None, bits, group, q.shape[2], q.dtype == torch.float32, 1)
    return launch.reader == "cc"


def assert_close_to_reference(out, q, st, bits, tau, scale, want=None):
    """``out`` within its reader's tolerance of the float64 reference (computed where the inputs are: on the GPU in
    float64 there, which keeps the GPU tests from waiting on the CPU; ``want`` if given)."""
    if want is None:
        want = reference64(q, st, bits, tau, scale)
    assert out.dtype == q.dtype
    assert out.shape == q.shape
    if reads_k16(q, bits, q.shape[1] // st[0].shape[1]):
        assert (out.double() - want).norm() / want.norm() < ATTN_K16_REL_L2
        assert (out.double() - want).abs().max() < ATTN_K16_ATOL
    elif q.dtype == torch.float32:
        torch.testing.assert_close(out.double(), want, atol=ATTN_FP32_ATOL, rtol=ATTN_FP32_RTOL)
    else:
        torch.testing.assert_close(out.double(), want, atol=ATTN_BF16_ATOL, rtol=ATTN_BF16_RTOL)


# lengths: empty, inside the sink, window only, exactly one page, pages + a partial page
LENGTHS = [0, 17, 320, 288 + 32 * 3 + 5]
CASES = [  # bits, tau, query heads per KV head, head_dim, dtype: every entry of triton_config.TABLE
    (4, INF, 1, 128, torch.bfloat16),  # CUDA-core reader, capped
    (4, 14.0, 2, 64, torch.float16),  # CUDA-core reader, two query heads, V precision
    (4, 0.0, 1, 64, torch.bfloat16),  # V precision with cold tokens
    (2, INF, 1, 64, torch.bfloat16),  # INT2: 32-bit offsets
    (2, INF, 2, 96, torch.bfloat16),  # padded head_dim
    (4, 14.0, 3, 96, torch.bfloat16),  # tensor-core reader (subnormal fp16 fields), padded group
    (2, INF, 4, 64, torch.float16),
    (4, 14.0, 1, 128, torch.float32),  # tensor-core reader, fp32 products
    (2, INF, 2, 64, torch.float32),
    (16, INF, 2, 64, torch.float32),  # BF16 pages
    (16, INF, 1, 64, torch.bfloat16),
    (0, INF, 2, 64, torch.bfloat16),  # no history
    (4, 2.0, 8, 256, torch.bfloat16),  # eight query heads at 256: the eight-warp tensor-core row
    (2, INF, 2, 256, torch.float16),  # the two-warp CUDA-core reader at 256
]


@interpret
@pytest.mark.interpret
@pytest.mark.parametrize(("bits", "tau", "group", "head_dim", "dtype"), CASES)
def test_matches_reference(bits, tau, group, head_dim, dtype):
    heads, maxp = 2, 4
    lengths = LENGTHS if bits else [0, 17, 300, 318]
    st = make_cell(len(lengths), heads, head_dim, maxp, bits, lengths, dtype=dtype, seed=bits + head_dim)
    q = torch.randn(len(lengths), heads * group, head_dim).to(dtype)
    scale = head_dim**-0.5
    out = ta.cell_attention(q, *st, bits, tau, scale)
    assert_close_to_reference(out, q, st, bits, tau, scale)
    assert torch.equal(out[0], torch.zeros_like(out[0]))  # length 0 -> zeros


# head_dim (64, 96 padded to 128, 128, 256) x query heads per KV head (1, 2, 4, 8) x page kind (INT4, INT4 with V
# precision, INT2, BF16 pages). The default set runs the cases of a Latin square (every pair of head_dim, group and kind
# once, so every row of triton_config.TABLE) that CASES above does not already cover (head_dim 96 or 256, or eight
# query heads), Huginn's and Dory's cells (INT4 at 96 x 1 and 256 x 4) and fp32 at 256 once; the whole product is slow.
SHAPE_DIMS, SHAPE_GROUPS = (64, 96, 128, 256), (1, 2, 4, 8)
SHAPE_KINDS = ((4, INF), (4, 2.0), (2, INF), (16, INF))  # tau 2: some tokens cold, some hot
MODEL_CELLS = ((4, INF, 1, 96), (4, 2.0, 4, 256))  # Huginn-0125, Dory-4B (bits, tau, group, head_dim)


def shape_cases():
    for k, (bits, tau) in enumerate(SHAPE_KINDS):
        for d, head_dim in enumerate(SHAPE_DIMS):
            for g, group in enumerate(SHAPE_GROUPS):
                fast = (g == (k + d) % len(SHAPE_GROUPS) and (head_dim in (96, 256) or group == 8)
                        or (bits, tau, group, head_dim) in MODEL_CELLS)
                yield pytest.param(bits, tau, group, head_dim, torch.bfloat16, marks=() if fast else pytest.mark.slow)
    for group in SHAPE_GROUPS:  # fp32 inputs: the four-warp (128) and eight-warp (256) tensor-core rows
        for bits, tau in ((4, 2.0), (2, INF)):
            fast = (group, bits) == (1, 4)
            yield pytest.param(bits, tau, group, 256, torch.float32, marks=() if fast else pytest.mark.slow)


SHARED_TABLE_PAGES = 3


def shared_table_cell(bits, group, head_dim, dtype, heads):
    """Three rows read through a share-style page table (pages out of order, two rows on the same physical pages, a
    pool of 7 pages, more than the rows need) at 17 tokens, past the first window exits, and at capacity: the cell,
    a query and the generator that drew it (for the new tokens)."""
    lengths = [17, 288 + 32 * 2 + 5, capacity(SHARED_TABLE_PAGES)]
    table = torch.tensor([[6, 2, 0], [6, 2, 4], [1, 5, 3]])
    st = make_cell(3, heads, head_dim, SHARED_TABLE_PAGES, bits, lengths, dtype=dtype, pool_pages=7,
                   page_table=table, seed=head_dim + group)
    g = torch.Generator().manual_seed(bits + group)
    q = (2 * torch.randn(3, heads * group, head_dim, generator=g)).to(dtype)
    return st, q, g


@interpret
@pytest.mark.interpret
@pytest.mark.parametrize(("bits", "tau", "group", "head_dim", "dtype"), list(shape_cases()))
def test_every_served_shape_reads_and_writes_like_the_reference(bits, tau, group, head_dim, dtype):
    """A cell of every shape the kernels serve, read through a share-style page table (pages out of order, two rows
    on the same physical pages, a pool larger than the rows need): ``cell_attention`` within its tier of the float64
    reference; ``token_attention_`` writes the token bit for bit as the reference does (into the sink, the ring, not
    at capacity) and reads within its tier of the float64 reference of the appended state. One KV head (the
    interpreter's time is per program); ``test_matches_reference`` reads two at 256 x 8."""
    maxp, heads = SHARED_TABLE_PAGES, 1
    st, q, g = shared_table_cell(bits, group, head_dim, dtype, heads)
    kn, vn = (torch.randn(3, heads, 1, head_dim, generator=g).to(dtype) for _ in range(2))
    scale = head_dim**-0.5
    assert triton_config.serves(head_dim, group)
    assert_close_to_reference(ta.cell_attention(q, *st, bits, tau, scale), q, st, bits, tau, scale)
    want_st = [t.clone() for t in st]
    token_attention_reference(q, kn, vn, *want_st, bits, tau, scale)
    got = ta.token_attention(q, kn, vn, *st, bits, tau, scale)
    for i, (a, b) in enumerate(zip(st, want_st, strict=True)):
        assert torch.equal(a, b), i
    appended = [t.clone() for t in want_st]
    appended[4] += (appended[4] < capacity(maxp)).int()
    assert_close_to_reference(got, q, appended, bits, tau, scale)


# The query-head-row tensor-core reader (triton_dot.far_gqa, launch reader "gqa": the table's for Dory's cell from
# B x KV heads = 32, forced here for every case): Dory's cell (4 x 256) in every page kind, and padded head_dim and
# group sizes.
# bits, tau, query heads per KV head, head_dim, dtype; the default set runs the first three
GQA_CASES = [
    (4, 2.0, 4, 256, torch.bfloat16),  # Dory, V precision with cold and hot tokens
    (2, INF, 4, 256, torch.bfloat16),
    (4, INF, 3, 96, torch.float16),  # padded head_dim (a padded 32-channel group) and group
    (4, INF, 4, 256, torch.bfloat16),
    (4, 0.0, 8, 128, torch.bfloat16),  # every token cold
    (2, INF, 5, 224, torch.bfloat16),
    (4, 14.0, 8, 64, torch.float16),
]


@interpret
@pytest.mark.interpret
@pytest.mark.parametrize(("bits", "tau", "group", "head_dim", "dtype"),
                         [pytest.param(*c, marks=() if i < 3 else pytest.mark.slow) for i, c in enumerate(GQA_CASES)])
def test_query_head_row_reader_matches_reference(bits, tau, group, head_dim, dtype, monkeypatch):
    """``far_gqa`` through a share-style page table (pages out of order, two rows on the same pages), with the table's
    split count and with 2 history programs per (row, KV head), on the read and the token path: within the bf16 tier
    of the float64 reference (its products round ``q * k_scale`` and ``p * v_scale`` to fp16, as ``far_dot``'s do);
    the token written bit for bit as the reference writes it."""
    gqa = triton_config.Launch("gqa", 4, 1, 64)
    monkeypatch.setattr(triton_config, "launch_config", lambda *a: gqa)
    maxp, heads = SHARED_TABLE_PAGES, 2
    st, q, g = shared_table_cell(bits, group, head_dim, dtype, heads)
    scale = head_dim**-0.5
    want = reference64(q, st, bits, tau, scale)
    choose = triton_config.choose_splits
    for splits in (None, 2):
        monkeypatch.setattr(triton_config, "choose_splits", choose if splits is None else lambda *a, s=splits: s)
        out = ta.cell_attention(q, *st, bits, tau, scale)
        torch.testing.assert_close(out.double(), want, atol=ATTN_BF16_ATOL, rtol=ATTN_BF16_RTOL)
    kn, vn = (torch.randn(3, heads, 1, head_dim, generator=g).to(dtype) for _ in range(2))
    want_st = [t.clone() for t in st]
    token_attention_reference(q, kn, vn, *want_st, bits, tau, scale)
    got = ta.token_attention(q, kn, vn, *st, bits, tau, scale)
    for i, (a, b) in enumerate(zip(st, want_st, strict=True)):
        assert torch.equal(a, b), i
    want_st[4] += (want_st[4] < capacity(maxp)).int()
    torch.testing.assert_close(got.double(), reference64(q, want_st, bits, tau, scale), atol=ATTN_BF16_ATOL,
                               rtol=ATTN_BF16_RTOL)


TOKEN_CASES = [  # bits, tau, query heads per KV head, dtype
    (4, 14.0, 1, torch.bfloat16), (2, INF, 2, torch.float16), (4, INF, 4, torch.bfloat16),
    (4, 14.0, 1, torch.float32), (16, INF, 1, torch.bfloat16), (0, INF, 2, torch.bfloat16),
]


@interpret
@pytest.mark.interpret
@pytest.mark.parametrize(("bits", "tau", "group", "dtype"), TOKEN_CASES)
def test_token_attention_matches_reference(bits, tau, group, dtype):
    """``token_attention_`` from the sink, the window, the first window exits and a full row: the output within its
    tier of the float64 reference with the token appended, and the storage it writes bit for bit the reference's
    (``lengths`` untouched: ``advance_`` counts the token)."""
    maxp, H, D = 3, 2, 64
    lengths = [0, 31, 300, 318, 319, 350, capacity(maxp) - 1, capacity(maxp)]
    B = len(lengths)
    st = make_cell(B, H, D, maxp, bits, lengths, dtype=dtype, seed=7 + bits)
    g = torch.Generator().manual_seed(bits)
    q = torch.randn(B, H * group, D, generator=g).to(dtype)
    kn, vn = (torch.randn(B, H, 1, D, generator=g).to(dtype) for _ in range(2))
    want_st = [t.clone() for t in st]
    token_attention_reference(q, kn, vn, *want_st, bits, tau, D**-0.5)
    st64 = upcast(st)
    want = token_attention_reference(q.double(), kn.double(), vn.double(), *st64, bits, tau, D**-0.5)
    got = ta.token_attention(q, kn, vn, *st, bits, tau, D**-0.5)
    for i, (a, b) in enumerate(zip(st, want_st, strict=True)):
        assert torch.equal(a, b), i
    appended = [t.clone() for t in want_st]
    appended[4] += (appended[4] < capacity(maxp)).int()
    assert_close_to_reference(got, q, appended, bits, tau, D**-0.5, want=want)


@interpret
@pytest.mark.interpret
@pytest.mark.parametrize(("group", "dtype"), [(1, torch.bfloat16), (4, torch.bfloat16), (1, torch.float32)])
@pytest.mark.parametrize("splits", [1, 5])
def test_split_counts_and_window_only_rows(group, dtype, splits, monkeypatch):
    """1 history program per (row, KV head), and more than the row has pages; a row with a window but no history
    page (300 tokens); the three code readers."""
    monkeypatch.setattr(triton_config, "choose_splits", lambda *a: splits)
    lengths = [300, 288 + 32 * 3, 1]
    st = make_cell(3, 2, 64, 3, 4, lengths, dtype=dtype, seed=3)
    q = torch.randn(3, 2 * group, 64).to(dtype)
    assert_close_to_reference(ta.cell_attention(q, *st, 4, 14.0, 0.125), q, st, 4, 14.0, 0.125)


@interpret
@pytest.mark.interpret
@pytest.mark.parametrize(("group", "dtype"), [(1, torch.bfloat16), (4, torch.bfloat16), (2, torch.float32)])
def test_v_precision_reads_cold_tokens_and_huge_tau_is_plain_int4(group, dtype):
    """tau = 0 marks tokens cold (the output moves, and still matches the reference); a finite tau no token can
    reach runs the V-precision code path yet gives the plain INT4 reader's bits (tau = inf)."""
    lengths = [288 + 32 * 2 + 3, 288 + 32 * 3]
    st = make_cell(2, 2, 64, 3, 4, lengths, dtype=dtype, seed=4)
    q = (3 * torch.randn(2, 2 * group, 64)).to(dtype)
    plain = ta.cell_attention(q, *st, 4, INF, 0.125)
    assert torch.equal(plain, ta.cell_attention(q, *st, 4, 1e30, 0.125))
    cold = ta.cell_attention(q, *st, 4, 0.0, 0.125)
    assert (cold.double() - plain.double()).abs().max() > 1e-3
    assert_close_to_reference(cold, q, st, 4, 0.0, 0.125)


@interpret
@pytest.mark.interpret
@pytest.mark.parametrize(("bits", "group", "dtype"), [(4, 1, torch.bfloat16), (2, 2, torch.bfloat16),
                                                      (4, 4, torch.float16), (2, 1, torch.float32)])
def test_shared_cell_reads_another_pool(bits, group, dtype):
    """A shared cell's page table points into the final loop's pool: pages out of order, two rows on the same
    physical pages, a pool larger than batch * maxp."""
    page_table = torch.tensor([[6, 2, 9], [6, 2, 0], [1, 1, 1]])
    lengths = [288 + 32 * 3 + 7, 288 + 32 * 2 + 1, 288 + 32]
    st = make_cell(3, 2, 64, 3, bits, lengths, dtype=dtype, pool_pages=10, page_table=page_table, seed=5)
    q = torch.randn(3, 2 * group, 64).to(dtype)
    assert_close_to_reference(ta.cell_attention(q, *st, bits, 14.0, 0.125), q, st, bits, 14.0, 0.125)


@interpret
@pytest.mark.interpret
def test_repeated_calls_reset_the_merge_counters():
    st = make_cell(2, 2, 64, 2, 4, [288 + 64, 100], dtype=torch.bfloat16, seed=6)
    q = torch.randn(2, 2, 64).bfloat16()
    first = ta.cell_attention(q, *st, 4, INF, 0.125)
    assert torch.equal(first, ta.cell_attention(q, *st, 4, INF, 0.125))
    assert int(counters("cpu", 4, purpose="attention")[:4].abs().sum()) == 0


def live_chunks(npg, splits, coef, rows_heads):
    """History programs with pages for a row of ``npg`` pages: the kernel's chunk rule, in Python."""
    if npg == 0 or splits == 0:
        return 0
    chunk = max(-(-npg // splits), 1)
    if coef > 0:
        chunk = max(chunk, min(math.ceil(math.sqrt(coef * rows_heads * npg)), npg))
    return min(-(-npg // chunk), splits)


@interpret
@pytest.mark.interpret
@pytest.mark.parametrize(("bits", "tau", "dtype"), [
    (4, INF, torch.float32), (4, 14.0, torch.bfloat16),
    pytest.param(2, INF, torch.bfloat16, marks=pytest.mark.slow),  # ~55 s interpreted
    (16, INF, torch.float32),
])
def test_minimum_chunk_keeps_the_result(bits, tau, dtype, monkeypatch):
    """The minimum-chunk rule (``Launch.chunk_coef``) gives a row's history pages to fewer programs, the rest exit
    with no partial and the merge waits only for those with one: still the reference's result for rows of no, one, a
    few and all pages, on the token path (which merges the same way) too. The coefficient is raised so that these
    small shapes reach the rule."""
    maxp, batch, heads, D = 9, 4, 2, 64
    lengths = [300, 288 + 32 + 5, 288 + 32 * 4, capacity(maxp)]  # 0, 1, 4 and 9 history pages
    st = make_cell(batch, heads, D, maxp, bits, lengths, dtype=dtype, seed=bits)
    g = torch.Generator().manual_seed(3)
    q = torch.randn(batch, heads, D, generator=g).to(dtype)
    kn, vn = (torch.randn(batch, heads, 1, D, generator=g).to(dtype) for _ in range(2))
    want = reference64(q, st, bits, tau, 0.125)
    appended = [t.clone() for t in st]
    token_attention_reference(q, kn, vn, *appended, bits, tau, 0.125)
    appended[4] += (appended[4] < capacity(maxp)).int()
    want_token = reference64(q, appended, bits, tau, 0.125)
    table = triton_config.launch_config
    monkeypatch.setattr(triton_config, "choose_splits", lambda *a: 5)
    for coef in (0.0, 0.3, 1e6):  # no minimum; some rows in fewer chunks; every row in one chunk
        assert [live_chunks(n_pages(n), 5, coef, batch * heads) for n in lengths] == \
            {0.0: [0, 1, 4, 5], 0.3: [0, 1, 1, 2], 1e6: [0, 1, 1, 1]}[coef]
        monkeypatch.setattr(triton_config, "launch_config",
                            lambda *a, coef=coef: dataclasses.replace(table(*a), chunk_coef=coef))
        assert_close_to_reference(ta.cell_attention(q, *st, bits, tau, 0.125), q, st, bits, tau, 0.125, want=want)
        if coef == 0.3:
            out = ta.token_attention(q, kn, vn, *[t.clone() for t in st], bits, tau, 0.125)
            assert_close_to_reference(out, q, appended, bits, tau, 0.125, want=want_token)


@interpret
@pytest.mark.interpret
def test_int32_offsets_fall_back_for_large_pools(monkeypatch):
    """INT2 reads with 32-bit history offsets; a pool with INT32_OFFSET_LIMIT elements or more gets 64-bit offsets
    instead, with the same values. The limit is lowered so that a small cell crosses it."""
    lengths = [288 + 32 * 3 + 5, 300]
    st = make_cell(len(lengths), 2, 64, 4, 2, lengths, dtype=torch.bfloat16, seed=41)
    q = torch.randn(len(lengths), 2, 64).bfloat16()
    want = ta.cell_attention(q, *st, 2, INF, 0.125)
    monkeypatch.setattr(triton_config, "INT32_OFFSET_LIMIT", 64)
    assert not triton_config.fits_int32(*st[6:])
    out = ta.cell_attention(q, *st, 2, INF, 0.125)
    assert torch.equal(out, want)
    assert_close_to_reference(out, q, st, 2, INF, 0.125)


@interpret
@pytest.mark.interpret
def test_reference_fallbacks_and_argument_errors(monkeypatch):
    """float64 queries, non-contiguous storage, tokens of another dtype and a GPU the table has no entry for run the
    references (bit for bit); wrong bits, heads or head_dim are refused."""
    st = make_cell(2, 2, 64, 2, 4, [288 + 40, 5], seed=1)
    q = torch.randn(2, 2, 64)
    want = cell_attention_reference(q.double(), *upcast(st), 4, 14.0, 0.125)
    assert torch.equal(ta.cell_attention(q.double(), *upcast(st), 4, 14.0, 0.125), want)
    strided = [t.transpose(2, 3).contiguous().transpose(2, 3) if i < 4 else t for i, t in enumerate(st)]
    assert torch.equal(ta.cell_attention(q, *strided, 4, 14.0, 0.125),
                       cell_attention_reference(q, *strided, 4, 14.0, 0.125))
    kn = torch.randn(2, 2, 1, 64, dtype=torch.float64)
    got, ref = [t.clone() for t in st], [t.clone() for t in st]
    assert torch.equal(ta.token_attention(q, kn, kn, *got, 4, 14.0, 0.125),
                       token_attention_reference(q, kn, kn, *ref, 4, 14.0, 0.125))
    assert all(torch.equal(a, b) for a, b in zip(got, ref, strict=True))
    monkeypatch.setattr(triton_config, "_capability", lambda device: (7, 5))  # before sm_80: no entry
    assert torch.equal(ta.cell_attention(q, *st, 4, 14.0, 0.125), cell_attention_reference(q, *st, 4, 14.0, 0.125))
    with pytest.raises(ValueError, match="bits must be"):
        ta.cell_attention(q, *st, 8, INF, 0.125)
    with pytest.raises(ValueError, match="not a multiple"):
        ta.cell_attention(torch.randn(2, 3, 64), *st, 4, INF, 0.125)
    with pytest.raises(ValueError, match="one token per row"):
        ta.token_attention(q, kn[:1], kn[:1], *st, 4, INF, 0.125)


def test_the_table_has_a_launch_for_exactly_the_served_shapes():
    """Brute force over head_dim 32-320 x 1-12 query heads per KV head x page kinds x inputs x B x H: a launch for
    every shape ``serves`` names, on sm_80, sm_90 and under the interpreter, and none for the others (they run the
    reference)."""
    for head_dim in range(32, 321, 16):
        for group in range(1, 13):
            served = head_dim % 32 == 0 and 64 <= head_dim <= 256 and group <= 8
            assert triton_config.serves(head_dim, group) == served
            for bits in (16, 4, 2, 0):
                for exact in (False, True):
                    for capability in (None, (8, 0), (9, 0)):
                        for rows_heads in (1, 64, 4096):
                            launch = triton_config.launch_config(capability, bits, group, head_dim, exact, rows_heads)
                            assert (launch is not None) == served, (head_dim, group, bits, exact, capability)
    assert triton_config.launch_config((7, 5), 4, 1, 128, False, 1) is None  # before sm_80


@interpret
@pytest.mark.interpret
@pytest.mark.parametrize(("bits", "group", "head_dim"), [(4, 1, 32), (16, 1, 80), (2, 16, 64), (4, 2, 288)])
def test_shapes_the_kernels_do_not_serve_run_the_reference(bits, group, head_dim, monkeypatch):
    """head_dim 32 (tl.dot needs 16 columns), one that is not a multiple of 32 (a bf16 plan's), more than 8 query
    heads per KV head and head_dim above 256: the read and the token path are the reference's, bit for bit, with one
    warning per shape that says what the kernels serve."""
    monkeypatch.setattr(triton_config, "_WARNED", set())
    assert not triton_config.serves(head_dim, group)
    lengths = [288 + 32 + 3, 5]
    st = make_cell(2, 2, head_dim, 2, bits, lengths, seed=9)
    q = torch.randn(2, 2 * group, head_dim)
    with pytest.warns(UserWarning, match=f"head_dim={head_dim} with {group} query heads per KV head runs the PyTorch "
                                         "reference"):
        out = ta.cell_attention(q, *st, bits, 14.0, 0.125)
    assert torch.equal(out, cell_attention_reference(q, *st, bits, 14.0, 0.125))
    kn = torch.randn(2, 2, 1, head_dim)
    got, ref = [t.clone() for t in st], [t.clone() for t in st]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once per shape
        assert torch.equal(ta.token_attention(q, kn, kn, *got, bits, 14.0, 0.125),
                           token_attention_reference(q, kn, kn, *ref, bits, 14.0, 0.125))
    assert all(torch.equal(a, b) for a, b in zip(got, ref, strict=True))


@interpret
@pytest.mark.interpret
def test_warmup_and_the_registered_pairs():
    """``warmup`` runs every launch a cache of the given shapes makes (here under the interpreter) and allocates the
    counters; ``launchers`` pairs exactly the four ops of the decode path and the prompt, and the continuation's chunk
    read, with their launchers."""
    from loopkv.ops import triton_chunk, triton_quant
    from loopkv.ops.triton_register import launchers, warmup

    warmup(batch_size=3, kv_heads=2, q_heads=4, head_dim=64, max_pages=3, dtype=torch.bfloat16, read_bits=(4,),
           own_bits=(4, 0), tau=14.0, device="cpu")
    assert counters("cpu", 6, purpose="attention").numel() >= 6
    assert [(op._name, fn) for op, fn in launchers()] == [
        ("cell_attention", ta.cell_attention), ("token_attention_", ta.token_attention),
        ("advance_", triton_quant.advance), ("write_pages_", triton_quant.write_pages),
        ("chunk_attention", triton_chunk.chunk_attention)]


@interpret
@pytest.mark.interpret
@pytest.mark.slow
@pytest.mark.parametrize("seed", range(6))
def test_random_shapes(seed):
    g = torch.Generator().manual_seed(seed)

    def pick(xs):
        return xs[int(torch.randint(len(xs), (1,), generator=g))]

    bits, group, head_dim = pick([4, 2, 16]), pick([1, 2, 4]), pick([64, 96, 128])
    dtype = pick([torch.bfloat16, torch.float16, torch.float32])
    tau = pick([INF, 14.0, 0.0]) if bits == 4 else INF
    heads, maxp, batch = pick([1, 2]), pick([1, 3, 5]), pick([1, 3])
    lengths = torch.randint(0, capacity(maxp) + 1, (batch,), generator=g).tolist()
    st = make_cell(batch, heads, head_dim, maxp, bits, lengths, dtype=dtype, seed=seed)
    q = torch.randn(batch, heads * group, head_dim, generator=g).to(dtype)
    out = ta.cell_attention(q, *st, bits, tau, head_dim**-0.5)
    assert_close_to_reference(out, q, st, bits, tau, head_dim**-0.5)


# ---------------------------------------------------------------------------------------------- GPU

GPU_CASES = [  # bits, tau, heads, group, head_dim, dtype
    (4, INF, 16, 1, 128, torch.bfloat16),
    (4, 14.0, 16, 1, 128, torch.bfloat16),
    (2, INF, 16, 1, 128, torch.bfloat16),
    (16, INF, 16, 1, 128, torch.bfloat16),
    (4, 14.0, 8, 2, 64, torch.float16),
    (2, INF, 8, 2, 128, torch.bfloat16),
    (4, 14.0, 4, 4, 256, torch.bfloat16),
    (4, 14.0, 2, 3, 96, torch.bfloat16),
    (4, 0.0, 16, 1, 128, torch.float32),
    (2, INF, 4, 4, 256, torch.float32),
    (16, INF, 8, 2, 64, torch.float32),
    # every row of the table above head_dim 128 or past 4 query heads per KV head
    (4, 14.0, 4, 1, 256, torch.bfloat16),  # two-warp CUDA-core reader, capped
    (2, INF, 4, 1, 256, torch.bfloat16),
    (4, 0.0, 4, 2, 256, torch.float16),  # two warps uncapped, V precision with cold tokens
    (2, INF, 4, 2, 160, torch.bfloat16),  # padded to 256
    (4, INF, 4, 8, 256, torch.bfloat16),  # eight-warp tensor-core reader
    (2, INF, 2, 5, 224, torch.bfloat16),  # padded group and head_dim
    (4, 14.0, 4, 8, 128, torch.bfloat16),  # two-warp tensor-core reader
    (2, INF, 4, 6, 96, torch.float16),
    (4, 14.0, 2, 8, 256, torch.float32),  # eight-warp fp32 products
    (16, INF, 4, 8, 256, torch.bfloat16),
]


@pytest.mark.gpu
@pytest.mark.parametrize(("bits", "tau", "heads", "group", "head_dim", "dtype"), GPU_CASES)
def test_gpu_matches_reference(bits, tau, heads, group, head_dim, dtype, monkeypatch):
    """The compiled launches at B = 8 with rows of 0 tokens to capacity, with the table's split count and with 1 and
    7 history programs per (row, KV head)."""
    maxp, batch = 96, 8
    g = torch.Generator().manual_seed(bits * 7 + head_dim)
    lengths = [0, 5, 300, capacity(maxp)] + torch.randint(320, capacity(maxp) + 1, (batch - 4,),
                                                            generator=g).tolist()
    st = make_cell(batch, heads, head_dim, maxp, bits, lengths, dtype=dtype, device="cuda", seed=head_dim)
    q = torch.randn(batch, heads * group, head_dim, generator=g).to(dtype).cuda()
    scale = head_dim**-0.5
    want = reference64(q, st, bits, tau, scale)  # the splits change the programs, not the result
    choose = triton_config.choose_splits
    for splits in (None, 1, 7):
        monkeypatch.setattr(triton_config, "choose_splits", choose if splits is None else lambda *a, s=splits: s)
        out = ta.cell_attention(q, *st, bits, tau, scale)
        assert_close_to_reference(out, q, st, bits, tau, scale, want=want)


@pytest.mark.gpu
@pytest.mark.parametrize(("bits", "tau"), [(4, INF), (4, 14.0), (2, INF)])
def test_gpu_cuda_core_reader_real_shape(bits, tau):
    """Ouro-1.4B cell at B = 8 x 16K (16 KV heads x 128, bf16, one and two query heads per KV head) against a float64
    reference computed on the GPU, on the read and on the token path."""
    batch, heads, head_dim = 8, 16, 128
    maxp = n_pages(16384 + 1)
    lengths = [16384, 16384 - 77, 5, 300, 16384 // 2 + 13, 16384, 320, 4000]
    st = make_cell(batch, heads, head_dim, maxp, bits, lengths, dtype=torch.bfloat16, device="cuda", seed=2)
    for group in (1, 2):
        q = (2 * torch.randn(batch, heads * group, head_dim)).to(torch.bfloat16).cuda()
        out = ta.cell_attention(q, *st, bits, tau, head_dim**-0.5)
        assert_close_to_reference(out, q, st, bits, tau, head_dim**-0.5)
        kn, vn = (torch.randn(batch, heads, 1, head_dim).to(torch.bfloat16).cuda() for _ in range(2))
        cell = [t.clone() for t in st]
        out = ta.token_attention(q, kn, vn, *cell, bits, tau, head_dim**-0.5)
        cell[4] += (cell[4] < capacity(maxp)).int()
        assert_close_to_reference(out, q, cell, bits, tau, head_dim**-0.5)


@pytest.mark.gpu
@pytest.mark.parametrize(("bits", "tau"), [(4, INF), (4, 14.0), (2, INF), (16, INF)])
@pytest.mark.parametrize(("heads", "group", "head_dim"), [(4, 4, 256), (55, 1, 96)])  # Dory-4B, Huginn-0125
def test_gpu_model_cells_real_shape(bits, tau, heads, group, head_dim):
    """Dory's cell (4 KV heads x 256, 4 query heads each) and Huginn's (55 x 96) at B = 8 x 16K, bf16, against a
    float64 reference computed on the GPU, on the read and on the token path."""
    batch = 8
    maxp = n_pages(16384 + 1)
    lengths = [16384, 16384 - 77, 5, 300, 16384 // 2 + 13, 16384, 320, 4000]
    st = make_cell(batch, heads, head_dim, maxp, bits, lengths, dtype=torch.bfloat16, device="cuda", seed=3)
    g = torch.Generator().manual_seed(head_dim)
    q = (2 * torch.randn(batch, heads * group, head_dim, generator=g)).to(torch.bfloat16).cuda()
    scale = head_dim**-0.5
    assert_close_to_reference(ta.cell_attention(q, *st, bits, tau, scale), q, st, bits, tau, scale)
    kn, vn = (torch.randn(batch, heads, 1, head_dim, generator=g).to(torch.bfloat16).cuda() for _ in range(2))
    want_st = [t.clone() for t in st]
    token_attention_reference(q, kn, vn, *want_st, bits, tau, scale)
    out = ta.token_attention(q, kn, vn, *st, bits, tau, scale)
    for a, b in zip(st, want_st, strict=True):
        assert torch.equal(a, b)
    st[4] += (st[4] < capacity(maxp)).int()
    assert_close_to_reference(out, q, st, bits, tau, scale)


def one_cell_stacks(cell):
    """A cell's storage as the 1-row stacks that ``advance_`` takes (``CellStacks``): (lengths, win_k, win_v, page
    table, pool fields) as 2-D views of the same memory, and the cell's tensors as views of them."""
    stacks = [t.reshape(1, -1) if t.numel() else t for t in cell[4:]]
    stacks = [stacks[0], cell[2].reshape(1, -1), cell[3].reshape(1, -1), *stacks[1:]]
    return stacks


@pytest.mark.gpu
@pytest.mark.parametrize(("bits", "tau"), [(4, 14.0), (2, INF)])
@pytest.mark.parametrize(("heads", "group", "head_dim"), [(16, 1, 128), (4, 4, 256), (55, 1, 96)])  # Ouro, Dory, Huginn
def test_gpu_cuda_graph_decode_step(bits, tau, heads, group, head_dim):
    """The decode step through the registered ops (``token_attention_``, then ``advance_``), captured once and replayed
    across window exits: every replay's output and storage match the references run on a CPU mirror (counters
    reset by the kernels)."""
    from loopkv.ops.step_ops import advance_stacks_reference
    from loopkv.ops.triton_register import register_triton_kernels

    assert register_triton_kernels()
    batch, maxp = 4, 12
    mirror = make_cell(batch, heads, head_dim, maxp, bits, [0, 300, 319, 288 + 32 * 8 + 30], dtype=torch.bfloat16,
                       seed=11)
    dev = [t.cuda() for t in mirror]
    idx = torch.zeros(1, dtype=torch.int32, device="cuda")
    k_new = torch.zeros(batch, heads, 1, head_dim, dtype=torch.bfloat16, device="cuda")
    v_new = torch.zeros_like(k_new)
    q = torch.zeros(batch, heads * group, head_dim, dtype=torch.bfloat16, device="cuda")
    shape = (batch, batch, heads, head_dim, maxp, bits)

    def step(cell):
        out = torch.ops.loopkv.token_attention_(q, k_new, v_new, *cell, bits, tau, head_dim**-0.5)
        torch.ops.loopkv.advance_(idx, idx, *one_cell_stacks(cell), *shape)
        return out

    step([t.clone() for t in dev])  # compile and allocate counters on a copy, outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step(dev)
    for _ in range(40):
        kn, vn = torch.randn(batch, heads, 1, head_dim), torch.randn(batch, heads, 1, head_dim)
        qn = torch.randn(batch, heads * group, head_dim)
        for dst, src in ((k_new, kn), (v_new, vn), (q, qn)):
            dst.copy_(src)
        graph.replay()
        want = token_attention_reference(qn.bfloat16().double(), kn.bfloat16().double(), vn.bfloat16().double(),
                                         *upcast(mirror), bits, tau, head_dim**-0.5)
        token_attention_reference(qn.bfloat16(), kn.bfloat16(), vn.bfloat16(), *mirror, bits, tau, head_dim**-0.5)
        advance_stacks_reference(idx.cpu(), idx.cpu(), *one_cell_stacks(mirror), *shape)
        for a, b in zip(dev, mirror, strict=True):
            assert torch.equal(a.cpu(), b)
        assert_close_to_reference(out.cpu(), qn.bfloat16(), mirror, bits, tau, head_dim**-0.5, want=want)
