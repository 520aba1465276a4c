"""The storage format of one cell, stated once (docs/design.md, "Storage layout"). Imports nothing heavy.

Every other module takes these facts from here: the codec (group sizes), the cache (shapes of what it
allocates), the kernels (their guards and literals), the byte model (bytes per token) and the dense simulator
(which tokens are history). The position functions work on Python ints and on integer tensors alike, so one
formula serves the host (sizing pools) and the device (per-row state inside the decode step).

A row of a cell holding ``n`` tokens keeps:

* the **sink**: positions ``[0, SINK)``, exact;
* **history pages**: positions ``[SINK, SINK + PAGE * n_pages(n))``, quantized in pages of ``PAGE`` tokens;
* the **window**: the rest (at most ``WINDOW + PAGE - 1`` tokens), exact, in a ring of ``RING`` slots.
"""

from __future__ import annotations

import math

SINK = 32  # exact tokens at the start of every sequence (paper §2.3)
WINDOW = 256  # most recent tokens kept exact (paper §2.3)
PAGE = 32  # tokens per history page; K is quantized per channel over a page's tokens
GROUP = 32  # channels per V quantization group (per token)
RING = WINDOW + PAGE  # window ring slots: the window plus the page being filled
ROW_ALIGN = 16  # bytes: each cell's slice of a stacked buffer starts at a multiple of this (aligned_bytes)
# A page is *read* as history from length SINK + WINDOW + PAGE * (p + 1) on (320 for page 0), but it is *written*
# to the pool one token earlier (319 for page 0), when its tokens are complete and still intact in the ring: the
# loops of one decode step run in order, so a ``share`` cell of an earlier loop reaches length 320 and reads page 0
# before its source in the final loop has counted the same step's token. Quantizing at 319 makes the page
# available to every reader of that step.
QUANTIZE_LENGTH = SINK + WINDOW + PAGE - 1

OPTIONS = ("bf16", "int4", "int2", "share")  # what a plan may choose for a cell
QUANTIZED = ("int4", "int2")
BITS = {"bf16": 16, "int4": 4, "int2": 2, "share": 0}  # bits per stored K/V element's code; share stores no pages
POOL_FIELDS = ("k_pages", "k_scale", "k_zero", "v_hi", "v_lo", "v_scale", "v_zero")
COLD_MIDPOINT = 1.5  # a cold INT4 value decodes from its high plane as 4 * hi + 1.5 (its bucket's midpoint)
LN2 = math.log(2.0)


def n_pages(length):
    """History pages (read as history) of a row holding ``length`` tokens: ``max(0, (n - 288) // 32)``. ``length``:
    an int (or a symbolic one, as a traced op's int argument is), or an integer tensor."""
    if hasattr(length, "clamp_min"):  # a tensor
        return ((length - SINK - WINDOW) // PAGE).clamp_min(0)
    return max(0, (length - SINK - WINDOW) // PAGE)


def stored_pages(length):
    """Pages already quantized into the pool at ``length`` tokens: ``n_pages(length + 1)`` (see QUANTIZE_LENGTH)."""
    return n_pages(length + 1)


def max_pages(max_cache_len: int) -> int:
    """Pages a row needs to hold ``max_cache_len`` tokens."""
    return stored_pages(max_cache_len)


def capacity(pages_per_row: int) -> int:
    """The most tokens a row with ``pages_per_row`` pages can hold (the next token would quantize a page that does
    not exist): page ``p`` is quantized when the length reaches ``QUANTIZE_LENGTH + PAGE * p``."""
    return QUANTIZE_LENGTH + PAGE * pages_per_row - 1


def exact_slots(max_cache_len: int) -> tuple[int, int]:
    """(sink slots, ring slots) a row of ``max_cache_len`` tokens allocates: ``(SINK, RING)`` when it has pages; a
    short row (``max_pages == 0``, at most ``capacity(0) = 318`` tokens) never wraps its ring, so it keeps
    ``min(SINK, n)`` sink slots and ``max(0, n - SINK)`` ring slots, every slot it can fill and no more."""
    if max_pages(max_cache_len):
        return SINK, RING
    return min(SINK, max_cache_len), max(0, max_cache_len - SINK)


def row_capacity(pages_per_row: int, sink_slots: int, ring_slots: int) -> int:
    """The most tokens a row holds, from its allocated shapes: ``capacity(pages_per_row)`` with the whole ring; a short
    row (fewer than ``RING`` ring slots, no pages: ``exact_slots``) holds its slots."""
    return capacity(pages_per_row) if ring_slots == RING else sink_slots + ring_slots


def aligned_bytes(nbytes: int) -> int:
    """Bytes a cell's slice of ``nbytes`` takes in a stacked buffer (``loopkv/cache/storage.py``): rounded up to
    ``ROW_ALIGN``, so that every slice starts 16-byte aligned, as Triton's launcher specializes pointers on that."""
    return -(-nbytes // ROW_ALIGN) * ROW_ALIGN


def ring_slot(position):
    """Window ring slot of a position ``>= SINK``."""
    return (position - SINK) % RING


def cold_threshold(m_ref, tau):
    """V precision (paper §3.3, Proposition 1): a history token is *cold* for a query head when its score
    ``s = scale * q . k`` (natural units) is below ``m_ref - tau * ln 2``, with ``m_ref = max(sink max, its page's
    max)``; it is cold for a KV head when it is cold for every query head that reads it. A cold INT4 value decodes
    from its high plane only (``COLD_MIDPOINT``). Works on floats and tensors."""
    return m_ref - tau * LN2


def pool_field_shapes(bits: int, pages: int, heads: int, head_dim: int) -> dict[str, tuple[int, ...]]:
    """Shapes of a pool's fields for ``pages`` physical pages; ``(0,)`` marks a field this kind of pool does not use
    (BF16 pages' scales, INT2's lo plane), held as an empty placeholder.

    bits 16: k_pages, v_hi [N, H, PAGE, D] in the model's dtype (exact pages).
    bits 4, 2: k_pages uint8 [N, H, PAGE, D * bits / 8] (K codes along channels, channel 2j / 4j + i in the low
    bits first); k_scale, k_zero fp16 [N, H, D] (per channel over the page); v_hi, v_lo uint8 [N, H, PAGE, D / 4]
    (INT4: the codes' high and low 2-bit planes; INT2: the codes in v_hi, four per byte); v_scale, v_zero fp16
    [N, H, PAGE, D / GROUP] (per token and channel group)."""
    if bits == 16:
        page = (pages, heads, PAGE, head_dim)
        return dict(k_pages=page, k_scale=(0,), k_zero=(0,), v_hi=page, v_lo=(0,), v_scale=(0,), v_zero=(0,))
    if bits not in (4, 2):
        raise ValueError(f"bits must be 16, 4 or 2 for a pool, got {bits}")
    crumbs = (pages, heads, PAGE, head_dim // 4)  # V: 4 channels per byte in each plane
    groups = (pages, heads, PAGE, head_dim // GROUP)
    return dict(k_pages=(pages, heads, PAGE, head_dim * bits // 8), k_scale=(pages, heads, head_dim),
                k_zero=(pages, heads, head_dim), v_hi=crumbs, v_lo=crumbs if bits == 4 else (0,), v_scale=groups,
                v_zero=groups)


def pool_field_kind(bits: int, name: str) -> str:
    """The element type of a pool field: ``"exact"`` (the model's dtype), ``"float16"`` or ``"uint8"``."""
    if bits == 16 and name in ("k_pages", "v_hi"):
        return "exact"
    return "float16" if name.endswith(("scale", "zero")) else "uint8"


def page_bytes(bits: int, heads: int, head_dim: int, *, exact_bytes: int = 2) -> int:
    """Bytes of one physical page (all heads, K and V) in a pool of ``bits``."""
    size = {"exact": exact_bytes, "float16": 2, "uint8": 1}
    return sum(math.prod(shape) * size[pool_field_kind(bits, name)]
               for name, shape in pool_field_shapes(bits, 1, heads, head_dim).items() if shape != (0,))


def stored_bits_per_element(option: str, *, exact_bytes: int = 2) -> float:
    """History bits per K or V element of ``option``, scales and zeros included: bf16 16, int4 5, int2 3, share 0
    (from the pool's fields, at head_dim 128: every head_dim that is a multiple of GROUP gives the same)."""
    if option not in BITS:
        raise ValueError(f"unknown option {option!r}; choose from {OPTIONS}")
    if option == "share":
        return 0.0
    heads, head_dim = 1, 128
    return page_bytes(BITS[option], heads, head_dim, exact_bytes=exact_bytes) * 8 / (2 * PAGE * heads * head_dim)


def check_head_dim(head_dim: int) -> None:
    """Refuse a head_dim that the codec cannot group."""
    if head_dim <= 0 or head_dim % GROUP != 0:
        raise ValueError(
            f"head_dim={head_dim} is not a multiple of the codec's group size {GROUP}; loopkv quantizes "
            f"V in groups of {GROUP} channels. Keep this model's cells in 'bf16' or use a model whose "
            f"head_dim is a multiple of {GROUP} (64, 96, 128, 256 are)."
        )
