"""The chunk read (``chunk_attention``): its Triton kernel against the op's reference (each query a virtual row of the
decode read) and against float64 re-computations of the same stored row.

A test row is made the way a continuation leaves one: ``held + S`` exact tokens, the sink their first 32, history pages
encoded from them by the codec (in a pool with other pages, through a shuffled page table) and the exact tail
``[window_start(held), held + S)``. Interpreted cases (``TRITON_INTERPRET=1``, set on machines without CUDA) are small:
head_dim 64, two KV heads, chunks of 8-40 tokens after 300-400; the GPU test runs Ouro's cell.

Tolerances (tests/tolerances.py): fp32 inputs run every product in fp32, so ``ATTN_FP32_*`` against float64; bf16 inputs
round the output to bf16 (and the weights of exact values, as the decode reader does), so ``ATTN_BF16_*``. With V
precision a page token whose score sits on the cold threshold (within the rounding of two implementations' scores)
can be cold in one and hot in the other, which moves that (token, query head)'s output by about its value's lo-plane
error; the tests bound how many (token, query head) rows may differ beyond the tier instead of widening it for all.
"""

import contextlib
import math
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")

from loopkv.format import PAGE, RING, SINK, n_pages  # noqa: E402
from loopkv.ops import codec, triton_chunk, triton_config  # noqa: E402
from loopkv.ops.chunk_attention import chunk_attention_reference, window_start  # noqa: E402
from tests.tolerances import ATTN_BF16_ATOL, ATTN_BF16_RTOL, ATTN_FP32_ATOL, ATTN_FP32_RTOL  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
interpret = pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 (set on machines without CUDA)")
INF = math.inf


def make_row(heads, group, head_dim, held, new, bits, *, dtype=torch.float32, ring=RING, device="cpu", seed=0):
    """(q [S, Hq, D], the op's arguments after q up to and including ``scale``'s predecessors: sink_k, sink_v, tail_k,
    tail_v, held, ring, page_table, the 7 pool fields) of a row holding ``held + new`` tokens."""
    g = torch.Generator(device=device).manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=g, device=device)

    end = held + new
    # keys with per-channel offsets and spreads, like real keys; queries of std 2 (a spread of scores)
    k = (rnd(heads, end, head_dim) * (0.5 + 2 * torch.rand(heads, 1, head_dim, generator=g, device=device))
         + rnd(heads, 1, head_dim)).to(dtype)
    v = rnd(heads, end, head_dim).to(dtype)
    q = (2 * rnd(new, heads * group, head_dim)).to(dtype)
    sink_k, sink_v = k[:, :SINK].contiguous(), v[:, :SINK].contiguous()
    ws = window_start(held)
    tail_k, tail_v = k[:, ws:].contiguous(), v[:, ws:].contiguous()
    pages = n_pages(end)
    extra = 3  # pages of other rows in the pool
    pk = rnd(pages + extra, heads, PAGE, head_dim).to(dtype)
    pv = rnd(pages + extra, heads, PAGE, head_dim).to(dtype)
    table = torch.randperm(pages + extra, generator=g, device=device)[:pages + 1].int()  # one page to spare
    for p in range(pages):  # page p: positions [SINK + PAGE p, SINK + PAGE (p + 1))
        span = slice(SINK + PAGE * p, SINK + PAGE * (p + 1))
        pk[table[p]], pv[table[p]] = k[:, span], v[:, span]
    f16, u8 = {"dtype": torch.float16, "device": device}, {"dtype": torch.uint8, "device": device}
    if bits == 0:
        pool = [torch.empty(0, **u8)] * 7
    elif bits == 16:
        pool = [pk, torch.empty(0, **f16), torch.empty(0, **f16), pv, torch.empty(0, **u8), torch.empty(0, **f16),
                torch.empty(0, **f16)]
    else:
        pool = list(codec.encode_pages(pk, pv, bits))
    if ring != RING:  # a short cache: no pages
        table = torch.zeros(0, dtype=torch.int32, device=device)
    return q, [sink_k, sink_v, tail_k, tail_v, held, ring, table, *pool]


def reference64(q, args, bits, tau, scale):
    """The op's reference on the same stored row in float64 (q and the exact parts upcast; codes as stored)."""
    up = [a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() and a.dtype != torch.float16 else a
          for a in args]
    return chunk_attention_reference(q.double(), *up, bits, tau, scale)


def rows_beyond(out, want, atol, rtol):
    """How many (token, query head) rows of ``out`` [S, Hq, D] have an element outside the tolerance of ``want``."""
    far = ~torch.isclose(out.double(), want.double(), atol=atol, rtol=rtol)
    return int(far.any(dim=-1).sum())


@pytest.fixture
def no_fallback(monkeypatch):
    """The launcher's reference replaced by a failure: the kernel is what runs."""

    def refuse(*args, **kwargs):
        raise AssertionError("the chunk launcher fell back to its reference")

    monkeypatch.setattr(triton_chunk, "chunk_attention_reference", refuse)


CASES = [  # bits, tau, query heads per KV head, held, new, dtype, ring
    (4, 14.0, 1, 300, 40, torch.float32, RING),  # across the first history read: page 0 read from the 20th token on
    (4, 2.0, 2, 350, 24, torch.float32, RING),  # V precision with many cold tokens, two query heads per KV head
    (4, 2.0, 3, 340, 12, torch.float32, RING),  # three query heads padded to four: a padded head is never hot
    (4, INF, 2, 400, 16, torch.float32, RING),  # INT4 without V precision, pages 0-3
    (2, INF, 1, 330, 20, torch.float32, RING),
    (16, INF, 2, 300, 30, torch.float32, RING),  # BF16 pages (exact tiles)
    (0, INF, 1, 330, 8, torch.float32, RING),  # no history read (positions in pages are not attended)
    (4, 14.0, 1, 5, 40, torch.float32, RING),  # the chunk's first 27 tokens land in the sink: no pages
    (4, 14.0, 2, 20, 30, torch.float32, 60),  # a short cache: sink 32, ring 60, no page table
    (4, 14.0, 2, 320, 24, torch.bfloat16, RING),  # 16-bit inputs: fp16 code tiles and split q * k_scale
]


# history splits forced (NSPLIT > 1; the cases above run the chooser's NSPLIT = 1): split sp reads pages
# [sp * per, (sp + 1) * per) of its block's n_pages(n_last), per = cdiv(n_pages(n_last), NSPLIT); split 0 adds the
# sink, the last split reads the tail
SPLIT_CASES = [  # bits, tau, query heads per KV head, held, new, dtype, ring, NSPLIT
    (4, 2.0, 2, 380, 40, torch.float32, RING, 3),  # blocks of 32 tokens: 3 pages (1 a split), 4 (2, 2 and none)
    (4, 14.0, 1, 300, 40, torch.float32, RING, 2),  # page 0 in split 0 (read from the 20th token on), split 1 the tail
    (2, INF, 1, 460, 20, torch.float32, RING, 4),  # 6 pages: 2, 2, 2 and none
    (16, INF, 2, 330, 30, torch.float32, RING, 2),  # BF16 pages
    (4, 14.0, 1, 5, 40, torch.float32, RING, 2),  # no pages: the first tokens' rows get nothing from split 1 (-inf)
    (0, INF, 1, 330, 8, torch.float32, RING, 2),  # no history read
    (4, 14.0, 2, 20, 30, torch.float32, 60, 2),  # a short cache
    (4, 14.0, 2, 320, 24, torch.bfloat16, RING, 3),  # 16-bit inputs, the merge writes bf16
]


@interpret
@pytest.mark.interpret
@pytest.mark.usefixtures("no_fallback")
@pytest.mark.parametrize(("bits", "tau", "group", "held", "new", "dtype", "ring", "splits"),
                         [(*case, None) for case in CASES] + SPLIT_CASES)
def test_kernel_matches_the_reference(monkeypatch, bits, tau, group, held, new, dtype, ring, splits):
    """The kernel equals the float64 reference of the same row within its dtype's tier, and the op's own reference
    (virtual rows of ``cell_attention``, fp32) as closely; a token on the cold threshold may flip (at most one (token,
    query head) row in 64 here). ``splits``: NSPLIT forced (None: the launcher's choice, 1 at these sizes), the
    partials merged by the merge kernel."""
    chosen = []
    choose = triton_chunk.choose_splits
    monkeypatch.setattr(triton_chunk, "choose_splits",
                        lambda *a: chosen.append(splits or choose(*a)) or chosen[-1])
    head_dim, scale = 64, 64**-0.5
    q, args = make_row(2, group, head_dim, held, new, bits, dtype=dtype, ring=ring, seed=bits + held)
    out = triton_chunk.chunk_attention(q, *args, bits, tau, scale)
    assert chosen == [splits or 1]
    assert out.shape == q.shape
    assert out.dtype == q.dtype
    assert not out.isnan().any()
    want = reference64(q, args, bits, tau, scale)
    op_ref = chunk_attention_reference(q, *args, bits, tau, scale)
    atol, rtol = (ATTN_FP32_ATOL, ATTN_FP32_RTOL) if dtype == torch.float32 else (ATTN_BF16_ATOL, ATTN_BF16_RTOL)
    flips = out.shape[0] * out.shape[1] // 64
    assert rows_beyond(out, want, atol, rtol) <= flips
    assert rows_beyond(out, op_ref, atol, rtol) <= flips
    if not (bits == 4 and math.isfinite(tau)):  # no cold rule, nothing to flip
        torch.testing.assert_close(out.double(), want, atol=atol, rtol=rtol)


@interpret
@pytest.mark.interpret
@pytest.mark.usefixtures("no_fallback")
def test_kernel_keeps_each_tokens_own_semantics():
    """Each token reads what its own decode reads, not the chunk's last state: the kernel's output for every token
    equals the float64 decode read (``cell_attention``'s reference) of a row that holds exactly ``held + i + 1``
    tokens, built independently (no tail, no virtual ring: its own sink, window ring and pages)."""
    from loopkv.ops.cell_attention import cell_attention_reference

    heads, group, head_dim, held, new, tau = 2, 2, 64, 310, 24, 14.0
    q, args = make_row(heads, group, head_dim, held, new, 4, seed=3)
    out = triton_chunk.chunk_attention(q, *args, 4, tau, head_dim**-0.5)
    sink_k, sink_v, tail_k, tail_v, _, _, table, *pool = args
    ws = window_start(held)
    for i in (0, 9, 10, new - 1):  # 9: the last token before page 0 is read (n = 319), 10: the first (n = 320)
        n = held + i + 1
        win_k = torch.zeros(heads, RING, head_dim, dtype=torch.float64)
        win_v = torch.zeros_like(win_k)
        for p in range(SINK + PAGE * n_pages(n), n):  # the positions a decode at n reads exactly, in their slots
            win_k[:, (p - SINK) % RING] = tail_k[:, p - ws].double()
            win_v[:, (p - SINK) % RING] = tail_v[:, p - ws].double()
        want = cell_attention_reference(
            q[i:i + 1].double(), sink_k[None].double(), sink_v[None].double(), win_k[None], win_v[None],
            torch.tensor([n], dtype=torch.int32), table[None], *pool, 4, tau, head_dim**-0.5)
        torch.testing.assert_close(out[i:i + 1].double(), want, atol=ATTN_FP32_ATOL, rtol=ATTN_FP32_RTOL)


class Recorder:
    """Stands in for the ``@triton.jit`` kernel: ``kernel[grid](*args, **kwargs)`` records the call."""

    def __init__(self):
        self.calls = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((grid, kwargs))


@pytest.mark.usefixtures("no_fallback")
@pytest.mark.parametrize("head_dim", [64, 96, 128, 256])
@pytest.mark.parametrize("group", [1, 2, 4])
def test_served_cells_launch_the_kernel(monkeypatch, head_dim, group):
    """INT4 with and without V precision, INT2 and BF16 pages at every served head_dim and 1, 2, 4 query heads per KV
    head launch the kernel (one program per block of tokens and KV head), never the reference."""
    rec = Recorder()
    monkeypatch.setattr(triton_chunk, "_chunk_attn_kernel", rec)
    for bits, tau in ((4, 14.0), (4, INF), (2, INF), (16, INF)):
        q, args = make_row(2, group, head_dim, 330, 40, bits, dtype=torch.bfloat16)
        triton_chunk.chunk_attention(q, *args, bits, tau, head_dim**-0.5)
        grid, kw = rec.calls[-1]
        assert grid == (triton.cdiv(40, kw["BM"]), 2)
        assert (kw["BITS"], kw["VPREC"], kw["G"], kw["D"]) == (bits, bits == 4 and tau == 14.0, group, head_dim)
    assert len(rec.calls) == 4


def test_split_rule(monkeypatch):
    """NSPLIT: programs for two per SM, at least 4 pages a split, at most 16. Ouro's cell on an H200 (132 SMs, 16 KV
    heads): a 256-token chunk after 12,800 tokens (4 blocks, 399 pages) splits 5 ways; 2,048 tokens (32 blocks) does
    not; a row of few pages never splits."""
    monkeypatch.setattr(triton_config, "_num_sms", lambda device: 132)
    choose = triton_chunk.choose_splits
    cpu = torch.device("cpu")
    assert choose(4, 16, n_pages(12_800 + 256), cpu) == 5
    assert choose(32, 16, n_pages(12_800 + 2048), cpu) == 1
    assert choose(1, 1, 7, cpu) == 1
    assert choose(1, 1, 8, cpu) == 2
    assert choose(1, 2, 10_000, cpu) == 16
    assert choose(4, 16, 0, cpu) == 1


def test_split_launch_grid_and_merge(monkeypatch):
    """With NSPLIT > 1 the launcher runs a (blocks, H, NSPLIT) grid writing the workspace, then the merge over the
    S x Hq rows."""
    rec, merge = Recorder(), Recorder()
    monkeypatch.setattr(triton_chunk, "_chunk_attn_kernel", rec)
    monkeypatch.setattr(triton_chunk, "_chunk_merge_kernel", merge)
    monkeypatch.setattr(triton_config, "_num_sms", lambda device: 132)
    q, args = make_row(2, 2, 64, 600, 40, 4, dtype=torch.bfloat16)  # 11 pages: 2 splits
    triton_chunk.chunk_attention(q, *args, 4, 14.0, 0.125)
    (grid, kw), = rec.calls
    assert grid == (triton.cdiv(40, kw["BM"]), 2, 2)
    assert kw["NSPLIT"] == 2
    (mgrid, mkw), = merge.calls
    assert mgrid == (triton.cdiv(40 * 4, triton_chunk.MERGE_ROWS),)
    assert mkw["NSPLIT"] == 2


def test_float64_and_unserved_shapes_run_the_reference(monkeypatch):
    """A float64 query (tests' re-computations) and head_dim 32 (outside ``triton_config.HEAD_DIMS``) run the op's
    reference: its output exactly, no launch."""
    rec = Recorder()
    monkeypatch.setattr(triton_chunk, "_chunk_attn_kernel", rec)
    monkeypatch.setattr(triton_config, "_WARNED", set())  # warned once per shape and session
    for dtype, head_dim in ((torch.float64, 64), (torch.float32, 32)):
        q, args = make_row(2, 1, head_dim, 300, 8, 4, dtype=dtype)
        with pytest.warns(UserWarning, match="head_dim=32") if head_dim == 32 else contextlib.nullcontext():
            out = triton_chunk.chunk_attention(q, *args, 4, 14.0, 0.125)
        assert torch.equal(out, chunk_attention_reference(q, *args, 4, 14.0, 0.125))
    assert rec.calls == []


def test_launcher_refuses_a_tail_of_the_wrong_length():
    q, args = make_row(2, 1, 64, 300, 8, 4)
    args[2] = args[2][:, 1:]
    with pytest.raises(ValueError, match=r"tail_k, tail_v must be \[2, 276, 64\]"):
        triton_chunk.chunk_attention(q, *args, 4, 14.0, 0.125)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(("bits", "tau"), [(4, 14.0), (4, INF), (2, INF), (16, INF)])
def test_gpu_ouro_cell_matches_the_reference(bits, tau):
    """Ouro-1.4B's cell (16 KV heads x 128, one query head each, bf16): a 512-token chunk after 2,000 tokens through the
    compiled kernel against the float64 reference of the same row and against the op's reference (virtual rows through
    the decode kernel). A token on the cold threshold may flip: at most one (token, head) row in 1,000."""
    from loopkv.ops.triton_register import register_triton_kernels

    assert register_triton_kernels()
    q, args = make_row(16, 1, 128, 2000, 512, bits, dtype=torch.bfloat16, device="cuda", seed=bits)
    scale = 128**-0.5
    out = torch.ops.loopkv.chunk_attention(q, *args, bits, tau, scale)
    want = reference64(q, args, bits, tau, scale)
    op_ref = chunk_attention_reference(q, *args, bits, tau, scale)
    rows = out.shape[0] * out.shape[1]
    assert rows_beyond(out, want, ATTN_BF16_ATOL, ATTN_BF16_RTOL) <= rows // 1000
    assert rows_beyond(out, op_ref, ATTN_BF16_ATOL, ATTN_BF16_RTOL) <= rows // 1000
    assert ((out.double() - want).norm() / want.norm()) < ATTN_BF16_RTOL
