"""Property tests of the codec reference (loopkv/ops/codec.py), against float64 math and hand-computed bytes.

Every property is a plain ``check_*`` function, driven by hypothesis in one test and, in a second test,
run against a deliberately broken copy of the codec (``monkeypatch``) to show that the check catches
that break ("mutation tests").

Dequantization bound, per group ``x`` (32 values; K: one channel over a page's 32 tokens, V: 32
channels of one token), ``b`` bits, ``Lv = 2**b - 1`` levels:

* stored ``z = fp16(min x)`` and ``s = fp16(max(max x - min x, EPS) / Lv)``; let ``s* = max(max x -
  min x, EPS) / Lv`` be the exact (float64) scale before fp16 rounding, so ``max x - min x <= Lv * s*``.
* ``code = clamp(round(u), 0, Lv)`` with ``u = (x - z) / s`` and ``x_hat = code * s + z``. Three cases:
  - ``0 <= u <= Lv``: ``|x_hat - x| = s * |code - u| <= s / 2``;
  - ``u > Lv`` (code = Lv): ``0 < x - x_hat = x - z - Lv*s <= (min x - z) + (max x - min x) - Lv*s
    <= |z - min x| + Lv * |s - s*|``;
  - ``u < 0`` (code = 0): ``0 < x_hat - x = z - x <= z - min x <= |z - min x|``.
  So ``|x_hat - x| <= s/2 + |z - min x| + Lv * |s - s*|`` (the sum covers every case).
* fp32 slack: ``x - z`` and the division each round once (relative ``2**-24``), which moves ``u`` by at
  most ``2**-23 * |x - z| / s`` and so ``x_hat`` by ``2**-23 * (|x| + |z|)``; ``code * s`` is exact (4 + 11
  bits) and ``+ z`` rounds once more, ``2**-24 * (|z| + Lv * s)``. Total below
  ``2**-22 * (|x| + |z| + Lv * s)``; we allow ``2**-20`` times that (4x margin).

Cold V decode: ``4*hi + 1.5`` against the full code ``4*hi + lo``, ``lo in {0..3}``: at most 1.5 code
steps, ``|decode_cold - decode_full| <= 1.5 * s`` plus the same fp32 slack.
"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from loopkv.ops import codec

FP32_SLACK = 2.0**-20  # times (|x| + |zero| + levels * scale); derivation in the module docstring
FP16_MIN_NORMAL = 2.0**-14
GROUP_KINDS = ("normal", "uniform", "constant", "two_values", "outlier", "zeros", "tiny_range", "extreme")


# ------------------------------------------------------------------------------------------ data


def make_groups(seed: int, n_groups: int, *, kinds=GROUP_KINDS, max_abs: float = 1e30) -> torch.Tensor:
    """float64 [n_groups, 32]: each group of one random kind, magnitude 2**U(-12, 12), random offset."""
    g = torch.Generator().manual_seed(seed)
    kind_ids = torch.randint(len(kinds), (n_groups,), generator=g)
    mag = 2.0 ** (torch.rand(n_groups, 1, generator=g, dtype=torch.float64) * 24 - 12)
    offset = torch.where(
        torch.rand(n_groups, 1, generator=g, dtype=torch.float64) < 0.5,
        0.0,
        mag * (torch.rand(n_groups, 1, generator=g, dtype=torch.float64) * 100 - 50),
    )
    normal = torch.randn(n_groups, codec.GROUP, generator=g, dtype=torch.float64)
    uniform = torch.rand(n_groups, codec.GROUP, generator=g, dtype=torch.float64)
    bits = torch.rand(n_groups, codec.GROUP, generator=g, dtype=torch.float64) < 0.5
    sign = torch.where(torch.rand(n_groups, codec.GROUP, generator=g) < 0.5, -1.0, 1.0).double()
    out_pos = torch.randint(codec.GROUP, (n_groups, 1), generator=g)
    outlier = normal.clone()
    outlier.scatter_(1, out_pos, 1000.0)
    candidates = {
        "normal": offset + mag * normal,
        "uniform": offset + mag * uniform,
        "constant": (offset + mag * normal[:, :1]).expand(-1, codec.GROUP),
        "two_values": offset + mag * bits.double(),
        "outlier": offset + mag * outlier,
        "zeros": torch.zeros(n_groups, codec.GROUP, dtype=torch.float64),
        "tiny_range": offset + 1e-6 * normal,  # range far below EPS: the eps guard decides the scale
        "extreme": sign * (60000.0 + 5504.0 * uniform),  # up to the edge of fp16's range
    }
    stacked = torch.stack([candidates[k] for k in kinds])  # [K, n_groups, 32]
    x = stacked[kind_ids, torch.arange(n_groups)]
    return x.clamp(-max_abs, max_abs)


def k_page(groups: torch.Tensor, heads: int, dim: int) -> torch.Tensor:
    """K page [heads, PAGE, dim] whose channel c of head h over the 32 tokens is group h*dim + c."""
    return groups.reshape(heads, dim, codec.PAGE).transpose(-1, -2)


def v_page(groups: torch.Tensor, heads: int, dim: int) -> torch.Tensor:
    """V page [heads, PAGE, dim] whose channels 32j..32j+31 of token t, head h are one group."""
    return groups.reshape(heads, codec.PAGE, dim)


def as_dtype(x64: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    fmax = torch.finfo(dtype).max
    return x64.clamp(-fmax, fmax).to(dtype)


# ------------------------------------------------------------------------------------------ checks


def exact_scale(x64: torch.Tensor, bits: int) -> torch.Tensor:
    """s* = max(max x - min x, EPS) / levels in float64, per group along the last axis."""
    return (x64.amax(-1) - x64.amin(-1)).clamp_min(codec.EPS) / (2**bits - 1)


def check_dequant_bound(x: Tensor, x_hat: Tensor, scale: Tensor, zero: Tensor, bits: int) -> None:
    """x, x_hat: [..., G] (one group along the last axis); scale, zero: fp16 [...]."""
    levels = 2**bits - 1
    x64, s, z = x.double(), scale.double(), zero.double()
    assert torch.isfinite(x_hat).all()
    bound = s / 2 + (z - x64.amin(-1)).abs() + levels * (s - exact_scale(x64, bits)).abs()
    slack = FP32_SLACK * (x64.abs().amax(-1) + z.abs() + levels * s)
    err = (x_hat.double() - x64).abs().amax(-1)
    assert (err <= bound + slack).all(), f"max excess {(err - bound - slack).max().item()}"


def check_codes_nearest(x: Tensor, codes: Tensor, scale: Tensor, zero: Tensor, bits: int) -> None:
    """Each code is the nearest integer in [0, levels] to (x - zero) / scale (float64, up to fp32 noise)."""
    u = (x.double() - zero.double().unsqueeze(-1)) / scale.double().unsqueeze(-1)
    assert codes.dtype == torch.uint8
    assert int(codes.max()) <= 2**bits - 1
    dist = (codes.double() - u.clamp(0, 2**bits - 1)).abs()
    assert (dist <= 0.5 + 1e-4).all()


def check_qparams(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int):
    """zero = fp16(min x) exactly; scale = fp16(s*) within one fp16 rounding of an fp32 value; the scale is
    a positive fp16 normal (the eps guard)."""
    x64 = x.double()
    assert scale.dtype == zero.dtype == torch.float16
    assert torch.equal(zero, x64.amin(-1).clamp(-codec.FP16_MAX, codec.FP16_MAX).to(torch.float16))
    ref = exact_scale(x64, bits).clamp_max(codec.FP16_MAX)
    assert torch.allclose(scale.double(), ref, rtol=2.0**-10, atol=0)
    assert (scale.double() >= FP16_MIN_NORMAL).all(), "scale must be a positive fp16 normal (eps guard)"


def check_full_range(x: Tensor, codes: Tensor, bits: int) -> int:
    """A group with spread reaches codes 0 and ``2**bits - 1``; returns how many groups qualified.

    Qualifying depends on the data only: range >= EPS, ``s*`` an fp16 normal (so fp16 rounds it by at
    most ``2**-11`` relative: ``Lv * |s - s*| <= 15 * 2**-11 * s* < 0.01 s*``) and ``|fp16(min x) - min x|
    < 0.1 s*``. A correct codec then maps ``min x`` within 0.11 steps of code 0 and ``max x`` within 0.11
    steps of ``Lv``."""
    levels = 2**bits - 1
    x64 = x.double()
    lo, s_star = x64.amin(-1), exact_scale(x64, bits)
    z = lo.clamp(-codec.FP16_MAX, codec.FP16_MAX).half().double()
    qualify = (
        (x64.amax(-1) - lo >= codec.EPS)
        & (s_star >= FP16_MIN_NORMAL)
        & (s_star <= codec.FP16_MAX)
        & ((z - lo).abs() < 0.1 * s_star)
    )
    assert (codes.amax(-1)[qualify] == levels).all(), "a group with spread must reach the top code"
    assert (codes.amin(-1)[qualify] == 0).all(), "a group with spread must reach code 0"
    return int(qualify.sum())


def check_constant_groups(value: float, bits: int):
    """A page whose every group is constant: a finite scale > 0, and the decode is the fp16 constant."""
    k = torch.full((2, codec.PAGE, 64), value)
    v = torch.full((2, codec.PAGE, 64), value)
    pages = codec.encode_pages(k, v, bits)
    for scale in (pages.k_scale, pages.v_scale):
        assert torch.isfinite(scale).all()
        assert (scale.double() >= FP16_MIN_NORMAL).all(), "constant group: the eps guard keeps scale > 0"
    k_hat, v_hat = codec.decode_k(pages, bits), codec.decode_v(pages, bits)
    check_dequant_bound(k.transpose(-1, -2), k_hat.transpose(-1, -2), pages.k_scale, pages.k_zero, bits)
    check_dequant_bound(
        v.unflatten(-1, (-1, 32)), v_hat.unflatten(-1, (-1, 32)), pages.v_scale, pages.v_zero, bits
    )
    constant16 = torch.tensor(value).clamp(-codec.FP16_MAX, codec.FP16_MAX).half().float()
    assert (k_hat == constant16).all()  # code 0 * scale + zero == zero exactly
    assert (v_hat == constant16).all()


def check_pack_round_trip(codes: torch.Tensor, bits: int):
    packed = codec.pack(codes, bits)
    assert packed.dtype == torch.uint8
    assert packed.shape == codes.shape[:-1] + (codes.shape[-1] * bits // 8,)
    assert torch.equal(codec.unpack(packed, bits), codes)


def check_pack_golden():
    """Hand-computed bytes: element i of a byte sits at bit ``bits * i``."""
    # bits=4: [3, 10] -> 3 | 10 << 4 = 0xA3; [15, 0] -> 0x0F
    assert codec.pack(torch.tensor([[3, 10, 15, 0]], dtype=torch.uint8), 4).tolist() == [[0xA3, 0x0F]]
    # bits=2: [1, 2, 3, 0] -> 1 | 2 << 2 | 3 << 4 | 0 << 6 = 0x39; [3, 3, 3, 3] -> 0xFF
    assert codec.pack(torch.tensor([1, 2, 3, 0, 3, 3, 3, 3], dtype=torch.uint8), 2).tolist() == [0x39, 0xFF]
    assert codec.unpack(torch.tensor([0xA3], dtype=torch.uint8), 4).tolist() == [3, 10]
    assert codec.unpack(torch.tensor([0x39], dtype=torch.uint8), 2).tolist() == [1, 2, 3, 0]


def check_planes(codes4: torch.Tensor):
    hi, lo = codec.split_planes(codes4)
    assert int(hi.max()) <= 3
    assert int(lo.max()) <= 3
    assert torch.equal(4 * hi + lo, codes4)


def check_cold_decode(pages: codec.PageCodes, cold: torch.Tensor):
    """cold bool [..., PAGE]: cold tokens within 1.5 steps of the full decode and equal to 4*hi + 1.5;
    hot tokens bit-identical to the full decode."""
    full = codec.decode_v(pages, 4)
    mixed = codec.decode_v(pages, 4, cold=cold)
    assert torch.isfinite(mixed).all()
    assert torch.equal(mixed[~cold], full[~cold])
    s = pages.v_scale.double().repeat_interleave(codec.GROUP, dim=-1)  # [..., PAGE, D]
    z = pages.v_zero.double().repeat_interleave(codec.GROUP, dim=-1)
    hi = codec.unpack(pages.v_hi, 2).double()
    expect = (4 * hi + 1.5) * s + z  # float64 reference of the cold decode
    slack = FP32_SLACK * (z.abs() + 15 * s)
    assert ((mixed.double() - expect).abs()[cold] <= slack[cold]).all()
    assert ((mixed.double() - full.double()).abs()[cold] <= (1.5 * s + slack)[cold]).all()


def check_head_dim_refused(dim: int):
    with pytest.raises(ValueError, match=f"head_dim={dim} is not a multiple of the codec's group size 32"):
        codec.check_head_dim(dim)
    x = torch.zeros(1, codec.PAGE, max(dim, 1))
    if dim > 0:
        with pytest.raises(ValueError, match="not a multiple of the codec's group size"):
            codec.quantize_v(x, 4)
        with pytest.raises(ValueError, match="not a multiple of the codec's group size"):
            codec.encode_pages(x, x, 2)


# ------------------------------------------------------------------------------------------ tests

shapes = st.tuples(st.integers(1, 3), st.sampled_from([32, 64, 96]))
dtypes = st.sampled_from([torch.float32, torch.bfloat16, torch.float16])


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), bits=st.sampled_from([2, 4]), shape=shapes, dtype=dtypes)
def test_quantize_k_and_v_properties(seed, bits, shape, dtype):
    heads, dim = shape
    k = as_dtype(k_page(make_groups(seed, heads * dim), heads, dim), dtype)
    v = as_dtype(v_page(make_groups(seed + 1, heads * dim), heads, dim), dtype)
    codes, scale, zero = codec.quantize_k(k, bits)
    kx, kc = k.float().transpose(-1, -2), codes.transpose(-1, -2)  # groups along the last axis
    check_qparams(kx, scale, zero, bits)
    check_codes_nearest(kx, kc, scale, zero, bits)
    check_dequant_bound(kx, codec.dequantize_k(codes, scale, zero).transpose(-1, -2), scale, zero, bits)
    check_full_range(kx, kc, bits)
    codes, scale, zero = codec.quantize_v(v, bits)
    vx, vc = v.float().unflatten(-1, (-1, 32)), codes.unflatten(-1, (-1, 32))
    check_qparams(vx, scale, zero, bits)
    check_codes_nearest(vx, vc, scale, zero, bits)
    check_dequant_bound(vx, codec.dequantize_v(codes, scale, zero).unflatten(-1, (-1, 32)), scale, zero, bits)
    check_full_range(vx, vc, bits)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), bits=st.sampled_from([2, 4]), shape=shapes, dtype=dtypes)
def test_encode_decode_pages_within_bound(seed, bits, shape, dtype):
    """The stored path (quantize, pack, split planes, unpack, dequantize) keeps the bound."""
    heads, dim = shape
    k = as_dtype(k_page(make_groups(seed, heads * dim), heads, dim), dtype)
    v = as_dtype(v_page(make_groups(seed + 1, heads * dim), heads, dim), dtype)
    pages = codec.encode_pages(k, v, bits)
    assert pages.k_codes.shape == (heads, codec.PAGE, dim * bits // 8)
    assert pages.k_scale.shape == pages.k_zero.shape == (heads, dim)
    assert pages.v_hi.shape == (heads, codec.PAGE, dim // 4)
    assert pages.v_lo.shape == ((heads, codec.PAGE, dim // 4) if bits == 4 else (heads, codec.PAGE, 0))
    assert pages.v_scale.shape == pages.v_zero.shape == (heads, codec.PAGE, dim // codec.GROUP)
    k_hat, v_hat = codec.decode_k(pages, bits), codec.decode_v(pages, bits)
    check_dequant_bound(
        k.float().transpose(-1, -2), k_hat.transpose(-1, -2), pages.k_scale, pages.k_zero, bits
    )
    check_dequant_bound(
        v.float().unflatten(-1, (-1, 32)), v_hat.unflatten(-1, (-1, 32)), pages.v_scale, pages.v_zero, bits
    )
    # the decode equals dequantizing quantize_*'s codes exactly
    assert torch.equal(k_hat, codec.dequantize_k(*codec.quantize_k(k, bits)))
    assert torch.equal(v_hat, codec.dequantize_v(*codec.quantize_v(v, bits)))


def test_full_range_is_exercised():
    """The full-range check is not vacuous on ordinary data: most groups qualify and reach both ends."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, codec.PAGE, 128, generator=g)
    for bits in (2, 4):
        codes, scale, _ = codec.quantize_v(x, bits)
        n = check_full_range(x.unflatten(-1, (-1, 32)), codes.unflatten(-1, (-1, 32)), bits)
        assert n >= 0.9 * scale.numel()


@settings(max_examples=30, deadline=None)
@given(
    bits=st.sampled_from([2, 4]),
    lead=st.lists(st.integers(1, 3), max_size=2),
    n_bytes=st.integers(1, 9),
    seed=st.integers(0, 2**31 - 1),
)
def test_pack_unpack_round_trip(bits, lead, n_bytes, seed):
    n = n_bytes * 8 // bits
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(2**bits, (*lead, n), generator=g, dtype=torch.uint8)
    check_pack_round_trip(codes, bits)


def test_pack_golden_bytes():
    check_pack_golden()


def test_pack_unpack_errors():
    with pytest.raises(ValueError, match="bits must be 2 or 4"):
        codec.pack(torch.zeros(8, dtype=torch.uint8), 3)
    with pytest.raises(ValueError, match="bits must be 2 or 4"):
        codec.unpack(torch.zeros(8, dtype=torch.uint8), 8)
    with pytest.raises(ValueError, match="not a multiple of 4 codes per byte"):
        codec.pack(torch.zeros(6, dtype=torch.uint8), 2)
    for fn in (codec.quantize_k, codec.quantize_v):
        with pytest.raises(ValueError, match="bits must be 2 or 4"):
            fn(torch.zeros(codec.PAGE, 32), 8)
    with pytest.raises(ValueError, match="pages hold 32 tokens"):
        codec.encode_pages(torch.zeros(2, 16, 32), torch.zeros(2, 16, 32), 4)


def test_planes_hi_lo():
    check_planes(torch.arange(16, dtype=torch.uint8))
    # and through encode_pages: 4 * unpack(v_hi) + unpack(v_lo) is exactly quantize_v's code
    g = torch.Generator().manual_seed(2)
    v = torch.randn(3, codec.PAGE, 64, generator=g)
    pages = codec.encode_pages(torch.randn(3, codec.PAGE, 64, generator=g), v, 4)
    codes, _, _ = codec.quantize_v(v, 4)
    check_planes(codes)
    assert torch.equal(4 * codec.unpack(pages.v_hi, 2) + codec.unpack(pages.v_lo, 2), codes)


def test_golden_page():
    """A hand-computed INT4 and INT2 page (every group spans 0..levels, so scale 1 and zero 0 exactly)."""
    t = torch.arange(codec.PAGE).view(-1, 1)
    c = torch.arange(64).view(1, -1)
    k4 = ((t + c) % 16).float().unsqueeze(0)  # [1, 32, 64]: every channel sees 0..15 over the page
    v4 = (c % 16).float().expand(codec.PAGE, -1).unsqueeze(0)
    pages = codec.encode_pages(k4, v4, 4)
    for t_ in (pages.k_scale, pages.v_scale):
        assert (t_ == 1).all()
    for t_ in (pages.k_zero, pages.v_zero):
        assert (t_ == 0).all()
    # K token 0: channels (0, 1) -> 0 | 1 << 4 = 0x10, (2, 3) -> 0x32; token 1: (1, 2) -> 0x21
    assert pages.k_codes[0, 0, :2].tolist() == [0x10, 0x32]
    assert pages.k_codes[0, 1, :2].tolist() == [0x21, 0x43]
    # V: channels 4j..4j+3 share hi = j % 4 -> byte (j % 4) * 0b01010101; lo = 0, 1, 2, 3 -> 0xE4
    assert pages.v_hi[0, 0, :4].tolist() == [0x00, 0x55, 0xAA, 0xFF]
    assert (pages.v_lo == 0xE4).all()
    assert torch.equal(codec.decode_k(pages, 4), k4)
    assert torch.equal(codec.decode_v(pages, 4), v4)
    # INT2: K token t: all channels (t + c) % 4; V channels c % 4 -> 0 | 1 << 2 | 2 << 4 | 3 << 6 = 0xE4
    k2, v2 = ((t + c) % 4).float().unsqueeze(0), (c % 4).float().expand(codec.PAGE, -1).unsqueeze(0)
    pages = codec.encode_pages(k2, v2, 2)
    assert pages.k_codes[0, 0, :1].tolist() == [0xE4]
    assert pages.k_codes[0, 1, :1].tolist() == [0x39]  # codes 1, 2, 3, 0
    assert (pages.v_hi == 0xE4).all()
    assert torch.equal(codec.decode_v(pages, 2), v2)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), shape=shapes, cold_p=st.sampled_from([0.0, 0.3, 1.0]))
def test_cold_decode_within_one_and_a_half_steps(seed, shape, cold_p):
    heads, dim = shape
    g = torch.Generator().manual_seed(seed)
    v = v_page(make_groups(seed, heads * dim), heads, dim).float()
    pages = codec.encode_pages(torch.randn(heads, codec.PAGE, dim, generator=g), v, 4)
    cold = torch.rand(heads, codec.PAGE, generator=g) < cold_p
    check_cold_decode(pages, cold)


def test_cold_is_ignored_by_int2():
    g = torch.Generator().manual_seed(3)
    pages = codec.encode_pages(torch.randn(2, 32, 64, generator=g), torch.randn(2, 32, 64, generator=g), 2)
    cold = torch.ones(2, 32, dtype=torch.bool)
    assert torch.equal(codec.decode_v(pages, 2, cold=cold), codec.decode_v(pages, 2))


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("value", [0.0, -0.0, 1.0, -3.14159, 1e-7, 1000.3, 65504.0, -65504.0])
def test_constant_and_zero_groups(value, bits):
    check_constant_groups(value, bits)


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_values_near_and_beyond_fp16_range_stay_finite(bits, dtype):
    """Values at fp16's edge keep the bound; values beyond it (fp32/bf16 caches) still decode finitely."""
    edge = make_groups(5, 2 * 64, kinds=("extreme",))
    edge[0, 0], edge[0, 1] = codec.FP16_MAX, -codec.FP16_MAX  # one group spanning the whole fp16 range
    for page_of in (k_page, v_page):
        x = as_dtype(page_of(edge, 2, 64), dtype)
        pages = codec.encode_pages(x, x, bits)
        for scale in (pages.k_scale, pages.v_scale):
            assert torch.isfinite(scale).all()
        k_hat, v_hat = codec.decode_k(pages, bits), codec.decode_v(pages, bits)
        xf = x.float()
        check_dequant_bound(xf.transpose(-1, -2), k_hat.transpose(-1, -2), pages.k_scale, pages.k_zero, bits)
        check_dequant_bound(
            xf.unflatten(-1, (-1, 32)), v_hat.unflatten(-1, (-1, 32)), pages.v_scale, pages.v_zero, bits
        )
    if dtype != torch.float16:
        huge = as_dtype(make_groups(6, 2 * 64) * 1e6, dtype)  # up to ~1e13, far beyond fp16
        huge[0, 0] = torch.finfo(dtype).max / 2
        huge[0, 1] = -torch.finfo(dtype).max / 2
        pages = codec.encode_pages(v_page(huge, 2, 64), v_page(huge, 2, 64), bits)
        assert torch.isfinite(codec.decode_k(pages, bits)).all()
        assert torch.isfinite(codec.decode_v(pages, bits)).all()
        if bits == 4:
            assert torch.isfinite(codec.decode_v(pages, bits, cold=torch.ones(2, 32, dtype=torch.bool))).all()


@pytest.mark.parametrize("dim", [48, 100, 16, 0, -32])
def test_head_dim_not_a_multiple_of_32_is_refused(dim):
    check_head_dim_refused(dim)


@pytest.mark.parametrize("dim", [32, 64, 96, 128, 256])
def test_head_dims_that_are_multiples_of_32_pass(dim):
    codec.check_head_dim(dim)


# ------------------------------------------------------------------------------------------ mutation tests
# Each test breaks one piece of a copy of the codec (monkeypatch restores it) and shows that the
# corresponding check fails on a fixed example. If one of these starts passing, the check went blind.


def _floor_codes(x, scale, zero, bits):
    q = torch.floor((x - zero.float()) / scale.float())  # mutation: floor instead of round
    return q.clamp_(0, 2**bits - 1).to(torch.uint8)


def _wide_qparams(xmin, xmax, bits):
    levels = 2**bits - 1
    zero = xmin.clamp(-codec.FP16_MAX, codec.FP16_MAX).to(torch.float16)
    scale = (2 * (xmax - xmin).clamp_min(codec.EPS) / levels).to(torch.float16)  # mutation: twice the step
    return scale, zero


def _unclamped_qparams(xmin, xmax, bits):
    levels = 2**bits - 1
    zero = xmin.to(torch.float16)  # mutation: no fp16 range clamp
    scale = ((xmax - xmin).clamp_min(codec.EPS) / levels).to(torch.float16)
    return scale, zero


def _reversed_pack(codes, bits):
    per = 8 // bits
    c = codes.to(torch.uint8).unflatten(-1, (-1, per))
    out = torch.zeros(c.shape[:-1], dtype=torch.uint8)
    for i in range(per):
        out |= c[..., i] << (bits * (per - 1 - i))  # mutation: element 0 in the high bits
    return out


def _random_v_page(seed=7):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, codec.PAGE, 64, generator=g)


def test_mutation_floor_breaks_the_bound(monkeypatch):
    v = _random_v_page()
    monkeypatch.setattr(codec, "_codes", _floor_codes)
    codes, scale, zero = codec.quantize_v(v, 4)
    x_hat = codec.dequantize_v(codes, scale, zero).unflatten(-1, (-1, 32))
    with pytest.raises(AssertionError):
        check_dequant_bound(v.unflatten(-1, (-1, 32)), x_hat, scale, zero, 4)
    with pytest.raises(AssertionError):
        check_codes_nearest(v.unflatten(-1, (-1, 32)), codes.unflatten(-1, (-1, 32)), scale, zero, 4)


def test_mutation_wide_scale_breaks_full_range_and_qparams(monkeypatch):
    v = _random_v_page()
    monkeypatch.setattr(codec, "_qparams", _wide_qparams)
    codes, scale, zero = codec.quantize_v(v, 4)
    vx, vc = v.unflatten(-1, (-1, 32)), codes.unflatten(-1, (-1, 32))
    # the bound is relative to the stored scale, so a too-coarse scale passes it: full range catches it
    check_dequant_bound(vx, codec.dequantize_v(codes, scale, zero).unflatten(-1, (-1, 32)), scale, zero, 4)
    with pytest.raises(AssertionError):
        check_full_range(vx, vc, 4)
    with pytest.raises(AssertionError):
        check_qparams(vx, scale, zero, 4)


def test_mutation_no_eps_guard_breaks_constant_groups(monkeypatch):
    monkeypatch.setattr(codec, "EPS", 0.0)
    with pytest.raises(AssertionError, match="eps guard"):
        check_constant_groups(1.0, 4)


def test_mutation_no_fp16_clamp_breaks_finiteness(monkeypatch):
    monkeypatch.setattr(codec, "_qparams", _unclamped_qparams)
    x = torch.full((1, codec.PAGE, 32), -1e5)
    x[0, 0, 0] = 1e5
    pages = codec.encode_pages(x, x, 4)
    with pytest.raises(AssertionError):
        check_dequant_bound(
            x.transpose(-1, -2), codec.decode_k(pages, 4).transpose(-1, -2), pages.k_scale, pages.k_zero, 4
        )


def test_mutation_reversed_pack_breaks_round_trip_and_golden(monkeypatch):
    monkeypatch.setattr(codec, "pack", _reversed_pack)
    with pytest.raises(AssertionError):
        check_pack_round_trip(torch.tensor([1, 2, 3, 0], dtype=torch.uint8), 2)
    with pytest.raises(AssertionError):
        check_pack_golden()


def test_mutation_wrong_planes_break_hi_lo(monkeypatch):
    monkeypatch.setattr(codec, "split_planes", lambda c: (c >> 2, c & 1))
    with pytest.raises(AssertionError):
        check_planes(torch.arange(16, dtype=torch.uint8))


def test_mutation_wrong_cold_midpoint_breaks_cold_bound(monkeypatch):
    g = torch.Generator().manual_seed(8)
    pages = codec.encode_pages(torch.randn(2, 32, 64, generator=g), torch.randn(2, 32, 64, generator=g), 4)
    monkeypatch.setattr(codec, "COLD_MIDPOINT", 3.5)
    with pytest.raises(AssertionError):
        check_cold_decode(pages, torch.ones(2, 32, dtype=torch.bool))


def test_mutation_no_head_dim_check_is_caught(monkeypatch):
    monkeypatch.setattr(codec, "check_head_dim", lambda head_dim: None)
    with pytest.raises((pytest.fail.Exception, AssertionError)):
        check_head_dim_refused(48)


def test_bound_is_not_vacuous():
    """On ordinary data the bound is about half a step and the worst error comes close to it."""
    v = _random_v_page()
    codes, scale, zero = codec.quantize_v(v, 4)
    err = (codec.dequantize_v(codes, scale, zero) - v).abs().unflatten(-1, (-1, 32)).amax(-1)
    ratio = err / scale.float()
    assert ratio.max() <= 0.5 + 0.01  # fp16 rounding of zero/scale may add a hair
    assert ratio.max() >= 0.45
    ref = exact_scale(v.double().unflatten(-1, (-1, 32)), 4)
    assert math.isclose(float(scale.double().median()), float(ref.median()), rel_tol=0.01)


@pytest.mark.parametrize("bits", [2, 4])
def test_non_contiguous_inputs(bits):
    """Strided views (e.g. a [B, T, H, D] tensor seen as [B, H, T, D]) encode like their contiguous copy."""
    g = torch.Generator().manual_seed(9)
    k = torch.randn(2, codec.PAGE, 3, 64, generator=g).transpose(1, 2)  # [2, 3, PAGE, 64], non-contiguous
    v = torch.randn(2, codec.PAGE, 3, 64, generator=g).transpose(1, 2)
    assert not k.is_contiguous()
    got, want = codec.encode_pages(k, v, bits), codec.encode_pages(k.contiguous(), v.contiguous(), bits)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    codes = torch.randint(2**bits, (16, 5), generator=g, dtype=torch.uint8).t()  # [5, 16] strided
    assert torch.equal(codec.pack(codes, bits), codec.pack(codes.contiguous(), bits))
    check_pack_round_trip(codes, bits)
