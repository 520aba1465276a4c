"""Triton fused cell attention against a float64 re-computation of the same stored state.

Interpreted tests run on CPU under ``TRITON_INTERPRET=1`` (set below before ``loopkv.ops.triton_attention``
is imported, on machines without CUDA; Triton reads it when the kernels are decorated). GPU tests
(``@pytest.mark.gpu``) run the compiled kernel at real shapes, and inside a CUDA graph with the append.

Tolerances: fp32 inputs run every product in fp32 (``ATTN_FP32_*``); bf16 inputs run the tensor-core
path with fp16 operands (``q * k_scale`` and ``p * v_scale`` rounded to fp16, relative 2**-11, far
below the one bf16 rounding of the output that ``ATTN_BF16_*`` allows). The CUDA-core reader's "k16" (on by
default for 16-bit inputs since session 13) sums K's products in fp16: its own tier, ``ATTN_K16_*``.
"""

import math
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")

from loopkv.ops import cache_ops, codec, layout, triton_config  # noqa: E402
from loopkv.ops import triton_attention as ta  # noqa: E402
from loopkv.ops.cell_attention import cell_attention_reference  # noqa: E402
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
    K (per-channel offsets and spreads, like real keys) and V."""
    g = torch.Generator(device=device).manual_seed(seed)  # on the device: real shapes build in seconds
    n = batch * maxp if pool_pages is None else pool_pages

    def rnd(*shape):
        return torch.randn(*shape, generator=g, device=device)

    exact = [rnd(batch, heads, 32, head_dim), rnd(batch, heads, 32, head_dim),
             rnd(batch, heads, layout.RING, head_dim), rnd(batch, heads, layout.RING, head_dim)]
    exact[0] += rnd(1, heads, 1, head_dim)  # a shared per-channel offset in the sink keys
    if page_table is None:
        page_table = torch.arange(batch * maxp).view(batch, maxp).flip(1).contiguous()
    k = rnd(n, heads, 32, head_dim) * (0.5 + 2 * torch.rand(n, heads, 1, head_dim, generator=g, device=device))
    k += rnd(n, heads, 1, head_dim)
    v = rnd(n, heads, 32, head_dim)
    if bits == 16:
        f16, u8 = {"dtype": torch.float16, "device": device}, {"dtype": torch.uint8, "device": device}
        pool = [k.to(dtype), torch.empty(0, **f16), torch.empty(0, **f16), v.to(dtype), torch.empty(0, **u8),
                torch.empty(0, **f16), torch.empty(0, **f16)]
    else:
        pool = list(codec.encode_pages(k.to(dtype), v.to(dtype), bits))
    st = [t.to(dtype) for t in exact] + [torch.tensor(lengths, dtype=torch.int32, device=device),
                                         page_table.int().to(device)] + pool
    return [t.to(device) for t in st]


def reference64(q, st, bits, tau, scale):
    """The reference on the same stored state, in float64 (exact parts and q upcast; codes as stored)."""
    up = [t.double() if t.is_floating_point() and t.dtype != torch.float16 else t for t in st]
    return cell_attention_reference(q.double(), *up, bits, tau, scale)


def reads_k16(q, bits, group, far_impl=None, cc_opts=None):
    """Whether ``cell_attention`` runs "k16" for this call: the CUDA-core reader, with "k16" named in ``cc_opts``
    or, when none are given, in the default for ``bits`` and the inputs are 16-bit (docs/kernels.md)."""
    exact = q.dtype == torch.float32
    if ta.choose_far_impl(bits, group, far_impl, cc_default=ta.CC_DEFAULT, exact=exact) != "cc":
        return False
    if cc_opts is None:
        return not exact and "k16" in triton_config.CC_DEFAULT_OPTS_BY_BITS[bits]
    return "k16" in cc_opts


def assert_k16_close(out, want):
    """Within "k16"'s tier of the float64 reference (tests/tolerances.py): relative L2 and largest difference."""
    assert (out.double() - want).norm() / want.norm() < ATTN_K16_REL_L2
    assert (out.double() - want).abs().max() < ATTN_K16_ATOL


def assert_close_to_reference(out, q, st, bits, tau, scale, want=None, k16=False):
    """``out`` within the reader's tolerance of the float64 reference (computed where the inputs are: on the GPU
    in float64 there, which keeps the GPU tests from waiting on the CPU; ``want`` if given). ``k16``: the call
    ran "k16" (``reads_k16``), whose fp16 sums have their own tier."""
    if want is None:
        want = reference64(q, st, bits, tau, scale)
    assert out.dtype == q.dtype
    assert out.shape == q.shape
    if k16:
        assert_k16_close(out, want)
        return
    if q.dtype == torch.float32:
        atol, rtol = ATTN_FP32_ATOL, ATTN_FP32_RTOL
    else:
        atol, rtol = ATTN_BF16_ATOL, ATTN_BF16_RTOL
    torch.testing.assert_close(out.double(), want, atol=atol, rtol=rtol)


# lengths: empty, inside the sink, window only, exactly one page, pages + a partial page
LENGTHS = [0, 17, 320, 288 + 32 * 3 + 5]
CASES = [  # bits, tau, query heads per KV head, head_dim, dtype
    (4, INF, 1, 128, torch.float32),
    (4, 14.0, 2, 64, torch.float32),
    (4, 0.0, 2, 64, torch.float32),
    (4, 14.0, 3, 96, torch.float32),
    (2, INF, 1, 64, torch.float32),
    (16, INF, 2, 64, torch.float32),
    (4, 14.0, 1, 128, torch.bfloat16),
    (2, INF, 2, 64, torch.bfloat16),
    (16, INF, 1, 64, torch.bfloat16),
]


# history readers: "dot" (tensor cores) and "cc" (CUDA cores, loopkv/ops/triton_far.py); BF16 pages have one
FAR_CASES = [(*c, far) for c in CASES for far in (("dot", "cc") if c[0] != 16 else ("dot",))]


@interpret
@pytest.mark.interpret
@pytest.mark.parametrize(("bits", "tau", "group", "head_dim", "dtype", "far_impl"), FAR_CASES)
def test_matches_reference(bits, tau, group, head_dim, dtype, far_impl):
    heads, maxp = 2, 4
    st = make_cell(len(LENGTHS), heads, head_dim, maxp, bits, LENGTHS, dtype=dtype, seed=bits + head_dim)
    q = torch.randn(len(LENGTHS), heads * group, head_dim).to(dtype)
    scale = head_dim**-0.5
    out = ta.cell_attention(q, *st, bits, tau, scale, splits=2, far_impl=far_impl)
    assert_close_to_reference(out, q, st, bits, tau, scale, k16=reads_k16(q, bits, group, far_impl))
    assert torch.equal(out[0], torch.zeros_like(out[0]))  # length 0 -> zeros


@interpret
@pytest.mark.interpret
@pytest.mark.parametrize(("pages_per_iter", "sub_tokens", "prefetch", "bits", "tau", "group"), [
    (1, 4, False, 4, 2.0, 1), (1, 32, True, 2, INF, 2), (2, 8, True, 4, 14.0, 2), (2, 16, False, 4, 2.0, 1),
    (1, 16, True, 4, INF, 1)])
def test_cuda_core_reader_tilings(pages_per_iter, sub_tokens, prefetch, bits, tau, group):
    """The CUDA-core reader's tilings (pages per iteration, tokens per sub-tile, loads one iteration ahead)
    over odd page counts (the last iteration of 2 pages has one), 0 pages, V precision with cold tokens
    (tau = 2), 1 and 2 query heads per KV head, INT2: all match the reference."""
    lengths = [288 + 32 * 3 + 5, 288 + 32 * 2, 0]
    st = make_cell(len(lengths), 1, 64, 3, bits, lengths, seed=20 + sub_tokens)
    q = 2 * torch.randn(len(lengths), group, 64)
    out = ta.cell_attention(q, *st, bits, tau, 0.125, splits=2, far_impl="cc", pages_per_iter=pages_per_iter,
                            sub_tokens=sub_tokens, prefetch=prefetch, near_block=16 if prefetch else 64)
    assert_close_to_reference(out, q, st, bits, tau, 0.125)


CC_OPT_CASES = [  # cc_opts, bits, tau, query heads per KV head, head_dim, dtype
    (("qk", "vg", "f24"), 4, INF, 1, 128, torch.bfloat16),
    (("qk", "vg", "f24"), 4, 2.0, 2, 64, torch.float32),
    (("qk", "vg", "f24"), 2, INF, 2, 96, torch.bfloat16),
    (("qk", "vg", "f24"), 4, 2.0, 1, 128, torch.bfloat16),
    (("qk", "vg", "f24", "i32"), 4, 2.0, 1, 128, torch.bfloat16),  # 32-bit history offsets
    (("i32",), 2, INF, 2, 64, torch.float32),
    (("i32", "l2"), 2, INF, 1, 64, torch.float32),  # l2: a hint the launcher drops under the interpreter
    # the next page's index (pt) and scales (sc) carried one iteration ahead
    (("qk", "vg", "f24", "l2", "sc"), 4, 2.0, 1, 128, torch.bfloat16),
    (("qk", "vg", "f24", "i32", "pt"), 2, INF, 2, 96, torch.float32),
    pytest.param(("vg",), 4, 14.0, 1, 64, torch.float32, marks=pytest.mark.slow),  # single options: slow set
    pytest.param(("f24",), 2, INF, 1, 64, torch.float32, marks=pytest.mark.slow),
    pytest.param(("qk",), 4, 14.0, 2, 64, torch.bfloat16, marks=pytest.mark.slow),
]


@interpret
@pytest.mark.interpret
@pytest.mark.parametrize(("cc_opts", "bits", "tau", "group", "head_dim", "dtype"), CC_OPT_CASES)
def test_cuda_core_reader_opt_in_variants(cc_opts, bits, tau, group, head_dim, dtype):
    """The variants of the CUDA-core reader (``cc_opts``; all three are the default) over ragged rows (3 pages
    + a partial one, 2 pages, 0 pages with and without a window, empty): they match the reference and, being
    the same products up to exact powers of two in another order of loads, give session 2's reader's bits
    (``cc_opts=()``) under the interpreter."""
    lengths = [288 + 32 * 3 + 5, 288 + 32 * 2, 300, 17, 0]
    st = make_cell(len(lengths), 2, head_dim, 4, bits, lengths, dtype=dtype, seed=30 + bits + head_dim)
    q = (2 * torch.randn(len(lengths), 2 * group, head_dim)).to(dtype)
    scale = head_dim**-0.5
    kw = {"splits": 2, "far_impl": "cc", "num_warps": 1, "sub_tokens": 8}
    out = ta.cell_attention(q, *st, bits, tau, scale, cc_opts=cc_opts, **kw)
    assert_close_to_reference(out, q, st, bits, tau, scale)
    assert torch.equal(out, ta.cell_attention(q, *st, bits, tau, scale, cc_opts=(), **kw))
    if cc_opts == ta.CC_DEFAULT_OPTS and dtype != torch.float32:  # what the launcher runs when not told (fp32
        with triton_config.cc_options(drop=("k16",)):  # inputs take "dot"), but for "k16"'s fp16 sums
            assert torch.equal(out, ta.cell_attention(q, *st, bits, tau, scale, splits=2))


K16_CASES = [  # bits, tau, query heads per KV head, head_dim, dtype
    (4, INF, 1, 128, torch.float32),  # 4 words per lane: two levels of fp16 pair sums
    (4, 2.0, 2, 64, torch.float32),  # V precision with cold tokens, two query heads, one level
    (2, INF, 1, 128, torch.float32),
    (2, INF, 2, 96, torch.bfloat16),  # padded head_dim
]


@interpret
@pytest.mark.interpret
@pytest.mark.parametrize(("bits", "tau", "group", "head_dim", "dtype"), K16_CASES)
def test_cuda_core_reader_k16_within_its_fp16_bound(bits, tau, group, head_dim, dtype):
    """cc_opts "k16" (K's field work in packed fp16 pairs) over ragged rows against the float64 reference: within
    its own documented tier (tests/tolerances.py, fp16 products and sums), and, the same stored codes read in
    another precision, not further from the fp32 reader than that. The fp32 reader stays within ATTN_FP32."""
    lengths = [288 + 32 * 3 + 5, 288 + 32 * 2, 300, 17, 0]
    st = make_cell(len(lengths), 2, head_dim, 4, bits, lengths, dtype=dtype, seed=40 + bits + head_dim)
    g = torch.Generator().manual_seed(7 + head_dim)
    q = (2 * torch.randn(len(lengths), 2 * group, head_dim, generator=g)).to(dtype)
    scale = head_dim**-0.5
    kw = {"splits": 2, "far_impl": "cc", "num_warps": 1, "sub_tokens": 8}
    out = ta.cell_attention(q, *st, bits, tau, scale, cc_opts=("qk", "vg", "f24", "k16"), **kw)
    want = reference64(q, st, bits, tau, scale)
    assert out.dtype == q.dtype
    assert out.shape == q.shape
    if dtype == torch.float32:
        err = (out.double() - want).norm() / want.norm()
        assert err < ATTN_K16_REL_L2
        assert (out.double() - want).abs().max() < ATTN_K16_ATOL
        assert err > 1e-5  # fp16 arithmetic really ran (the fp32 reader is ~1e-6 here)
    else:
        torch.testing.assert_close(out.double(), want, atol=ATTN_BF16_ATOL, rtol=ATTN_BF16_RTOL)
    assert torch.equal(out[4], torch.zeros_like(out[4]))  # length 0 -> zeros
    fp32 = ta.cell_attention(q, *st, bits, tau, scale, cc_opts=("qk", "vg", "f24"), **kw)
    assert (out.double() - fp32.double()).abs().max() < ATTN_K16_ATOL


@pytest.mark.slow
@interpret
@pytest.mark.interpret
@pytest.mark.parametrize(("bits", "tau", "group", "head_dim", "kw", "extra"), [
    (4, INF, 1, 256, {}, ()),  # 8 words per lane: the fp16 pair sums stop at two levels
    (4, 14.0, 1, 128, {"sub_tokens": 16}, ()),
    (2, INF, 2, 64, {"sub_tokens": 4}, ()),  # one word per lane: no pair-sum level
    (4, INF, 1, 128, {"pages_per_iter": 2}, ()),
    (2, INF, 1, 128, {"prefetch": True}, ()),
    (4, 2.0, 1, 128, {}, ("sc",)),  # scales carried a page ahead
])
def test_cuda_core_reader_k16_tilings(bits, tau, group, head_dim, kw, extra):
    """"k16" with the reader's other tilings and head_dim 256: within its tier of the float64 reference."""
    lengths = [288 + 32 * 3 + 5, 288 + 32 * 2, 300, 17, 0]
    st = make_cell(len(lengths), 2, head_dim, 4, bits, lengths, seed=50 + bits + head_dim)
    q = 2 * torch.randn(len(lengths), 2 * group, head_dim, generator=torch.Generator().manual_seed(1))
    scale = head_dim**-0.5
    out = ta.cell_attention(q, *st, bits, tau, scale, splits=2, far_impl="cc", cc_opts=("qk", "vg", "f24", *extra,
                                                                                           "k16"), **kw)
    assert_k16_close(out, reference64(q, st, bits, tau, scale))


@pytest.mark.slow
@interpret
@pytest.mark.interpret
@pytest.mark.parametrize("seed", range(4))
def test_cuda_core_reader_opt_in_variants_random(seed):
    """Random subsets of ``cc_opts`` with random tilings, page counts and shapes against the reference."""
    g = torch.Generator().manual_seed(100 + seed)

    def pick(xs):
        return xs[int(torch.randint(len(xs), (1,), generator=g))]

    bits, group, head_dim = pick([4, 2]), pick([1, 2]), pick([64, 96, 128])
    tau = pick([INF, 14.0, 0.0]) if bits == 4 else INF
    maxp, batch = pick([1, 3, 5]), pick([1, 3])
    lengths = torch.randint(0, layout.capacity(maxp) + 1, (batch,), generator=g).tolist()
    st = make_cell(batch, 2, head_dim, maxp, bits, lengths, seed=seed)
    q = torch.randn(batch, 2 * group, head_dim, generator=g)
    opts = tuple(o for o in ("qk", "vg", "f24", "i32", "l2") if pick([False, True]))
    kw = {"pages_per_iter": pick([1, 2]), "sub_tokens": pick([4, 8, 16, 32]), "prefetch": pick([False, True])}
    if kw["pages_per_iter"] == 1 and not kw["prefetch"]:  # the one-page-ahead options need this loop
        opts += pick([(), ("pt",), ("sc",), ("pt", "sc")])
    out = ta.cell_attention(q, *st, bits, tau, head_dim**-0.5, splits=pick([1, 2, 4]), far_impl="cc",
                            cc_opts=opts, **kw)
    assert_close_to_reference(out, q, st, bits, tau, head_dim**-0.5)


def test_launch_config_follows_the_measurements():
    """docs/kernels.md, Sessions 3-4: INT4 with one query per KV head is register-capped (measured); two query
    heads per KV head stay uncapped (the cap would spill inside the page loop; not measured); INT2 is capped from
    B x H >= 64 on (measured faster at B = 8 and 32, slower at B = 1); every code reader uses 8-token sub-tiles;
    the tensor-core reader and BF16 pages have no cap."""
    from loopkv.ops import triton_config as tc

    assert tc._config(4, "cc", 512, 1)["maxnreg"] == 128
    assert tc._config(4, "cc", 512, 2)["maxnreg"] is None
    assert [tc._config(2, "cc", bh, 1)["maxnreg"] for bh in (16, 63, 64, 512)] == [None, None, 128, 128]
    assert tc._config(2, "cc", 512, 2)["maxnreg"] is None
    assert {tc._config(b, "cc", bh)["sub_tokens"] for b in (4, 2) for bh in (16, 64, 512)} == {8}
    # session 5: INT4 prefetches the next page to L2, INT2 also uses 32-bit offsets (measured faster there only);
    # session 7: both load the next page's page-table entry a page ahead; session 13: K's fields in fp16 pairs
    assert tc._config(4, "cc", 512)["cc_opts"] == ("qk", "vg", "f24", "l2", "pt", "k16")
    assert tc._config(2, "cc", 512)["cc_opts"] == ("qk", "vg", "f24", "i32", "l2", "pt", "k16")
    assert tc._config(4, "dot", 512).get("maxnreg") is None
    # session 15: the register cap stays 128 (112-152 measured slower), history programs launch first (measured
    # faster from B = 8 on; cell_attention_2026-11-30_session15_*.json)
    assert tc.CC_REG_CAP == 128
    assert tc.FAR_FIRST is True
    # fp32 inputs on code pages: four warps, one stage (static, session 6: one warp spilled 8-9 KB per thread)
    assert (tc._config(4, "dot", 512)["num_warps"], tc._config(4, "dot", 512)["num_stages"]) == (1, 3)
    assert (tc._config(2, "dot", 16, 4, True)["num_warps"], tc._config(2, "dot", 16, 4, True)["num_stages"]) == (4, 1)
    assert tc._config(16, "dot").get("maxnreg") is None


@interpret
@pytest.mark.interpret
@pytest.mark.parametrize("bits", [4, 2])
def test_default_reader_runs_k16_for_16_bit_inputs_only(bits):
    """Session 13: the default CUDA-core reader works K's fields in fp16 pairs ("k16") for bf16 inputs, giving the
    bits of the explicit default set; fp32 inputs read in fp32 (the set without "k16"), unless "k16" is named."""
    st32 = make_cell(2, 1, 64, 2, bits, [288 + 32 * 2 + 3, 300], seed=3)
    st16 = [t.to(torch.bfloat16) if t.dtype == torch.float32 else t for t in st32]
    q = 2 * torch.randn(2, 1, 64, generator=torch.Generator().manual_seed(4))
    default = triton_config.CC_DEFAULT_OPTS_BY_BITS[bits]
    k32 = tuple(o for o in default if o != "k16")
    kw = {"splits": 2, "far_impl": "cc"}
    out16 = ta.cell_attention(q.bfloat16(), *st16, bits, INF, 0.125, **kw)
    assert torch.equal(out16, ta.cell_attention(q.bfloat16(), *st16, bits, INF, 0.125, cc_opts=default, **kw))
    out32 = ta.cell_attention(q, *st32, bits, INF, 0.125, **kw)
    assert torch.equal(out32, ta.cell_attention(q, *st32, bits, INF, 0.125, cc_opts=k32, **kw))
    named = ta.cell_attention(q, *st32, bits, INF, 0.125, cc_opts=default, **kw)
    assert not torch.equal(named, out32)  # fp16 sums ran: another rounding
    assert_k16_close(named, reference64(q, st32, bits, INF, 0.125))


def test_cc_options_changes_the_defaults_inside_its_block_only():
    before = dict(triton_config.CC_DEFAULT_OPTS_BY_BITS)
    with triton_config.cc_options(drop=("k16",), add=("sc",)):
        for bits, opts in before.items():
            assert triton_config.CC_DEFAULT_OPTS_BY_BITS[bits] == (*(o for o in opts if o != "k16"), "sc")
    assert triton_config.CC_DEFAULT_OPTS_BY_BITS == before
    with triton_config.cc_options(add=("k16",)):  # already there: not twice
        assert triton_config.CC_DEFAULT_OPTS_BY_BITS == before
    with pytest.raises(KeyError), triton_config.cc_options(drop=("pt",)):
        raise KeyError("a failing block")
    assert triton_config.CC_DEFAULT_OPTS_BY_BITS == before
    with pytest.raises(ValueError, match=r"unknown reader variant\(s\) \['fast'\]; choose from"):
        with triton_config.cc_options(add=("fast",)):
            pass
    # the register cap: the configs of capped readers take it inside the block, uncapped ones stay uncapped
    cap = triton_config.CC_REG_CAP
    with triton_config.cc_options(reg_cap=120):
        assert triton_config._config(4, "cc", 512, 1)["maxnreg"] == 120
        assert triton_config._config(2, "cc", 512, 1)["maxnreg"] == 120
        assert triton_config._config(2, "cc", 16, 1)["maxnreg"] is None
        assert triton_config._config(4, "cc", 512, 2)["maxnreg"] is None
        assert triton_config.CC_DEFAULT_OPTS_BY_BITS == before
    assert triton_config.CC_REG_CAP == cap
    assert triton_config._config(4, "cc", 512, 1)["maxnreg"] == cap
    with pytest.raises(ValueError, match=r"reg_cap must be an int in \[32, 255\]"):
        with triton_config.cc_options(reg_cap=16):
            pass
    assert triton_config.CC_REG_CAP == cap
    coef = triton_config.CHUNK_COEF
    with triton_config.cc_options(chunk_coef=0.0):
        assert triton_config.CHUNK_COEF == 0.0
    assert triton_config.CHUNK_COEF == coef
    with pytest.raises(ValueError, match="chunk_coef must be a finite number >= 0"):
        with triton_config.cc_options(chunk_coef=float("nan")):
            pass
    assert triton_config.CHUNK_COEF == coef
    cpu, waves = torch.device("cpu"), triton_config.WAVES  # 4 "SMs" on CPU (the interpreter)
    assert triton_config.choose_splits(8, 100, cpu) == -(-4 * waves // 8)  # 4 SMs x WAVES programs over 8 row-heads
    with triton_config.cc_options(waves=10):
        assert triton_config.WAVES == 10
        assert triton_config.choose_splits(8, 100, cpu) == 5
        assert triton_config.choose_splits(8, 3, cpu) == 3  # at most one per page
    assert triton_config.WAVES == waves
    for bad in (0, 2.5, True):
        with pytest.raises(ValueError, match="waves must be an int >= 1"):
            with triton_config.cc_options(waves=bad):
                pass
    assert triton_config.WAVES == waves


def test_far_impl_choice_and_argument_errors():
    assert ta.choose_far_impl(4, 1) == "cc"
    assert ta.choose_far_impl(2, 2) == "cc"
    assert ta.choose_far_impl(4, 1, cc_default=False) == "dot"
    assert ta.choose_far_impl(4, 4) == "dot"
    assert ta.choose_far_impl(16, 1, "cc") == "dot"  # BF16 pages: one reader
    assert ta.choose_far_impl(4, 8, "cc") == "cc"
    assert ta.choose_far_impl(4, 1, exact=True) == "dot"  # fp32 inputs (session 6: one-warp cc spills)
    assert ta.choose_far_impl(4, 1, "cc", exact=True) == "cc"
    with pytest.raises(ValueError, match="far_impl"):
        ta.choose_far_impl(4, 1, "tensor")
    st = make_cell(1, 1, 64, 1, 4, [330], seed=1)
    q = torch.randn(1, 1, 64)
    with pytest.raises(ValueError, match="pages_per_iter"):
        ta.cell_attention(q, *st, 4, INF, 0.125, far_impl="cc", pages_per_iter=3)
    with pytest.raises(ValueError, match="sub_tokens"):
        ta.cell_attention(q, *st, 4, INF, 0.125, far_impl="cc", sub_tokens=12)
    with pytest.raises(ValueError, match="near_block"):
        ta.cell_attention(q, *st, 4, INF, 0.125, near_block=48)
    with pytest.raises(ValueError, match="cc_opts"):
        ta.cell_attention(q, *st, 4, INF, 0.125, far_impl="cc", cc_opts=("fast",))
    with pytest.raises(ValueError, match="cc_opts .* CUDA-core reader.*'dot'.*far_impl='cc'"):
        ta.cell_attention(q, *st, 4, INF, 0.125, cc_opts=("qk",))  # fp32 inputs read with "dot" by default
    for kw in ({"pages_per_iter": 2}, {"prefetch": True}):  # pt / sc carry one page's index and scales
        with pytest.raises(ValueError, match="'pt' and 'sc'.*pages_per_iter=1 and prefetch=False"):
            ta.cell_attention(q, *st, 4, INF, 0.125, far_impl="cc", cc_opts=("sc",), **kw)
        # the default carries "pt" (session 7); with these it reads without it instead of refusing
        assert "pt" in triton_config.CC_DEFAULT_OPTS_BY_BITS[4]
        out = ta.cell_attention(q, *st, 4, INF, 0.125, far_impl="cc", **kw)
        assert_close_to_reference(out, q, st, 4, INF, 0.125)
    with pytest.raises(ValueError, match="'k16'.*'qk'"):  # k16 builds its factors on qk's layout
        ta.cell_attention(q, *st, 4, INF, 0.125, far_impl="cc", cc_opts=("vg", "k16"))
    for removed in ("la", "p2"):  # measured slower and removed (sessions 4 and 5)
        with pytest.raises(ValueError, match="cc_opts"):
            ta.cell_attention(q, *st, 4, 14.0, 0.125, far_impl="cc", cc_opts=(removed,))
    ta.check_int32_offsets(k_pages=torch.zeros(4), v_scale=torch.zeros(1).expand(2**31 - 1))  # fits
    with pytest.raises(ValueError, match="'i32'.*v_scale"):
        ta.check_int32_offsets(k_pages=torch.zeros(4), v_scale=torch.zeros(1).expand(2**31))


@interpret
@pytest.mark.interpret
def test_default_int32_offsets_fall_back_for_large_pools(monkeypatch):
    """INT2's default reads with 32-bit offsets ("i32"); a pool with INT32_OFFSET_LIMIT elements or more gets
    64-bit offsets instead (same values), while an explicit "i32" is refused. The limit is lowered so that a
    small cell crosses it. (fp32 inputs default to the tensor-core reader, so the CUDA-core one is named.)"""
    from loopkv.ops import triton_config as tc

    lengths = [288 + 32 * 3 + 5, 300]
    st = make_cell(len(lengths), 2, 64, 4, 2, lengths, seed=41)
    q = torch.randn(len(lengths), 2, 64)
    want = ta.cell_attention(q, *st, 2, INF, 0.125, splits=2, far_impl="cc")
    assert "i32" in tc._config(2, "cc", 512)["cc_opts"]
    monkeypatch.setattr(tc, "INT32_OFFSET_LIMIT", 64)
    out = ta.cell_attention(q, *st, 2, INF, 0.125, splits=2, far_impl="cc")
    assert torch.equal(out, want)
    assert_close_to_reference(out, q, st, 2, INF, 0.125)
    with pytest.raises(ValueError, match="'i32'"):
        ta.cell_attention(q, *st, 2, INF, 0.125, splits=2, far_impl="cc", cc_opts=("i32",))


@interpret
@pytest.mark.interpret
@pytest.mark.parametrize("field_mode", ["offset", "subnormal"])
def test_fp16_field_modes(field_mode):
    """Both ways of making fp16 code operands, INT4 with V precision and INT2, match the reference."""
    st4 = make_cell(2, 2, 128, 3, 4, [288 + 32 * 3 + 9, 350], dtype=torch.bfloat16, seed=8)
    st2 = make_cell(2, 2, 64, 3, 2, [288 + 32 * 3, 400], dtype=torch.bfloat16, seed=9)
    for st, bits, d in ((st4, 4, 128), (st2, 2, 64)):
        q = torch.randn(2, 2, d).to(torch.bfloat16)
        out = ta.cell_attention(q, *st, bits, 14.0, d**-0.5, splits=1, field_mode=field_mode)
        assert_close_to_reference(out, q, st, bits, 14.0, d**-0.5)


@interpret
@pytest.mark.interpret
@pytest.mark.parametrize("far_impl", ["dot", "cc"])
def test_splits_and_window_only_rows(far_impl):
    """1 split, more splits than pages; a row with a window but no history page (300 tokens)."""
    lengths = [300, 288 + 32 * 3, 1]
    st = make_cell(3, 2, 64, 3, 4, lengths, seed=3)
    q = torch.randn(3, 2, 64)
    outs = [ta.cell_attention(q, *st, 4, 14.0, 0.125, splits=s, far_impl=far_impl) for s in (1, 5)]
    for out in outs:
        assert_close_to_reference(out, q, st, 4, 14.0, 0.125)


@interpret
@pytest.mark.interpret
@pytest.mark.parametrize("far_impl", ["dot", "cc"])
def test_v_precision_reads_cold_tokens_and_huge_tau_is_plain_int4(far_impl):
    """tau = 0 marks tokens cold (the output moves, and still matches the reference); a finite tau no
    token can reach runs the V-precision code path yet gives the plain INT4 reader's bits (tau = inf)."""
    lengths = [288 + 32 * 2 + 3, 288 + 32 * 3]
    st = make_cell(2, 2, 64, 3, 4, lengths, seed=4)
    q = 3 * torch.randn(2, 4, 64)
    plain = ta.cell_attention(q, *st, 4, INF, 0.125, splits=2, far_impl=far_impl)
    huge = ta.cell_attention(q, *st, 4, 1e30, 0.125, splits=2, far_impl=far_impl)
    assert torch.equal(plain, huge)
    cold = ta.cell_attention(q, *st, 4, 0.0, 0.125, splits=2, far_impl=far_impl)
    assert (cold - plain).abs().max() > 1e-3
    assert_close_to_reference(cold, q, st, 4, 0.0, 0.125)


@interpret
@pytest.mark.interpret
@pytest.mark.parametrize(("bits", "far_impl"), [(4, "dot"), (2, "dot"), (4, "cc"), (2, "cc")])
def test_shared_cell_reads_another_pool(bits, far_impl):
    """A shared cell's page table points into the final loop's pool: pages out of order, two rows on
    the same physical pages, a pool larger than batch * maxp."""
    page_table = torch.tensor([[6, 2, 9], [6, 2, 0], [1, 1, 1]])
    lengths = [288 + 32 * 3 + 7, 288 + 32 * 2 + 1, 288 + 32]
    st = make_cell(3, 2, 64, 3, bits, lengths, pool_pages=10, page_table=page_table, seed=5)
    q = torch.randn(3, 2, 64)
    out = ta.cell_attention(q, *st, bits, 14.0, 0.125, splits=2, far_impl=far_impl)
    assert_close_to_reference(out, q, st, bits, 14.0, 0.125)


@interpret
@pytest.mark.interpret
@pytest.mark.parametrize("far_impl", ["dot", "cc"])
def test_repeated_calls_reset_the_merge_counters(far_impl):
    st = make_cell(2, 2, 64, 2, 4, [288 + 64, 100], seed=6)
    q = torch.randn(2, 2, 64)
    first = ta.cell_attention(q, *st, 4, INF, 0.125, splits=3, far_impl=far_impl)
    second = ta.cell_attention(q, *st, 4, INF, 0.125, splits=3, far_impl=far_impl)
    assert torch.equal(first, second)
    assert int(ta.counters("cpu", 4, purpose="attention")[:4].abs().sum()) == 0


@interpret
@pytest.mark.interpret
@pytest.mark.slow
@pytest.mark.parametrize("seed", range(6))
def test_random_shapes(seed):
    g = torch.Generator().manual_seed(seed)

    def pick(xs):
        return xs[int(torch.randint(len(xs), (1,), generator=g))]

    bits, group, head_dim = pick([4, 2, 16]), pick([1, 2, 4]), pick([64, 96, 128])
    tau = pick([INF, 14.0, 0.0]) if bits == 4 else INF
    heads, maxp, batch = pick([1, 2]), pick([1, 3, 5]), pick([1, 3])
    lengths = torch.randint(0, layout.capacity(maxp) + 1, (batch,), generator=g).tolist()
    st = make_cell(batch, heads, head_dim, maxp, bits, lengths, seed=seed)
    q = torch.randn(batch, heads * group, head_dim, generator=g)
    kw = {"far_impl": pick(["dot", "cc"]), "pages_per_iter": pick([1, 2]), "sub_tokens": pick([8, 16, 32]),
          "prefetch": pick([False, True]), "near_block": pick([16, 32, 64])}
    out = ta.cell_attention(q, *st, bits, tau, head_dim**-0.5, splits=pick([1, 2, 4]), **kw)
    assert_close_to_reference(out, q, st, bits, tau, head_dim**-0.5)


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
    (4, INF, torch.float32), (4, 14.0, torch.bfloat16), (2, INF, torch.bfloat16), (16, INF, torch.float32),
])
def test_minimum_chunk_keeps_the_result(bits, tau, dtype):
    """``chunk_coef`` (triton_config.CHUNK_COEF) gives a row's history pages to fewer programs, the rest exit with
    no partial and the merge waits only for those with one: still the reference's result for rows of no, one,
    a few and all pages, with the decode token path (which merges the same way) too."""
    maxp, batch, heads, D = 9, 4, 2, 64
    lengths = [300, 288 + 32 + 5, 288 + 32 * 4, layout.capacity(maxp)]  # 0, 1, 4 and 9 history pages
    st = make_cell(batch, heads, D, maxp, bits, lengths, dtype=dtype, seed=bits)
    g = torch.Generator().manual_seed(3)
    q = torch.randn(batch, heads, D, generator=g).to(dtype)
    want = reference64(q, st, bits, tau, 0.125)
    k16 = reads_k16(q, bits, 1)
    for coef in (0.0, 0.3, 1e6):  # no minimum; some rows in fewer chunks; every row in one chunk
        assert [live_chunks(layout.n_pages(n), 5, coef, batch * heads) for n in lengths] == \
            {0.0: [0, 1, 4, 5], 0.3: [0, 1, 1, 2], 1e6: [0, 1, 1, 1]}[coef]
        out = ta.cell_attention(q, *st, bits, tau, 0.125, splits=5, chunk_coef=coef)
        assert_close_to_reference(out, q, st, bits, tau, 0.125, want=want, k16=k16)
    if bits == 16:
        return
    kn, vn = (torch.randn(batch, heads, 1, D, generator=g).to(dtype) for _ in range(2))
    appended = [t.clone() for t in st]  # the state the token path reads: the token appended (reference op)
    cache_ops.append_reference(kn, vn, *appended, bits)
    want = reference64(q, appended, bits, tau, 0.125)
    for coef in (0.0, 1e6):  # 5 history partials per row, or 1
        out = ta.token_attention(q, kn, vn, *[t.clone() for t in st], bits, tau, 0.125, splits=5, chunk_coef=coef)
        assert_close_to_reference(out, q, appended, bits, tau, 0.125, want=want, k16=k16)
    with pytest.raises(ValueError, match="chunk_coef"):
        ta.cell_attention(q, *st, bits, tau, 0.125, chunk_coef=-1.0)


@interpret
@pytest.mark.interpret
@pytest.mark.parametrize(("bits", "tau", "far_impl", "dtype"), [
    (4, INF, "cc", torch.bfloat16), (4, 14.0, "cc", torch.bfloat16), (2, INF, "cc", torch.float32),
    (4, INF, "dot", torch.float32), (16, INF, None, torch.float32),
])
def test_far_first_launch_order_gives_the_same_bits(bits, tau, far_impl, dtype):
    """``far_first`` renumbers the programs (every history program, then the near ones): the same programs write
    the same partials and the merge reads them in slot order, so the output is bit-identical, in rows of different
    lengths (no history, one page, pages + a partial page), with the token path too; append_attention refuses it."""
    lengths = [17, 288 + 32 * 1, 288 + 32 * 3 + 5]
    st = make_cell(3, 2, 64, 4, bits, lengths, dtype=dtype, seed=11)
    q = torch.randn(3, 2, 64, generator=torch.Generator().manual_seed(12)).to(dtype)
    kw = {"splits": 3, "far_impl": far_impl}
    base = ta.cell_attention(q, *st, bits, tau, 0.125, far_first=False, **kw)
    got = ta.cell_attention(q, *st, bits, tau, 0.125, far_first=True, **kw)
    assert torch.equal(got, base)
    default = triton_config.FAR_FIRST
    for ff in (True, False):  # the default the launcher reads at every launch
        with triton_config.cc_options(far_first=ff):
            assert triton_config.FAR_FIRST is ff
            assert torch.equal(ta.cell_attention(q, *st, bits, tau, 0.125, **kw), base)
        assert triton_config.FAR_FIRST is default
    assert_close_to_reference(base, q, st, bits, tau, 0.125, k16=reads_k16(q, bits, 1, far_impl))
    if bits == 16:
        return
    kn, vn = (torch.randn(3, 2, 1, 64, generator=torch.Generator().manual_seed(s)).to(dtype) for s in (13, 14))
    outs = []
    for ff in (False, True):
        cell = [t.clone() for t in st]
        outs.append((ta.token_attention(q, kn, vn, *cell, bits, tau, 0.125, far_first=ff, **kw), cell))
    assert torch.equal(outs[0][0], outs[1][0])
    assert all(torch.equal(a, b) for a, b in zip(outs[0][1], outs[1][1], strict=True))  # the same token writes
    with pytest.raises(ValueError, match="append_attention's launch keeps its order"):
        ta.append_attention(q, kn, vn, *[t.clone() for t in st], bits, bits, tau, 0.125, far_first=True, **kw)


# ---------------------------------------------------------------------------------------------- GPU

GPU_CASES = [  # bits, tau, heads, group, head_dim, dtype
    (4, INF, 16, 1, 128, torch.bfloat16),
    (4, 14.0, 16, 1, 128, torch.bfloat16),
    (2, INF, 16, 1, 128, torch.bfloat16),
    (16, INF, 16, 1, 128, torch.bfloat16),
    (4, 14.0, 4, 4, 256, torch.bfloat16),
    (4, 14.0, 8, 2, 64, torch.float16),
    (4, 14.0, 2, 3, 96, torch.bfloat16),
    (4, 0.0, 16, 1, 128, torch.float32),
    (2, INF, 4, 4, 256, torch.float32),
    (16, INF, 8, 2, 64, torch.float32),
]


@pytest.mark.gpu
@pytest.mark.parametrize("far_impl", ["dot", "cc"])
@pytest.mark.parametrize(("bits", "tau", "heads", "group", "head_dim", "dtype"), GPU_CASES)
def test_gpu_matches_reference(bits, tau, heads, group, head_dim, dtype, far_impl):
    if bits == 16 and far_impl == "cc":
        pytest.skip("BF16 pages have one reader")
    maxp, batch = 96, 8
    g = torch.Generator().manual_seed(bits * 7 + head_dim)
    lengths = [0, 5, 300, layout.capacity(maxp)] + torch.randint(320, layout.capacity(maxp) + 1, (batch - 4,),
                                                                   generator=g).tolist()
    st = make_cell(batch, heads, head_dim, maxp, bits, lengths, dtype=dtype, device="cuda", seed=head_dim)
    q = torch.randn(batch, heads * group, head_dim, generator=g).to(dtype).cuda()
    scale = head_dim**-0.5
    want = reference64(q, st, bits, tau, scale)  # the splits change the reader, not the result
    for splits in (None, 1, 7):
        out = ta.cell_attention(q, *st, bits, tau, scale, splits=splits, far_impl=far_impl)
        assert_close_to_reference(out, q, st, bits, tau, scale, want=want,
                                  k16=reads_k16(q, bits, group, far_impl))


@pytest.mark.gpu
@pytest.mark.parametrize(("bits", "tau"), [(4, INF), (4, 14.0), (2, INF), (16, INF)])
def test_gpu_far_first_bit_identical(bits, tau):
    """The compiled kernel with ``far_first`` (history programs launched first) at B = 32 x 16 KV heads x 128, rows
    of 0 to 4K tokens: the same output bits as the default launch order, for the reader and for the token path
    (whose near program also writes the token)."""
    maxp, batch, heads, D = 128, 32, 16, 128
    g = torch.Generator().manual_seed(bits)
    lengths = [0, 5, 300, layout.capacity(maxp)] + torch.randint(320, layout.capacity(maxp) + 1, (batch - 4,),
                                                                   generator=g).tolist()
    st = make_cell(batch, heads, D, maxp, bits, lengths, dtype=torch.bfloat16, device="cuda", seed=bits)
    q = torch.randn(batch, heads, D, generator=g).bfloat16().cuda()
    base = ta.cell_attention(q, *st, bits, tau, D**-0.5, far_first=False)
    for splits in (None, 7):
        assert torch.equal(ta.cell_attention(q, *st, bits, tau, D**-0.5, far_first=True, splits=splits),
                           ta.cell_attention(q, *st, bits, tau, D**-0.5, far_first=False, splits=splits))
    assert_close_to_reference(base, q, st, bits, tau, D**-0.5, k16=reads_k16(q, bits, 1))
    if bits == 16:
        return
    kn, vn = (torch.randn(batch, heads, 1, D, generator=g).bfloat16().cuda() for _ in range(2))
    outs = []
    for ff in (False, True):
        cell = [t.clone() for t in st]
        outs.append((ta.token_attention(q, kn, vn, *cell, bits, tau, D**-0.5, far_first=ff), cell))
    assert torch.equal(outs[0][0], outs[1][0])
    assert all(torch.equal(a, b) for a, b in zip(outs[0][1], outs[1][1], strict=True))


@pytest.mark.gpu
def test_gpu_timeline_records_every_program_and_changes_no_bit():
    """``cell_attention(timeline=...)`` (benchmarks/probe_timeline.py): the same output bits as the plain launch,
    one row per program with start <= end on a real SM, and the history programs' pages adding up to every row's
    pages (rows of 0 to 4K tokens, 7 splits)."""
    maxp, batch, heads, D, splits = 128, 8, 16, 128, 7
    g = torch.Generator().manual_seed(5)
    lengths = [0, 300, layout.capacity(maxp)] + torch.randint(320, layout.capacity(maxp) + 1, (batch - 3,),
                                                                generator=g).tolist()
    st = make_cell(batch, heads, D, maxp, 4, lengths, dtype=torch.bfloat16, device="cuda", seed=5)
    q = torch.randn(batch, heads, D, generator=g).bfloat16().cuda()
    nprog = 320 // triton_config.CC_NEAR_BLOCK + splits
    buf = torch.zeros(nprog * batch * heads, 6, dtype=torch.int64, device="cuda")
    with pytest.raises(ValueError, match="at least"):
        ta.cell_attention(q, *st, 4, INF, D**-0.5, splits=splits, timeline=buf[:-1])
    got = ta.cell_attention(q, *st, 4, INF, D**-0.5, splits=splits, timeline=buf)
    assert torch.equal(got, ta.cell_attention(q, *st, 4, INF, D**-0.5, splits=splits))
    rows = buf.cpu()
    assert (rows[:, 1] >= rows[:, 0]).all()
    assert (rows[:, 0] > 0).all()
    assert int(rows[:, 2].max()) < torch.cuda.get_device_properties(0).multi_processor_count
    assert sorted(rows[:, 3].tolist()) == sorted(list(range(nprog)) * batch * heads)
    want = sum(layout.n_pages(n) for n in lengths) * heads
    assert int(rows[:, 5].sum()) == want
    # with a minimum chunk, only the programs the kernel's rule gives pages have any (the others exited)
    buf.zero_()
    ta.cell_attention(q, *st, 4, INF, D**-0.5, splits=splits, chunk_coef=0.05, timeline=buf)
    rows = buf.cpu()
    live = torch.zeros(batch * heads, dtype=torch.int64).index_add_(0, rows[:, 4], (rows[:, 5] > 0).long())
    rule = [live_chunks(layout.n_pages(n), splits, 0.05, batch * heads) for n in lengths for _ in range(heads)]
    assert live.tolist() == rule
    assert int(rows[:, 5].sum()) == want


CC_CONFIGS = [  # (num_warps, sub_tokens, pages_per_iter, prefetch): the benchmark's CUDA-core arms and more
    (4, 16, 1, False), (4, 32, 1, True), (1, 8, 1, False), (4, 16, 2, False), (2, 16, 1, True)]


@pytest.mark.gpu
@pytest.mark.parametrize(("bits", "tau"), [(4, INF), (4, 14.0), (2, INF)])
def test_gpu_cuda_core_reader_real_shape(bits, tau):
    """Ouro-1.4B cell at B = 8 x 16K (16 KV heads x 128, bf16, one query per KV head; also two): every
    CUDA-core config of the benchmark against a float64 reference computed on the GPU. The configs run the default
    variants, "k16" included (its tier); the explicit variant sets without "k16" keep the bf16 tier."""
    batch, heads, head_dim = 8, 16, 128
    maxp = layout.stored_pages(16384)
    lengths = [16384, 16384 - 77, 5, 300, 16384 // 2 + 13, 16384, 320, 4000]
    st = make_cell(batch, heads, head_dim, maxp, bits, lengths, dtype=torch.bfloat16, device="cuda", seed=2)
    for group, configs in ((1, CC_CONFIGS), (2, CC_CONFIGS[:1])):
        q = (2 * torch.randn(batch, heads * group, head_dim)).to(torch.bfloat16).cuda()
        want = reference64(q, st, bits, tau, head_dim**-0.5)
        for (nw, ts, ppi, pf), splits in zip(configs, (None, 5, None, 3, None), strict=False):
            out = ta.cell_attention(q, *st, bits, tau, head_dim**-0.5, splits=splits, far_impl="cc",
                                    num_warps=nw, sub_tokens=ts, pages_per_iter=ppi, prefetch=pf)
            assert_close_to_reference(out, q, st, bits, tau, head_dim**-0.5, want=want,
                                      k16=reads_k16(q, bits, group, "cc"))
        # session 2's reader, one variant, 32-bit offsets, pipelined / L2-prefetching loops, the reader up to
        # session 12 (bench arms; all without "k16"), then the default (with it)
        for opts in ((), ("vg", "f24"), ("qk", "vg", "f24", "i32"),
                     ("qk", "vg", "f24", "i32", "l2"), ("qk", "vg", "f24", "l2"), ("qk", "vg", "f24", "l2", "pt"),
                     ("qk", "vg", "f24", "l2", "sc"), ("qk", "vg", "f24", "i32", "l2", "sc"),
                     tuple(o for o in triton_config.CC_DEFAULT_OPTS_BY_BITS[bits] if o != "k16"), None):
            out = ta.cell_attention(q, *st, bits, tau, head_dim**-0.5, far_impl="cc", cc_opts=opts)
            assert_close_to_reference(out, q, st, bits, tau, head_dim**-0.5, want=want,
                                      k16=reads_k16(q, bits, group, "cc", opts))
        out = ta.cell_attention(q, *st, bits, tau, head_dim**-0.5, far_impl="dot", near_block=32)
        torch.testing.assert_close(out.double(), want, atol=ATTN_BF16_ATOL, rtol=ATTN_BF16_RTOL)


@pytest.mark.gpu
@pytest.mark.parametrize(("bits", "tau"), [(4, INF), (4, 14.0), (2, INF)])
def test_gpu_k16_fp32_inputs_within_its_fp16_bound(bits, tau):
    """"k16"'s inline PTX (and.b32 + fma.rn.f16x2, add.rn.f16x2, cvt.rn.f16x2.f32) with fp32 inputs, where its own
    rounding is visible: within the tier the interpreter's emulation meets (tests/tolerances.py), at B = 4 x 8K."""
    batch, heads, head_dim = 4, 16, 128
    maxp = layout.stored_pages(8192)
    lengths = [8192, 8192 - 77, 300, 4000]
    st = make_cell(batch, heads, head_dim, maxp, bits, lengths, dtype=torch.float32, device="cuda", seed=5)
    q = (2 * torch.randn(batch, heads, head_dim)).cuda()
    want = reference64(q, st, bits, tau, head_dim**-0.5)
    k16 = triton_config.CC_DEFAULT_OPTS_BY_BITS[bits]  # named explicitly: fp32 inputs drop the default's "k16"
    assert "k16" in k16
    out = ta.cell_attention(q, *st, bits, tau, head_dim**-0.5, far_impl="cc", cc_opts=k16)
    err = (out.double() - want).norm() / want.norm()
    assert 1e-5 < err < ATTN_K16_REL_L2
    assert (out.double() - want).abs().max() < ATTN_K16_ATOL


@pytest.mark.gpu
@pytest.mark.parametrize(("bits", "tau", "heads", "group", "head_dim"), [
    (4, INF, 16, 1, 128), (4, 14.0, 4, 4, 256), (2, INF, 8, 2, 64)])
def test_gpu_subnormal_fields_match_reference(bits, tau, heads, group, head_dim):
    """The other way to make fp16 code operands (subnormal fields), over many pages per program."""
    maxp, batch = 96, 4
    lengths = [layout.capacity(maxp), 5, 320, 1000]
    st = make_cell(batch, heads, head_dim, maxp, bits, lengths, dtype=torch.bfloat16, device="cuda", seed=3)
    q = torch.randn(batch, heads * group, head_dim).to(torch.bfloat16).cuda()
    want = reference64(q, st, bits, tau, head_dim**-0.5)
    for splits in (1, 3):
        out = ta.cell_attention(q, *st, bits, tau, head_dim**-0.5, splits=splits, field_mode="subnormal")
        assert_close_to_reference(out, q, st, bits, tau, head_dim**-0.5, want=want)


@pytest.mark.gpu
def test_gpu_cuda_graph_replay_append_and_attention():
    """append_ + cell_attention through the registered ops, captured once, replayed across window exits:
    every replay matches the references run on a CPU mirror (counters reset by the kernels)."""
    from loopkv.ops import cache_ops
    from loopkv.ops.triton_register import register_triton_kernels

    assert register_triton_kernels()
    batch, heads, head_dim, maxp, bits, tau = 4, 16, 128, 12, 4, 14.0
    lengths = [0, 300, 319, 288 + 32 * 8 + 30]
    mirror = make_cell(batch, heads, head_dim, maxp, bits, lengths, dtype=torch.bfloat16, seed=11)
    dev = [t.cuda() for t in mirror]
    k_new = torch.zeros(batch, heads, 1, head_dim, dtype=torch.bfloat16, device="cuda")
    v_new, q = torch.zeros_like(k_new), torch.zeros(batch, heads, head_dim, dtype=torch.bfloat16, device="cuda")

    def step():
        torch.ops.loopkv.append_(k_new, v_new, *dev[:6], *dev[6:], bits)
        return torch.ops.loopkv.cell_attention(q, *dev, bits, tau, head_dim**-0.5)

    warm = [t.clone() for t in dev]  # compile and allocate counters on a copy, outside the capture
    torch.ops.loopkv.append_(k_new, v_new, *warm[:6], *warm[6:], bits)
    torch.ops.loopkv.cell_attention(q, *warm, bits, tau, head_dim**-0.5)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for _ in range(40):
        kn, vn = torch.randn(batch, heads, 1, head_dim), torch.randn(batch, heads, 1, head_dim)
        qn = torch.randn(batch, heads, head_dim)
        k_new.copy_(kn)
        v_new.copy_(vn)
        q.copy_(qn)
        graph.replay()
        cache_ops.append_reference(kn.bfloat16(), vn.bfloat16(), *mirror[:6], *mirror[6:], bits)
        want = reference64(qn.bfloat16(), mirror, bits, tau, head_dim**-0.5)
        for a, b in zip(dev, mirror, strict=True):
            assert torch.equal(a.cpu(), b)
        torch.testing.assert_close(out.cpu().double(), want, atol=ATTN_BF16_ATOL, rtol=ATTN_BF16_RTOL)
