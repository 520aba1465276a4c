"""loopkv inside vLLM (docs/vllm.md): the plan setting, its start-up validation and the plan-to-KV-spec map.

Importing this package imports no vLLM: :mod:`loopkv.vllm.settings` (where the plan comes from and whether it fits
the served model) and :mod:`loopkv.vllm.layout` (per cell: its vLLM layer, option, bytes per 32-token page, and the
layer whose blocks a ``share`` cell reads) are pure and testable without vLLM. :mod:`loopkv.vllm.plugin` is the
``vllm.general_plugins`` entry point; :mod:`loopkv.vllm.model` (imported by vLLM only) is the served Ouro.
:mod:`loopkv.vllm.cells` (pure: a quantized cell's step plan, write and read inside vLLM's batches) and
:mod:`loopkv.vllm.backend` (vLLM's classes around it, imported by vLLM only) serve ``int4`` cells.

What is served: plans whose cells are all ``bf16`` (vLLM's own attention backend and KV cache) or all ``int4``
(loopkv's pages in vLLM's blocks). Other plans are refused at start-up, naming their options (docs/vllm.md,
"Still to build").
"""

from loopkv.vllm.layout import CellKV, block_bytes, exact_bytes_per_request, kv_layout, layer_name, parse_layer_name
from loopkv.vllm.settings import PLAN_ENV, PLAN_KEY, load_plan, validate_for_vllm

__all__ = [
    "PLAN_ENV",
    "PLAN_KEY",
    "CellKV",
    "block_bytes",
    "exact_bytes_per_request",
    "kv_layout",
    "layer_name",
    "load_plan",
    "parse_layer_name",
    "validate_for_vllm",
]
