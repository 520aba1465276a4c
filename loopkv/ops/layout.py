"""Positions of a row inside one cell (docs/storage-layout.md), shared by the ops and the cache.

All functions work on Python ints and on integer tensors alike, so the same formula serves the host
(sizing pools) and the device (per-row state inside the decode step).
"""

from __future__ import annotations

from loopkv.ops.codec import PAGE, SINK, WINDOW

RING = WINDOW + PAGE  # window ring slots: the 256-token window plus the open page
EXIT_LENGTH = SINK + WINDOW + PAGE  # the first length at which a page leaves the window (320)


def n_pages(length):
    """History pages (quantized) of a row holding ``length`` tokens: ``max(0, (n - 288) // 32)``."""
    if isinstance(length, int):
        return max(0, (length - SINK - WINDOW) // PAGE)
    return ((length - SINK - WINDOW) // PAGE).clamp_min(0)


def max_pages(max_cache_len: int) -> int:
    """Pages a row needs to hold ``max_cache_len`` tokens."""
    return n_pages(max_cache_len)


def capacity(pages_per_row: int) -> int:
    """The most tokens a row with ``pages_per_row`` pages can hold (the next append would need one more)."""
    return SINK + WINDOW + PAGE * (pages_per_row + 1) - 1


def ring_slot(position):
    """Window ring slot of a position ``>= SINK``."""
    return (position - SINK) % RING
