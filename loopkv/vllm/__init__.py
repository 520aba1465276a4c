"""loopkv inside vLLM (docs/vllm.md): the plan setting, its start-up validation and the plan-to-KV-spec map.

Importing this package imports no vLLM: :mod:`loopkv.vllm.settings` (where the plan comes from and whether it fits
the served model) and :mod:`loopkv.vllm.layout` (per cell: its vLLM layer, option, bytes per 32-token page, and the
layer whose blocks a ``share`` cell reads) are pure and testable without vLLM. :mod:`loopkv.vllm.plugin` is the
``vllm.general_plugins`` entry point; :mod:`loopkv.vllm.model` (imported by vLLM only) is the served Ouro.
:mod:`loopkv.vllm.cells` (pure: a quantized cell's step plan, write and read inside vLLM's batches) and
:mod:`loopkv.vllm.backend` (vLLM's classes around it, imported by vLLM only) serve loopkv's cells.

What is served: an all-``bf16`` plan by vLLM's own attention backend and KV cache; any other plan (``bf16``,
``int4``, ``int2`` and ``share`` cells) by loopkv's backend, every cell's pages in one vLLM KV tensor.
"""

from loopkv.vllm.layout import (
    HOLDER,
    CellKV,
    PoolRef,
    block_bytes,
    exact_bytes_per_request,
    kv_layout,
    layer_name,
    parse_layer_name,
    pool_refs,
)
from loopkv.vllm.settings import PLAN_ENV, PLAN_KEY, load_plan, validate_for_vllm

__all__ = [
    "HOLDER",
    "PLAN_ENV",
    "PLAN_KEY",
    "CellKV",
    "PoolRef",
    "block_bytes",
    "exact_bytes_per_request",
    "kv_layout",
    "layer_name",
    "load_plan",
    "parse_layer_name",
    "pool_refs",
    "validate_for_vllm",
]
