"""loopkv's cells as a vLLM 0.26 attention backend (imported only where vLLM is; docs/vllm.md).

Every cell of a plan that is not all-bf16 is one :class:`LoopKVAttention`, vLLM's ``Attention`` with

* one KV tensor for the whole plan: the layer vLLM builds first (``loopkv.vllm.layout.HOLDER``) declares
  :class:`LoopKVPageSpec`, a ``FullAttentionSpec`` whose page is the plan's block (every storing cell's page of 32
  tokens, ``loopkv.vllm.layout.block_bytes``; ``--block-size 32``), so vLLM's pool counts the real bytes; every other
  cell names it as its ``kv_sharing_target_layer_name``, so vLLM gives it no spec and binds the same tensor. vLLM then
  sees one spec (one group, one block table) and one backend (one metadata builder, one step plan for all cells);
  each cell reads its pool as a region of the tensor (``loopkv.vllm.layout.PoolRef``, a ``share`` cell its source's);
* its backend :class:`LoopKVBackend` (``Attention(..., attn_backend=...)``): the metadata builder plans each step
  once on the host (``loopkv.vllm.cells.plan_step``: slots, prompt rows, the decode read's inputs) and the impl
  writes and reads the cell (``loopkv.vllm.cells.forward_cell``; loopkv's Triton kernels on CUDA);
* the exact sink and window of ``max_num_seqs`` requests, buffers allocated when the model is built (vLLM's memory
  profiler counts them before sizing the pool).

CUDA graphs: the builder declares ``UNIFORM_SINGLE_TOKEN_DECODE``: a step whose every request decodes one token (vLLM
pads it to a capture size with requests of no tokens) is a decode read whose device inputs the builder writes in
place into buffers of fixed address (``loopkv.vllm.cells.StepState``), so vLLM captures the whole decode step as one
graph (``FULL_DECODE_ONLY``, or ``FULL_AND_PIECEWISE``'s decode graphs); steps with prompts run attention eagerly.
The write is part of the read (``forward_includes_kv_cache_update``).
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

from loopkv.format import PAGE
from loopkv.vllm.cells import CellExact, Step, StepState, cell_region, forward_cell, plan_step, pool_views
from loopkv.vllm.layout import PoolRef


@dataclass(frozen=True, kw_only=True)
class LoopKVPageSpec(FullAttentionSpec):
    """The plan's KV spec: full attention whose page is the plan's block, ``loopkv_block_bytes`` for ``block_size``
    (32) tokens of every storing cell.

    ``merge`` keeps the page: ``FullAttentionSpec.merge`` rebuilds a spec from ``AttentionSpec``'s fields only, which
    would drop it (docs/vllm.md, "A trap in case 2")."""

    loopkv_block_bytes: int = 0  # a default only for FullAttentionSpec.merge's cls(...); merge sets it

    @property
    def real_page_size_bytes(self) -> int:
        return self.loopkv_block_bytes

    @classmethod
    def merge(cls, specs):
        sizes = {getattr(s, "loopkv_block_bytes", None) for s in specs}
        if len(sizes) != 1 or not all(isinstance(s, LoopKVPageSpec) for s in specs):
            raise ValueError(f"loopkv specs of different blocks in one KV-cache group ({sorted(map(str, sizes))}): "
                             "one plan declares one spec")
        return dataclasses.replace(super().merge(specs), loopkv_block_bytes=sizes.pop())


@dataclass
class LoopKVMetadata(AttentionMetadata):
    """What every cell reads in a step: its plan (``loopkv.vllm.cells.Step``)."""

    step: Step
    num_actual_tokens: int


class LoopKVMetadataBuilder(AttentionMetadataBuilder[LoopKVMetadata]):
    """Plans each step once, on the host, for every cell (``loopkv.vllm.cells.plan_step``): slots from the requests'
    first block ids, the slots' page tables from vLLM's block table, which tokens decode; the device inputs of the
    decode read are written into buffers allocated here once (``loopkv.vllm.cells.StepState``), so a uniform decode
    batch is one CUDA graph: vLLM calls ``build`` on the host before each replay, and the graph reads the same
    addresses (``UNIFORM_SINGLE_TOKEN_DECODE``; steps with prompts run attention eagerly)."""

    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    reorder_batch_threshold: int | None = None

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        scheduler = vllm_config.scheduler_config
        pages = max(0, math.ceil(vllm_config.model_config.max_model_len / PAGE) - 1)
        self.state = StepState(scheduler.max_num_seqs, pages, scheduler.max_num_batched_tokens, device=device)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> LoopKVMetadata:
        cm = common_attn_metadata
        n = cm.num_reqs
        qsl = cm.query_start_loc_cpu[:n + 1].tolist()
        # the requests' first block ids (their slots' keys) are on the device only: one copy to the host per step
        host = torch.stack([cm.seq_lens[:n].to(torch.int64), cm.block_table_tensor[:n, 0].to(torch.int64)]).cpu()
        step = plan_step(self.state, query_start_loc=qsl, seq_lens=host[0].tolist(), first_blocks=host[1].tolist(),
                         block_table=cm.block_table_tensor, num_tokens=cm.num_actual_tokens)
        return LoopKVMetadata(step=step, num_actual_tokens=cm.num_actual_tokens)


class LoopKVImpl(AttentionImpl[LoopKVMetadata]):
    """One cell's write and read (``loopkv.vllm.cells.forward_cell``) on its pool in the plan's KV tensor and its exact
    buffers (the layer's ``loopkv_pool``, ``loopkv_exact()``, ``loopkv_source_exact()``, ``loopkv_tau``)."""

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int | None = None,
                 alibi_slopes=None, sliding_window=None, kv_cache_dtype: str = "auto", logits_soft_cap=None,
                 attn_type: str = AttentionType.DECODER, kv_sharing_target_layer_name=None, **extra) -> None:
        # kv_sharing_target_layer_name: every cell but the holder shares the holder's tensor (module docstring)
        unsupported = {"alibi_slopes": alibi_slopes, "sliding_window": sliding_window,
                       "logits_soft_cap": logits_soft_cap}
        given = [k for k, v in unsupported.items() if v is not None]
        if given or attn_type != AttentionType.DECODER:
            raise ValueError(f"loopkv's vLLM backend serves causal decoder attention without {given or attn_type}")
        self.num_heads, self.head_size, self.scale = num_heads, head_size, float(scale)
        self.num_kv_heads = num_kv_heads or num_heads
        self.kv_cache_dtype = kv_cache_dtype
        self._views: tuple[int, tuple[torch.Tensor, ...]] | None = None

    def pool(self, kv_cache: torch.Tensor, ref: PoolRef, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """The fields of the pool ``ref`` in the plan's KV tensor (views made once per tensor)."""
        if self._views is None or self._views[0] != kv_cache.data_ptr():
            region = cell_region(kv_cache, ref.offset, ref.size)
            self._views = (kv_cache.data_ptr(), pool_views(region, ref.bits, self.num_kv_heads, self.head_size,
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
        ref = layer.loopkv_pool
        forward_cell(layer.loopkv_exact(), self.pool(kv_cache, ref, query.dtype), attn_metadata.step,
                     query[:n].view(n, self.num_heads, self.head_size), key[:n].view(n, self.num_kv_heads, -1),
                     value[:n].view(n, self.num_kv_heads, -1), out[:n], bits=ref.bits, tau=layer.loopkv_tau,
                     scale=self.scale, name=getattr(layer, "layer_name", "cell"), source=layer.loopkv_source_exact())
        return output


class LoopKVBackend(AttentionBackend):
    """The backend of every loopkv cell (per layer: ``Attention(..., attn_backend=LoopKVBackend)``)."""

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
        # the plan's block: its bytes are the spec's page (LoopKVPageSpec), which this static method is not given;
        # vLLM views the raw tensor of num_blocks pages with this shape, so -1 takes the page from the tensor
        return (num_blocks, -1)

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @classmethod
    def supports_head_size(cls, head_size: int) -> bool:
        return head_size > 0 and head_size % 32 == 0


class LoopKVAttention(Attention):
    """vLLM's ``Attention`` for one loopkv cell: loopkv's backend, the pool it reads (``loopkv_pool``), the plan's
    spec (declared by the holder only; the others pass ``kv_sharing_target_layer_name``), and the cell's exact buffers
    for ``max_num_seqs`` requests (non-persistent buffers: no weights, no state dict). A ``share`` cell is given its
    source layer with :meth:`loopkv_link_source` once the model is built."""

    def __init__(self, *args, loopkv_tau: float, loopkv_pool: PoolRef, loopkv_shares: bool, loopkv_block_bytes: int,
                 **kwargs) -> None:
        super().__init__(*args, attn_backend=LoopKVBackend, **kwargs)
        self.loopkv_pool = loopkv_pool
        self.loopkv_shares = bool(loopkv_shares)
        self.loopkv_block_bytes = int(loopkv_block_bytes)
        self._loopkv_source: list[LoopKVAttention] = []  # a list, so the source is not registered as a submodule
        config = get_current_vllm_config()
        slots = config.scheduler_config.max_num_seqs
        dtype = config.model_config.dtype
        exact = CellExact.allocate(slots, self.num_kv_heads, self.head_size, dtype=dtype)
        for name in ("sink_k", "sink_v", "win_k", "win_v"):
            self.register_buffer(f"loopkv_{name}", getattr(exact, name), persistent=False)
        self.loopkv_tau = float(loopkv_tau)

    def loopkv_exact(self) -> CellExact:
        return CellExact(self.loopkv_sink_k, self.loopkv_sink_v, self.loopkv_win_k, self.loopkv_win_v)

    def loopkv_link_source(self, source: LoopKVAttention) -> None:
        """Make this ``share`` cell read ``source``'s exact slots (its pool it finds through ``loopkv_pool``)."""
        if not self.loopkv_shares or source.loopkv_shares or source.loopkv_pool != self.loopkv_pool:
            raise ValueError(f"{self.layer_name} cannot read {source.layer_name}'s pool: a share cell's source is "
                             f"the cell that writes the pool it reads ({self.loopkv_pool.owner})")
        self._loopkv_source[:] = [source]

    def loopkv_source_exact(self) -> CellExact | None:
        """A ``share`` cell's source's exact slots; ``None`` for a cell that stores its own pool."""
        if not self.loopkv_shares:
            return None
        if not self._loopkv_source:
            raise RuntimeError(f"{self.layer_name} is a share cell whose source layer was never linked "
                               "(LoopKVOuroForCausalLM links them when it builds the model)")
        return self._loopkv_source[0].loopkv_exact()

    def get_kv_cache_spec(self, vllm_config):
        return LoopKVPageSpec(block_size=vllm_config.cache_config.block_size, num_kv_heads=self.num_kv_heads,
                              head_size=self.head_size, head_size_v=self.head_size, dtype=torch.uint8,
                              loopkv_block_bytes=self.loopkv_block_bytes)
