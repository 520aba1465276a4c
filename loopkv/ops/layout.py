"""TODO(transition): moved to loopkv.format; deleted once every import points there."""

from loopkv.format import (  # noqa: F401
    QUANTIZE_LENGTH,
    RING,
    capacity,
    max_pages,
    n_pages,
    pool_field_shapes,
    ring_slot,
    stored_pages,
)
