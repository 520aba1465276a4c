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

import torch

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
                "loopkv.ops.triton_attention.warmup(...) before capturing."
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


def register_triton_kernels() -> bool:
    """Register the Triton launchers as the CUDA kernels of the loopkv ops; True if they are registered."""
    global _registered
    if _registered:
        return True
    if not triton_available():
        return False
    from loopkv.ops import triton_attention, triton_quant
    from loopkv.ops.cache_ops import append_, write_pages_
    from loopkv.ops.cell_attention import cell_attention

    cell_attention.register_kernel("cuda")(triton_attention.cell_attention)
    append_.register_kernel("cuda")(triton_quant.append)
    write_pages_.register_kernel("cuda")(triton_quant.write_pages)
    _registered = True
    return True
