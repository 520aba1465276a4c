"""What LoopKVCache checks before it allocates or stores: the model's shape, the arguments, the memory a cache needs
against the device's free memory, and K/V values the codec cannot store."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from loopkv.cache.storage import CellStorage
from loopkv.families import PER_CALL_LOOPS, ModelLayout, layout_of
from loopkv.ops.codec import FP16_MAX

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def model_shape(config) -> tuple[int, int, int, int]:
    """(loops, layers, kv_heads, head_dim) of a looped model's config: its planned cells (the family's layout,
    :mod:`loopkv.families`; Ouro: ``total_ut_steps`` x ``num_hidden_layers``) and their K/V shape."""
    layout = model_layout(config)
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return layout.loops, layout.layers, kv_heads, head_dim


def model_layout(config, *, loops: int | None = None) -> ModelLayout:
    """The :class:`~loopkv.families.ModelLayout` of ``config`` (for ``loops`` loops; ``None``: the config's), or a
    ValueError naming what it lacks."""
    needed = ("num_hidden_layers", "num_attention_heads")
    missing = [a for a in needed if not hasattr(config, a)]
    if missing:
        raise ValueError(f"config lacks {missing}: LoopKVCache needs a looped model's config "
                         "(e.g. OuroConfig, or transformers' DoryConfig)")
    return layout_of(config, loops=loops)


def plan_for_loops(plan, loops: int | None):
    """The plan a cache built for calls of ``loops`` loops serves (``None``: every loop of ``plan``):
    ``plan.for_loops(loops)``, for a family whose model chooses its loop count per call; refused for the others."""
    if loops is None or loops == plan.loops:
        return plan
    if plan.family not in PER_CALL_LOOPS:
        raise ValueError(f"loops={loops!r}: models of the {plan.family} family run all {plan.loops} loops of this "
                         "plan in every call; build the LoopKVCache without loops= (it is for models whose loop count "
                         "is chosen per call, such as Huginn's num_steps)")
    return plan.for_loops(loops)


def resolve_dtype(config, dtype) -> torch.dtype:
    """``dtype`` (a torch.dtype or its name, e.g. ``"bfloat16"``), else the config's, else fp32."""
    if dtype is None:
        dtype = getattr(config, "dtype", None) or torch.float32
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype.removeprefix("torch."), dtype)
    if dtype not in SUPPORTED_DTYPES:
        names = ", ".join(str(d).removeprefix("torch.") for d in SUPPORTED_DTYPES)
        raise ValueError(f"dtype {dtype!r} is not supported: pass the model's activation dtype, one of {names}")
    return dtype


def uncodable(x: Tensor) -> Tensor:
    """Bool tensor: ``x`` holds a value the codec cannot store (non-finite, or beyond fp16's range, where its fp16
    scale and zero saturate and the value, and its whole group, would decode wrong). Compared in fp32: in bf16 the
    bound rounds up to 65536, a bf16 value that is beyond it."""
    return ~(x.abs().float() <= FP16_MAX)  # NaN compares False


def uncodable_error(cells: list[int]) -> ValueError:
    return ValueError(
        f"cells {cells} were given K/V values the INT4/INT2 codec cannot store (non-finite, or |x| > {FP16_MAX:g}, "
        "beyond its fp16 scales): they would decode wrong. Keep these cells 'bf16' in the plan (or find why the "
        "model produces such values); the cache was not counted past them: cache.reset() before the next request")


def uncodable_request_error(request_id: str, tokens: str, cells: list[int]) -> ValueError:
    """A serving engine's request whose ``tokens`` (its prompt, or its token at a position) the codec cannot store
    (``loopkv/serving/engine_cache.py``)."""
    return ValueError(
        f"request {request_id}: {tokens} gave cells {cells} K/V values the INT4/INT2 codec cannot store (non-finite, "
        f"or |x| > {FP16_MAX:g}, beyond its fp16 scales): they would decode wrong from its pages. The request was "
        "stopped and its slot and pages freed; the other requests go on. Keep these cells 'bf16' in the plan (or "
        "find why the model produces such values)")


def positive_int(name: str, value) -> int:
    """``value`` as a positive Python int (numpy and torch integers too), or a ValueError naming ``name``."""
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    value = value.__index__()
    if value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def free_bytes(device: torch.device) -> int | None:
    """Memory free for new tensors on ``device`` (CUDA: the driver's count; CPU: the OS's available memory)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type == "cpu":
        try:
            with open("/proc/meminfo") as f:
                info = dict(line.split(":", 1) for line in f)
            return int(info["MemAvailable"].split()[0]) * 1024
        except (OSError, KeyError, ValueError):
            return None
    return None


def check_fits(templates: list[CellStorage], device: torch.device) -> None:
    """Refuse, before allocating, a cache larger than the memory free on ``device`` (its bytes counted from the
    cells' shapes, each stacked buffer once)."""
    needed = sum(math.prod(t.shape) * t.element_size() for st in templates for t in st.own_tensors().values())
    free = free_bytes(device)
    if free is not None and needed > free:
        raise ValueError(f"this LoopKVCache needs {needed / 2**30:.2f} GiB on {device}, which has {free / 2**30:.2f} "
                         "GiB free: lower max_batch_size or max_cache_len, or plan fewer stored bytes per token")


def row_index(value, rows: int) -> int:
    """``value`` as a row index in ``[0, rows)``, or a ValueError naming it."""
    if isinstance(value, bool) or not hasattr(value, "__index__") or not 0 <= value.__index__() < rows:
        raise ValueError(f"row {value!r} is not a row of this LoopKVCache (0 to {rows - 1})")
    return value.__index__()
