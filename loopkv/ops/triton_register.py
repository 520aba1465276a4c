"""Register the Triton kernels as the CUDA kernels of the ``torch.ops.loopkv`` custom ops.

``register_triton_kernels()`` is idempotent and cheap after the first call. It imports Triton lazily and registers
nothing (returns False) when Triton or CUDA is unavailable, or on ROCm (the kernels use inline PTX): the ops' PyTorch
references then serve the device, so ``import loopkv`` stays lean. The launchers it registers (``launchers()``) are
plain functions; tests call them directly on CPU tensors under ``TRITON_INTERPRET=1``.

``warmup(...)`` compiles the kernels a cache of given shapes launches and allocates their counters
(``triton_counters``), so that nothing compiles or allocates during CUDA-graph capture.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from loopkv.format import PAGE, RING, SINK, pool_field_shapes
from loopkv.ops.triton_counters import counters

_registered = False


def triton_available() -> bool:
    """True when Triton imports and a CUDA device (not ROCm) is present."""
    if not torch.cuda.is_available() or torch.version.hip:
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def launchers() -> list:
    """``(custom op, Triton launcher)`` pairs: what ``register_triton_kernels`` registers for CUDA. Imports Triton."""
    from loopkv.ops import triton_attention, triton_chunk, triton_quant
    from loopkv.ops.cache_ops import write_pages_
    from loopkv.ops.cell_attention import cell_attention
    from loopkv.ops.chunk_attention import chunk_attention
    from loopkv.ops.step_ops import advance_, token_attention_

    return [(cell_attention, triton_attention.cell_attention), (token_attention_, triton_attention.token_attention),
            (advance_, triton_quant.advance), (write_pages_, triton_quant.write_pages),
            (chunk_attention, triton_chunk.chunk_attention)]


def register_triton_kernels() -> bool:
    """Register the Triton launchers as the CUDA kernels of the loopkv ops; True if they are registered. On ROCm,
    without CUDA or without Triton nothing is registered and the ops run their PyTorch references."""
    global _registered
    if _registered:
        return True
    if not triton_available():
        return False
    for op, launcher in launchers():
        op.register_kernel("cuda")(launcher)
    _registered = True
    return True


def warmup(
    *, batch_size: int, kv_heads: int, q_heads: int, head_dim: int, max_pages: int, dtype: torch.dtype,
    read_bits: tuple[int, ...] = (4,), own_bits: tuple[int, ...] = (4,), tau: float = math.inf,
    device: torch.device | str = "cuda",
) -> None:
    """JIT-compile the kernels a cache of this shape launches and allocate their counters, so that nothing compiles
    or allocates during CUDA-graph capture.

    Runs each kernel on zeroed dummy tensors with the cache's specializations (heads, head_dim, pages per row and,
    at batch 1 and ``batch_size``, the rows' launch config and split count): ``cell_attention`` and
    ``token_attention_`` for every ``read_bits`` (and V precision when ``tau`` is finite), ``write_pages_`` and
    ``advance_`` for every ``own_bits``.
    """
    from loopkv.ops import triton_attention

    device = torch.device(device)
    H, D = kv_heads, head_dim
    counters(device, batch_size * H, purpose="attention")
    counters(device, batch_size, purpose="advance")
    for bits in sorted(set(read_bits) | set(own_bits)):
        pool = _dummy_pool(bits, H, D, dtype, device)
        for batch in sorted({1, batch_size}) if bits in read_bits else ():
            exact = [torch.zeros(batch, H, n, D, dtype=dtype, device=device) for n in (SINK, SINK, RING, RING)]
            lengths = torch.zeros(batch, dtype=torch.int32, device=device)
            table = torch.zeros(batch, max_pages, dtype=torch.int32, device=device)
            q = torch.zeros(batch, q_heads, D, dtype=dtype, device=device)
            token = torch.zeros(batch, H, 1, D, dtype=dtype, device=device)
            for t in {math.inf, tau} if bits == 4 else {math.inf}:
                triton_attention.cell_attention(q, *exact, lengths, table, *pool, bits, t, D**-0.5)
                triton_attention.token_attention(q, token, token, *exact, lengths, table, *pool, bits, t, D**-0.5)
        if bits in own_bits:
            _warm_writes(bits, pool, H, D, max_pages, dtype, device)


def _warm_writes(bits: int, pool: list[Tensor], heads: int, head_dim: int, max_pages: int, dtype: torch.dtype,
                 device: torch.device) -> None:
    """``write_pages_`` of one page and ``advance_`` of one row (from length 0: counts a token, encodes no page)."""
    from loopkv.ops import triton_quant

    if bits:
        page = torch.zeros(1, heads, PAGE, head_dim, dtype=dtype, device=device)
        triton_quant.write_pages(page, page, torch.zeros(1, dtype=torch.int64, device=device), *pool, bits)
    idx = torch.zeros(1, dtype=torch.int32, device=device)
    lengths = torch.zeros(1, 1, dtype=torch.int32, device=device)
    ring = torch.zeros(1, heads * RING * head_dim, dtype=dtype, device=device)
    table = torch.zeros(1, max(max_pages, 1), dtype=torch.int32, device=device)
    stacks = [t.reshape(1, -1) if t.numel() else t for t in pool]
    triton_quant.advance(idx, idx, lengths, ring, ring.clone(), table, *stacks, 1, 1, heads, head_dim, max_pages,
                         bits)


def _dummy_pool(bits: int, heads: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> list[Tensor]:
    """A one-page pool of ``bits`` (zeros), its fields in ``POOL_FIELDS`` order; bits 0: seven empty placeholders."""
    if bits == 0:
        return [torch.empty(0, dtype=torch.uint8, device=device)] * 7
    kinds = {"k_pages": dtype if bits == 16 else torch.uint8, "v_hi": dtype if bits == 16 else torch.uint8,
             "v_lo": torch.uint8}
    return [torch.zeros(shape, dtype=kinds.get(name, torch.float16), device=device) if shape != (0,)
            else torch.empty(0, dtype=kinds.get(name, torch.float16), device=device)
            for name, shape in pool_field_shapes(bits, 1, heads, head_dim).items()]
