"""Persistent int32 counters that the one-launch Triton kernels use to find the last program of a row.

A kernel's programs of one (row, KV head) or one row each add 1 to the row's counter when their part is done; the
program that sees the last count does the row's final work (the merge of the partials, the row's new length) and
resets the counter to zero. So one zeroed buffer per purpose serves every launch and every CUDA-graph replay.
Buffers are allocated on first use, eagerly: ``triton_register.warmup`` or the first eager call does it, never a
graph capture.
"""

from __future__ import annotations

import torch

_MIN_COUNTERS = 1 << 14
_counters: dict[tuple[str, torch.device], torch.Tensor] = {}


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
