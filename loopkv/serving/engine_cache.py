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
* **the model** calls :meth:`update` per cell, as with any transformers cache, and the ``"loopkv"`` attention function
  hands the packed batch to :meth:`attend`, which splits it into segments (a new prompt, a prompt's next chunk, a
  decode token) and runs them through ``loopkv/cache/slots.py``.

A finished, cancelled or preempted request's slot and pages are freed by ``free_blocks``; a preempted request comes
back under the same id as a new prompt (its generated tokens appended) and is prefilled again.
"""

from __future__ import annotations

import logging
import math
from collections import OrderedDict

import torch
from torch import Tensor

from loopkv.cache import slots
from loopkv.cache.attention import _prompt_attention
from loopkv.cache.layer import LoopKVHandle
from loopkv.cache.loop_cache import LoopKVCache
from loopkv.format import PAGE

logger = logging.getLogger(__name__)
LIVES_KEPT = 1024  # requests whose steps EngineCache.lives keeps


class EngineHandle(LoopKVHandle):
    """What :meth:`EngineCache.update` returns: the ``"loopkv"`` attention function gives it to :meth:`attend`."""

    __slots__ = ()
    is_packed_batch = True


class EngineCache:
    """A continuous-batching engine's cache over a LoopKVCache (module docstring).

    plan, config: the LoopKV plan and the model's config; max_slots: requests in flight at once; max_len: tokens per
    request (prompt + generated); pool_pages: the shared pool (the engine's ``num_blocks``); max_batch_tokens: the
    engine's tokens per step; dtype, device: the model's.
    """

    attention_implementation = "loopkv"
    builds_no_mask = True  # the engine's packed batch carries its segments; the model builds no dense mask

    def __init__(self, plan, *, config, max_slots: int, max_len: int, pool_pages: int, max_batch_tokens: int,
                 dtype: torch.dtype, device):
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
        self._step: list[tuple[int, int, int, int]] = []  # the segments of the forward in progress
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
        """The request is finished, cancelled or preempted: its slot's tokens and pages go back."""
        self._blocks.pop(request_id, None)
        slot = self._slot.pop(request_id, None)
        if slot is not None:
            self.cache.release([slot])
            self._free_slots.append(slot)
            self._free_slots.sort()

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

    # ---- the model's side -------------------------------------------------------------------------
    def update(self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args, **kwargs):
        """Cell ``layer_idx``'s K/V of the packed batch ([1, H, T, D]), to be written by :meth:`attend`."""
        return (EngineHandle(self, layer_idx, key_states, value_states),) * 2

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # positions come from the engine's position_ids

    def attend(self, cell: int, query: Tensor, k: Tensor, v: Tensor, *, scale: float, write_index,
               cu_seq_lens_q: Tensor) -> Tensor:
        """One cell of the packed batch: query [1, Hq, T, D], k, v [1, H, T, D] -> [1, T, Hq, D]."""
        if cell == 0:  # the forward's first cell: the batch's segments, checked, and the pages its tokens store
            w = write_index[0] if isinstance(write_index, (list, tuple)) else write_index
            self._step = self._segments(w, cu_seq_lens_q)
            self.cache.reserve({slot: pos + n for slot, pos, _, n in self._step})
            owner = {slot: request_id for request_id, slot in self._slot.items()}
            for slot, pos, _, n in self._step:
                self.lives[owner[slot]][-1].append((pos, n))
        segments = self._step
        q, kk, vv = query[0], k[0], v[0]  # [Hq, T, D], [H, T, D]
        out = query.new_zeros(q.shape[1], q.shape[0], q.shape[2])  # [T, Hq, D]
        decoding = []
        for slot, pos, start, n in segments:
            seg = slice(start, start + n)
            if pos == 0:  # a new prompt
                slots.prefill(self.cache, cell, slot, kk[:, seg], vv[:, seg])
                zero = torch.zeros(1, dtype=torch.long, device=q.device)
                out[seg] = _prompt_attention(q[None, :, seg], kk[None, :, seg], vv[None, :, seg], zero, scale)[0]
            elif n > 1:  # a prompt's next chunk
                out[seg] = slots.extend(self.cache, cell, slot, q[:, seg], kk[:, seg], vv[:, seg], scale=scale)
            else:
                decoding.append((slot, start))
        if decoding:
            rows = torch.tensor([s for s, _ in decoding], device=q.device)
            at = torch.tensor([t for _, t in decoding], device=q.device)
            out[at] = slots.decode(self.cache, cell, rows, q[:, at].transpose(0, 1), kk[:, at].transpose(0, 1),
                                   vv[:, at].transpose(0, 1), scale=scale)
        if cell == len(self.cache.layers) - 1 and decoding:
            slots.end_step(self.cache, rows)
        return out[None]

    def _segments(self, write_index: Tensor, cu_seq_lens_q: Tensor) -> list[tuple[int, int, int, int]]:
        """(slot, first position, first packed token, tokens) of each request in the batch; padding dropped. The
        position must be what the slot holds (the engine and the cache agree on every request's length)."""
        starts = cu_seq_lens_q.tolist()
        first = write_index[torch.tensor(starts[:-1], device=write_index.device).clamp_max(len(write_index) - 1)]
        held = self.cache.layers[0].storage.lengths.tolist()
        out = []
        for (a, b), w in zip(zip(starts[:-1], starts[1:], strict=True), first.tolist(), strict=True):
            if b <= a or w >= self.write_trash_index:
                continue
            slot, pos = divmod(w, self.max_len)
            if held[slot] != pos:
                raise RuntimeError(f"the engine writes slot {slot} from position {pos}, but the slot holds "
                                   f"{held[slot]} tokens: the engine's and the cache's requests disagree")
            out.append((slot, pos, a, b - a))
        return out


def blocks_for(tokens: int) -> int:
    """The engine's blocks for ``tokens`` tokens."""
    return math.ceil(tokens / PAGE)
