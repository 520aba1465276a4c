"""LoopKV in transformers' continuous-batching engine: ``loopkv.serving.generate_batch`` (docs/design.md, "Serving").

transformers has no hook for a cache class in its engine: ``ContinuousBatchingManager._create_batch_processor`` builds
``continuous_api.PagedAttentionCache`` by name. :func:`engine_cache` swaps that name, for the duration of a
``with`` block and under a lock, for a factory of :class:`~loopkv.serving.engine_cache.EngineCache` with the engine's
method names, chosen by the installed version (:func:`engine_class`):

* :class:`EngineCache517` follows the engine of transformers 5.17 (tested; 5.18-5.23 are assumed to keep its cache
  interface, untested): the engine counts blocks itself and asks the cache to allocate ``n`` of them per request.
* :class:`EngineCache524` follows the engine of transformers 5.24 (tested): the cache decides whether a request's new
  tokens fit (``can_store_request_tokens``) and the engine reads a per-attention-type allocator
  (``cache_allocators``) and a sector pool; loopkv answers with one stub allocator that holds no block table (so the
  engine never copies blocks: a preempted request is soft reset, i.e. freed and prefilled again as a new prompt) and
  that reads none of a request's past tokens through the engine (``read_cache_limit = 0``, so the engine's read
  budget never binds and the attention mask it builds for ``sdpa``/``eager`` covers only the step's new tokens).

:func:`engine_cache` also swaps the engine's batch-processor class (``continuous_api.ContinuousBatchProcessor``) for a
subclass (:class:`EngineProcessor`): its ``warmup`` warms loopkv's cache up (every decode bucket's CUDA graph captured
before the first request) and, around the engine's count of a step's tokens, it fails alone each request whose
prompt or decode token the codec could not store.

What this relies on, and is checked by the tests on 5.17 and 5.24: the engine looks both classes up in that module
when it builds a processor (the cache first), ``manager.warmup()`` calls the processor's ``warmup(model)``, the
processor's ``update_batch`` counts the step's tokens and counts none for a request already ``FAILED`` (a streaming
one is delivered again, failed), its ``_handle_request_error`` and its scheduler's ``finish_request`` fail and free
one request, the engine calls the
allocation and index methods below, prepares each batch by calling
``extend_read_and_write_indices`` once per request in packing order with a fresh ``write_index`` list (one list per
attention type, empty at the batch's first request: loopkv records the step's segments there, on the host) and runs
that batch's forward before preparing the next, and takes the model's configured attention implementation as it is
(``sdpa`` or ``eager``: loopkv's Ouro runs the cache's own ``"loopkv"`` attention and ignores the engine's mask). It
runs without the engine's CUDA graphs, async batching or CPU offloading (all off in :func:`engine_config`: the engine
keys its graphs by its padded token and read counts, not by which requests are prompts, so a graph would replay one
step's split into prompts and decodes for another; loopkv captures its decode-only steps itself,
``loopkv/serving/decode_graphs.py``; async preparation would record the next batch's segments while the current one
runs; offloading copies engine blocks loopkv does not have) and without compilation (the engine's default; a compile
config, which also pads the batch, is untested here).

**Prompts.** :func:`engine_cache` swaps the engine's scheduler classes (``scheduler.SCHEDULER_MAPPING``) for
subclasses (:class:`Prompts`: it filters the candidates before the engine's ``_process_candidates``, whose signature
5.17 and 5.24 share, and tells the cache each prompt's length). A prompt (a new request, or a preempted one back as a
new prompt) that the step's token budget holds whole is one exact pass (``slots.prefill_step``), as in ``generate``.
One that it does not hold:

* waits for a step that does, by default: the budget must then hold the longest request next to every slot decoding
  (``max_batch_tokens >= max_len + max_slots``, :func:`check_step_budget`), so a waiting prompt fits once it is
  first in line, and a long prompt's step stalls every decoding request for its pass;
* with ``chunked_prefill=True``, is prefilled in chunks of what the budget leaves after the decoding requests, one
  such prompt at a time, through the cache's exact scratch (:mod:`loopkv.serving.prompt_chunks`): its tokens are
  those of the prompt in one pass, and a step's time is bounded by the budget (``max_batch_tokens`` defaults to
  ``max_slots + min(DEFAULT_CHUNK, max_len)``). The scratch holds ``max_len`` tokens of every cell, exact, besides
  the pool.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading

import torch
import transformers
from packaging.version import Version

from loopkv.cache.paging import pool_pages_for
from loopkv.format import PAGE
from loopkv.serving.engine_cache import EngineCache, blocks_for

logger = logging.getLogger(__name__)
_LOCK = threading.Lock()
SUPPORTED = (Version("5.17"), Version("5.25"))  # [from, to): the engines' cache interfaces these classes follow
# With chunked prefill: the prompt tokens a step holds beside every slot decoding, by default. On the H200 at
# Ouro-1.4B's shapes, 8,192-token chunks served bench_serving's trace as well as whole prompts and 2,048-token ones
# worse (docs/design.md, "Prompts").
DEFAULT_CHUNK = 8192
NEW_ENGINE = Version("5.24")  # from here on: EngineCache524


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

    def compute_max_num_forks(self, request_id: str) -> int:
        return 0  # no child shares the parent's slot: the engine prefills each child from scratch

    def extend_read_and_write_indices(self, request_id, past_length, query_length, read_index, write_index) -> None:
        self.schedule(request_id, past_length, query_length, write_index[0])


class EngineProcessor:
    """Mixed into the engine's batch processor (``continuous_api.ContinuousBatchProcessor``) by :func:`engine_cache`:

    * its ``warmup(model)`` (what ``manager.warmup()`` calls before the engine starts; transformers' ``generate_batch``
      does by default) also warms loopkv's cache up (:meth:`EngineCache.warm_up`: every decode bucket's graph
      captured before the first request);
    * before the engine counts a step's tokens (``update_batch``), each request whose decode token the codec could
      not store (:meth:`EngineCache.uncodable_decodes`) is failed alone, with the error, and finished, which frees
      its slot and pages; the engine then counts no token for it (a failed request is not decoding). A request
      whose prompt the codec could not store (:meth:`EngineCache.uncodable_prompts`) is failed after the count (the
      engine marks a prompt's request decoding as it counts its first token, which would undo an earlier failure);
      one that finished at that step is left as delivered (nothing is read from its pages after);
    * once built, it puts its cache in :func:`engine_cache`'s list (``built``), after the scheduler and itself exist,
      so a caller that waits for that list may leave the ``with`` block.
    """

    built: list  # the list engine_cache yields

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.built.append(self.cache)

    def warmup(self, model) -> None:
        super().warmup(model)
        self.cache.warm_up(model)

    def update_batch(self) -> None:
        self._fail(self.cache.uncodable_decodes())
        super().update_batch()
        self._fail(self.cache.uncodable_prompts())

    def _fail(self, failures: list[tuple[str, Exception]]) -> None:
        """Fail each request with its error and finish it (its slot and pages go back); one that has already
        finished (at this step) was delivered as it was."""
        for request_id, error in failures:
            state = self.scheduler.active_requests.get(request_id)
            if state is not None:
                logger.error("%s", error)
                self._handle_request_error(error, state)
                self.scheduler.finish_request(request_id)


class Prompts:
    """Mixed into the engine's scheduler class: a prompt (a waiting request, a preempted one back as a new prompt, or
    the rest of the prompt in chunks) is a candidate when the step's token budget, after the candidates before it,
    holds the rest of it, or, with chunked prefill, when no other request's prompt is in chunks: the engine then gives
    it what the budget leaves, and its length goes to the cache
    (:meth:`~loopkv.serving.engine_cache.EngineCache.note_prompt`), which takes a shorter segment of it for a chunk.
    Otherwise it waits for a later step (module docstring). A prompt of ``max_len`` tokens or more stays a candidate:
    the cache refuses its blocks and the engine fails it alone."""

    def _process_candidates(self, candidates, token_budget, cache_budget, request_ids_to_remove_from_waiting):
        from transformers.generation.continuous_batching.requests import RequestStatus

        kept, left, in_chunks = [], token_budget, self.cache.chunk_owner
        for state in candidates:
            if state.status == RequestStatus.DECODING:
                kept.append(state)
                left -= 1
                continue
            need = len(state.remaining_prefill_tokens)
            if need <= left or state.position_offset + need >= self.cache.max_len:
                kept.append(state)
                left -= need
            elif self.cache.chunked_prefill and left > 0 and in_chunks in (None, state.request_id):
                self.cache.note_prompt(state.request_id, state.position_offset + need)
                kept.append(state)  # the engine gives it the rest of the budget: a chunk
                in_chunks, left = state.request_id, 0
        return super()._process_candidates(kept, token_budget, cache_budget, request_ids_to_remove_from_waiting)


def check_step_budget(*, max_batch_tokens: int, max_len: int, max_slots: int, chunked_prefill: bool = False) -> None:
    """Refuse a step budget that cannot hold every slot decoding and a prompt token (chunked prefill) or the longest
    prompt (whole prompts) beside them."""
    if chunked_prefill and max_batch_tokens <= max_slots:
        raise ValueError(f"max_batch_tokens={max_batch_tokens} is too small: a step holds every slot decoding "
                         f"(max_slots={max_slots}) and a prompt's chunk, so use max_batch_tokens > max_slots (by "
                         f"default max_slots + min({DEFAULT_CHUNK}, max_len)), or leave it unset")
    if not chunked_prefill and max_batch_tokens < max_len + max_slots:
        least = max_len + max_slots
        raise ValueError(f"max_batch_tokens={max_batch_tokens} is too small: without chunked prefill loopkv's engine "
                         f"schedules every prompt whole, so use max_batch_tokens >= max_len + max_slots = {least} (the "
                         "longest request next to every slot decoding), leave it unset, or pass "
                         "chunked_prefill=True")


class _Allocator524:
    """The one allocator (full attention) the 5.24 engine reads: trash indices, key lengths per request, block counts.
    It holds no block table (``{}``): the engine then has no blocks to offload or fork, and soft resets instead."""

    index, layer_type, tokens_per_page, blocks_per_sector = 0, "full_attention", PAGE, 1

    def __init__(self, cache: EngineCache524):
        self._cache = cache
        self.write_trash_index = self.read_trash_index = cache.write_trash_index
        self.num_blocks, self.bytes_per_block = cache.num_blocks, cache.bytes_per_sector
        self.block_table: dict[str, list[int]] = {}

    def get_seqlen_k(self, past_length: int, query_length: int) -> int:
        return query_length  # keys the engine reads: the new tokens only (loopkv reads the past from its storage)

    def needs_new_blocks(self, request_id: str, past_length: int, query_length: int) -> int:
        return self._cache.new_blocks(request_id, past_length + query_length)


class _Pool524:
    """The engine's sector pool: loopkv's blocks are counted by :class:`EngineCache`, so there is nothing to free."""

    def try_to_free_sectors(self) -> None:
        return None


class EngineCache524(EngineCache):
    """The 5.24 engine's names for :class:`EngineCache`'s calls (one attention type, no block table, no prefix sharing,
    no decode fast path; the engine reads no past tokens, so its read budget and attention mask stay per step)."""

    max_blocks_per_request = max_decode_fast_path_length = 0
    allow_block_sharing = use_prefix_sharing = False
    read_cache_limit = 0  # past tokens per request the engine reads: none (each request costs 0 of its read budget)
    max_tokens_read = 1  # the engine's read budget per step (any positive value: it stops a batch at 0)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # the bytes of a block stored exactly (every cell's K and V): what the engine converts capacities with
        self.bytes_per_sector = (len(self.cache.layers) * 2 * self.cache.kv_heads * self.cache.head_dim * PAGE
                                 * torch.empty(0, dtype=self.dtype).element_size())
        self.num_sectors = self.num_blocks
        self.cache_allocators = {"full_attention": _Allocator524(self)}
        self.pool = _Pool524()

    def new_blocks(self, request_id: str, tokens: int) -> int:
        """Blocks ``request_id`` needs beyond those it holds to hold ``tokens`` tokens."""
        return max(0, blocks_for(tokens) - self.blocks_held(request_id))

    def can_store_request_tokens(self, state, request_len: int, dry_run: bool = False) -> bool:
        """Allocate (unless ``dry_run``) the blocks, and a slot if it has none, for ``request_len`` more tokens."""
        rid = state.request_id
        blocks = self.new_blocks(rid, state.current_len() + request_len)
        if dry_run:
            return blocks <= self.free_block_count() and (rid in self._slot or bool(self._free_slots))
        return self.allocate(rid, blocks)

    def count_storable_requests(self, list_blocks_needed: list[dict[str, int]]) -> int:
        """How many of these (active) requests, in order, would get their blocks."""
        free = self.free_block_count()
        for i, needed in enumerate(list_blocks_needed):
            free -= needed["full_attention"]
            if free < 0:
                return i
        return len(list_blocks_needed)

    def compute_free_capacity(self, relative: bool = True) -> int | float:
        free = self.free_block_count()
        return free / self.num_blocks if relative else free * self.bytes_per_sector

    def free_blocks(self, request_id: str, no_cache: bool = False) -> None:
        self.free(request_id)

    def free_all_requests(self, clear_ledgers: bool = False) -> None:
        self.free_all()

    def reset(self) -> None:
        self.free_all()

    def search_prefix_match(self, request_id: str, prompt_ids: list[int]) -> int:
        return 0

    def count_new_complete_blocks(self, state, request_len: int) -> dict[str, int]:
        return {}

    def mark_complete_blocks(self, state, complete_blocks: dict[str, int]) -> None:
        return None

    def evict_cached_blocks(self) -> bool:
        return False

    def prepare_fork_request(self, src_state, dst_req_ids: list[str], copy_src_and_dst) -> list[str]:
        return []  # no child shares the parent's slot: the engine prefills each child from scratch

    def perform_cache_copy(self, copy_src_and_dst) -> None:
        return None

    def extend_read_and_write_indices(self, request_id, past_length, query_length, read_index, write_index) -> None:
        self.schedule(request_id, past_length, query_length, write_index[0])


def installed_version() -> Version:
    return Version(Version(transformers.__version__).base_version)


def engine_class() -> type[EngineCache]:
    """The :class:`EngineCache` subclass whose names the installed transformers' engine calls."""
    return EngineCache524 if installed_version() >= NEW_ENGINE else EngineCache517


def check_version() -> None:
    have = installed_version()
    if not SUPPORTED[0] <= have < SUPPORTED[1]:
        raise NotImplementedError(
            f"loopkv's continuous batching follows the engine of transformers {SUPPORTED[0]} to before {SUPPORTED[1]}; "
            f"this is transformers {transformers.__version__}, whose engine's cache interface differs. Serve with "
            "LoopKVCache through model.generate, or install a transformers in that range")


@contextlib.contextmanager
def engine_cache(plan, *, max_slots: int, max_len: int, cuda_graphs: bool = True, chunked_prefill: bool = False):
    """Within the block, transformers' engine builds an :class:`EngineCache` for ``plan`` (:func:`engine_class`; a
    lock keeps two engines from building at once), schedules prompts through :class:`Prompts` (whole, or with
    ``chunked_prefill`` the one that does not fit in chunks) and runs its steps through :class:`EngineProcessor`;
    yields the list of the caches it built, each added once the engine's batch processor around it exists.
    ``cuda_graphs``: decode-only steps on CUDA replay loopkv's graphs (``loopkv/serving/decode_graphs.py``), every
    bucket's captured by the cache's warm-up. The engine's config comes from :func:`engine_config` with the same
    ``chunked_prefill``."""
    from transformers.generation.continuous_batching import continuous_api, scheduler

    check_version()
    cls = engine_class()
    built = []

    def build(config, continuous_batching_config, device, *args, dtype=torch.float16, **kwargs):
        cb = continuous_batching_config
        check_step_budget(max_batch_tokens=cb.max_batch_tokens, max_len=max_len, max_slots=max_slots,
                          chunked_prefill=chunked_prefill)
        return cls(plan, config=config, max_slots=max_slots, max_len=max_len, pool_pages=cb.num_blocks,
                   max_batch_tokens=cb.max_batch_tokens, dtype=dtype, device=device, cuda_graphs=cuda_graphs,
                   chunked_prefill=chunked_prefill)

    schedulers = dict(scheduler.SCHEDULER_MAPPING)
    with _LOCK:
        original = continuous_api.PagedAttentionCache, continuous_api.ContinuousBatchProcessor
        continuous_api.PagedAttentionCache = build
        continuous_api.ContinuousBatchProcessor = type(f"LoopKV{original[1].__name__}",
                                                       (EngineProcessor, original[1]), {"built": built})
        for name, base in schedulers.items():
            scheduler.SCHEDULER_MAPPING[name] = type(f"LoopKV{base.__name__}", (Prompts, base), {})
        try:
            yield built
        finally:
            continuous_api.PagedAttentionCache, continuous_api.ContinuousBatchProcessor = original
            scheduler.SCHEDULER_MAPPING.update(schedulers)


def engine_config(*, pool_pages: int, max_len: int, max_slots: int, max_batch_tokens: int | None = None,
                  chunked_prefill: bool = False, **config):
    """transformers' ``ContinuousBatchingConfig`` for a LoopKV engine cache of ``max_slots`` requests of at most
    ``max_len`` tokens: 32-token blocks (the page; the field is ``page_size`` where the config has one, as in 5.24,
    else ``block_size``), the pool's pages as the engine's blocks, no CUDA graphs of the engine's (loopkv captures
    its own), no async batching, no block table, no CPU offloading and, where the engine has the switch (5.24), no
    automatic switch to flash attention (loopkv's attention would not use it). ``max_batch_tokens`` (tokens per
    step) defaults to, and must be at least, ``max_len + max_slots`` (prompts are scheduled whole); with
    ``chunked_prefill`` it defaults to ``max_slots + min(DEFAULT_CHUNK, max_len)`` and must exceed ``max_slots``
    (:func:`check_step_budget`)."""
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    fields = {f.name for f in dataclasses.fields(ContinuousBatchingConfig)}
    page = "page_size" if "page_size" in fields else "block_size"  # renamed in the 5.24 engine (block_size deprecated)
    for name in ("use_cuda_graph", "use_async_batching", "block_size", "page_size", "num_blocks",
                 "max_blocks_per_request", "cpu_offload_space"):
        if name in config:
            raise ValueError(f"{name} is set by loopkv's continuous batching; leave it out")
    if max_batch_tokens is None:
        max_batch_tokens = max_slots + (min(DEFAULT_CHUNK, max_len) if chunked_prefill else max_len)
    check_step_budget(max_batch_tokens=max_batch_tokens, max_len=max_len, max_slots=max_slots,
                      chunked_prefill=chunked_prefill)
    if "auto_switch_to_flash" in fields:
        config.setdefault("auto_switch_to_flash", False)
    return ContinuousBatchingConfig(**{page: PAGE}, num_blocks=pool_pages, max_batch_tokens=max_batch_tokens,
                                    use_cuda_graph=False, use_async_batching=False, max_blocks_per_request=0,
                                    cpu_offload_space=0.0, **config)


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
                   max_batch_tokens: int | None = None, chunked_prefill: bool = False, generation_config=None,
                   cuda_graphs: bool = True, **config):
    """``model.generate_batch(inputs, ...)`` with LoopKV storage: ``max_slots`` requests in flight, each at most
    ``max_len`` tokens, history pages from a pool of ``pool_pages`` (or what ``kv_budget_gib`` buys after the
    slots' exact sink and window and, with ``chunked_prefill``, the prompt scratch: :func:`pool_pages_within`).
    ``max_batch_tokens``, ``chunked_prefill`` and other keywords go to transformers' ``ContinuousBatchingConfig``
    (:func:`engine_config`); ``cuda_graphs``: :func:`engine_cache`'s. Returns what ``generate_batch`` returns
    (request id -> output)."""
    if (pool_pages is None) == (kv_budget_gib is None):
        raise ValueError("pass exactly one of pool_pages and kv_budget_gib")
    check_model(model)
    if pool_pages is None:
        pool_pages = pool_pages_within(plan, model.config, kv_budget_gib=kv_budget_gib, max_slots=max_slots,
                                       max_len=max_len, dtype=model.dtype, chunked_prefill=chunked_prefill)
    cb = engine_config(pool_pages=pool_pages, max_batch_tokens=max_batch_tokens, max_len=max_len,
                       max_slots=max_slots, chunked_prefill=chunked_prefill, **config)
    new = (generation_config or model.generation_config).max_new_tokens or 0
    check_requests(inputs, max_len=max_len, pool_pages=pool_pages, max_new_tokens=new)
    implementation = model.config._attn_implementation
    if implementation == "loopkv":  # the engines refuse it by name; loopkv's Ouro takes its attention from the cache
        model.set_attn_implementation("sdpa")
    try:
        with engine_cache(plan, max_slots=max_slots, max_len=max_len, cuda_graphs=cuda_graphs,
                          chunked_prefill=chunked_prefill):
            return model.generate_batch(inputs, generation_config=generation_config, continuous_batching_config=cb)
    finally:
        if implementation == "loopkv":
            model.set_attn_implementation(implementation)


def pool_pages_within(plan, config, *, kv_budget_gib: float, max_slots: int, max_len: int, dtype: torch.dtype,
                      chunked_prefill: bool = False) -> int:
    """The pages a KV budget of ``kv_budget_gib`` buys an engine of ``max_slots`` requests after their exact sink and
    window and, with ``chunked_prefill``, the prompt scratch (``max_len`` tokens of every cell, exact:
    :func:`loopkv.serving.prompt_chunks.scratch_bytes`)."""
    from loopkv.serving.prompt_chunks import scratch_bytes

    dtype_bytes = torch.empty(0, dtype=dtype).element_size()
    reserved = scratch_bytes(config, tokens=max_len, dtype_bytes=dtype_bytes) if chunked_prefill else 0
    return pool_pages_for(plan, config, budget_bytes=int(kv_budget_gib * 2**30), max_batch_size=max_slots,
                          dtype_bytes=dtype_bytes, reserved_bytes=reserved)


def check_model(model) -> None:
    """Refuse a model the engine cache cannot serve: the engine hands the cache to the model, which must call
    ``cache.update`` for every cell and take its attention function from the cache (loopkv's Ouro does both)."""
    if not getattr(model, "attention_from_cache", False):
        raise NotImplementedError(
            f"{type(model).__name__} does not take its attention function from the cache, so transformers' engine "
            "would run its own paged attention on LoopKV's handles; loopkv serves loopkv.models.ouro models "
            "(OuroForCausalLM) through continuous batching")
