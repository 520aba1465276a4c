"""``torch.library.opcheck`` on the three loopkv ops (schema and declared mutation, fake tensors,
autograd registration, AOT dispatch), on small CPU samples for every bits value and a shared-cell call;
the GPU variant runs the same checks through the registered Triton kernels."""

import math

import pytest
import torch

from loopkv.ops import append_attention, cache_ops, cell_attention, codec, layout  # noqa: F401  (registers torch.ops.loopkv.*)

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
    exact = [torch.randn(b, HEADS, n, HEAD_DIM, dtype=dtype, device=device) for n in (32, 32, layout.RING, layout.RING)]
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


def append_samples(device="cpu", dtype=torch.float32):
    samples = []
    for bits in (16, 4, 2, 0):  # 0: a shared cell appends to its sink and window only
        q = layout.QUANTIZE_LENGTH
        lengths = [0, q - 1, q + 31]  # the last two complete pages 0 and 1
        kv = [torch.randn(3, HEADS, 1, HEAD_DIM, dtype=dtype, device=device) for _ in range(2)]
        p = pool(bits, BATCH * MAXP, device, dtype) if bits else pool(4, BATCH * MAXP, device, dtype)
        samples.append((*kv, *storage(lengths, device, dtype), *p, bits))
    return samples


def write_samples(device="cpu", dtype=torch.float32):
    samples = []
    for bits in (16, 4, 2):
        k = torch.randn(2, HEADS, 32, HEAD_DIM, dtype=dtype, device=device)
        v = torch.randn(2, HEADS, 32, HEAD_DIM, dtype=dtype, device=device)
        pages = torch.tensor([3, 0], dtype=torch.int64, device=device)
        samples.append((k, v, pages, *pool(bits, 5, device, dtype), bits))
    return samples


def append_attention_samples(device="cpu", dtype=torch.float32):
    """``append_`` samples (every own bits, a window exit on two rows) with a query; bits 0 (a shared cell)
    reads the INT4 pool it does not own."""
    samples = []
    for kn, vn, *st, own in append_samples(device, dtype):
        q = torch.randn(3, 2 * HEADS, HEAD_DIM, dtype=dtype, device=device)
        samples.append((q, kn, vn, *st, own or 4, own, 14.0 if own in (0, 4) else math.inf, HEAD_DIM**-0.5))
    return samples


OPS = {
    "cell_attention": (lambda: torch.ops.loopkv.cell_attention.default, attention_samples),
    "append_": (lambda: torch.ops.loopkv.append_.default, append_samples),
    "write_pages_": (lambda: torch.ops.loopkv.write_pages_.default, write_samples),
    "append_attention_": (lambda: torch.ops.loopkv.append_attention_.default, append_attention_samples),
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
