"""``token_attention_`` + ``advance_`` (``loopkv/ops/step_ops.py``): a decode step on stacked cells.

The pair must leave the storage that writing each cell's token and counting it (``write_token_reference``, then
``advance_reference``, per cell) leaves, and return what ``cell_attention`` returns over the appended state. The
references are checked at that level on stacks; the Triton kernels bit for bit against the Triton reader over the
reference-appended state (the same reader reads the same values) and the reference's storage (the encoder is the
reference codec's); ``advance_`` on stacks of several cells, kinds and pool orders against its reference. Under the
interpreter the token-writing programs run after every reader, so a reader that took the ring instead of the op's
input for the new token would read a stale slot and fail.
"""

import math
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from loopkv import format as fmt  # noqa: E402
from loopkv.ops import step_ops  # noqa: E402
from loopkv.ops.cache_ops import advance_reference, write_token_reference  # noqa: E402
from loopkv.ops.cell_attention import cell_attention_reference  # noqa: E402
from tests.ops.test_triton_attention import interpret, make_cell  # noqa: E402

INF = math.inf
MAXP = 3
CAP = fmt.capacity(MAXP)
# sink, window only, the first window exit (318 -> 319), the first history read (319 -> 320), a later exit (350 ->
# 351) and a full row (left unchanged)
LENGTHS = [0, 31, 290, 318, 319, 350, CAP - 1, CAP]
NAMES = ("sink_k", "sink_v", "win_k", "win_v", "lengths", "page_table", "k_pages", "k_scale", "k_zero", "v_hi",
         "v_lo", "v_scale", "v_zero")


def as_stacks(cells):
    """Several cells' storage (``make_cell`` lists) -> (own stacks, pool stacks, per-cell views): rows of 2-D stacks
    as the cache's ``CellStacks`` holds them, each cell's tensors views of its rows (every cell owns a pool here)."""
    own = [torch.stack([c[i].flatten() for c in cells]) for i in range(5)]
    pools = [torch.stack([c[i].flatten() for c in cells]) if cells[0][i].numel() else cells[0][i] for i in range(5, 13)]
    views = []
    for n, c in enumerate(cells):
        v = [own[i][n].view(c[i].shape) for i in range(5)]
        v += [pools[i - 5][n].view(c[i].shape) if c[i].numel() else c[i] for i in range(5, 13)]
        views.append(v)
    return own, pools, views


def append_token(kn, vn, st, own_bits):
    """The per-cell oracle of a decode token: write it at ``lengths[b]`` (``write_token_reference``), then count it
    and quantize the page leaving the window (``advance_reference``; own_bits 0: a share cell, no pool)."""
    write_token_reference(kn, vn, *st[:5], st[5].shape[1])
    advance_reference(st[2], st[3], st[4], st[5], *st[6:], own_bits)


def assert_same(a, b):
    for name, x, y in zip(NAMES, a, b, strict=True):
        assert torch.equal(x, y), name


def test_references_compose_to_append_then_attention():
    """Reference level: three steps of ``token_attention_reference`` + ``advance_stacks_reference`` on a 2-cell
    stack (an INT4 cell and a share cell, which writes no pool) equal the per-cell token append +
    ``cell_attention_reference``: outputs and every tensor."""
    cells = [make_cell(len(LENGTHS), 2, 64, MAXP, 4, LENGTHS, seed=s) for s in (1, 2)]
    own, pools, views = as_stacks(cells)
    ref = [[t.clone() for t in c] for c in views]
    g = torch.Generator().manual_seed(0)
    B, H, D = len(LENGTHS), 2, 64
    for _ in range(3):
        for n, (st, rf) in enumerate(zip(views, ref, strict=True)):
            q = torch.randn(B, 2 * H, D, generator=g)
            kn, vn = (torch.randn(B, H, 1, D, generator=g) for _ in range(2))
            own_bits = 4 if n == 0 else 0  # cell 1 reads cell 0's pool as a share cell (its own rows here)
            append_token(kn, vn, rf, own_bits)
            want = cell_attention_reference(q, *rf, 4, 14.0, D**-0.5)
            got = step_ops.token_attention_reference(q, kn, vn, *st, 4, 14.0, D**-0.5)
            assert torch.equal(got, want)
        zero, one = torch.tensor([0], dtype=torch.int32), torch.tensor([1], dtype=torch.int32)
        step_ops.advance_stacks_reference(zero, zero, own[4], own[2], own[3], *pools, B, B, H, D, MAXP, 4)
        step_ops.advance_stacks_reference(one, zero, own[4], own[2], own[3], *pools, B, B, H, D, MAXP, 0)
        for st, rf in zip(views, ref, strict=True):
            assert_same(st, rf)
    assert views[0][4].tolist() == [min(n + 3, CAP) for n in LENGTHS]


READER_CASES = (("bits", "tau", "group", "dtype", "head_dim"), [
    (4, 14.0, 1, torch.bfloat16, 64),  # CUDA-core reader, V precision
    pytest.param(2, INF, 2, torch.float16, 64, marks=pytest.mark.slow),  # CUDA-core reader, two query heads (~75 s)
    (4, INF, 4, torch.bfloat16, 96),  # tensor-core reader, padded head_dim
    (4, 14.0, 1, torch.float32, 64),  # tensor-core reader, fp32 products
    (16, INF, 1, torch.bfloat16, 64),  # BF16 pages
])


@interpret
@pytest.mark.interpret
@pytest.mark.parametrize(*READER_CASES)
def test_token_attention_and_advance_equal_append_then_attention(bits, tau, group, dtype, head_dim):
    """Triton: three decode steps from every length in ``LENGTHS``; outputs bit for bit the Triton reader's over the
    reference-appended state, storage bit for bit the reference's, with ``advance`` run on the cell's row of the
    stacks."""
    from loopkv.ops import triton_attention as ta
    from loopkv.ops import triton_quant as tq

    B, H = len(LENGTHS), 2
    own, pools, (st,) = as_stacks([make_cell(B, H, head_dim, MAXP, bits, LENGTHS, dtype=dtype, seed=3 + bits)])
    ref = [t.clone() for t in st]
    g = torch.Generator().manual_seed(bits)
    idx = torch.zeros(1, dtype=torch.int32)
    for _ in range(3):
        q = torch.randn(B, H * group, head_dim, generator=g).to(dtype)
        kn, vn = (torch.randn(B, H, 1, head_dim, generator=g).to(dtype) for _ in range(2))
        appended = write_token_reference(kn, vn, *ref[:5], MAXP).to(torch.int32)
        want = ta.cell_attention(q, *ref[:4], appended, *ref[5:], bits, tau, head_dim**-0.5)
        advance_reference(ref[2], ref[3], ref[4], ref[5], *ref[6:], bits)
        got = ta.token_attention(q, kn, vn, *st, bits, tau, head_dim**-0.5)
        assert torch.equal(got, want)
        assert torch.equal(st[4] + (st[4] < CAP).int(), ref[4])  # the token is not counted yet
        tq.advance(idx, idx, own[4], own[2], own[3], *pools, B, B, H, head_dim, MAXP, bits)
        assert_same(st, ref)
    assert st[4].tolist() == [min(n + 3, CAP) for n in LENGTHS]


@interpret
@pytest.mark.interpret
@pytest.mark.parametrize("programs", [None, 1, 3])
@pytest.mark.parametrize("bits", [4, 2, 16, 0])
def test_advance_on_stacks_equals_its_reference(bits, programs, monkeypatch):
    """Triton ``advance`` on stacks of three cells, two of them listed, in another order than their pools
    (cells [2, 0] -> pools [0, 1]), the first 6 of 8 rows (rows 6 and 7 must not change); every row starting at a
    length from ``LENGTHS`` (or one less), so exits, non-exits and full rows mix; 1, 3 (not a divisor of 2 H) or
    the default number of programs per row."""
    from loopkv.ops import triton_quant as tq

    if programs is not None:
        monkeypatch.setattr(tq, "advance_programs", lambda *a: programs)
    B, H, D = 8, 2, 64
    rows = [[*LENGTHS[i:], *LENGTHS[:i]] for i in range(3)]
    starts = [[max(n - (c == 1), 0) for n in r] for c, r in enumerate(rows)]
    cells = [make_cell(B, H, D, MAXP, bits or 4, r, seed=c) for c, r in enumerate(starts)]
    own, pools, _ = as_stacks(cells)
    want_own, want_pools = [t.clone() for t in own], [t.clone() for t in pools]
    cell_idx, pool_idx = torch.tensor([2, 0], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32)
    for _ in range(2):
        step_ops.advance_stacks_reference(cell_idx, pool_idx, want_own[4], want_own[2], want_own[3], *want_pools, 6, B,
                                          H, D, MAXP, bits)
        tq.advance(cell_idx, pool_idx, own[4], own[2], own[3], *pools, 6, B, H, D, MAXP, bits)
        for name, x, y in zip(NAMES, own + pools, want_own + want_pools, strict=True):
            assert torch.equal(x, y), name
    before = torch.tensor(starts, dtype=torch.int32)
    assert torch.equal(own[4][1], before[1])  # cell 1 was not listed
    assert torch.equal(own[4][:, 6:], before[:, 6:])  # rows beyond the batch
    assert torch.equal(own[4][[2, 0], :6], torch.clamp(before[[2, 0], :6] + 2, max=CAP))
    if bits:  # something was encoded: a pool differs from its start
        assert any(not torch.equal(x, y) for x, y in zip(pools, as_stacks(cells)[1], strict=True) if x.numel())


def test_advance_refuses_bad_arguments():
    own, pools, _ = as_stacks([make_cell(2, 2, 64, MAXP, 4, [0, 300])])
    idx = torch.zeros(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="bits must be"):
        step_ops.advance_stacks_reference(idx, idx, own[4], own[2], own[3], *pools, 2, 2, 2, 64, MAXP, 8)
    with pytest.raises(ValueError, match="alike"):
        step_ops.advance_stacks_reference(idx, idx[:0], own[4], own[2], own[3], *pools, 2, 2, 2, 64, MAXP, 4)
    with pytest.raises(ValueError, match="batch=3"):
        step_ops.advance_stacks_reference(idx, idx, own[4], own[2], own[3], *pools, 3, 2, 2, 64, MAXP, 4)


@pytest.mark.gpu
@pytest.mark.parametrize(("bits", "tau"), [(4, 14.0), (4, INF), (2, INF), (16, INF)])
def test_gpu_token_attention_and_advance_equal_append_then_attention(bits, tau):
    """On the GPU the programs of one launch run concurrently, so this is where a race between the token-writing
    programs and the readers, or between ``advance``'s programs of one row, would show: 40 decode steps of an
    Ouro-sized cell (16 KV heads x 128, bf16, 8 rows whose lengths cross window exits at different steps), outputs and
    storage bit for bit equal to the reference token append + the Triton reader; ``advance`` with its default and
    with 1 program per row on alternate steps."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from loopkv.ops import triton_attention as ta
    from loopkv.ops import triton_quant as tq

    maxp = 12
    lengths = [0, 20, 300, 318, 319, 340, 500, fmt.capacity(maxp) - 5]
    B, H, D = len(lengths), 16, 128
    cell = make_cell(B, H, D, maxp, bits, lengths, dtype=torch.bfloat16, device="cuda", seed=11)
    own, pools, (st,) = as_stacks([cell])
    ref = [t.clone() for t in st]
    idx = torch.zeros(1, dtype=torch.int32, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(bits)
    default = tq.advance_programs
    try:
        for step in range(40):
            q = torch.randn(B, H, D, generator=g, device="cuda").to(torch.bfloat16)
            kn, vn = (torch.randn(B, H, 1, D, generator=g, device="cuda").to(torch.bfloat16) for _ in range(2))
            appended = write_token_reference(kn, vn, *ref[:5], maxp).to(torch.int32)
            want = ta.cell_attention(q, *ref[:4], appended, *ref[5:], bits, tau, D**-0.5)
            advance_reference(ref[2], ref[3], ref[4], ref[5], *ref[6:], bits)
            got = ta.token_attention(q, kn, vn, *st, bits, tau, D**-0.5)
            tq.advance_programs = default if step % 2 else (lambda *a: 1)
            tq.advance(idx, idx, own[4], own[2], own[3], *pools, B, B, H, D, maxp, bits)
            assert torch.equal(got, want)
            assert_same(st, ref)
    finally:
        tq.advance_programs = default
