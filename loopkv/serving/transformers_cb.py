"""LoopKV in transformers' continuous-batching engine: ``loopkv.serving.generate_batch`` (docs/design.md, "Serving").

transformers has no hook for a cache class in its engine: ``ContinuousBatchingManager._create_batch_processor`` builds
``continuous_api.PagedAttentionCache`` by name. :func:`engine_cache` swaps that name, for the duration of a
``with`` block and under a lock, for a factory of :class:`~loopkv.serving.engine_cache.EngineCache` with the engine's
method names (:class:`EngineCache517` for transformers 5.17-5.23). What this relies on, and is checked by the tests:
the engine looks the class up in that module when it builds a processor, calls the allocation and index methods
below, passes ``write_index`` and ``cu_seq_lens_q`` to the model, and runs without CUDA graphs or async batching
(both off here: a graph would freeze the host-side split of the batch, and async preparation would race it).
"""

from __future__ import annotations

import contextlib
import threading

import torch
import transformers
from packaging.version import Version

from loopkv.cache.paging import pool_pages_for
from loopkv.format import PAGE, WINDOW
from loopkv.serving.engine_cache import EngineCache, blocks_for

_LOCK = threading.Lock()
SUPPORTED = (Version("5.17"), Version("5.24"))  # [from, to): the engine's cache interface these methods follow


class EngineCache517(EngineCache):
    """The 5.17-5.23 engine's names for :class:`EngineCache`'s calls (one layer group: full attention, no block
    table, no prefix sharing)."""

    num_groups, num_full_attention_groups, num_sliding_attention_groups = 1, 1, 0
    max_blocks_per_request = 0
    allow_block_sharing = use_prefix_sharing = False
    group_cache_managers = ()  # no engine blocks to copy: a preempted request is prefilled again (soft reset)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # read by the engine's offloading manager to size a CPU swap pool (loopkv keeps it at 0 bytes)
        self.key_cache = self.value_cache = [torch.empty(0, dtype=self.dtype)]
        self.num_key_value_heads, self.head_dim = self.cache.kv_heads, self.cache.head_dim

    def get_num_free_blocks(self) -> int:
        return self.free_block_count()

    def blocks_needed(self, num_requested_blocks: int, allocated_blocks: int) -> int:
        return num_requested_blocks

    def will_allocation_be_successful(self, num_requested_blocks: int, allocated_blocks: int) -> bool:
        return num_requested_blocks <= self.free_block_count()

    def blocks_in_use(self, request_id: str) -> int:
        return self.blocks_held(request_id)

    def allocate_blocks(self, n_blocks: int, request_id: str, allocated_blocks: int) -> int | None:
        return n_blocks if self.allocate(request_id, n_blocks) else None

    def free_blocks(self, request_id: str) -> None:
        self.free(request_id)

    def free_all_requests(self) -> None:
        self.free_all()

    def search_prefix_match(self, request_id: str, prompt_ids: list[int]) -> int:
        return 0

    def mark_shareable_blocks_as_complete(self, state, num_complete_blocks: int) -> None:
        return None

    def get_seqlens_k(self, past_length: int, query_length: int) -> dict[str, int]:
        return {"full_attention": past_length + query_length}

    def extend_read_and_write_indices(self, request_id, past_length, query_length, read_index, write_index) -> None:
        write_index[0].extend(self.write_indices(request_id, past_length, query_length))


def check_version() -> None:
    have = Version(Version(transformers.__version__).base_version)
    if not SUPPORTED[0] <= have < SUPPORTED[1]:
        raise NotImplementedError(
            f"loopkv's continuous batching follows the engine of transformers {SUPPORTED[0]} to before {SUPPORTED[1]}; "
            f"this is transformers {transformers.__version__}, whose engine's cache interface differs. Serve with "
            "LoopKVCache through model.generate, or install a transformers in that range")


@contextlib.contextmanager
def engine_cache(plan, *, max_slots: int, max_len: int):
    """Within the block, transformers' engine builds an :class:`EngineCache517` for ``plan`` (a lock keeps two
    engines from building at once); yields the list of the caches it built."""
    from transformers.generation.continuous_batching import continuous_api

    check_version()
    built = []

    def build(config, continuous_batching_config, device, *args, dtype=torch.float16, **kwargs):
        cb = continuous_batching_config
        built.append(EngineCache517(plan, config=config, max_slots=max_slots, max_len=max_len,
                                    pool_pages=cb.num_blocks, max_batch_tokens=cb.max_batch_tokens, dtype=dtype,
                                    device=device))
        return built[-1]

    with _LOCK:
        original = continuous_api.PagedAttentionCache
        continuous_api.PagedAttentionCache = build
        try:
            yield built
        finally:
            continuous_api.PagedAttentionCache = original


def engine_config(plan, *, pool_pages: int, max_batch_tokens: int | None = None, **config):
    """transformers' ``ContinuousBatchingConfig`` for a LoopKV engine cache: 32-token blocks (the page), the pool's
    pages as the engine's blocks, no CUDA graphs, no async batching, no block table. ``max_batch_tokens`` (tokens per
    step) defaults to 512, and to at most ``WINDOW`` for a plan with ``share`` cells: a later chunk of a prompt is a
    continuation, which such a plan takes ``WINDOW`` tokens at a time (``LoopKVCache.continuation_limit``)."""
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    for name in ("use_cuda_graph", "use_async_batching", "block_size", "num_blocks", "max_blocks_per_request"):
        if name in config:
            raise ValueError(f"{name} is set by loopkv's continuous batching; leave it out")
    limit = WINDOW if "share" in plan.options else None
    if max_batch_tokens is None:
        max_batch_tokens = limit or 512
    if limit is not None and max_batch_tokens > limit:
        raise ValueError(f"max_batch_tokens={max_batch_tokens} would let a prompt's later chunk exceed the {limit} "
                         "tokens a plan with 'share' cells continues by at once; use max_batch_tokens <= "
                         f"{limit} or a plan without 'share' cells")
    return ContinuousBatchingConfig(block_size=PAGE, num_blocks=pool_pages, max_batch_tokens=max_batch_tokens,
                                    use_cuda_graph=False, use_async_batching=False, max_blocks_per_request=0,
                                    **config)


def check_requests(inputs, *, max_len: int, pool_pages: int, max_new_tokens: int) -> None:
    """Refuse, before the engine starts, a request the engine could never finish: empty, or longer than ``max_len``
    or than the whole pool holds."""
    for i, ids in enumerate(inputs):
        if len(ids) == 0:
            raise ValueError(f"request {i} has an empty prompt; give every request at least one token")
        total = len(ids) + max_new_tokens
        if total > max_len or blocks_for(total) > pool_pages:
            raise ValueError(f"request {i} needs {total} tokens ({blocks_for(total)} blocks of {PAGE}); this engine "
                             f"holds at most max_len={max_len} tokens per request and {pool_pages} blocks in all: "
                             "raise max_len / the pool (kv_budget_gib, pool_pages), or shorten the request")


def generate_batch(model, inputs: list[list[int]], plan, *, max_slots: int, max_len: int,
                   pool_pages: int | None = None, kv_budget_gib: float | None = None,
                   max_batch_tokens: int | None = None, generation_config=None, **config):
    """``model.generate_batch(inputs, ...)`` with LoopKV storage: ``max_slots`` requests in flight, each at most
    ``max_len`` tokens, history pages from a pool of ``pool_pages`` (or what ``kv_budget_gib`` buys after the
    slots' exact sink and window: ``loopkv.cache.paging.pool_pages_for``). Other keywords go to transformers'
    ``ContinuousBatchingConfig`` (:func:`engine_config`). Returns what ``generate_batch`` returns (request id ->
    output)."""
    if (pool_pages is None) == (kv_budget_gib is None):
        raise ValueError("pass exactly one of pool_pages and kv_budget_gib")
    if pool_pages is None:
        dtype_bytes = torch.empty(0, dtype=model.dtype).element_size()
        pool_pages = pool_pages_for(plan, model.config, budget_bytes=int(kv_budget_gib * 2**30),
                                    max_batch_size=max_slots, dtype_bytes=dtype_bytes)
    cb = engine_config(plan, pool_pages=pool_pages, max_batch_tokens=max_batch_tokens, **config)
    new = (generation_config or model.generation_config).max_new_tokens or 0
    check_requests(inputs, max_len=max_len, pool_pages=pool_pages, max_new_tokens=new)
    with engine_cache(plan, max_slots=max_slots, max_len=max_len):
        return model.generate_batch(inputs, generation_config=generation_config, continuous_batching_config=cb)
