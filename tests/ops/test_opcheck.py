"""``torch.library.opcheck`` on the five loopkv ops (schema and declared mutation, fake tensors, autograd
registration, AOT dispatch), on small CPU samples for every bits value and a shared-cell call; the GPU variant runs
the same checks through the registered Triton kernels. And the fake implementations refuse a malformed call the
way a compiled step would meet it."""

import math

import pytest
import torch

from loopkv import format as fmt
from loopkv.ops import cache_ops, cell_attention, chunk_attention, codec, step_ops  # noqa: F401  (registers the ops)

HEADS, HEAD_DIM, BATCH, MAXP = 2, 64, 3, 2


def pool(bits, n, device="cpu", dtype=torch.float32):
    """Pool tensors (k_pages, k_scale, k_zero, v_hi, v_lo, v_scale, v_zero) holding real codes."""
    if bits == 0:
        return [torch.empty(0, dtype=torch.uint8, device=device)] * 7
    k = torch.randn(n, HEADS, 32, HEAD_DIM, dtype=dtype, device=device)
    v = torch.randn(n, HEADS, 32, HEAD_DIM, dtype=dtype, device=device)
    if bits == 16:
        e16, e8 = torch.empty(0, dtype=torch.float16, device=device), torch.empty(0, dtype=torch.uint8, device=device)
        return [k, e16, e16.clone(), v, e8, e16.clone(), e16.clone()]
    return list(codec.encode_pages(k, v, bits))


def storage(lengths, device="cpu", dtype=torch.float32):
    b = len(lengths)
    exact = [torch.randn(b, HEADS, n, HEAD_DIM, dtype=dtype, device=device) for n in (32, 32, fmt.RING, fmt.RING)]
    page_table = torch.arange(b * MAXP, dtype=torch.int32, device=device).view(b, MAXP)
    return exact + [torch.tensor(lengths, dtype=torch.int32, device=device), page_table]


LENGTHS = [0, 300, 288 + 32 * 2 + 5]


def attention_samples(device="cpu", dtype=torch.float32):
    samples = []
    for bits, tau in ((16, math.inf), (4, math.inf), (4, 14.0), (2, math.inf)):
        q = torch.randn(len(LENGTHS), 2 * HEADS, HEAD_DIM, dtype=dtype, device=device)
        samples.append((q, *storage(LENGTHS, device, dtype), *pool(bits, BATCH * MAXP, device, dtype),
                        bits, tau, HEAD_DIM**-0.5))
    # shared cell: its page table points into the final loop's (larger) pool, rows share pages
    st = storage(LENGTHS, device, dtype)
    st[5] = torch.tensor([[4, 1], [4, 1], [0, 5]], dtype=torch.int32, device=device)
    q = torch.randn(len(LENGTHS), HEADS, HEAD_DIM, dtype=dtype, device=device)
    samples.append((q, *st, *pool(4, 6, device, dtype), 4, 14.0, HEAD_DIM**-0.5))
    return samples


def token_samples(device="cpu", dtype=torch.float32):
    """``token_attention_``: a window exit on two rows for every read bits; a shared cell reads an INT4 pool."""
    samples = []
    for bits, tau in ((16, math.inf), (4, 14.0), (2, math.inf)):
        q = fmt.QUANTIZE_LENGTH
        lengths = [0, q - 1, q + 31]  # the last two complete pages 0 and 1
        kv = [torch.randn(3, HEADS, 1, HEAD_DIM, dtype=dtype, device=device) for _ in range(2)]
        query = torch.randn(3, 2 * HEADS, HEAD_DIM, dtype=dtype, device=device)
        samples.append((query, *kv, *storage(lengths, device, dtype), *pool(bits, BATCH * MAXP, device, dtype), bits,
                        tau, HEAD_DIM**-0.5))
    return samples


def advance_samples(device="cpu", dtype=torch.float32):
    """``advance_`` on stacks of two cells (rows of 2-D tensors), one listed, every kind of pool and a share group."""
    samples = []
    lengths = [0, fmt.QUANTIZE_LENGTH - 1, fmt.QUANTIZE_LENGTH + 31]
    for bits in (16, 4, 2, 0):
        own = [torch.stack([t.flatten() for t in (a, b)]) for a, b in zip(storage(lengths, device, dtype)[:5],
                                                                          storage(lengths, device, dtype)[:5],
                                                                          strict=True)]
        table = torch.arange(BATCH * MAXP, dtype=torch.int32, device=device)[None].expand(2, -1).contiguous()
        fields = [torch.stack([t.flatten()] * 2) if t.numel() else t for t in pool(bits or 4, BATCH * MAXP, device,
                                                                                  dtype)]
        if bits == 0:
            table, fields = torch.zeros(0, dtype=torch.int32, device=device), [torch.zeros(0, device=device)] * 7
        idx = torch.ones(1, dtype=torch.int32, device=device)
        samples.append((idx, idx * 0, own[4], own[2], own[3], table, *fields, BATCH, BATCH, HEADS, HEAD_DIM, MAXP,
                        bits))
    return samples


def write_samples(device="cpu", dtype=torch.float32):
    samples = []
    for bits in (16, 4, 2):
        k = torch.randn(2, HEADS, 32, HEAD_DIM, dtype=dtype, device=device)
        v = torch.randn(2, HEADS, 32, HEAD_DIM, dtype=dtype, device=device)
        pages = torch.tensor([3, 0], dtype=torch.int64, device=device)
        samples.append((k, v, pages, *pool(bits, 5, device, dtype), bits))
    return samples


def chunk_samples(device="cpu", dtype=torch.float32):
    """``chunk_attention`` of one row: chunks across the first history read (held 300 + 24: page 0 read from the
    21st token on) and over two pages, for every read bits; a short row (no pages, 60 ring slots)."""
    samples = []
    for bits, tau, held, new in ((16, math.inf, 300, 24), (4, 14.0, 300, 24), (4, math.inf, 330, 40),
                                 (2, math.inf, 330, 40)):
        T = chunk_attention.tail_length(held, new)
        exact = [torch.randn(HEADS, n, HEAD_DIM, dtype=dtype, device=device) for n in (32, 32, T, T)]
        table = torch.tensor([4, 1], dtype=torch.int32, device=device)
        q = torch.randn(new, 2 * HEADS, HEAD_DIM, dtype=dtype, device=device)
        samples.append((q, *exact, held, fmt.RING, table, *pool(bits, BATCH * MAXP, device, dtype), bits, tau,
                        HEAD_DIM**-0.5))
    held, new = 20, 30
    exact = [torch.randn(HEADS, n, HEAD_DIM, dtype=dtype, device=device)
             for n in (32, 32, held + new - 32, held + new - 32)]
    q = torch.randn(new, HEADS, HEAD_DIM, dtype=dtype, device=device)
    samples.append((q, *exact, held, 60, torch.zeros(0, dtype=torch.int32, device=device), *pool(4, 0, device, dtype),
                    4, 14.0, HEAD_DIM**-0.5))
    return samples


OPS = {
    "cell_attention": (lambda: torch.ops.loopkv.cell_attention.default, attention_samples),
    "token_attention_": (lambda: torch.ops.loopkv.token_attention_.default, token_samples),
    "advance_": (lambda: torch.ops.loopkv.advance_.default, advance_samples),
    "write_pages_": (lambda: torch.ops.loopkv.write_pages_.default, write_samples),
    "chunk_attention": (lambda: torch.ops.loopkv.chunk_attention.default, chunk_samples),
}


@pytest.mark.parametrize("name", list(OPS))
def test_opcheck_cpu(name):
    op, samples = OPS[name]
    for args in samples():
        torch.library.opcheck(op(), args)


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(OPS))
def test_opcheck_gpu_triton_kernels(name):
    pytest.importorskip("triton")
    from loopkv.ops.triton_register import register_triton_kernels

    assert register_triton_kernels()
    op, samples = OPS[name]
    for args in samples("cuda", torch.bfloat16):
        torch.library.opcheck(op(), args)


def test_fake_implementations_refuse_malformed_calls():
    """Traced with fake tensors (what ``torch.compile`` does), a call with a wrong shape or dtype fails with a
    message that names the tensor, not deep inside a kernel."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    q, *rest = attention_samples()[1]
    bad_window = list(rest)
    bad_window[2] = torch.zeros(3, HEADS, fmt.RING - 1, HEAD_DIM)  # win_k one slot short
    bad_lengths = list(rest)
    bad_lengths[4] = bad_lengths[4].long()
    bad_pool = list(rest)
    bad_pool[6] = torch.zeros(BATCH * MAXP, HEADS, 32, HEAD_DIM // 4, dtype=torch.uint8)  # INT2-wide INT4 codes
    with FakeTensorMode(allow_non_fake_inputs=True):
        for args, match in ((bad_window, "win_k"), (bad_lengths, "lengths"), (bad_pool, "k_pages")):
            with pytest.raises(RuntimeError, match=match):
                torch.ops.loopkv.cell_attention(q, *args)
        k = torch.zeros(3, HEADS, 2, HEAD_DIM)  # two tokens where a decode step takes one
        with pytest.raises(RuntimeError, match="one token per row"):
            torch.ops.loopkv.token_attention_(q, k, k, *rest)
    q, *rest = chunk_samples()[1]  # held 300 + 24 new: a tail of positions [32, 324)
    short_tail = list(rest)
    short_tail[2] = torch.zeros(HEADS, 291, HEAD_DIM)
    batched_table = list(rest)
    batched_table[6] = batched_table[6][None]
    few_pages = list(rest)
    few_pages[4] = 400  # held 400 + 24 reads n_pages(424) = 4 pages; the table holds 2
    few_pages[2] = few_pages[3] = torch.zeros(HEADS, chunk_attention.tail_length(400, 24), HEAD_DIM)
    with FakeTensorMode(allow_non_fake_inputs=True):
        for args, match in ((short_tail, r"tail_k must be \[2, 292, 64\].*_exact_tail"),
                            (batched_table, "page_table must be one row's"), (few_pages, "reserve the row's pages")):
            with pytest.raises(RuntimeError, match=match):
                torch.ops.loopkv.chunk_attention(q, *args)
