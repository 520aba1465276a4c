"""Register the Triton kernels as the CUDA kernels of the ``torch.ops.loopkv`` custom ops.

``register_triton_kernels()`` is idempotent and cheap after the first call. It imports Triton lazily
and does nothing (returns False) when Triton or CUDA is unavailable, so ``import loopkv`` stays lean.
The launchers it registers (``loopkv.ops.triton_quant.append`` / ``write_pages`` and
``loopkv.ops.triton_attention.cell_attention``) are plain functions; tests call them directly on CPU
tensors under ``TRITON_INTERPRET=1``.

``counters(device, n, purpose=...)`` hands out the persistent int32 counters that the one-launch kernels
use to find the last program of a row; the kernels reset every counter they touch to zero, so one
zeroed buffer serves every launch and every CUDA-graph replay. Counters are allocated on first use
(eagerly, before any graph capture: ``warmup`` or the first eager call does it).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

_registered = False
_counters: dict[tuple[str, torch.device], torch.Tensor] = {}
_MIN_COUNTERS = 1 << 14


def counters(device: torch.device | str, n: int, *, purpose: str) -> torch.Tensor:
    """A zeroed int32 buffer of at least ``n`` counters for ``purpose`` on ``device``, reused across calls.

    Raises RuntimeError if it would have to be (re)allocated while a CUDA graph is being captured.
    """
    device = torch.device(device)
    key = (purpose, device)
    buf = _counters.get(key)
    if buf is None or buf.numel() < n:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"loopkv: the {purpose} kernel needs {n} counters but none are allocated yet and a CUDA "
                "graph is being captured; run one eager step first or call "
                "loopkv.ops.triton_register.warmup(...) before capturing."
            )
        buf = torch.zeros(max(n, _MIN_COUNTERS), dtype=torch.int32, device=device)
        _counters[key] = buf
    return buf


def triton_available() -> bool:
    """True when Triton imports and a CUDA device is present."""
    if not torch.cuda.is_available():
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def launchers() -> list:
    """``(custom op, Triton launcher)`` pairs: what ``register_triton_kernels`` registers for CUDA. Imports Triton.
    (``benchmarks/probe_served_quality.py --interpret`` registers the same pairs for CPU tensors under
    ``TRITON_INTERPRET=1``, to run a whole model through the kernels without a GPU.)"""
    from loopkv.ops import triton_attention, triton_quant
    from loopkv.ops.append_attention import append_attention_
    from loopkv.ops.cache_ops import append_, write_pages_
    from loopkv.ops.cell_attention import cell_attention
    from loopkv.ops.step_ops import advance_, token_attention_

    return [(cell_attention, triton_attention.cell_attention), (token_attention_, triton_attention.token_attention),
            (advance_, triton_quant.advance), (append_attention_, triton_attention.append_attention),
            (append_, triton_quant.append), (write_pages_, triton_quant.write_pages)]


def register_triton_kernels() -> bool:
    """Register the Triton launchers as the CUDA kernels of the loopkv ops; True if they are registered."""
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
    """JIT-compile the kernels a cache of this shape launches and allocate their counters, so that
    nothing compiles or allocates during CUDA-graph capture.

    Runs each kernel once on small dummy tensors with the cache's specializations (heads, head_dim,
    pages per row, strides, split count): ``cell_attention`` for every ``read_bits`` (and V precision
    when ``tau`` is finite), ``append_`` and ``write_pages_`` for every ``own_bits``.
    """
    from loopkv.ops import triton_quant
    from loopkv.ops.codec import PAGE, SINK
    from loopkv.ops.layout import RING
    from loopkv.ops.triton_attention import cell_attention
    from loopkv.ops.triton_config import choose_splits

    device = torch.device(device)
    H, D = kv_heads, head_dim
    exact = dict(dtype=dtype, device=device)
    sink = [torch.zeros(1, H, SINK, D, **exact) for _ in range(2)]
    ring = [torch.zeros(1, H, RING, D, **exact) for _ in range(2)]
    lengths = torch.zeros(1, dtype=torch.int32, device=device)
    table = torch.zeros(1, max_pages, dtype=torch.int32, device=device)
    splits = choose_splits(batch_size * H, max_pages, device)
    counters(device, batch_size * H, purpose="attention")
    counters(device, batch_size, purpose="append")
    for bits in sorted(set(read_bits) | set(own_bits)):
        pool = _dummy_pool(bits, H, D, dtype, device)
        if bits in read_bits:
            q = torch.zeros(1, q_heads, D, **exact)
            for t in {math.inf, tau} if bits == 4 else {math.inf}:
                cell_attention(q, *sink, *ring, lengths, table, *pool, bits, t, D**-0.5, splits=splits)
        if bits in own_bits or bits == 0:
            kv = torch.zeros(1, H, 1, D, **exact)
            triton_quant.append(kv, kv, *sink, *ring, lengths, table, *pool, bits)
            lengths.zero_()
            if bits:
                page = torch.zeros(1, H, PAGE, D, **exact)
                triton_quant.write_pages(page, page, torch.zeros(1, dtype=torch.int64, device=device), *pool, bits)


def _dummy_pool(bits: int, heads: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> list[Tensor]:
    from loopkv.ops.codec import GROUP, PAGE

    f16 = dict(dtype=torch.float16, device=device)
    u8 = dict(dtype=torch.uint8, device=device)
    if bits == 0:
        return [torch.empty(0, **u8)] * 7
    if bits == 16:
        full = torch.zeros(1, heads, PAGE, head_dim, dtype=dtype, device=device)
        return [full, torch.empty(0, **f16), torch.empty(0, **f16), full.clone(), torch.empty(0, **u8),
                torch.empty(0, **f16), torch.empty(0, **f16)]
    ng = head_dim // GROUP
    return [torch.zeros(1, heads, PAGE, head_dim * bits // 8, **u8), torch.zeros(1, heads, head_dim, **f16),
            torch.zeros(1, heads, head_dim, **f16), torch.zeros(1, heads, PAGE, head_dim // 4, **u8),
            torch.zeros(1, heads, PAGE, head_dim // 4, **u8) if bits == 4 else torch.empty(0, **u8),
            torch.zeros(1, heads, PAGE, ng, **f16), torch.zeros(1, heads, PAGE, ng, **f16)]
