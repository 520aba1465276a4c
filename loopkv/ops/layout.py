"""Positions of a row inside one cell (docs/storage-layout.md), shared by the ops and the cache.

All functions work on Python ints and on integer tensors alike, so the same formula serves the host
(sizing pools) and the device (per-row state inside the decode step).
"""

from __future__ import annotations

from loopkv.ops.codec import GROUP, PAGE, SINK, WINDOW

RING = WINDOW + PAGE  # window ring slots: the 256-token window plus the open page
# A page is *read* as history from length SINK + WINDOW + PAGE * (p + 1) on (320 for page 0), but it is
# *written* to the pool one append earlier (319 for page 0), when its 32 tokens are complete and still
# intact in the ring. Why: within one decode step the loops run in order, so a ``share`` cell of an
# earlier loop reaches length 320 and reads page 0 before its source in the final loop has appended
# the same step's token; quantizing at 319 makes the page available to every reader of that step.
QUANTIZE_LENGTH = SINK + WINDOW + PAGE - 1  # 319: the length whose append quantizes page 0


def n_pages(length):
    """History pages (quantized) of a row holding ``length`` tokens: ``max(0, (n - 288) // 32)``."""
    if isinstance(length, int):
        return max(0, (length - SINK - WINDOW) // PAGE)
    return ((length - SINK - WINDOW) // PAGE).clamp_min(0)


def stored_pages(length):
    """Pages already quantized into the pool at ``length`` tokens: ``n_pages(length + 1)`` (see above)."""
    return n_pages(length + 1)


def max_pages(max_cache_len: int) -> int:
    """Pages a row needs to hold ``max_cache_len`` tokens."""
    return stored_pages(max_cache_len)


def capacity(pages_per_row: int) -> int:
    """The most tokens a row with ``pages_per_row`` pages can hold (the next append would quantize a page
    that does not exist): page ``p`` is quantized by the append that makes ``length = 319 + 32 p``."""
    return QUANTIZE_LENGTH + PAGE * pages_per_row - 1


def ring_slot(position):
    """Window ring slot of a position ``>= SINK``."""
    return (position - SINK) % RING


def pool_field_shapes(bits: int, pages: int, heads: int, head_dim: int) -> dict[str, tuple[int, ...]]:
    """Shapes of a pool's fields (docs/storage-layout.md) for ``pages`` physical pages; ``(0,)`` marks a field this
    kind of pool does not use (BF16 pages' scales, INT2's lo plane), which the cache holds as an empty placeholder."""
    if bits == 16:
        page = (pages, heads, PAGE, head_dim)
        return dict(k_pages=page, k_scale=(0,), k_zero=(0,), v_hi=page, v_lo=(0,), v_scale=(0,), v_zero=(0,))
    crumbs = (pages, heads, PAGE, head_dim // 4)  # V: 4 channels per byte in each plane
    groups = (pages, heads, PAGE, head_dim // GROUP)
    return dict(k_pages=(pages, heads, PAGE, head_dim * bits // 8), k_scale=(pages, heads, head_dim),
                k_zero=(pages, heads, head_dim), v_hi=crumbs, v_lo=crumbs if bits == 4 else (0,), v_scale=groups,
                v_zero=groups)
