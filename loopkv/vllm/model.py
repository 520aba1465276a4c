"""vLLM's Ouro with a loopkv plan checked where vLLM builds the model (imported by vLLM only, through the plugin).

:class:`LoopKVOuroForCausalLM` is vLLM's own ``OuroForCausalLM`` (vllm/model_executor/models/ouro.py): the same
layers, parameter names and weights. Before building it, it reads the plan (``additional_config["loopkv_plan"]`` or
``$LOOPKV_PLAN``), checks it against the served config, tensor-parallel size, KV-cache dtype and engine settings, and
refuses engine settings the plan cannot run under (:func:`loopkv.vllm.settings.check_engine`): an error here stops
vLLM's start with the reason. With no plan, or an all-bf16 plan, every cell is vLLM's ``Attention`` with vLLM's own
backend and KV cache, so the served tokens are vLLM's. With any other plan (``bf16``, ``int4``, ``int2`` and ``share``
cells) every cell is a :class:`loopkv.vllm.backend.LoopKVAttention` (loopkv's pages in one vLLM KV tensor, exact sink
and window, loopkv's kernels): ``OuroAttention`` builds its cells through the name ``Attention`` of vLLM's ouro
module, which is pointed at :func:`_cell_factory` while this class builds the model; then each ``share`` cell is
linked to its source (the final loop's cell, built after it).
"""

from __future__ import annotations

import logging
from unittest import mock

import torch
from vllm.model_executor.models import ouro as vllm_ouro
from vllm.model_executor.models.ouro import OuroForCausalLM

from loopkv.vllm.layout import block_bytes, kv_layout
from loopkv.vllm.settings import check_engine, load_plan, validate_for_vllm

logger = logging.getLogger(__name__)


def _cell_factory(plan, layout, built: dict):
    """``Attention(...)`` as ``OuroAttention`` calls it: loopkv's layer for the cell of ``prefix`` (layer index ``t *
    L + l``), reading the pool ``layout`` gives it; the first layer built (cell (0, 0), ``HOLDER``) declares the plan's
    spec and every later one shares its tensor. Built layers are recorded in ``built`` by layer index."""
    from vllm.model_executor.models.utils import extract_layer_index

    from loopkv.vllm.backend import LoopKVAttention
    from loopkv.vllm.layout import block_bytes, pool_refs

    refs, total = pool_refs(layout), block_bytes(layout)
    by_index = {i: c for i, c in enumerate(layout)}

    def make(*args, prefix: str = "", **kwargs):
        index = extract_layer_index(prefix)
        if (index == 0) == bool(built):
            raise RuntimeError(f"vLLM's Ouro built {prefix} {'again' if index == 0 else 'before layer 0'}: loopkv's "
                               "plugin needs cell (0, 0) built first, as vLLM 0.26's Ouro does")
        c = by_index[index]
        holder = built[0].layer_name if built else None
        layer = LoopKVAttention(*args, prefix=prefix, loopkv_tau=plan.tau_of(c.cell), loopkv_pool=refs[c.layer_name],
                                loopkv_shares=not c.stores, loopkv_block_bytes=total,
                                kv_sharing_target_layer_name=holder, **kwargs)
        built[index] = layer
        return layer

    return make


def _link_sources(layout, built: dict) -> None:
    """Give each ``share`` cell its source's layer (built after it: the final loop)."""
    index = {c.layer_name: i for i, c in enumerate(layout)}
    for i, c in enumerate(layout):
        if not c.stores:
            built[i].loopkv_link_source(built[index[c.source]])


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
        cache, scheduler = vllm_config.cache_config, vllm_config.scheduler_config
        check_engine(plan, block_size=cache.block_size, prefix_caching=bool(cache.enable_prefix_caching),
                     speculative=vllm_config.speculative_config is not None,
                     chunked_prefill=bool(scheduler.enable_chunked_prefill),
                     long_prefill_token_threshold=int(scheduler.long_prefill_token_threshold or 0),
                     kv_sharing_fast_prefill=bool(getattr(cache, "kv_sharing_fast_prefill", False)))
        dtype_bytes = torch.empty(0, dtype=vllm_config.model_config.dtype).element_size()
        layout = kv_layout(plan, hf_config, tensor_parallel_size=tp, dtype_bytes=dtype_bytes)
        logger.info("loopkv: serving a %d x %d plan (%s), %d bytes per 32-token block per rank",
                    plan.loops, plan.layers, ", ".join(sorted(set(plan.options))), block_bytes(layout))
        if set(plan.options) == {"bf16"}:
            super().__init__(vllm_config=vllm_config, prefix=prefix)
        else:
            from loopkv.ops.triton_register import register_triton_kernels

            register_triton_kernels()  # loopkv's ops run their Triton kernels on CUDA
            built: dict = {}
            with mock.patch.object(vllm_ouro, "Attention", _cell_factory(plan, layout, built)):
                super().__init__(vllm_config=vllm_config, prefix=prefix)
            _link_sources(layout, built)
        self.loopkv_plan = plan
