"""Triton cache-writing kernels (``write_pages_``, ``advance_``) against the references: codes ``torch.equal``.

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

from loopkv.format import QUANTIZE_LENGTH, RING, capacity  # noqa: E402
from loopkv.ops import cache_ops, codec  # noqa: E402
from loopkv.ops import triton_quant as tq  # noqa: E402
from loopkv.ops.step_ops import advance_stacks_reference  # noqa: E402

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
@pytest.mark.parametrize(("head_dim", "dtype"), [(64, torch.bfloat16), (96, torch.float32), (128, torch.float16),
                                                  (256, torch.bfloat16)])
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


def make_stacks(cells, batch, heads, head_dim, maxp, bits, lengths, dtype=torch.bfloat16, device="cpu", seed=0):
    """Stacks as ``advance_`` takes them (``CellStacks``): lengths [cells, batch] (``lengths`` rotated by the cell's
    index), windows [cells, batch * H * RING * D] (random), page tables and pools [2, ...] (row b's pages at b * maxp
    + p, in reverse; random bytes)."""
    g = torch.Generator().manual_seed(seed)
    ring = [torch.randn(cells, batch * heads * RING * head_dim, generator=g).to(dtype=dtype, device=device)
            for _ in range(2)]
    own = torch.tensor([[*lengths[c:], *lengths[:c]] for c in range(cells)], dtype=torch.int32, device=device)
    table = (torch.arange(batch)[:, None] * maxp + torch.arange(maxp).flip(0)[None, :]).int().flatten()
    tables = table[None].expand(2, -1).contiguous().to(device)
    per_pool = [make_pool(batch * maxp, heads, head_dim, bits or 4, dtype, device) for _ in range(2)]
    pools = [torch.stack([p[i].flatten() for p in per_pool]) if per_pool[0][i].numel() else per_pool[0][i]
             for i in range(7)]
    return own, ring, tables, pools


def run_advance(bits, lengths, steps, *, cells=3, maxp=3, heads=2, head_dim=64, dtype=torch.bfloat16, device="cpu"):
    """``steps`` calls of Triton ``advance`` on cells [2, 0] -> pools [0, 1] of ``cells`` stacked cells, the first
    ``len(lengths) - 1`` rows, against ``advance_stacks_reference`` on a copy: every tensor bit for bit after every
    step. Returns the window exits the reference saw."""
    batch = len(lengths)
    own, ring, tables, pools = make_stacks(cells, batch, heads, head_dim, maxp, bits, lengths, dtype, device)
    want = [t.clone() for t in (own, *ring, tables, *pools)]
    got = [own, *ring, tables, *pools]
    idx = torch.tensor([2, 0], dtype=torch.int32, device=device), torch.tensor([0, 1], dtype=torch.int32,
                                                                                 device=device)
    exits = 0
    for _ in range(steps):
        n = want[0][idx[0].long(), : batch - 1]
        exits += int(((n + 1 >= QUANTIZE_LENGTH) & ((n + 1 - QUANTIZE_LENGTH) % 32 == 0)
                      & (n < capacity(maxp))).sum())
        args = (batch - 1, batch, heads, head_dim, maxp, bits)
        advance_stacks_reference(*idx, *want, *args)
        tq.advance(*idx, *got, *args)
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            assert torch.equal(a.cpu(), b.cpu()), i
    return exits


@interpret
@pytest.mark.interpret
@pytest.mark.parametrize("bits", [4, 2, 16, 0])
def test_advance_matches_reference(bits):
    """Rows: empty, inside the sink, one before page 0 is quantized, one before page 1, at capacity (unchanged), and
    a last row beyond the batch (unchanged); three cells, two listed, in another order than their pools. Two steps
    cross both page writes."""
    q = QUANTIZE_LENGTH
    exits = run_advance(bits, [0, 31, q - 1, q + 31, capacity(3), 5], 2)
    assert exits == 4


@interpret
@pytest.mark.interpret
@pytest.mark.parametrize("bits", [4, 2, 16])
@pytest.mark.parametrize("head_dim", [96, 256])
def test_advance_matches_reference_at_wide_and_padded_head_dims(bits, head_dim):
    """Window exits at head_dim 96 (padded to 128 with masks) and 256, one KV head: the same bits as the reference."""
    q = QUANTIZE_LENGTH
    exits = run_advance(bits, [q - 1, q + 31, capacity(3), 0], 2, heads=1, head_dim=head_dim)
    assert exits == 3


@interpret
@pytest.mark.interpret
@pytest.mark.parametrize(("bits", "head_dim"), [(4, 32), (16, 32), (16, 80)])
def test_head_dims_the_kernels_do_not_serve_run_the_reference(bits, head_dim):
    """head_dim 32 and 80 (a bf16 plan's, not a multiple of 32): ``write_pages_`` and ``advance_`` run the
    references, with the same results."""
    k, v = page_values(2, 2, head_dim, torch.bfloat16, bits=bits)
    got = make_pool(3, 2, head_dim, bits)
    want = [t.clone() for t in got]
    tq.write_pages(k, v, torch.tensor([2, 0]), *got, bits)
    cache_ops.write_pages_reference(k, v, torch.tensor([2, 0]), *want, bits)
    assert_pools_equal(got, want)
    q = QUANTIZE_LENGTH
    assert run_advance(bits, [q - 1, 5, 0], 1, heads=1, head_dim=head_dim) == 2


@interpret
@pytest.mark.interpret
@pytest.mark.parametrize("programs", [1, 3])
def test_advance_programs_per_row(programs, monkeypatch):
    """1 and 3 (not a divisor of 2 H) programs per row share a window exit's encode tasks; the row's counter is reset
    for the next call."""
    monkeypatch.setattr(tq, "advance_programs", lambda *a: programs)
    q = QUANTIZE_LENGTH
    run_advance(4, [q - 1, q + 30, 0], 3, heads=3, head_dim=96, dtype=torch.float32)
    assert int(tq.counters("cpu", 8, purpose="advance")[:8].abs().sum()) == 0


# ---------------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("bits", [4, 2, 16])
@pytest.mark.parametrize(("heads", "head_dim"), [(16, 128), (4, 256), (55, 96)])  # Ouro, Dory, Huginn cells
def test_write_pages_gpu_matches_cpu_reference(bits, heads, head_dim):
    n = 64
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
@pytest.mark.parametrize(("heads", "head_dim"), [(16, 128), (4, 256), (55, 96)])  # Ouro, Dory, Huginn cells
def test_advance_gpu_matches_reference(bits, heads, head_dim):
    """A model's cell shape, 8 rows crossing window exits at different steps, 40 steps."""
    q = QUANTIZE_LENGTH
    maxp = 8
    lengths = [0, 31, q - 1, q + 31, q + 32 * 5 - 3, capacity(maxp), 1000 % capacity(maxp), 500]
    run_advance(bits, lengths, 40, maxp=maxp, heads=heads, head_dim=head_dim, device="cuda")
