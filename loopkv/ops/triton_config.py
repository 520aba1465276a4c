"""The launch table of the fused cell attention (``triton_attention``): which history reader a call gets and how it
is launched, from what the launcher sees. No autotuning: the op runs inside CUDA graphs, so every choice is a
function of static shapes. docs/kernels.md explains the readers.

Every number below was measured on an H200 (sm_90, 132 SMs) with ``benchmarks/bench_cell_attention.py`` at Ouro-1.4B's
cell (16 KV heads x 128, one query head per KV head, bf16; INT4, INT4 with V precision at tau = 14 on data with about
1/6 of history tokens hot, INT2), in ms per launch, unless the line says otherwise. The arguments quoted are the
ones that ran the measurement; ``--readers`` names that script's reader arms.

Keys: the GPU's capability; ``bits`` of the history pages (16: exact BF16 pages, 4 / 2: codes, 0: no history);
query heads per KV head; head_dim (up to 128, where every timing was made, or wider); the inputs' dtype (fp32 asks
for fp32 products: "fp32"; bf16 and fp16: "16-bit"); B x KV heads; and the page table's width for the split count.
The rows for head_dim above 128 and for more than four query heads per KV head were chosen statically (registers and
spills of the sm_90 build, ``tests/ops/sm90_compile_check.py``), not timed. The kernels serve ``HEAD_DIMS`` x
``GROUPS``, the shapes the tests check against float64 references; a call outside them runs the PyTorch reference.

Built into the CUDA-core reader (``triton_far``), not switchable, each chosen by a measurement at B = 32 x 16K:

* one warp, 8-token sub-tiles: INT4 0.785 ms against the tensor-core reader's 0.986 (``--readers dot,cc_w1_t8``);
* ``q * k_scale`` once per page, V scale and zero per 32-channel group, fields below bit 24 in place ("qk", "vg",
  "f24"): INT4 0.597 ms vs 0.785 (``--readers cc_w1_t8,cc_w1_t8_qk_vg_f24``);
* the next page prefetched to L2: INT4 at par, V precision 0.454 vs 0.468 ms (``--readers cc_w1_t8_qk_vg_f24,l2``);
* the next page-table entry loaded one page ahead: INT4 0.426 vs 0.435 ms, INT2 0.344 vs 0.351 (``--readers
  l2,l2_pt,i32_l2,i32_l2_pt``);
* K's fields in packed fp16 pairs, 16-bit inputs only: at B = 36 x 16K INT4 0.453 vs 0.470 ms, V precision 0.466
  vs 0.492, INT2 0.361 vs 0.384 (``--batches 36 --contexts 16384 --readers l2_pt,l2_pt_k16,i32_l2_pt,i32_l2_pt_k16``);
  its rounding is 76-244x below the codes' own error (tests/tolerances.py, ``ATTN_K16_*``).

Built into the kernel: every history program launches before the near programs, which then fill the end of the
launch: INT4 0.395 vs 0.407 ms, V precision 0.379 vs 0.418, INT2 0.292 vs 0.324 (``--readers ff,nf``); the
tensor-core reader makes fp16 code operands as subnormals: 0.98 vs 1.12 ms for the offset form (its first sweep).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

# History programs per SM the split count aims for: 16 splits at B = 32 x 16 KV heads ran INT4 at 16K in 0.389 ms vs
# 32 splits' 0.397, 12-24 within 1% (``--batches 32 --readers split12,split16,split24,split32``)
WAVES = 62
# At most this many history programs per (row, KV head): at B = 1 x 8K 48 ran 0.018 ms vs 32's 0.021, 64 no better
# (``--readers split16,split24,split32,split48,split64``)
MAX_SPLITS = 48
# The CUDA-core reader gives a row of ``pages`` history pages chunks of at least ceil(sqrt(CHUNK_COEF * B*H * pages))
# pages (the other programs exit at once): at B = 32 x 1,344 tokens 0.075 vs 0.078 ms with no minimum; 0.004 and
# 0.008 were up to 3% and 6% slower at 16K (``--batches 32 --contexts 1344 16384 --readers coef0,coef1,coef4,coef8``)
CHUNK_COEF = 0.002
# Launch options of every loopkv kernel: fused multiply-adds, with which the kernels were measured and their codes
# checked bit for bit (Triton 3.10 turns them off by default)
KERNEL_OPTIONS = {"enable_fp_fusion": True}
# 32-bit history offsets address pools of fewer elements than this; larger pools take 64-bit offsets
INT32_OFFSET_LIMIT = 2**31


# The shapes the kernels serve: head_dim a multiple of the codec's group from 64 to 256 (a head_dim that is not a power
# of two, 96, 160, ..., is padded to the next one with masked loads: docs/kernels.md) and 1-8 query heads per KV head
# (query heads padded to a power of two). tl.dot needs 16 columns, which head_dim 32 does not give
HEAD_DIMS = range(64, 257, 32)
GROUPS = range(1, 9)
NARROW, WIDE = range(64, 129, 32), range(160, 257, 32)  # head_dims the timings were made at (128), and wider ones


def serves(head_dim: int, group: int) -> bool:
    """Whether the kernels serve this cell shape (``group``: query heads per KV head); others run the reference."""
    return head_dim in HEAD_DIMS and group in GROUPS


_WARNED: set[tuple[int, int]] = set()


def warn_reference(head_dim: int, group: int) -> None:
    """Warn, once per shape, that a cell the kernels do not serve runs the PyTorch reference instead."""
    if (head_dim, group) in _WARNED:
        return
    _WARNED.add((head_dim, group))
    warnings.warn(
        f"loopkv: the Triton kernels serve head_dim {HEAD_DIMS.start}-{HEAD_DIMS.stop - 1} in steps of "
        f"{HEAD_DIMS.step} and {GROUPS.start}-{GROUPS.stop - 1} query heads per KV head; head_dim={head_dim} with "
        f"{group} query heads per KV head runs the PyTorch reference instead (the same results, much slower)",
        stacklevel=3)


@dataclass(frozen=True)
class Launch:
    """How one call of the fused cell attention runs.

    ``reader``: "cc" (CUDA-core code reader, ``triton_far``), "dot" (tensor-core code reader with expanded rows,
    ``triton_dot.far_dot``), "gqa" (tensor-core code reader with the query heads as rows, ``triton_dot.far_gqa``;
    16-bit inputs, fp32 ones take "dot"'s) or "exact" (BF16 pages read as exact tiles; also no history at all).
    ``near_block``: sink + window slots per near program. ``maxnreg``: the register cap per thread handed to ptxas
    (None: uncapped). ``i32``: 32-bit history offsets. ``chunk_coef``: the minimum-chunk rule (``CHUNK_COEF``; 0: an
    even split)."""

    reader: str
    num_warps: int
    num_stages: int
    near_block: int
    maxnreg: int | None = None
    i32: bool = False
    chunk_coef: float = 0.0


@dataclass(frozen=True)
class Entry:
    """A row of ``TABLE``: the launch for calls that match every key, and why."""

    capability: tuple[int, int]  # the lowest GPU capability (sm_80: bf16 MMA, cvt.rn.f16x2.f32)
    bits: tuple[int, ...]
    groups: range  # query heads per KV head
    head_dims: range
    inputs: str  # "16-bit", "fp32" or "any"
    rows_heads: int  # from this many rows x KV heads on
    launch: Launch
    why: str


SM80 = (8, 0)
ANY, ONE, TWO = GROUPS, range(1, 2), range(2, 3)
FEW_MANY, MOST = range(3, 5), range(5, GROUPS.stop)  # 3-4 and 5-8 query heads per KV head (tensor cores)
# The CUDA-core reader: one warp, 32-slot near programs (64 slots ran 18-38% slower under the register cap, 16 level:
# --readers nb16,nb64), and the minimum chunk (measured with this reader only). The other readers keep 64-slot near
# programs (with tensor cores 32 slots ran 8% faster at one query head per KV head, where the CUDA-core reader now
# runs: --readers dot,dot_n32; larger groups not timed) and an even split. Above head_dim 128 it runs two warps: each
# thread then holds what it holds at 128 on one warp (a word tile's lanes, V's 16 field accumulators)
CC = {"reader": "cc", "num_warps": 1, "num_stages": 1, "near_block": 32, "chunk_coef": CHUNK_COEF}
CC2 = {**CC, "num_warps": 2}
# The first entry that matches a call is its launch.
TABLE = (
    Entry(SM80, (16, 0), ANY, HEAD_DIMS, "any", 0, Launch("exact", 4, 2, 64),
          "exact K and V tiles on tensor cores: the first kernel's config, not re-tuned since the code readers took "
          "over (--full times it: arm loopkv_bf16); at 256 x 8 query heads 205 registers, no spill (static)"),
    Entry(SM80, (4, 2), ANY, NARROW, "fp32", 0, Launch("dot", 4, 1, 64),
          "fp32 products: one warp spills 8-9 KB per thread at head_dim 128, four warps 16-24 B (static, sm_90; "
          "tests/ops/sm90_compile_check.py), not timed"),
    Entry(SM80, (4, 2), ANY, WIDE, "fp32", 0, Launch("dot", 8, 1, 64),
          "fp32 products at head_dim 256: eight warps spill 1.5, 5 and 9 KB per thread at 1, 4 and 8 query heads, "
          "four warps 1.9 and 11 KB at 1 and 4 (static); a correctness path (fp32 caches), not timed"),
    Entry(SM80, (4,), ONE, NARROW, "16-bit", 0, Launch(**CC, maxnreg=128),
          "capped at 128 registers (16 programs per SM, not 11): INT4 0.437 vs 0.601 ms; 112-152 all slower "
          "(--readers r112,r120,r128,r136,r144,r152)"),
    Entry(SM80, (4,), TWO, NARROW, "16-bit", 0, Launch(**CC),
          "uncapped: two query heads need 255 registers, the cap would put 152 spill operations in the page loop "
          "(static, sm_90), not timed"),
    Entry(SM80, (2,), ONE, NARROW, "16-bit", 64, Launch(**CC, maxnreg=128, i32=True),
          "INT2 capped from B x H = 64: 0.399 vs 0.472 ms at B = 32, 0.123 vs 0.134 at B = 8; 32-bit offsets: 0.349 "
          "vs 0.396 (--quick --readers t8_r128, then --readers l2,i32_l2)"),
    Entry(SM80, (2,), range(1, 3), NARROW, "16-bit", 0, Launch(**CC, i32=True),
          "INT2 uncapped below B x H = 64: the cap cost 0.001 ms at B = 1 x 8K (0.022 vs 0.021; --quick --readers "
          "t8_r128); INT4 keeps 64-bit offsets: 0.459 vs 0.437 ms with 32-bit ones (--readers i32)"),
    Entry(SM80, (4, 2), FEW_MANY, NARROW, "16-bit", 0, Launch("dot", 1, 3, 64),
          "tensor cores, whose 16-row tiles larger groups fill; one warp 1.21 ms vs two 1.86 and four 3.35, three "
          "stages 15% faster than one (at one query head per KV head, before the CUDA-core reader)"),
    Entry(SM80, (4, 2), MOST, NARROW, "16-bit", 0, Launch("dot", 2, 3, 64),
          "5-8 query heads: two warps spill 0-60 B (150-200 B with V precision), one warp 84-916 B (1.2 KB; "
          "static), not timed"),
    Entry(SM80, (4,), ONE, WIDE, "16-bit", 0, Launch(**CC2, maxnreg=128),
          "head_dim 160-256, one query head: two warps under the cap spill 44 B, one warp 2 KB (static), not timed"),
    Entry(SM80, (2,), ONE, WIDE, "16-bit", 0, Launch(**CC2, maxnreg=128, i32=True),
          "INT2 as INT4 above, with INT2's 32-bit offsets: 44 B of spill under the cap (static), not timed"),
    Entry(SM80, (4,), TWO, WIDE, "16-bit", 0, Launch(**CC2),
          "head_dim 160-256, two query heads: two warps uncapped, 240 registers, no spill (one warp: 255 and 532 B; "
          "static), as 128 runs on one warp; not timed"),
    Entry(SM80, (2,), TWO, WIDE, "16-bit", 0, Launch(**CC2, i32=True),
          "INT2 as INT4 above, with INT2's 32-bit offsets (static), not timed"),
    Entry(SM80, (4, 2), FEW_MANY, WIDE, "16-bit", 32, Launch("gqa", 4, 1, 64, maxnreg=128),
          "Dory's cell (4 query heads x 256) from B x KV heads = 32: the query-head-row reader under a 128 register "
          "cap (four programs per SM). At 16K, INT4 0.932 vs the tensor-core reader's 1.485 ms at B = 32 (0.51x vs "
          "0.32x cuDNN BF16), 0.296 vs 0.407 at B = 8 (1.20x vs 0.87x); uncapped 1.165 / 0.340, capped at 168 0.986 / "
          "0.298 (--cells dory --batches 32,1,8 --alternatives gqa_w4,gqa_w4_r168,gqa_w4_r128); V precision 0.979 vs "
          "1.713 and 0.307 vs 0.464, INT2 0.865 vs 1.343 and 0.278 vs 0.368 (--batches 32,8 --alternatives "
          "dot_w4,gqa_w4_r128 --alt-modes int4_vp,int2)"),
    Entry(SM80, (4, 2), FEW_MANY, WIDE, "16-bit", 0, Launch("dot", 4, 3, 64),
          "Dory's cell (4 query heads x 256): four warps spill 296 B, one warp 6.9 KB (static); INT4 at B = 32 x 16K "
          "1.50 ms (0.33x cuDNN) against eight warps' 2.78 and the CUDA-core reader's 1.95 on eight (--cells dory "
          "--alternatives dot_w8,cc_w8); below B x KV heads = 32: at B = 1 x 16K INT4 0.087 ms vs the query-head-row "
          "reader's 0.095"),
    Entry(SM80, (4, 2), MOST, WIDE, "16-bit", 0, Launch("dot", 8, 1, 64),
          "5-8 query heads at 256: eight warps spill 144-184 B, four 464 B, one 62 KB (static); one stage: Triton 3.6 "
          "cannot pipeline its 64-row warp-group MMA with V precision (3.9 can), not timed"),
)


def launch_config(capability: tuple[int, int] | None, bits: int, group: int, head_dim: int, exact: bool,
                  rows_heads: int) -> Launch | None:
    """The launch of the first ``TABLE`` entry matching the call, or None (no Triton kernel for this GPU or this
    shape: the launcher runs the reference). ``capability`` None: Triton's interpreter (CPU tensors), which runs every
    entry."""
    inputs = "fp32" if exact else "16-bit"
    for e in TABLE:
        if ((capability is None or capability >= e.capability) and bits in e.bits and group in e.groups
                and head_dim in e.head_dims and e.inputs in ("any", inputs) and rows_heads >= e.rows_heads):
            return e.launch
    return None


def choose_splits(rows_heads: int, max_pages: int, device: torch.device) -> int:
    """History programs per (row, KV head): enough for ``WAVES`` per SM, at most ``MAX_SPLITS`` and one per page."""
    if max_pages == 0:
        return 0
    want = -(-_num_sms(device) * WAVES // max(rows_heads, 1))
    return int(max(1, min(want, max_pages, MAX_SPLITS)))


def fits_int32(*pools: torch.Tensor) -> bool:
    """Whether 32-bit offsets address every pool (fewer than ``INT32_OFFSET_LIMIT`` elements each)."""
    return all(t.numel() < INT32_OFFSET_LIMIT for t in pools)


_SM_COUNT: dict[int, int] = {}
_CAPABILITY: dict[int, tuple[int, int]] = {}


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: any small number
    idx = _index(device)
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


def _capability(device: torch.device) -> tuple[int, int] | None:
    """(major, minor) of a CUDA device; None for CPU tensors (the kernels run in Triton's interpreter)."""
    if device.type != "cuda":
        return None
    idx = _index(device)
    if idx not in _CAPABILITY:
        _CAPABILITY[idx] = tuple(torch.cuda.get_device_capability(idx))
    return _CAPABILITY[idx]
