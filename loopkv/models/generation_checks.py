"""What ``generate`` checks about a cache passed in, before anything is written: that the request fits the cache's
declared capacity (every model's ``generate``: :func:`check_from_generate`; Ouro's also in its own override), and that
the input continues what a previous ``generate`` left in the cache (Ouro's ``generate``)."""

from __future__ import annotations

import weakref
from types import FrameType
from typing import Any

import torch
from transformers.cache_utils import Cache, DynamicCache


def _declared_max_cache_len(cache: Any) -> int | None:
    """``cache.max_cache_len`` when the cache itself declares one (a LoopKVCache does); ``None`` for
    transformers' base ``Cache``, whose deprecated ``max_cache_len`` property (5.17) is not a capacity."""
    if "max_cache_len" in getattr(cache, "__dict__", {}):
        value = cache.__dict__["max_cache_len"]
    else:
        for klass in type(cache).__mro__:
            if klass is Cache:
                return None
            if "max_cache_len" in vars(klass):
                break
        else:
            return None
        value = cache.max_cache_len
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def check_capacity(cache: Any, generation_config: Any) -> None:
    """Refuse a ``generate`` request of more tokens than ``cache`` declares it holds. Called once transformers
    has settled ``generation_config.max_length`` (prompt + new tokens: from ``max_new_tokens``, ``max_length``
    or transformers' default), so every way of asking for a length is covered."""
    limit = _declared_max_cache_len(cache)
    total = generation_config.max_length
    if limit is None or not isinstance(total, int) or total <= limit:
        return
    new = generation_config.max_new_tokens
    what = (f"prompt length {total - new} + max_new_tokens {new} = {total} tokens" if new is not None
            else f"max_length {total} tokens (the prompt and the new tokens)")
    raise ValueError(
        f"{what} exceeds the cache's max_cache_len {limit}; build the cache with a larger max_cache_len or "
        "pass a smaller max_new_tokens"
    )


# The one call transformers' generate (5.17 to 5.24) makes on a cache passed in before its prefill is
# `cache._is_user_defined = True`, inside this method, once `generation_config.max_length` is settled.
GENERATE_MARKS_CACHE_IN = "_prepare_cache_for_generation"


def check_from_generate(cache: Any, caller: FrameType | None) -> None:
    """Called when ``caller`` marks ``cache`` as user-defined: inside transformers' ``generate``, refuse a request
    longer than the cache holds (:func:`check_capacity`) before any model forward.

    transformers hands a user cache no length before generating (no ``max_cache_len`` check, no hook with the
    generation config), so this reads ``generation_config`` from the marking call, generate's own
    ``_prepare_cache_for_generation``. From any other caller (or a transformers that no longer marks the cache
    there: ``tests/models/test_other_models.py`` then fails), nothing is checked here and the cache refuses the first
    forward that would pass ``max_cache_len``."""
    if caller is None or caller.f_code.co_name != GENERATE_MARKS_CACHE_IN:
        return
    generation_config = caller.f_locals.get("generation_config")
    if generation_config is not None:
        check_capacity(cache, generation_config)


# The sequences each user cache's last `generate` returned (what the cache holds, bar the last token), by cache.
GENERATED: weakref.WeakKeyDictionary[Any, torch.Tensor] = weakref.WeakKeyDictionary()
_FRESH_CACHE_FIX = (
    "call cache.reset() (or pass a new cache) between unrelated requests; to continue the conversation, pass the "
    "earlier output followed by the new tokens"
)


def check_continues(cache: Any, input_ids: torch.Tensor | None) -> None:
    """Refuse a ``generate`` whose ``input_ids`` do not continue what ``cache`` holds from its previous ``generate``.

    transformers feeds only the input positions past ``cache.get_seq_length()``, so a new, unrelated prompt on a used
    cache would silently be read as a continuation of the old conversation (or fail on a shape, if shorter). A cache
    that is empty (new or ``reset()``), or that was filled outside ``generate``, is not checked. Rows beyond those of
    the previous call are left to the cache (LoopKVCache refuses rows it never held)."""
    if cache is None or input_ids is None:
        return
    before = GENERATED.get(cache)
    if before is None:
        return
    held = int(cache.get_seq_length())
    if held == 0:
        return
    rows, n = min(input_ids.shape[0], before.shape[0]), min(held, before.shape[1])
    if input_ids.shape[1] <= held:
        raise ValueError(
            f"this cache already holds {held} positions from an earlier generate and the new input has "
            f"{input_ids.shape[1]}, so it does not continue them: a new prompt on a used cache; {_FRESH_CACHE_FIX}")
    same = input_ids[:rows, :n].to(before.device) == before[:rows, :n]
    if not bool(same.all()):
        row, position = (~same).nonzero()[0].tolist()
        raise ValueError(
            f"this cache holds {held} positions from an earlier generate and the new input differs from them (row "
            f"{row}, position {position}): a new, unrelated prompt on a used cache would be read as a continuation "
            f"of the old one; {_FRESH_CACHE_FIX}")


def refuse_layer_cache(generation_config: Any, user_cache: Any, *, model: str, cell: str) -> None:
    """Refuse a ``cache_implementation`` that transformers would build with one layer per physical layer when the
    user passes no cache: a looped ``model`` needs one per ``cell``."""
    implementation = generation_config.cache_implementation
    if user_cache is None and generation_config.use_cache is not False and implementation not in (None, "dynamic"):
        raise ValueError(
            f"cache_implementation={implementation!r} builds a cache with one layer per physical layer, but "
            f"{model} needs one per {cell} cell; pass past_key_values=dense_cache(model.config) or a "
            "loopkv.LoopKVCache instead"
        )


def replace_default_cache(model_kwargs: dict, dense: Any) -> None:
    """Swap the ``DynamicCache`` transformers built for a looped model (one layer per physical layer) for
    ``dense``, built with one layer per cell."""
    for name in ("cache", "past_key_values"):
        if isinstance(model_kwargs.get(name), DynamicCache):
            model_kwargs[name] = dense
