"""Rows as request slots: what a continuous-batching engine needs from a LoopKVCache (docs/design.md, "Serving").

An engine's step mixes requests at different stages: some slots decode one token, some start a prompt, some add a
chunk of a longer prompt, the rest wait. Per cell, in the model's order:

* :func:`prefill` writes a new request's prompt into its empty slot (``LoopKVCache.prefill_cell`` with ``rows``);
  its attention over the prompt is exact, as in ``generate``;
* :func:`extend` adds several tokens to a slot that holds some (a prompt's next chunk), with the served semantics
  (``loopkv/cache/continuation.py``);
* :func:`decode` reads and writes one token for each decoding slot: one ``token_attention_`` over every row of the
  cache, the decoding slots' tokens scattered in, the others given zeros;

and after the step's last cell, :func:`end_step` counts the decoding slots' tokens in every cell (``advance_``) and
puts every other row's length back. A row's read and write touch only that row, and a waiting row's write lands
at its next position, which no read reaches before that row writes it again; so a step over all rows equals a step
over the decoding ones, with fixed shapes (the same kernels and, on CUDA, one graph for any mix). Pages for the
step's tokens come first: ``LoopKVCache.reserve({slot: tokens after the step})``.
"""

from __future__ import annotations

import torch
from torch import Tensor


def prefill(cache, cell: int, slot: int, k: Tensor, v: Tensor) -> None:
    """Write a prompt (k, v [H, n, D]) into empty ``slot`` of ``cell``."""
    cache.prefill_cell(cell, k[None], v[None], torch.zeros(1, dtype=torch.long), rows=[slot])


def extend(cache, cell: int, slot: int, query: Tensor, k: Tensor, v: Tensor, *, scale: float) -> Tensor:
    """Several tokens (k, v [H, n, D], query [Hq, n, D]) after what ``slot`` holds; returns [n, Hq, D]."""
    from loopkv.cache.continuation import continue_rows

    if k.shape[1] + int(cache.layers[cell].storage.lengths[slot]) > cache.max_cache_len:
        raise ValueError(f"slot {slot} would pass max_cache_len={cache.max_cache_len}")
    return continue_rows(cache, cell, query[None], k[None], v[None], scale=scale, rows=[slot])[0]


def decode(cache, cell: int, slots: Tensor, query: Tensor, k: Tensor, v: Tensor, *, scale: float) -> Tensor:
    """One token for each of ``slots`` (int64 [m]; query [m, Hq, D], k, v [m, H, D]); returns [m, Hq, D]."""
    rows = cache.max_batch_size
    st = cache._rows(cell, rows)
    q_all = query.new_zeros(rows, *query.shape[1:]).index_copy_(0, slots, query)
    k_all = k.new_zeros(rows, k.shape[1], 1, k.shape[2]).index_copy_(0, slots, k[:, :, None])
    v_all = v.new_zeros(rows, v.shape[1], 1, v.shape[2]).index_copy_(0, slots, v[:, :, None])
    out = torch.ops.loopkv.token_attention_(
        q_all, k_all, v_all, st.sink_k, st.sink_v, st.win_k, st.win_v, st.lengths, st.page_table, *st.pool(),
        st.read_bits, cache._tau(cell, st), scale,
    )
    return out.index_select(0, slots)


def end_step(cache, slots: Tensor) -> None:
    """After the step's last cell: count the token of each of ``slots`` in every cell; every other row keeps its
    length (its pages and positions are untouched: see the module docstring)."""
    rows = cache.max_batch_size
    decoding = torch.zeros(rows, dtype=torch.bool, device=slots.device).index_fill_(0, slots, True)
    for shard in cache._shards:
        lengths = shard.stacks.own["lengths"]
        before = lengths[:, :rows].clone()
        cache._advance(shard, rows, lengths, shard.groups)
        lengths[:, :rows] = torch.where(decoding.to(lengths.device), lengths[:, :rows], before)
