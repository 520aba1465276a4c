"""vLLM's Ouro with a loopkv plan checked where vLLM builds the model (imported by vLLM only, through the plugin).

:class:`LoopKVOuroForCausalLM` is vLLM's own ``OuroForCausalLM`` (vllm/model_executor/models/ouro.py): the same
layers, parameter names and weights. Before building it, it reads the plan (``additional_config["loopkv_plan"]`` or
``$LOOPKV_PLAN``), checks it against the served config, tensor-parallel size, KV-cache dtype and engine settings, and
refuses plans the plugin cannot serve yet (:func:`loopkv.vllm.settings.check_servable`): an error here stops vLLM's
start with the reason. With no plan, or an all-bf16 plan, every cell is vLLM's ``Attention`` with vLLM's own backend
and KV cache, so the served tokens are vLLM's. With an all-int4 plan every cell is a
:class:`loopkv.vllm.backend.LoopKVAttention` (loopkv's pages in vLLM's blocks, exact sink and window, loopkv's
kernels): ``OuroAttention`` builds its cells through the name ``Attention`` of vLLM's ouro module, which is pointed
at :func:`_cell_factory` while this class builds the model.
"""

from __future__ import annotations

import logging
from unittest import mock

from vllm.model_executor.models import ouro as vllm_ouro
from vllm.model_executor.models.ouro import OuroForCausalLM

from loopkv.vllm.layout import block_bytes, kv_layout
from loopkv.vllm.settings import check_engine, check_servable, load_plan, validate_for_vllm

logger = logging.getLogger(__name__)


def _cell_factory(plan):
    """``Attention(...)`` as ``OuroAttention`` calls it, building each cell by its plan option: vLLM's own for
    ``bf16``, loopkv's for ``int4`` (the cell is read from the layer index in ``prefix``: ``t * L + l``)."""
    from vllm.model_executor.models.utils import extract_layer_index

    from loopkv.cells import Cell
    from loopkv.vllm.backend import LoopKVAttention

    original = vllm_ouro.Attention

    def make(*args, prefix: str = "", **kwargs):
        index = extract_layer_index(prefix)
        cell = Cell(index // plan.layers, index % plan.layers)
        if plan.option(cell) == "bf16":
            return original(*args, prefix=prefix, **kwargs)
        return LoopKVAttention(*args, prefix=prefix, loopkv_tau=plan.tau_of(cell), **kwargs)

    return make


class LoopKVOuroForCausalLM(OuroForCausalLM):
    """vLLM's Ouro, serving the loopkv plan of ``vllm_config`` (``self.loopkv_plan``; ``None`` without one)."""

    def __init__(self, *, vllm_config, prefix: str = "") -> None:
        plan = load_plan(vllm_config.additional_config)
        if plan is None:
            super().__init__(vllm_config=vllm_config, prefix=prefix)
            self.loopkv_plan = None
            return
        hf_config = vllm_config.model_config.hf_config
        tp = vllm_config.parallel_config.tensor_parallel_size
        validate_for_vllm(plan, hf_config, tensor_parallel_size=tp,
                          kv_cache_dtype=vllm_config.cache_config.cache_dtype)
        check_servable(plan)
        check_engine(plan, block_size=vllm_config.cache_config.block_size,
                     prefix_caching=bool(vllm_config.cache_config.enable_prefix_caching),
                     speculative=vllm_config.speculative_config is not None)
        layout = kv_layout(plan, hf_config, tensor_parallel_size=tp)
        logger.info("loopkv: serving a %d x %d plan (%s), %d bytes per 32-token block per rank",
                    plan.loops, plan.layers, ", ".join(sorted(set(plan.options))), block_bytes(layout))
        if set(plan.options) == {"bf16"}:
            super().__init__(vllm_config=vllm_config, prefix=prefix)
        else:
            from loopkv.ops.triton_register import register_triton_kernels

            register_triton_kernels()  # loopkv's ops run their Triton kernels on CUDA
            with mock.patch.object(vllm_ouro, "Attention", _cell_factory(plan)):
                super().__init__(vllm_config=vllm_config, prefix=prefix)
        self.loopkv_plan = plan
