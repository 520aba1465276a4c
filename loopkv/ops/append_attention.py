"""Decode append and cell attention as one op: ``append_attention_`` (docs/design-decisions.md §10).

``append_`` followed by ``cell_attention`` of the same cell, for the one token a decode step adds to it:
the reference below is exactly those two references in turn; the Triton kernel
(``loopkv.ops.triton_attention.append_attention``, registered as the CUDA kernel) does both in one launch, so a
decode step needs one launch per cell instead of two. ``own_bits`` is the cell's own pool (``append_``'s
``bits``; 0 for a ``share`` cell, which has no pool), ``bits`` the pages it reads.

``LoopKVCache`` uses it only when built with ``fused_append=True`` (off by default, session 6): the kernel is
built and tested against the two ops under the interpreter, and nothing of it has run on a GPU. Its append
programs encode pages in slices so that the encoder's registers do not spill the reader's page loop (static,
sm_90, Triton 3.6: INT4 974 instructions per page-head and no spill, against 959 for the plain reader; with V
precision 996 and 5 spill loads).
"""

from __future__ import annotations

import torch
from torch import Tensor

from loopkv.ops.cache_ops import _APPEND_MUTATES, append_reference
from loopkv.ops.cell_attention import cell_attention_reference


@torch.library.custom_op("loopkv::append_attention_", mutates_args=_APPEND_MUTATES)
def append_attention_(
    q: Tensor, k_new: Tensor, v_new: Tensor, sink_k: Tensor, sink_v: Tensor, win_k: Tensor, win_v: Tensor,
    lengths: Tensor, page_table: Tensor, k_pages: Tensor, k_scale: Tensor, k_zero: Tensor, v_hi: Tensor,
    v_lo: Tensor, v_scale: Tensor, v_zero: Tensor, bits: int, own_bits: int, tau: float, scale: float,
) -> Tensor:
    """``append_`` of (k_new, v_new) at ``own_bits``, then ``cell_attention`` of q; the reference serves every
    device."""
    append_reference(k_new, v_new, sink_k, sink_v, win_k, win_v, lengths, page_table, k_pages, k_scale, k_zero,
                     v_hi, v_lo, v_scale, v_zero, own_bits)
    return cell_attention_reference(q, sink_k, sink_v, win_k, win_v, lengths, page_table, k_pages, k_scale, k_zero,
                                    v_hi, v_lo, v_scale, v_zero, bits, tau, scale)


@append_attention_.register_fake
def _(q, *args, **kwargs):
    return torch.empty_like(q)
