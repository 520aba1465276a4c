"""A sliding-window layer's cache slot: a ring of exact slots that is the whole cache (docs/design.md, "Model
families").

A sliding layer of window ``W`` (transformers' ``sliding_window``) lets the token at position ``i`` attend to the
positions ``i - W < j <= i`` of its row (``masking_utils.sliding_window_overlay``); transformers' own sliding cache
keeps the last ``W - 1`` tokens and appends the new ones. loopkv keeps a row's last ``slots = min(W, max_cache_len)``
tokens in a ring, position ``p`` (the row's own tokens, pads not counted) at slot ``p % slots``: a decode token is
written first (over position ``p - W``, which it does not see) and then reads every slot its row has filled, which
is exactly its window. No page is ever stored. ``lengths`` counts every token of the row, as in every other cell.

The slot is a :class:`~loopkv.cache.storage.CellStorage` with option ``"window"``: no sink (``[B, H, 0, D]``), the
ring in ``win_k``/``win_v``, ``lengths``, an empty page table and no pool (``own_bits`` 0), kept outside the cache's
stacked buffers. Its reads are plain PyTorch (a masked softmax over ``slots`` keys): no host sync, so a compiled
decode step captures them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from loopkv.cache.storage import CellStorage
from loopkv.format import POOL_FIELDS

OPTION = "window"


def allocate_window(*, batch: int, heads: int, head_dim: int, slots: int, dtype: torch.dtype, device
                    ) -> CellStorage:
    """One sliding layer's slot of ``slots`` ring positions per row (shapes in the module docstring)."""
    exact = dict(dtype=dtype, device=device)
    empty = torch.zeros(batch, heads, 0, head_dim, **exact)
    return CellStorage(
        option=OPTION, own_bits=0, read_bits=16, sink_k=empty, sink_v=empty.clone(),
        win_k=torch.zeros(batch, heads, slots, head_dim, **exact),
        win_v=torch.zeros(batch, heads, slots, head_dim, **exact),
        lengths=torch.zeros(batch, dtype=torch.int32, device=device),
        page_table=torch.zeros(batch, 0, dtype=torch.int32, device=device),
        **{n: torch.zeros(0, **exact) for n in POOL_FIELDS},
    )


def window_bytes_per_row(*, heads: int, head_dim: int, slots: int, dtype_bytes: int) -> int:
    """Bytes one row of a window slot allocates: K and V of ``slots`` positions."""
    return 2 * slots * heads * head_dim * dtype_bytes


def _attend(query: Tensor, keys: Tensor, values: Tensor, allowed: Tensor, scale: float) -> Tensor:
    """query [B, Hq, S, D] over keys/values [B, H, K, D] where ``allowed`` [B, S, K] -> [B, Hq, S, D]."""
    g = query.shape[1] // keys.shape[1]
    if g > 1:
        keys, values = keys.repeat_interleave(g, dim=1), values.repeat_interleave(g, dim=1)
    return F.scaled_dot_product_attention(query, keys, values, attn_mask=allowed[:, None], scale=scale)


def decode_(st: CellStorage, query: Tensor, k: Tensor, v: Tensor, *, scale: float, count: bool = True) -> Tensor:
    """One decode token per row: write k, v [B, H, 1, D] at slot ``lengths % slots`` and attend query [B, Hq, D]
    over the row's filled slots (its window) -> [B, Hq, D]. ``count``: also count the token (``lengths += 1``); a
    reader that only borrows the slot for its own token (Dory's ``last_loop``: an earlier loop reading the last
    loop's window, which then writes its own token at the same slot) leaves the count alone."""
    B, slots = query.shape[0], st.win_k.shape[2]
    held = st.lengths[:B].long()  # [B]
    at = (held % slots)[:, None, None, None].expand(B, k.shape[1], 1, k.shape[3])
    st.win_k[:B].scatter_(2, at, k.to(st.win_k.dtype))
    st.win_v[:B].scatter_(2, at, v.to(st.win_v.dtype))
    allowed = torch.arange(slots, device=held.device)[None, None, :] <= held[:, None, None]  # [B, 1, slots]
    out = _attend(query[:, :, None], st.win_k[:B], st.win_v[:B], allowed, scale)[:, :, 0]
    if count:
        st.lengths[:B] += 1
    return out


def prefill(st: CellStorage, k: Tensor, v: Tensor, pad: Tensor, rows: list[int]) -> None:
    """Write left-padded prompts k, v [B, H, S, D] (``pad`` [B] pads per row) into empty ``rows``: each row's last
    ``slots`` tokens at their ring slots."""
    S, slots = k.shape[2], st.win_k.shape[2]
    for i, (b, p) in enumerate(zip(rows, pad.tolist(), strict=True)):
        n = S - int(p)
        keep = torch.arange(max(0, n - slots), n, device=k.device)  # row positions kept
        st.win_k[b, :, keep % slots] = k[i, :, int(p) + keep]
        st.win_v[b, :, keep % slots] = v[i, :, int(p) + keep]
        st.lengths[b] = n


def extend(st: CellStorage, query: Tensor, k: Tensor, v: Tensor, *, scale: float, window: int,
           held: list[int]) -> Tensor:
    """Several tokens on rows that hold ``held`` tokens (a later turn): token ``i`` of a row (position
    ``held + i``) attends to the ring's positions and the new tokens within its window; then the new tokens are
    written and counted. query [B, Hq, S, D], k, v [B, H, S, D] -> [B, S, Hq, D]."""
    B, S, slots = k.shape[0], k.shape[2], st.win_k.shape[2]
    device = k.device
    n = torch.tensor(held, device=device)[:, None]  # [B, 1]
    s = torch.arange(slots, device=device)[None, :]
    ring_pos = n - 1 - (n - 1 - s) % slots  # [B, slots]: the latest position at slot s (negative: never filled)
    new_pos = n + torch.arange(S, device=device)[None, :]  # [B, S]
    key_pos = torch.cat([ring_pos, new_pos], 1)  # [B, slots + S]
    q_pos = new_pos[:, :, None]
    allowed = (key_pos[:, None, :] >= 0) & (key_pos[:, None, :] <= q_pos) & (q_pos - key_pos[:, None, :] < window)
    keys = torch.cat([st.win_k[:B], k.to(st.win_k.dtype)], 2)
    values = torch.cat([st.win_v[:B], v.to(st.win_v.dtype)], 2)
    out = _attend(query, keys, values, allowed, scale)
    for b in range(B):
        keep = torch.arange(max(0, S - slots), S, device=device)
        st.win_k[b, :, (held[b] + keep) % slots] = k[b, :, keep]
        st.win_v[b, :, (held[b] + keep) % slots] = v[b, :, keep]
    st.lengths[:B] += S
    return out.transpose(1, 2)
