"""loopkv's quantized cells as a vLLM 0.26 attention backend (imported only where vLLM is; docs/vllm.md).

One cell is one :class:`LoopKVAttention`, vLLM's ``Attention`` with

* its KV spec :class:`LoopKVPageSpec`: a ``FullAttentionSpec`` whose page is loopkv's page of 32 tokens
  (``loopkv.format.page_bytes``; ``--block-size 32``), so vLLM's pool counts the real bytes;
* its backend :class:`LoopKVBackend` (``Attention(..., attn_backend=...)``, so ``bf16`` cells keep vLLM's own):
  the KV tensor is ``[num_blocks, page_bytes]`` bytes (``loopkv.vllm.cells.pool_views``), the metadata builder
  plans each step once on the host (``loopkv.vllm.cells.plan_step``: slots, decode rows, pages to quantize) and the
  impl writes and reads the cell (``loopkv.vllm.cells.forward_cell``; loopkv's Triton kernels on CUDA);
* the exact sink and window of ``max_num_seqs`` requests, buffers allocated when the model is built (vLLM's memory
  profiler counts them before sizing the pool).

CUDA graphs: the builder declares ``NEVER`` (its step plan reads the device and decides on the host), so vLLM runs
attention eagerly between piecewise graphs. The write is part of the read (``forward_includes_kv_cache_update``).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import ClassVar

import torch
from vllm.config import get_current_vllm_config
from vllm.model_executor.layers.attention import Attention
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionMetadata,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
)
from vllm.v1.kv_cache_interface import FullAttentionSpec

from loopkv.format import PAGE, page_bytes
from loopkv.vllm.cells import CellExact, SlotMap, Step, forward_cell, plan_step, pool_views

BITS = 4  # what this backend stores: uniform INT4 (docs/vllm.md, "What is built")


@dataclass(frozen=True, kw_only=True)
class LoopKVPageSpec(FullAttentionSpec):
    """A cell's KV spec: full attention whose page is loopkv's ``loopkv_bits`` page of ``block_size`` (32) tokens.

    ``merge`` keeps the page: ``FullAttentionSpec.merge`` rebuilds a spec from ``AttentionSpec``'s fields only, which
    would drop it (docs/vllm.md, "A trap in case 2")."""

    loopkv_bits: int = BITS

    @property
    def real_page_size_bytes(self) -> int:
        return page_bytes(self.loopkv_bits, self.num_kv_heads, self.head_size)

    @classmethod
    def merge(cls, specs):
        bits = {s.loopkv_bits for s in specs}
        if len(bits) != 1 or not all(isinstance(s, LoopKVPageSpec) for s in specs):
            raise ValueError(f"loopkv cells of different storage in one KV-cache group ({sorted(bits)}); the plugin "
                             "serves one option for every cell")
        return dataclasses.replace(super().merge(specs), loopkv_bits=bits.pop())


@dataclass
class LoopKVMetadata(AttentionMetadata):
    """What every cell reads in a step: its plan (``loopkv.vllm.cells.Step``)."""

    step: Step
    num_actual_tokens: int


class LoopKVMetadataBuilder(AttentionMetadataBuilder[LoopKVMetadata]):
    """Plans each step once, on the host, for every cell: slots from the requests' first block ids, the slots'
    page tables from vLLM's block table, which rows decode, which pages their tokens complete."""

    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER
    reorder_batch_threshold: int | None = None

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        slots = vllm_config.scheduler_config.max_num_seqs
        pages = max(0, math.ceil(vllm_config.model_config.max_model_len / PAGE) - 1)
        self.slot_map = SlotMap(slots)
        self.page_table = torch.zeros(slots, pages, dtype=torch.int32, device=device)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> LoopKVMetadata:
        cm = common_attn_metadata
        n = cm.num_reqs
        qsl = cm.query_start_loc_cpu[:n + 1].tolist()
        host = torch.stack([cm.seq_lens[:n].to(torch.int64), cm.block_table_tensor[:n, 0].to(torch.int64)]).cpu()
        step = plan_step(self.slot_map, self.page_table, query_start_loc=qsl, seq_lens=host[0].tolist(),
                         first_blocks=host[1].tolist(), block_table=cm.block_table_tensor)
        return LoopKVMetadata(step=step, num_actual_tokens=cm.num_actual_tokens)


class LoopKVImpl(AttentionImpl[LoopKVMetadata]):
    """One cell's write and read (``loopkv.vllm.cells.forward_cell``) on its vLLM KV tensor and exact buffers."""

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int | None = None,
                 alibi_slopes=None, sliding_window=None, kv_cache_dtype: str = "auto", logits_soft_cap=None,
                 attn_type: str = AttentionType.DECODER, kv_sharing_target_layer_name=None, **extra) -> None:
        unsupported = {"alibi_slopes": alibi_slopes, "sliding_window": sliding_window,
                       "logits_soft_cap": logits_soft_cap, "kv_sharing_target_layer_name": kv_sharing_target_layer_name}
        given = [k for k, v in unsupported.items() if v is not None]
        if given or attn_type != AttentionType.DECODER:
            raise ValueError(f"loopkv's vLLM backend serves causal decoder attention without {given or attn_type}")
        self.num_heads, self.head_size, self.scale = num_heads, head_size, float(scale)
        self.num_kv_heads = num_kv_heads or num_heads
        self.kv_cache_dtype = kv_cache_dtype
        self._views: tuple[int, tuple[torch.Tensor, ...]] | None = None

    def pool(self, kv_cache: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """The cell's pool fields over vLLM's KV tensor (views made once per tensor)."""
        if self._views is None or self._views[0] != kv_cache.data_ptr():
            self._views = (kv_cache.data_ptr(), pool_views(kv_cache, BITS, self.num_kv_heads, self.head_size,
                                                           dtype=dtype))
        return self._views[1]

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("loopkv's vLLM backend does not fuse output quantization")
        if attn_metadata is None:  # vLLM's profiling run
            return output.fill_(0)
        n = attn_metadata.num_actual_tokens
        out = output.view(-1, self.num_heads, self.head_size)
        forward_cell(layer.loopkv_exact(), self.pool(kv_cache, query.dtype), attn_metadata.step,
                     query[:n].view(n, self.num_heads, self.head_size), key[:n].view(n, self.num_kv_heads, -1),
                     value[:n].view(n, self.num_kv_heads, -1), out[:n], bits=BITS, tau=layer.loopkv_tau,
                     scale=self.scale, name=getattr(layer, "layer_name", "cell"))
        return output


class LoopKVBackend(AttentionBackend):
    """The backend of a uniform-INT4 loopkv cell (per layer: ``Attention(..., attn_backend=LoopKVBackend)``)."""

    accept_output_buffer: bool = True
    forward_includes_kv_cache_update: bool = True  # the write is part of the cell's read (cells.forward_cell)
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16]
    supported_kv_cache_dtypes: ClassVar[list] = ["auto", "bfloat16", "float16"]

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @staticmethod
    def get_supported_kernel_block_sizes() -> list:
        return [PAGE]

    @staticmethod
    def get_impl_cls():
        return LoopKVImpl

    @staticmethod
    def get_builder_cls():
        return LoopKVMetadataBuilder

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int,
                           cache_dtype_str: str = "auto") -> tuple[int, ...]:
        if block_size != PAGE:
            raise ValueError(f"loopkv's cells need --block-size {PAGE} (one block is one page), got {block_size}")
        return (num_blocks, page_bytes(BITS, num_kv_heads, head_size))

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @classmethod
    def supports_head_size(cls, head_size: int) -> bool:
        return head_size > 0 and head_size % 32 == 0


class LoopKVAttention(Attention):
    """vLLM's ``Attention`` for one loopkv cell: loopkv's backend and spec, and the cell's exact buffers for
    ``max_num_seqs`` requests (non-persistent buffers: no weights, no state dict)."""

    def __init__(self, *args, loopkv_tau: float, **kwargs) -> None:
        super().__init__(*args, attn_backend=LoopKVBackend, **kwargs)
        config = get_current_vllm_config()
        slots = config.scheduler_config.max_num_seqs
        dtype = config.model_config.dtype
        exact = CellExact.allocate(slots, self.num_kv_heads, self.head_size, dtype=dtype)
        for name in ("sink_k", "sink_v", "win_k", "win_v"):
            self.register_buffer(f"loopkv_{name}", getattr(exact, name), persistent=False)
        self.loopkv_tau = float(loopkv_tau)

    def loopkv_exact(self) -> CellExact:
        return CellExact(self.loopkv_sink_k, self.loopkv_sink_v, self.loopkv_win_k, self.loopkv_win_v)

    def get_kv_cache_spec(self, vllm_config):
        return LoopKVPageSpec(block_size=vllm_config.cache_config.block_size, num_kv_heads=self.num_kv_heads,
                              head_size=self.head_size, head_size_v=self.head_size, dtype=torch.uint8,
                              loopkv_bits=BITS)
