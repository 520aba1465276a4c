"""The cache transformers' continuous-batching engine drives, with a LoopKVCache's storage behind it
(docs/design.md, "Serving").

The engine schedules requests, allocates 32-token blocks for them and packs each step's tokens into one row; it
calls its cache to allocate and free blocks and to write, per scheduled request, the index of each new token. This
class answers those calls for a LoopKVCache whose rows are request slots and whose shared page pool holds the
history:

* **blocks** are counted per request as the engine asks (its admission control); the pool has as many pages as the
  engine has blocks, and a request holding ``t`` tokens stores ``stored_pages(t) <= ceil(t / 32)`` pages, so the
  pool never runs out before the engine's count does. A request also needs a free slot (its exact sink and window);
  without one its allocation fails and the engine waits or preempts, as for blocks.
* **indices**: the write index of a request's token at position ``p`` is ``slot * max_len + p``, so the attention
  function recovers each packed token's slot and position from the engine's own index tensor; padding tokens get
  the engine's trash index (``max_slots * max_len``).
* **the step's segments** (a new prompt, whole; a chunk of the one prompt prefilled in chunks, when
  ``chunked_prefill`` is on; a decode token: ``transformers_cb.Prompts`` schedules them) are recorded on the host as
  the engine prepares the batch (:meth:`schedule`, from its per-request index call), so splitting the packed batch
  reads nothing back from the device. Which scheduled segment is a chunk comes from the prompt's length, which the
  scheduler gives the cache (:meth:`note_prompt`);
* **the model** hands its forward to :meth:`run_step`, which prepares the step on the host (the segments checked,
  pages reserved, the new prompts' writes as a :class:`~loopkv.cache.slots.PrefillStep`, the decoding rows written
  into :class:`~loopkv.cache.slots.DecodeSteps`' fixed tensors: one copy to the device) and runs it: a step where
  every request decodes one token through :class:`~loopkv.serving.decode_graphs.DecodeGraphs` (padded to a bucket,
  a CUDA graph per bucket on CUDA), any other step eagerly. In the forward the model calls :meth:`update` per cell, as
  with any transformers cache, and the ``"loopkv"`` attention function hands the packed batch to :meth:`attend`,
  which, through ``loopkv/cache/slots.py``, writes the step's new prompts together, runs their exact attention per
  segment, and every decoding slot in one fixed-shape call. Nothing is read back per cell.
* **a prompt in chunks** (``chunked_prefill``): its chunks go to a dense scratch (:mod:`loopkv.serving.prompt_chunks`)
  and attend exactly over the chunks before them; its last chunk writes the whole prompt into its slot as a new
  prompt is written. So its tokens are those of the prompt in one pass. One request holds the scratch at a time.
* **warm-up**: before its first request the cache runs every decode bucket once with a step in which no row decodes
  (:meth:`warm_up`; on CUDA, each bucket's graph is captured then), so no request's step waits for a capture. The
  engine's own warm-up calls it (``transformers_cb.EngineProcessor``); otherwise the first forward does.
* **uncodable tokens** (K/V values that are non-finite, or beyond the INT4/INT2 codec's fp16 range, in a cell that
  stores INT4/INT2 pages) are refused when written, failing only the request that brought them: the forward records
  them and the engine's batch processor (``transformers_cb.EngineProcessor``) fails those requests after it, which
  frees their slots and pages (an error raised from the forward would stop the engine). A prompt's are flagged on
  the device per quantized cell and read once, at the step's last cell (:meth:`uncodable_prompts`). A decode
  token's largest magnitude is recorded per (cell, row) on the device inside the step (a graph's too), copied to
  the host without waiting and read after the forward, where the engine reads the step's tokens
  (:meth:`uncodable_decodes`).

A finished, cancelled or preempted request's slot and pages are freed by ``free_blocks``; a preempted request comes
back under the same id as a new prompt (its generated tokens appended) and is prefilled again.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field

import torch
from torch import Tensor

from loopkv.cache import checks, slots
from loopkv.cache.layer import LoopKVHandle
from loopkv.cache.loop_cache import LoopKVCache
from loopkv.format import PAGE
from loopkv.serving.decode_graphs import DecodeGraphs, bucket, buckets
from loopkv.serving.prompt_chunks import PromptScratch, chunk_attention

logger = logging.getLogger(__name__)
LIVES_KEPT = 1024  # requests whose steps EngineCache.lives keeps
STEPS_KEPT = 4096  # forwards EngineCache.steps keeps


class EngineHandle(LoopKVHandle):
    """What :meth:`EngineCache.update` returns: the ``"loopkv"`` attention function gives it to :meth:`attend`."""

    __slots__ = ()
    is_packed_batch = True


class EngineCache:
    """A continuous-batching engine's cache over a LoopKVCache (module docstring).

    plan, config: the LoopKV plan and the model's config; max_slots: requests in flight at once; max_len: tokens per
    request (prompt + generated); pool_pages: the shared pool (the engine's ``num_blocks``); max_batch_tokens: the
    engine's tokens per step; dtype, device: the model's; cuda_graphs: on a CUDA device, decode-only steps replay a
    CUDA graph per bucket (:mod:`loopkv.serving.decode_graphs`; False runs the same padded step eagerly);
    chunked_prefill: a prompt the step's budget does not hold whole may be prefilled in chunks, exactly, through a
    scratch of ``max_len`` tokens in every cell (:mod:`loopkv.serving.prompt_chunks`; its bytes come on top of the
    pool's).
    """

    attention_implementation = "loopkv"
    builds_no_mask = True  # the engine's packed batch carries its segments; the model builds no dense mask

    def __init__(self, plan, *, config, max_slots: int, max_len: int, pool_pages: int, max_batch_tokens: int,
                 dtype: torch.dtype, device, cuda_graphs: bool = True, chunked_prefill: bool = False):
        self.cache = LoopKVCache(plan, config=config, max_batch_size=max_slots, max_cache_len=max_len, dtype=dtype,
                                 device=device, pool_pages=pool_pages)
        self.config, self.dtype, self.device = config, dtype, self.cache.device
        self.max_slots, self.max_len = max_slots, max_len
        self.block_size = PAGE
        self.num_blocks = pool_pages
        self.num_pages = pool_pages * PAGE
        self.max_batch_tokens = max_batch_tokens
        self.write_trash_index = self.read_trash_index = max_slots * max_len
        self._slot: dict[str, int] = {}
        self._free_slots = list(range(max_slots))
        self._blocks: dict[str, int] = {}
        self._held = [0] * max_slots  # tokens each slot holds (the cache's lengths, kept on the host)
        self._scheduled: list[tuple[str, int, int]] | None = None  # (request, past, new) of the batch being prepared
        self._prompt_tokens: dict[str, int] = {}  # the tokens of each prompt the scheduler takes in chunks
        self.scratch = PromptScratch(cells=len(self.cache.layers), max_len=max_len, kv_heads=self.cache.kv_heads,
                                     head_dim=self.cache.head_dim, dtype=dtype,
                                     device=self.device) if chunked_prefill else None
        self._step: _Step | None = None  # the segments of the forward in progress
        # the step's (cell, device flags: which of its prompt tokens are uncodable), and after its last cell the
        # prompts found uncodable: (request, slot, cells)
        self._uncodable: list[tuple[int, Tensor]] = []
        self._bad_prompts: list[tuple[str, int, list[int]]] = []
        self._quantized = any(layer.storage.own_bits in (4, 2) for layer in self.cache.layers)
        self._decode_steps = slots.DecodeSteps(rows=max_slots, max_tokens=max(max_batch_tokens, bucket(max_slots)),
                                               cells=len(self.cache.layers), device=self.device)
        # the last decode step's largest K/V magnitudes, copied to the host without waiting, and what they are of:
        # (request, slot, position) of each decoding row, and the event that says the copy is done
        self._largest_host = torch.empty(self._decode_steps.largest.shape, dtype=torch.float32,
                                         pin_memory=self.device.type == "cuda")
        self._decoded: list[tuple[str, int, int]] = []
        self._copied = torch.cuda.Event() if self.device.type == "cuda" else None
        self.graphs = DecodeGraphs(max_rows=max_slots, device=self.device,
                                   capture=cuda_graphs and self.device.type == "cuda")
        self.warm_up_s: float | None = None  # how long warm_up took, once it has run
        self._warming = False  # a forward that only warms up (warm_up)
        # the last STEPS_KEPT forwards: (time.perf_counter() when it began, decoding rows, prompt tokens); a step
        # lasts until the next one starts (what a benchmark times decode steps by)
        self.steps: deque[tuple[float, int, int]] = deque(maxlen=STEPS_KEPT)
        self.admissions = 0  # slots given out: more than the requests served means some were preempted
        # per request (the last LIVES_KEPT), each admission's (first position, tokens) steps: how its tokens went
        self.lives: OrderedDict[str, list[list[tuple[int, int]]]] = OrderedDict()

    # ---- allocation (the engine's scheduler) ----------------------------------------------------
    def free_block_count(self) -> int:
        return self.num_blocks - sum(self._blocks.values())

    def blocks_held(self, request_id: str) -> int:
        return self._blocks.get(request_id, 0)

    def allocate(self, request_id: str, blocks: int) -> bool:
        """Count ``blocks`` more for ``request_id`` (and give it a slot if it has none); False if either is short,
        and for a request that would pass ``max_len`` or has no tokens (the engine then fails that request alone,
        where an error here or at its indices would fail the whole batch)."""
        if (self._blocks.get(request_id, 0) + blocks - 1) * PAGE >= self.max_len:
            logger.error("request %s needs more than max_len=%d tokens, which this LoopKV engine cache holds per "
                         "request; the engine will fail it", request_id, self.max_len)
            return False
        if blocks == 0 and request_id not in self._slot:
            logger.error("request %s has no tokens; the engine will fail it", request_id)
            return False
        if blocks > self.free_block_count():
            return False
        if request_id not in self._slot:
            if not self._free_slots:
                return False
            self._slot[request_id] = self._free_slots.pop(0)
            self.admissions += 1
            self.lives.setdefault(request_id, []).append([])
            self.lives.move_to_end(request_id)
            while len(self.lives) > LIVES_KEPT:
                self.lives.popitem(last=False)
        self._blocks[request_id] = self._blocks.get(request_id, 0) + blocks
        return True

    def free(self, request_id: str) -> None:
        """The request is finished, cancelled or preempted: its slot's tokens and pages go back, and the prompt
        scratch if it held it."""
        self._blocks.pop(request_id, None)
        self._prompt_tokens.pop(request_id, None)
        if self.scratch is not None:
            self.scratch.release(request_id)
        slot = self._slot.pop(request_id, None)
        if slot is not None:
            self.cache.release([slot])
            self._held[slot] = 0
            self._free_slots.append(slot)
            self._free_slots.sort()

    @property
    def chunked_prefill(self) -> bool:
        return self.scratch is not None

    @property
    def chunk_owner(self) -> str | None:
        """The request whose prompt is being prefilled in chunks (None if none is, or chunked prefill is off)."""
        return None if self.scratch is None else self.scratch.owner

    def note_prompt(self, request_id: str, tokens: int) -> None:
        """The scheduler's word that it takes ``request_id``'s prompt (a preempted request's: everything it holds
        again) of ``tokens`` tokens in chunks: a segment of it shorter than that is a chunk (a prompt it does not
        note is whole, or split by the engine before its last token to fork it: a prompt, then a decode token)."""
        self._prompt_tokens[request_id] = tokens

    @property
    def requests_held(self) -> int:
        """Requests holding a slot."""
        return len(self._slot)

    def free_all(self) -> None:
        for request_id in list(self._slot):
            self.free(request_id)

    def write_indices(self, request_id: str, past: int, new: int) -> range:
        """The write index of each new token of ``request_id``: ``slot * max_len + position``."""
        if past + new > self.max_len:
            raise ValueError(f"request {request_id} would hold {past + new} tokens, more than this LoopKV engine cache "
                             f"was built for (max_len={self.max_len})")
        base = self._slot[request_id] * self.max_len
        return range(base + past, base + past + new)

    def schedule(self, request_id: str, past: int, new: int, write_index: list[int]) -> None:
        """The engine puts ``request_id``'s ``new`` tokens after its ``past`` ones into the batch it prepares, in
        packing order, extending the step's ``write_index`` list (empty at the batch's first request). The step's
        segments are recorded here, on the host, so the forward needs no device values to split the batch."""
        if not write_index:
            self._scheduled = []
        write_index.extend(self.write_indices(request_id, past, new))
        if new:
            self._scheduled.append((request_id, past, new))

    # ---- the model's side -------------------------------------------------------------------------
    def update(self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args, **kwargs):
        """Cell ``layer_idx``'s K/V of the packed batch ([1, H, T, D]), to be written by :meth:`attend`."""
        return (EngineHandle(self, layer_idx, key_states, value_states),) * 2

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # positions come from the engine's position_ids

    def run_step(self, logits_of, *, input_ids: Tensor, position_ids: Tensor, logits_to_keep) -> Tensor:
        """One engine forward, called by the model with its forward as ``logits_of(input_ids=, position_ids=,
        logits_to_keep=)`` (returning its logits): the step is prepared on the host (:meth:`_begin_step`), then run,
        a decode-only step through :attr:`graphs`. Returns the logits the engine asked for (``logits_to_keep``)."""
        if self.warm_up_s is None:
            self._warm_up(logits_of)
        if self._warming:
            return None
        tokens = input_ids.shape[1]
        kept = logits_to_keep.numel() if isinstance(logits_to_keep, Tensor) else tokens
        self._step = step = self._begin_step(tokens, logits=kept)
        try:
            if step.graphed:
                logits = self.graphs.run(logits_of, input_ids, position_ids)
            else:
                logits = logits_of(input_ids=input_ids, position_ids=position_ids, logits_to_keep=logits_to_keep)
        finally:
            self._step = None
        if step.chunk is not None and step.chunk.prefill is not None:  # the prompt is in its slot now
            self.scratch.release(step.chunk.request_id)
        if step.decoded and self._quantized:  # read by uncodable_decodes once the engine has the step's tokens
            self._largest_host.copy_(self._decode_steps.largest, non_blocking=True)
            if self._copied is not None:
                self._copied.record()
            self._decoded = step.decoded
        return logits

    def warm_up(self, model) -> None:
        """Before the first request: run every decode bucket (:func:`~loopkv.serving.decode_graphs.buckets` up to
        ``max_slots``) once, capturing its CUDA graph where graphs are on, with a step in which no row decodes, so no
        request's step waits for a capture. ``model`` is the engine's (its forward hands itself to :meth:`run_step`,
        which does the work). Once per cache; the first forward does it if this was not called."""
        if self.warm_up_s is not None:
            return
        self._warming = True
        try:
            with torch.no_grad():
                zeros = torch.zeros(1, 1, dtype=torch.long, device=self.device)
                model(input_ids=zeros, position_ids=zeros, past_key_values=self, logits_to_keep=1)
        finally:
            self._warming = False

    def _warm_up(self, logits_of) -> None:
        """:meth:`warm_up` with the model's forward: each bucket, largest first (the graphs' pool is sized by the
        first capture; the smaller ones fit in it), runs a :class:`~loopkv.cache.slots.DecodeStep` in which no row
        decodes: every cell reads and writes every row as in any decode step, but each row's token is zeros written
        at its next position, position 0 of a fresh cache's zeroed sink, no page leaves a window and every length is
        put back. So the storage is bitwise what it was, which is why it runs before the cache's first step."""
        if self.steps:
            raise RuntimeError(f"the LoopKV engine cache warms up before its first step; this one has run "
                               f"{len(self.steps)}")
        began = time.perf_counter()
        for width in reversed(buckets(self.max_slots)):
            self._step = _Step(prompts=[], decode=self._decode_steps.fill([], tokens=width), graphed=True)
            zeros = torch.zeros(1, width, dtype=torch.long, device=self.device)
            try:
                self.graphs.run(logits_of, zeros, zeros)
            finally:
                self._step = None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.warm_up_s = time.perf_counter() - began

    def uncodable_decodes(self) -> list[tuple[str, ValueError]]:
        """After a forward, once the engine has its tokens: each request whose decode token in that step gave a
        quantized cell K/V values the codec cannot store, with the error to fail it with (one host read of what the
        step recorded on the device; nothing if the step decoded nothing or the plan quantizes nothing)."""
        decoded, self._decoded = self._decoded, []
        if not decoded:
            return []
        if self._copied is not None:
            self._copied.synchronize()  # the step's end: the engine waits for it to read the step's tokens anyway
        bad = slots.uncodable_rows(self._largest_host, [slot for _, slot, _ in decoded])
        for slot in bad:
            self._scrub(slot)
        return [(rid, checks.uncodable_request_error(rid, f"its token at position {pos}", bad[slot]))
                for rid, slot, pos in decoded if slot in bad]

    def uncodable_prompts(self) -> list[tuple[str, ValueError]]:
        """After a forward, once the engine has counted its tokens: each request whose prompt in that step gave a
        quantized cell K/V values the codec cannot store, with the error to fail it with (found at the step's last
        cell, :meth:`_find_uncodable_prompts`). Its slot's exact parts are zeroed (:meth:`_scrub`)."""
        bad, self._bad_prompts = self._bad_prompts, []
        for _, slot, _ in bad:
            self._scrub(slot)
        return [(rid, checks.uncodable_request_error(rid, "its prompt", cells)) for rid, _, cells in bad]

    def _scrub(self, slot: int) -> None:
        """Zero the exact sink and window of ``slot`` in every cell: a non-finite value left there would reach the
        slot's next request, whose reads weigh the positions past its length by 0 (and 0 x NaN is NaN)."""
        for layer in self.cache.layers:
            st = layer.storage
            for t in (st.sink_k, st.sink_v, st.win_k, st.win_v):
                t[slot].zero_()

    def attend(self, cell: int, query: Tensor, k: Tensor, v: Tensor, *, scale: float) -> Tensor:
        """One cell of the packed batch: query [1, Hq, T, D], k, v [1, H, T, D] -> [1, T, Hq, D]. The batch's
        segments are those :meth:`schedule` recorded, prepared by :meth:`run_step`."""
        step = self._step
        if step is None:
            raise RuntimeError("the LoopKV engine cache got a forward that did not start through run_step: the "
                               "model must hand its forward to EngineCache.run_step (loopkv's Ouro does)")
        q, kk, vv = query[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1)  # [T, Hq|H, D]
        if step.prefill is not None:  # the new prompts' writes, all at once
            slots.prefill_step(self.cache, cell, step.prefill, kk, vv)
        if step.checked is not None and self.cache.layers[cell].storage.own_bits in (4, 2):
            kp, vp = kk.index_select(0, step.checked), vv.index_select(0, step.checked)
            self._uncodable.append((cell, (checks.uncodable(kp) | checks.uncodable(vp)).flatten(1).any(1)))
        written = []
        for _, start, n in step.prompts:  # each new prompt (written above): exact causal attention over itself
            seg = slice(start, start + n)
            written.append((seg, chunk_attention(q[seg].transpose(0, 1), kk[seg], vv[seg], scale=scale)))
        chunk = step.chunk
        if chunk is not None:  # the prompt in chunks: exact attention over its chunks so far (prompt_chunks.py)
            seg = slice(chunk.start, chunk.start + chunk.tokens)
            written.append((seg, self.scratch.attend(cell, q[seg].transpose(0, 1), kk[seg], vv[seg],
                                                     start=chunk.position, scale=scale)))
            if chunk.prefill is not None:  # its last chunk: the whole prompt written as a new prompt is
                slots.prefill_step(self.cache, cell, chunk.prefill, self.scratch.k[cell], self.scratch.v[cell])
        last = cell == len(self.cache.layers) - 1
        if last:
            self._find_uncodable_prompts(step)
        if step.decode is not None:
            out = slots.decode(self.cache, cell, step.decode, q, kk, vv, scale=scale)
            if last:
                slots.end_step(self.cache, step.decode)
        else:
            out = query.new_zeros(q.shape)
        for seg, o in written:
            out[seg] = o
        return out[None]

    def _find_uncodable_prompts(self, step: _Step) -> None:
        """At the step's last cell: the prompts that gave a quantized cell a token the codec cannot store (one read
        from the device per step with prompts), kept for :meth:`uncodable_prompts`: the engine fails those requests
        alone once it has counted the step's tokens, which frees their slots and pages."""
        flags, self._uncodable = self._uncodable, []
        if not flags:
            return
        read = torch.stack([f for _, f in flags]).cpu()  # [quantized cells, checked tokens: the prompts', in order]
        segments = step.prompt_segments
        ends = list(itertools.accumulate(n for *_, n in segments))
        bad = torch.stack([read[:, end - n:end].any(1) for (*_, n), end in zip(segments, ends, strict=True)])
        request = {slot: rid for rid, slot in self._slot.items()}
        for (slot, _, _), prompt_bad in zip(segments, bad.tolist(), strict=True):
            cells = [cell for (cell, _), f in zip(flags, prompt_bad, strict=True) if f]
            if cells:
                self._bad_prompts.append((request[slot], slot, cells))

    def _begin_step(self, tokens: int, *, logits: int) -> _Step:
        """Before the forward of ``tokens`` packed tokens, ``logits`` of them kept: the scheduled segments, checked
        against what each slot holds, their pages reserved, the new prompts' writes as a
        :class:`~loopkv.cache.slots.PrefillStep` and the decoding rows as a :class:`~loopkv.cache.slots.DecodeStep`
        (over ``bucket(tokens)`` packed tokens for a step :attr:`graphs` runs: every token decodes, every token's
        logits kept)."""
        scheduled, self._scheduled = self._scheduled, None
        if scheduled is None:
            raise RuntimeError("the LoopKV engine cache got a forward the engine did not schedule through "
                               "extend_read_and_write_indices")
        began = time.perf_counter()
        self._uncodable = []
        prompts, decoding, decoded, chunk, start = [], [], [], None, 0
        for request_id, pos, n in scheduled:
            slot = self._slot[request_id]
            if self._held[slot] != pos:
                raise RuntimeError(f"the engine writes slot {slot} from position {pos}, but the slot holds "
                                   f"{self._held[slot]} tokens: the engine's and the cache's requests disagree")
            total = self._prompt_tokens.get(request_id, pos + n)  # noted only for a prompt taken in chunks
            if self.chunk_owner == request_id or (pos == 0 and n < total):
                chunk = self._chunk(request_id, slot, start, pos, n, total)
            elif n == 1 and pos > 0:
                decoding.append((slot, start))
                decoded.append((request_id, slot, pos))
            elif pos == 0:  # a whole prompt, or all but the last token of one the engine splits to fork it
                prompts.append((slot, start, n))
            else:
                raise RuntimeError(f"the engine scheduled a chunk of {n} tokens after position {pos} of request "
                                   f"{request_id}, which is not a prompt being prefilled in chunks")
            if pos + n == total:  # the prompt's last segment: its later tokens decode
                self._prompt_tokens.pop(request_id, None)
            self.lives[request_id][-1].append((pos, n))
            start += n
        if start > tokens:
            raise RuntimeError(f"the engine scheduled {start} tokens but the forward has {tokens}")
        self.cache.reserve({self._slot[r]: pos + n for r, pos, n in scheduled})
        for request_id, pos, n in scheduled:
            self._held[self._slot[request_id]] = pos + n
        graphed = not prompts and chunk is None and len(decoding) == tokens == logits
        width = bucket(tokens) if graphed else tokens
        decode = self._decode_steps.fill(decoding, tokens=width) if decoding else None
        prefill = slots.PrefillStep.build(prompts, device=self.device) if prompts else None
        segments = prompts + ([(chunk.slot, chunk.start, chunk.tokens)] if chunk is not None else [])
        for slot, _, _ in segments:
            self.cache._pads[slot] = 0  # the engine's prompts are not padded
        checked = None
        if segments and self._quantized:  # the prompt tokens, checked codable once per step
            index = [t for _, start, n in segments for t in range(start, start + n)]
            checked = _to_device(index, self.device)
        self.steps.append((began, len(decoding), sum(n for *_, n in segments)))
        return _Step(prompts=prompts, decode=decode, prefill=prefill, chunk=chunk, prompt_segments=segments,
                     checked=checked, graphed=graphed, decoded=decoded)

    def _chunk(self, request_id: str, slot: int, start: int, pos: int, n: int, total: int) -> _Chunk:
        """A scheduled chunk of ``request_id``'s ``total``-token prompt: ``n`` tokens from position ``pos``, packed
        from token ``start`` (the scratch claimed at its first chunk; its last writes the prompt into ``slot``)."""
        if pos == 0:
            self.scratch.claim(request_id)
        elif self.scratch.owner != request_id:
            raise RuntimeError(f"request {request_id} continues a prompt in chunks it does not hold the scratch for")
        if pos + n > total:
            raise RuntimeError(f"the engine scheduled request {request_id}'s prompt to position {pos + n}, past its "
                               f"{total} tokens")
        last = pos + n == total
        prefill = slots.PrefillStep.build([(slot, 0, total)], device=self.device) if last else None
        return _Chunk(request_id=request_id, slot=slot, start=start, position=pos, tokens=n, prefill=prefill)


def _to_device(values: list[int], device) -> Tensor:
    """An int64 tensor of host values on ``device``, copied without waiting for the device (pinned on CUDA)."""
    host = torch.tensor(values, dtype=torch.long)
    if torch.device(device).type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


@dataclass(frozen=True)
class _Chunk:
    """The step's chunk of the prompt being prefilled in chunks: ``tokens`` tokens from ``position``, packed from
    token ``start``; ``prefill``: at its last chunk, the whole prompt's writes into ``slot`` (from the scratch)."""

    request_id: str
    slot: int
    start: int
    position: int
    tokens: int
    prefill: slots.PrefillStep | None


@dataclass(frozen=True)
class _Step:
    """A forward's segments: ``prompts`` (slot, first packed token, tokens) of each new prompt, their attention run per
    segment; ``chunk``: a chunk of the prompt prefilled in chunks; ``decode`` the decoding rows, run together (None if
    none decodes)."""

    prompts: list[tuple[int, int, int]]
    decode: slots.DecodeStep | None
    prefill: slots.PrefillStep | None = None  # the new prompts' writes (None if none starts)
    chunk: _Chunk | None = None  # the prompt in chunks' chunk, if the step has one
    prompt_segments: list[tuple[int, int, int]] = field(default_factory=list)  # prompts, then the chunk
    checked: Tensor | None = None  # the packed tokens of the prompts, checked codable (quantized plans)
    graphed: bool = False  # every token decodes a row: the step runs padded to its bucket (DecodeGraphs)
    decoded: list[tuple[str, int, int]] = field(default_factory=list)  # (request, slot, position) each


def blocks_for(tokens: int) -> int:
    """The engine's blocks for ``tokens`` tokens."""
    return math.ceil(tokens / PAGE)
