"""Triton quantizer kernels (``write_pages_``, ``append_``) against the references: codes ``torch.equal``.

Interpreted tests (``@pytest.mark.interpret``) run the kernels on CPU under ``TRITON_INTERPRET=1``,
which Triton reads when a kernel is decorated, i.e. when ``loopkv.ops.triton_quant`` is first imported
(3.6 and 3.9 alike): the variable is set below, before that import, on machines without CUDA. On a
CUDA machine the interpreted tests are skipped (unless the variable was set outside) and the
``@pytest.mark.gpu`` tests run the compiled kernels at real shapes.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")

from loopkv.ops import cache_ops, codec, layout  # noqa: E402
from loopkv.ops import triton_quant as tq  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
interpret = pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 (set on machines without CUDA)")


def make_pool(n: int, heads: int, head_dim: int, bits: int, dtype=torch.bfloat16, device="cpu") -> list:
    """Pool tensors in the order of the ops' arguments (k_pages, k_scale, k_zero, v_hi, v_lo, v_scale, v_zero),
    filled with random bytes so that untouched pages are visible."""
    f16 = dict(dtype=torch.float16, device=device)
    u8 = dict(dtype=torch.uint8, device=device)
    if bits == 0:
        return [torch.empty(0, **u8)] * 7
    if bits == 16:
        return [torch.randn(n, heads, 32, head_dim, dtype=dtype, device=device), torch.empty(0, **f16),
                torch.empty(0, **f16), torch.randn(n, heads, 32, head_dim, dtype=dtype, device=device),
                torch.empty(0, **u8), torch.empty(0, **f16), torch.empty(0, **f16)]
    ng = head_dim // codec.GROUP
    return [
        torch.randint(0, 256, (n, heads, 32, head_dim * bits // 8), **u8),
        torch.randn(n, heads, head_dim, **f16), torch.randn(n, heads, head_dim, **f16),
        torch.randint(0, 256, (n, heads, 32, head_dim // 4), **u8),
        torch.randint(0, 256, (n, heads, 32, head_dim // 4), **u8) if bits == 4 else torch.empty(0, **u8),
        torch.randn(n, heads, 32, ng, **f16), torch.randn(n, heads, 32, ng, **f16),
    ]


def page_values(n: int, heads: int, head_dim: int, dtype, *, bits=4, device="cpu", seed=0) -> tuple:
    """k, v [n, H, PAGE, D] with degenerate groups: a constant K channel, exact rounding ties, an outlier."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    k = torch.randn(n, heads, 32, head_dim, generator=g) * (1 + 3 * torch.rand(n, heads, 1, head_dim, generator=g))
    v = torch.randn(n, heads, 32, head_dim, generator=g)
    k[0, 0, :, 3] = 0.75  # constant channel: EPS range, no NaN
    # ties: multiples of 0.25 in [0, levels / 2] give scale 0.5 and (x - 0) / 0.5 = j / 2 exactly
    levels = 2 ** (bits if bits in (2, 4) else 4) - 1
    ties = (torch.arange(32) % (2 * levels + 1)) * 0.25
    k[-1, -1, :, 1] = ties
    v[-1, -1, 5, :32] = ties
    v[0, -1, 7, :] = 0.0  # a zero token
    k[-1, 0, 9, 0] = 300.0  # an outlier
    return k.to(device=device, dtype=dtype), v.to(device=device, dtype=dtype)


def assert_pools_equal(got: list, want: list) -> None:
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert a.dtype == b.dtype
        assert torch.equal(a, b), f"pool field {i} differs in {(a != b).sum().item()} elements"


@interpret
@pytest.mark.interpret
@pytest.mark.parametrize("bits", [4, 2, 16])
@pytest.mark.parametrize(("head_dim", "dtype"), [(64, torch.bfloat16), (96, torch.float32), (128, torch.float16)])
def test_write_pages_matches_reference(bits, head_dim, dtype):
    n, heads, pool_pages = 3, 2, 6
    k, v = page_values(n, heads, head_dim, dtype, bits=bits, seed=bits + head_dim)
    pages = torch.tensor([5, 0, 2])
    got = make_pool(pool_pages, heads, head_dim, bits, dtype)
    want = [t.clone() for t in got]
    tq.write_pages(k, v, pages, *got, bits)
    cache_ops.write_pages_reference(k, v, pages, *want, bits)
    assert_pools_equal(got, want)


@interpret
@pytest.mark.interpret
@pytest.mark.parametrize("bits", [4, 2])
def test_write_pages_extreme_values(bits):
    """fp32 values beyond fp16's range: zero and scale clamp to +-65504 exactly as the reference does."""
    k = torch.randn(1, 1, 32, 64) * 1e6
    v = torch.randn(1, 1, 32, 64) * 1e-6
    v[0, 0, 3] = torch.linspace(-1e6, 1e6, 64)
    got = make_pool(1, 1, 64, bits, torch.float32)
    want = [t.clone() for t in got]
    tq.write_pages(k, v, torch.tensor([0]), *got, bits)
    cache_ops.write_pages_reference(k, v, torch.tensor([0]), *want, bits)
    assert_pools_equal(got, want)


@interpret
@pytest.mark.interpret
def test_write_pages_non_contiguous_input():
    k, v = page_values(2, 4, 64, torch.bfloat16)
    k_t = k.transpose(0, 1).contiguous().transpose(0, 1)  # same values, other strides
    got = make_pool(2, 4, 64, 4)
    want = [t.clone() for t in got]
    tq.write_pages(k_t, v, torch.tensor([1, 0]), *got, 4)
    cache_ops.write_pages_reference(k, v, torch.tensor([1, 0]), *want, 4)
    assert_pools_equal(got, want)


def make_storage(batch, heads, head_dim, maxp, bits, lengths, dtype=torch.bfloat16, device="cpu"):
    exact = dict(dtype=dtype, device=device)
    st = [torch.randn(batch, heads, 32, head_dim, **exact), torch.randn(batch, heads, 32, head_dim, **exact),
          torch.randn(batch, heads, layout.RING, head_dim, **exact),
          torch.randn(batch, heads, layout.RING, head_dim, **exact),
          torch.tensor(lengths, dtype=torch.int32, device=device)]
    # own cell: row b's pages at b * maxp + p, stored in reverse to exercise the page table
    page_table = (torch.arange(batch)[:, None] * maxp + torch.arange(maxp).flip(0)[None, :]).int().to(device)
    return st, page_table, make_pool(batch * maxp, heads, head_dim, bits, dtype, device)


def run_appends(bits, lengths, steps, *, maxp=3, heads=2, head_dim=64, dtype=torch.bfloat16, device="cpu"):
    batch = len(lengths)
    st, pt, pool = make_storage(batch, heads, head_dim, maxp, bits, lengths, dtype, device)
    got = ([t.clone() for t in st], [t.clone() for t in pool])
    want = ([t.clone() for t in st], [t.clone() for t in pool])
    exits = 0
    for _ in range(steps):
        kn = torch.randn(batch, heads, 1, head_dim, dtype=dtype, device=device)
        vn = torch.randn(batch, heads, 1, head_dim, dtype=dtype, device=device)
        n = want[0][4]
        q = layout.QUANTIZE_LENGTH
        exits += int(((n + 1 >= q) & ((n + 1 - q) % 32 == 0) & (n < layout.capacity(maxp))).sum())
        tq.append(kn, vn, *got[0], pt, *got[1], bits)
        cache_ops.append_reference(kn, vn, *want[0], pt, *want[1], bits)
        for name, a, b in zip(("sink_k", "sink_v", "win_k", "win_v", "lengths"), got[0], want[0], strict=True):
            assert torch.equal(a, b), name
        assert_pools_equal(got[1], want[1])
    return exits


@interpret
@pytest.mark.interpret
@pytest.mark.parametrize("bits", [4, 2, 16, 0])
def test_append_matches_reference(bits):
    """Rows: empty, inside the sink, at the sink's end, one before page 0 is quantized, one before page 1,
    at capacity (unchanged). Two steps cross both page writes."""
    maxp = 3
    q = layout.QUANTIZE_LENGTH
    lengths = [0, 5, 31, q - 1, q + 31, layout.capacity(maxp)]
    exits = run_appends(bits, lengths, 2, maxp=maxp)
    assert exits == 2


@interpret
@pytest.mark.interpret
def test_append_gqa_shape_and_fp32():
    q = layout.QUANTIZE_LENGTH
    exits = run_appends(4, [q + 63, q - 33], 2, maxp=4, heads=3, head_dim=96, dtype=torch.float32)
    assert exits == 1


@interpret
@pytest.mark.interpret
def test_append_without_pages():
    """maxp = 0 (max_cache_len below the first page): tokens land, nothing is quantized, full rows stay."""
    exits = run_appends(4, [0, 100, 316, 318], 3, maxp=0)
    assert exits == 0


@interpret
@pytest.mark.interpret
def test_append_counter_reset_across_calls():
    """The row counters are reset by the kernel: many calls in a row keep lengths exact."""
    st, pt, pool = make_storage(3, 4, 64, 1, 4, [0, 10, 300])
    for _ in range(5):
        kn = torch.randn(3, 4, 1, 64, dtype=torch.bfloat16)
        tq.append(kn, kn, *st, pt, *pool, 4)
    assert st[4].tolist() == [5, 15, 305]
    assert int(tq.counters("cpu", 3, purpose="append")[:3].abs().sum()) == 0


# ---------------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("bits", [4, 2, 16])
def test_write_pages_gpu_matches_cpu_reference(bits):
    n, heads, head_dim = 64, 16, 128
    k, v = page_values(n, heads, head_dim, torch.bfloat16, bits=bits, seed=bits)
    pages = torch.randperm(2 * n)[:n]
    pool = make_pool(2 * n, heads, head_dim, bits)
    want = [t.clone() for t in pool]
    got = [t.cuda() for t in pool]
    tq.write_pages(k.cuda(), v.cuda(), pages.cuda(), *got, bits)
    cache_ops.write_pages_reference(k, v, pages, *want, bits)
    assert_pools_equal([t.cpu() for t in got], want)


@pytest.mark.gpu
@pytest.mark.parametrize("bits", [4, 2, 16, 0])
def test_append_gpu_matches_reference(bits):
    maxp = 8
    q = layout.QUANTIZE_LENGTH
    lengths = [0, 31, q - 1, q + 31, q + 32 * 5 - 3, layout.capacity(maxp), 1000 % layout.capacity(maxp), 500]
    run_appends(bits, lengths, 40, maxp=maxp, heads=16, head_dim=128, device="cuda")
