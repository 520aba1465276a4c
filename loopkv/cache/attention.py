"""The ``"loopkv"`` attention and mask functions for transformers, and :func:`register`.

``loopkv_attention(module, query, key, value, attention_mask, *, scaling, **kwargs)`` receives the
handles that ``LoopKVCache.update`` returned as ``key``/``value``:

* decode (one query per row): ``torch.ops.loopkv.token_attention_`` writes the token and reads the cell (sink,
  pages, window); the step's last cell counts the step (``LoopKVCache.decode_cell``);
* prefill on an empty cell: writes the prompt into the cell (each row only its own tokens, padding
  read from the mask) and attends exactly over the prompt, like KIVI and the paper's engine;
* several tokens on a non-empty cell: one pass with the served semantics (``loopkv/cache/continuation.py``).

A sliding layer's cache index is a ring of its window (``loopkv/cache/window.py``): the same three cases, its prompt
attending under the window. An earlier loop of Dory's ``last_loop`` mode passes a handle that reads the last loop's
cell (``loopkv/cache/last_loop.py``). Anything that is not a handle goes to transformers' SDPA attention, so a model
can mix caches.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

_REGISTERED = False


def _pad_lengths(attention_mask, batch: int, q_len: int, device) -> Tensor:
    """Left-padding tokens per row, from a 4D bool/additive mask, a 2D mask, or None (no padding)."""
    if attention_mask is None:
        return torch.zeros(batch, dtype=torch.long, device=device)
    m = attention_mask
    if m.dim() == 4:
        # a token is real when it sees itself (a pad sees nothing); the last query alone would not do: under a
        # sliding window it does not see the start of a long prompt
        own = m[:, 0, -q_len:, -q_len:].diagonal(dim1=-2, dim2=-1)
        valid = own if own.dtype == torch.bool else own > torch.finfo(own.dtype).min / 2
    elif m.dim() == 2:
        valid = m[:, -q_len:].bool()
    else:
        raise ValueError(f"unsupported attention_mask of shape {tuple(m.shape)}")
    valid = valid.expand(batch, q_len) if valid.shape[0] == 1 else valid
    n_valid = valid.sum(dim=-1)
    # left padding: the valid tokens must be a suffix of the row
    suffix = torch.arange(q_len, device=valid.device)[None, :] >= (q_len - n_valid)[:, None]
    if not torch.equal(valid, suffix):
        raise ValueError("LoopKVCache needs left padding (each row's tokens at the end): set "
                         "tokenizer.padding_side = 'left'")
    return (q_len - n_valid).to(device)


def _prompt_attention(query: Tensor, k: Tensor, v: Tensor, pad: Tensor, scaling: float, window: int | None = None
                      ) -> Tensor:
    """Exact causal attention over the prompt, pads masked; ``window``: a sliding layer's (query ``i`` sees keys
    ``i - window < j <= i``). query [B, Hq, S, D] -> [B, S, Hq, D]."""
    B, Hq, S, D = query.shape
    g = Hq // k.shape[1]
    if g > 1:
        k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    i = torch.arange(S, device=query.device)
    allowed = (i[None, :, None] >= i[None, None, :]) & (i[None, None, :] >= pad[:, None, None])
    if window is not None:
        allowed = allowed & (i[None, :, None] - i[None, None, :] < window)
    allowed = allowed | (i[:, None] == i[None, :])[None]  # pad queries see themselves: finite garbage
    out = F.scaled_dot_product_attention(query, k, v, attn_mask=allowed[:, None], scale=scaling)
    return out.transpose(1, 2)


def loopkv_attention(module, query: Tensor, key, value, attention_mask, *, scaling: float | None = None,
                     dropout: float = 0.0, **kwargs):
    """transformers attention function for LoopKVCache handles; returns ``(out [B, S, Hq, D], None)``."""
    if not getattr(key, "is_loopkv_handle", False):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    B, Hq, S, D = query.shape
    scale = scaling if scaling is not None else D**-0.5
    if getattr(key, "is_source_read", False):  # an earlier loop reading the last loop's cache (cache/last_loop.py)
        return key.attend(query, value, attention_mask, scale=scale), None
    cache, cell = key.cache, key.cell_index
    if getattr(key, "is_packed_batch", False):  # a continuous-batching engine's step (loopkv/serving)
        return cache.attend(cell, query, key.k_new, key.v_new, scale=scale), None
    if S == 1:  # decode: the read writes the token
        out = cache.decode_cell(cell, query[:, :, 0], key.k_new, key.v_new, scale=scale)  # [B, Hq, D]
        return out[:, None], None
    if cache.is_empty(cell):
        pad = _pad_lengths(attention_mask, B, S, query.device)
        cache.prefill_cell(cell, key.k_new, key.v_new, pad)
        return _prompt_attention(query, key.k_new, key.v_new, pad, scale, cache.sliding_window(cell)), None
    return cache.continue_cell(cell, query, key.k_new, key.v_new, scale=scale), None


def loopkv_mask(*args, **kwargs):
    """Mask function for ``attn_implementation="loopkv"``: none in decode (the kernel masks from device
    lengths, so no growing mask enters the graph); transformers' SDPA mask for prefill."""
    q_length = kwargs.get("q_length")
    if q_length is None and kwargs.get("cache_position") is not None:
        q_length = kwargs["cache_position"].shape[0]
    if q_length == 1:
        return None
    from transformers.masking_utils import sdpa_mask

    return sdpa_mask(*args, **kwargs)


def register() -> None:
    """Register ``"loopkv"`` with transformers' attention and mask interfaces (idempotent).

    Called by :class:`loopkv.LoopKVCache` on construction; ``import loopkv`` never does it.
    """
    global _REGISTERED
    if _REGISTERED:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register("loopkv", loopkv_attention)
    AttentionMaskInterface.register("loopkv", loopkv_mask)
    _REGISTERED = True


__all__ = ["loopkv_attention", "loopkv_mask", "register"]
