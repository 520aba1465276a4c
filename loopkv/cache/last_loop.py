"""Loops that read the last loop's cache without writing one of their own (transformers' Dory,
``recurrent_kv_cache_mode="last_loop"``; docs/design.md, "Model families").

What Dory does in that mode (``DoryModel.forward`` and ``DoryAttention.forward``, transformers 5.24): only the last
loop calls ``cache.update`` for the recurrent layers; at the start of each forward the model takes
``(cache.layers[i].keys, cache.layers[i].values)`` of every layer, and loop ``t`` before the last attends over
``torch.cat([past, own new tokens])`` of its layer's index (a sliding layer trimmed to its window), writing nothing.
So an earlier loop reads the last loop's K/V of every past token (sink, history and window alike) and its own K/V of
the current tokens. A ``share`` cell is not that: it keeps its own exact sink and window and borrows only its
source's history pages.

Served here without changing transformers: the cache layer of such an index answers ``.keys``/``.values`` with a
:class:`SourcePast`, a tensor-like whose ``torch.cat`` with the new tokens returns a :class:`SourceRead` handle (the
window's trim leaves it as it is: the source's own window already bounds it), which the ``"loopkv"`` attention
function hands back here (:meth:`SourceRead.attend`):

* decode: the loop's token is written at the source's next position (its sink or window slot; a sliding layer: its
  ring slot) and the source's cell is read, all of it, with the reading loop's V precision; the count is not
  advanced, and the last loop then writes its own token over the same slot. Every reader of a step reads before
  the last loop writes, so each sees the source's past and its own token, as Dory does.
* prefill (the source is empty, as the dense cache is before its first update): exact attention over the loop's own
  prompt (causal, the window for a sliding layer), nothing written.
* several tokens on a non-empty cache (a later turn) are refused, naming ``reset()``, before anything is written.

The plan gives these loops ``share``: they store nothing (:func:`check_plan`).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from loopkv.cache import window


class SourcePast:
    """What a read cache index's ``.keys`` (``part="k"``) or ``.values`` (``"v"``) is in a ``last_loop`` layout:
    the last loop's K/V of that index, not materialised. ``torch.cat([past, new], dim=-2)`` gives a
    :class:`SourceRead`; the k part counts its reads, and so the loop that reads (a fresh object each forward)."""

    def __init__(self, cache, index: int, part: str):
        self.cache, self.index, self.part = cache, index, part
        self.reads = 0

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.cat:
            tensors = args[0]
            dim = kwargs.get("dim", args[1] if len(args) > 1 else 0)
            if len(tensors) == 2 and isinstance(tensors[0], SourcePast) and isinstance(tensors[1], Tensor) \
                    and dim in (-2, 2):
                past, new = tensors
                loop = past.reads
                past.reads += 1
                return SourceRead(past.cache, past.index, new, loop)
        raise TypeError(
            f"{func.__name__} on a LoopKVCache layer's keys/values: in Dory's last_loop mode they stand for the last "
            "loop's cache, read by the 'loopkv' attention function; only torch.cat([past, new], dim=-2) is supported")


class SourceRead:
    """An earlier loop's read of cache index ``index`` with its new tokens ``new`` [B, H, S, D] (K or V) as the
    ``loop``-th reader of the forward: what ``torch.cat`` returned; the ``"loopkv"`` attention function calls
    :meth:`attend` with the K read as key and the V read as value."""

    is_loopkv_handle = True
    is_source_read = True

    def __init__(self, cache, index: int, new: Tensor, loop: int):
        self.cache, self.index, self.new, self.loop = cache, index, new, loop

    def __getitem__(self, item) -> SourceRead:
        """A sliding layer's trim to its window (``[..., -num_visible:, :]``): the source's window bounds it."""
        return self

    def attend(self, query: Tensor, value: SourceRead, attention_mask, *, scale: float) -> Tensor:
        """query [B, Hq, S, D] -> [B, S, Hq, D] (module docstring)."""
        from loopkv.cache.attention import _pad_lengths, _prompt_attention

        cache, index = self.cache, self.index
        B, _, S, _ = query.shape
        k, v = self.new, value.new
        slots = cache.layers[index].storage
        sliding = slots.option == window.OPTION
        if S == 1:
            st = cache._rows(index, B)
            if sliding:
                return window.decode_(st, query[:, :, 0], k, v, scale=scale, count=False)[:, None]
            tau = cache.taus[self.loop] if st.read_bits == 4 else math.inf
            out = torch.ops.loopkv.token_attention_(
                query[:, :, 0], k, v, st.sink_k, st.sink_v, st.win_k, st.win_v, st.lengths, st.page_table,
                *st.pool(), st.read_bits, tau, scale)
            return out[:, None]
        if not cache.is_empty(index):
            refuse_later_turn()
        pad = _pad_lengths(attention_mask, B, S, query.device)
        return _prompt_attention(query, k, v, pad, scale, window=cache.layout.sliding_window if sliding else None)


def refuse_later_turn() -> None:
    """Several new tokens on a non-empty cache in this mode: refused (``LoopKVCache.continue_cell`` raises it at the
    forward's first index, before anything is written)."""
    raise ValueError(
        "several new tokens on a non-empty LoopKVCache in Dory's last_loop mode (a later turn): its earlier loops "
        "would read the last loop's stored past with their own new tokens, which is not built. cache.reset() and send "
        "the whole conversation, or use recurrent_kv_cache_mode='per_loop'")


def attach(cache) -> None:
    """Point each cache index that earlier loops read (``layout.shared_reads``) at ``cache``, so that its layer's
    ``.keys``/``.values`` are :class:`SourcePast` objects."""
    for index in cache.layout.shared_reads:
        cache.layers[index].read_by = (cache, index)


def check_plan(layout, plan) -> None:
    """Refuse a plan that gives a loop storage of its own where the model's loop reads another loop's cache."""
    stored = [c for c in layout.reads_without_update if plan.option(c) != "share"]
    if stored:
        loops = sorted({c.loop for c in stored})
        raise ValueError(
            f"in this {layout.family} model, loops {loops} read the last loop's cache and write none of their own "
            "(Dory's recurrent_kv_cache_mode='last_loop'), so the plan must give their cells 'share' (they store "
            f"nothing); it gives {sorted({plan.option(c) for c in stored})}. Make the plan with "
            f"Plan.from_config(config, option=..., shared_loops={loops})")
