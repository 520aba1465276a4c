"""How loopkv's own models (Ouro, Huginn) take and give back their cache across transformers releases, and the mask
of one piece of a turn that a model splits (one home for what both models do alike).

transformers renamed the cache argument of ``forward``/``generate`` and the field of ``CausalLMOutputWithPast``
from ``past_key_values`` to ``cache`` (~5.2x); loopkv's models accept both names and answer in the installed
release's.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from transformers.cache_utils import Cache
from transformers.modeling_outputs import CausalLMOutputWithPast

# The name CausalLMOutputWithPast gives the cache: "past_key_values" up to ~5.2x, "cache" afterwards.
OUTPUT_CACHE_FIELD = (
    "cache" if "cache" in {f.name for f in dataclasses.fields(CausalLMOutputWithPast)} else "past_key_values"
)


def pick_cache(past_key_values: Cache | None, cache: Cache | None) -> Cache | None:
    """The one cache passed as ``past_key_values=`` or ``cache=`` (a ValueError for two different ones)."""
    if past_key_values is not None and cache is not None and past_key_values is not cache:
        raise ValueError("pass the cache once, as past_key_values= or as cache=, not two different caches")
    return cache if cache is not None else past_key_values


def generate_cache_kwargs(kwargs: dict[str, Any]) -> None:
    """In ``generate``'s keyword arguments, move ``past_key_values=`` to ``cache=`` where transformers takes the new
    name (accepting the old one without a warning); unchanged on older releases."""
    if OUTPUT_CACHE_FIELD == "cache" and "past_key_values" in kwargs:
        kwargs["cache"] = pick_cache(kwargs.pop("past_key_values"), kwargs.get("cache"))


def mask_piece(mask: Any, q_len: int, end: int, piece: int) -> Any:
    """The mask of queries ``[end - piece, end)`` of a ``q_len``-token forward, over keys up to the piece's last (a 2-D
    or 4-D mask, or a mapping of them per attention type)."""
    if mask is None:
        return None
    if isinstance(mask, dict):
        return {name: mask_piece(m, q_len, end, piece) for name, m in mask.items()}
    keys = mask.shape[-1] - q_len + end  # the cache's columns, then the forward's up to ``end``
    if mask.dim() == 2:
        return mask[:, :keys]
    return mask[..., end - piece:end, :keys]


__all__ = ["OUTPUT_CACHE_FIELD", "generate_cache_kwargs", "mask_piece", "pick_cache"]
