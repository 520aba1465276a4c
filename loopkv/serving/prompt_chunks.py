"""A prompt prefilled in chunks, exactly: its keys and values held in a dense scratch until its last chunk
(docs/design.md, "Prompts in chunks").

A prompt in one pass attends exactly over itself; its pages are quantized only after. A chunk of a prompt after its
first would read the history before it through the cache, as stored (the continuation), and pay one read of the
row's pages per chunk. The engine instead keeps every cell's keys and values of the prompt in progress exact here:
each chunk is written after the chunks before it and attends over all of them (causal attention, the prompt's own
positions only), and the last chunk writes the whole prompt into the request's slot as one prompt would be written
(``slots.prefill_step``). So a prompt in chunks gives the tokens of the prompt in one pass, at a dense attention's
cost, and a step is bounded by the engine's token budget rather than by the longest prompt.

The scratch holds one prompt of up to ``max_len`` tokens in every cell (:func:`scratch_bytes`): the engine prefills
one request in chunks at a time, and any other prompt waits for a step that holds it whole or for the scratch.
"""

from __future__ import annotations

import torch
from torch import Tensor


def scratch_bytes(config, *, tokens: int, dtype_bytes: int) -> int:
    """The bytes of a :class:`PromptScratch` of ``tokens`` tokens for ``config``'s model: K and V in every cell of its
    cache (the planned cells and the fixed exact ones). Ouro-1.4B in BF16 at 16,384 tokens: 12 GiB."""
    from loopkv.cache.checks import model_layout, model_shape

    loops, layers, kv_heads, head_dim = model_shape(config)
    cells = loops * layers + len(model_layout(config).fixed("exact"))
    return 2 * cells * tokens * kv_heads * head_dim * dtype_bytes


class PromptScratch:
    """Every cell's exact K and V ([cells, max_len, H, D] each, the packed batch's token-major layout) of the one
    prompt being prefilled in chunks, and which request holds it (:attr:`owner`, None when free)."""

    def __init__(self, *, cells: int, max_len: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device):
        shape = (cells, max_len, kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_len = max_len
        self.owner: str | None = None

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def claim(self, request_id: str) -> None:
        if self.owner is not None and self.owner != request_id:
            raise RuntimeError(f"request {request_id} starts a prompt in chunks while request {self.owner} holds the "
                               "scratch: the engine prefills one prompt in chunks at a time (loopkv's scheduler)")
        self.owner = request_id

    def release(self, request_id: str) -> None:
        """``request_id`` is done with the scratch (its prompt is written, or it left); nothing to clear: a new
        owner writes every position it reads."""
        if self.owner == request_id:
            self.owner = None

    def attend(self, cell: int, query: Tensor, k: Tensor, v: Tensor, *, start: int, scale: float) -> Tensor:
        """Write a chunk (k, v [n, H, D]) at positions ``start`` onward of ``cell`` and return its exact causal
        attention over positions ``0 .. start + n`` (query [Hq, n, D] -> [n, Hq, D])."""
        n = k.shape[0]
        end = start + n
        if end > self.max_len:
            raise ValueError(f"a chunk ending at position {end}, but the prompt scratch holds {self.max_len}")
        self.k[cell, start:end] = k
        self.v[cell, start:end] = v
        return chunk_attention(query, self.k[cell, :end], self.v[cell, :end], scale=scale)


def chunk_attention(query: Tensor, k: Tensor, v: Tensor, *, scale: float) -> Tensor:
    """The last ``n`` queries of a causal attention over ``T`` exact keys (query [Hq, n, D]; k, v [T, H, D]; query
    ``i`` sits at position ``T - n + i`` and sees keys ``0 .. T - n + i``): returns [n, Hq, D]. ``n == T``: a whole
    prompt. The causal rule is SDPA's lower-right causal bias rather than a mask tensor, so on CUDA flash attention
    runs it and skips the masked blocks."""
    from torch.nn.attention.bias import causal_lower_right

    Hq, n, _ = query.shape
    T, H, _ = k.shape
    g = Hq // H
    kk, vv = k.transpose(0, 1), v.transpose(0, 1)  # [H, T, D]
    if g > 1:
        kk, vv = kk.repeat_interleave(g, dim=0), vv.repeat_interleave(g, dim=0)
    out = torch.nn.functional.scaled_dot_product_attention(query[None], kk[None], vv[None],
                                                           attn_mask=causal_lower_right(n, T), scale=scale)
    return out[0].transpose(0, 1)
