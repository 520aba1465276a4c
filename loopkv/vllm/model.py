"""vLLM's Ouro with a loopkv plan checked where vLLM builds the model (imported by vLLM only, through the plugin).

:class:`LoopKVOuroForCausalLM` is vLLM's own ``OuroForCausalLM`` (vllm/model_executor/models/ouro.py): the same
layers, parameter names and weights. Before building it, it reads the plan (``additional_config["loopkv_plan"]`` or
``$LOOPKV_PLAN``), checks it against the served config, tensor-parallel size and KV-cache dtype, and refuses cells
the plugin cannot serve yet (:func:`loopkv.vllm.settings.check_servable`): an error here stops vLLM's start with
the reason. With no plan, or an all-bf16 plan, every cell is vLLM's ``Attention`` with vLLM's own backend and KV
cache, so the served tokens are vLLM's.
"""

from __future__ import annotations

import logging

from vllm.model_executor.models.ouro import OuroForCausalLM

from loopkv.vllm.layout import block_bytes, kv_layout
from loopkv.vllm.settings import check_servable, load_plan, validate_for_vllm

logger = logging.getLogger(__name__)


class LoopKVOuroForCausalLM(OuroForCausalLM):
    """vLLM's Ouro, serving the loopkv plan of ``vllm_config`` (``self.loopkv_plan``; ``None`` without one)."""

    def __init__(self, *, vllm_config, prefix: str = "") -> None:
        plan = load_plan(vllm_config.additional_config)
        if plan is not None:
            hf_config = vllm_config.model_config.hf_config
            tp = vllm_config.parallel_config.tensor_parallel_size
            validate_for_vllm(plan, hf_config, tensor_parallel_size=tp,
                              kv_cache_dtype=vllm_config.cache_config.cache_dtype)
            check_servable(plan)
            layout = kv_layout(plan, hf_config, tensor_parallel_size=tp)
            logger.info("loopkv: serving a %d x %d plan (%s), %d bytes per 32-token block per rank",
                        plan.loops, plan.layers, ", ".join(sorted(set(plan.options))), block_bytes(layout))
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self.loopkv_plan = plan
