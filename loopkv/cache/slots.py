"""Rows as request slots: what a continuous-batching engine needs from a LoopKVCache (docs/design.md, "Serving").

An engine's step mixes requests at different stages: some slots decode one token, some start a prompt, some add a
chunk of a longer prompt, the rest wait. Per cell, in the model's order:

* :func:`prefill` writes a new request's prompt into its empty slot (``LoopKVCache.prefill_cell`` with ``rows``);
  its attention over the prompt is exact, as in ``generate``;
* :func:`extend` adds several tokens to a slot that holds some (a prompt's next chunk), with the served semantics
  (``loopkv/cache/continuation.py``);
* :func:`decode` reads and writes one token for each decoding slot: one ``token_attention_`` over every row of the
  cache, the decoding slots' tokens gathered from the packed batch, the others given zeros; which rows decode, and
  which packed token each reads, is a :class:`DecodeStep`, device tensors built once per step (no host work per
  cell);

and after the step's last cell, :func:`end_step` counts the decoding slots' tokens in every cell (``advance_``) and
puts every other row's length back. A row's read and write touch only that row, and a waiting row's write lands
at its next position, which no read reaches before that row writes it again; so a step over all rows equals a step
over the decoding ones, with fixed shapes (the same kernels and, on CUDA, one graph for any mix). Pages for the
step's tokens come first: ``LoopKVCache.reserve({slot: tokens after the step})``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


def prefill(cache, cell: int, slot: int, k: Tensor, v: Tensor) -> None:
    """Write a prompt (k, v [H, n, D]) into empty ``slot`` of ``cell``."""
    cache.prefill_cell(cell, k[None], v[None], torch.zeros(1, dtype=torch.long), rows=[slot])


def extend(cache, cell: int, slot: int, held: int, query: Tensor, k: Tensor, v: Tensor, *, scale: float) -> Tensor:
    """Several tokens (k, v [H, n, D], query [Hq, n, D]) after the ``held`` tokens ``slot`` holds (the caller's
    count: reading it from the device would wait for it); returns [n, Hq, D]."""
    from loopkv.cache.continuation import continue_rows

    if k.shape[1] + held > cache.max_cache_len:
        raise ValueError(f"slot {slot} would pass max_cache_len={cache.max_cache_len}")
    return continue_rows(cache, cell, query[None], k[None], v[None], scale=scale, rows=[slot])[0]


@dataclass(frozen=True)
class DecodeStep:
    """Which packed tokens of a step decode, as device tensors whose shapes depend only on the cache's rows and the
    step's packed tokens: built on the host once per step, one copy to the device, read by every cell."""

    token: Tensor  # int64 [rows]: the packed token each row decodes (0 for a row that does not decode)
    decoding: Tensor  # bool [rows]: the row decodes a token this step
    row: Tensor  # int64 [tokens]: the row whose output each packed token takes (0 for a token that does not decode)

    @classmethod
    def build(cls, pairs: list[tuple[int, int]], *, rows: int, tokens: int, device) -> DecodeStep:
        """``pairs``: (row, packed token) of each decoding row; ``tokens``: the packed batch's length."""
        token, decoding, row = [0] * rows, [0] * rows, [0] * tokens
        for r, t in pairs:
            token[r], decoding[r], row[t] = t, 1, r
        host = torch.tensor(token + decoding + row, dtype=torch.long)
        if torch.device(device).type == "cuda":  # pinned: the copy does not wait for the device
            host = host.pin_memory()
        buf = host.to(device, non_blocking=True)
        return cls(token=buf[:rows], decoding=buf[rows:2 * rows].bool(), row=buf[2 * rows:])


def decode(cache, cell: int, step: DecodeStep, query: Tensor, k: Tensor, v: Tensor, *, scale: float) -> Tensor:
    """One token for each decoding row of ``step``, read from a packed batch (query [T, Hq, D], k, v [T, H, D]);
    returns [T, Hq, D]: each decoding token's attention (rows for the other tokens: another token's, unused)."""
    rows = cache.max_batch_size
    st = cache._rows(cell, rows)
    keep = step.decoding[:, None, None]
    q_all = torch.where(keep, query.index_select(0, step.token), 0)
    k_all = torch.where(keep, k.index_select(0, step.token), 0)[:, :, None]
    v_all = torch.where(keep, v.index_select(0, step.token), 0)[:, :, None]
    out = torch.ops.loopkv.token_attention_(
        q_all, k_all, v_all, st.sink_k, st.sink_v, st.win_k, st.win_v, st.lengths, st.page_table, *st.pool(),
        st.read_bits, cache._tau(cell, st), scale,
    )
    return out.index_select(0, step.row)


def end_step(cache, step: DecodeStep) -> None:
    """After the step's last cell: count the token of each decoding row of ``step`` in every cell; every other row
    keeps its length (its pages and positions are untouched: see the module docstring)."""
    rows = cache.max_batch_size
    for shard in cache._shards:
        decoding = step.decoding.to(shard.device)
        lengths = shard.stacks.own["lengths"]
        before = lengths[:, :rows].clone()
        cache._advance(shard, rows, lengths, shard.groups)
        lengths[:, :rows] = torch.where(decoding, lengths[:, :rows], before)
