"""A quantized loopkv cell inside vLLM's batches: the step's host plan and the cell's write + read (docs/vllm.md).

Imports no vLLM: the backend (``loopkv/vllm/backend.py``) turns vLLM's per-step metadata into a :class:`Step` once
per step (:func:`plan_step`, on the host) and calls :func:`forward_cell` for each cell, so the served semantics are
tested on CPU without vLLM against ``LoopKVCache`` (``tests/vllm/test_cells.py``).

Where things live, per cell (``--block-size 32``: one vLLM block is one loopkv page):

* history pages: in the plan's one vLLM KV tensor, ``[num_blocks, block_bytes]`` bytes, where each storing cell's
  pool is a region of ``num_blocks`` pages (:func:`cell_region`, at ``loopkv.vllm.layout.pool_refs``) read as
  loopkv's seven pool fields laid out field after field (:func:`pool_views`); a request's block ``b >= 1`` holds its
  page ``b - 1`` (positions ``32 b .. 32 b + 31``) in every cell, its block 0 is unused (the sink's positions, kept
  exact); a ``share`` cell reads its source's region and writes none;
* the exact sink and window ring: :class:`CellExact`, ``slots`` rows allocated when the model is built, one row per
  running request (its *slot*, found from the request's first block id by :class:`SlotMap`), in every cell.

Served semantics, as ``LoopKVCache`` serves them (docs/design.md, "Serving"): a prompt on an empty slot is written
and attended exactly; a later chunk (chunked prefill) is the one-pass continuation
(``loopkv.cache.continuation.continue_rows``; a ``share`` cell takes at most ``WINDOW`` tokens so); a single token
(a decode token) is written and read with ``token_attention_`` over all slots (the decoding slots' tokens gathered in,
as ``loopkv.cache.slots.decode`` does), and the page it makes leave the window is quantized into its block by
``advance_`` in the cell that owns the pool, decided on the device.

CUDA graphs: a step of single tokens only (vLLM's uniform decode batch, padded to a graph's size) is a decode read and
nothing else, and its device inputs are views of :class:`StepState`'s buffers, rewritten in place each step: the same
kernels, shapes and addresses for every step of the same packed length, no host sync and no branch on the step's
data in the cell's forward.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from loopkv.cache.slots import DecodeSteps
from loopkv.cache.storage import CellStorage
from loopkv.format import (
    BITS,
    PAGE,
    POOL_FIELDS,
    RING,
    SINK,
    WINDOW,
    capacity,
    n_pages,
    page_bytes,
    pool_field_kind,
    pool_field_shapes,
    stored_pages,
)
from loopkv.ops import cache_ops, step_ops  # noqa: F401 (register torch.ops.loopkv.write_pages_, token_attention_, advance_)

_KINDS = {"float16": torch.float16, "uint8": torch.uint8}
OPTION_OF_BITS = {bits: option for option, bits in BITS.items()}  # 0: share


def cell_region(kv: Tensor, offset: int, size: int) -> Tensor:
    """The pool region of one cell in the plan's KV tensor ``kv`` (uint8 ``[num_blocks, block_bytes]``): ``[num_blocks,
    size]`` bytes starting at byte ``num_blocks * offset``, contiguous (``offset``, ``size``: the bytes per block
    before the pool and of the pool, ``loopkv.vllm.layout.PoolRef``)."""
    if kv.dtype != torch.uint8 or kv.dim() != 2 or not kv.is_contiguous():
        raise ValueError(f"the plan's vLLM KV tensor is contiguous uint8 [num_blocks, block_bytes], got {kv.dtype} "
                         f"{tuple(kv.shape)}")
    num_blocks, total = kv.shape
    if offset < 0 or size <= 0 or offset + size > total:
        raise ValueError(f"a pool of {size} bytes per block at offset {offset} does not fit the plan's block of "
                         f"{total} bytes: the KV tensor is not the one this plan declared")
    return kv.view(-1)[num_blocks * offset:num_blocks * (offset + size)].view(num_blocks, size)


def pool_views(kv: Tensor, bits: int, heads: int, head_dim: int, *, dtype: torch.dtype = torch.bfloat16
               ) -> tuple[Tensor, ...]:
    """vLLM's KV tensor of one cell (``[num_blocks, page_bytes(bits, heads, head_dim)]`` bytes) as loopkv's seven
    pool fields (``POOL_FIELDS`` order), each contiguous: field after field, block ``i`` of a field at its row ``i``.
    A field the pool does not use is an empty tensor. ``dtype``: the exact dtype (bits 16 only)."""
    if kv.dtype != torch.uint8 or kv.dim() != 2:
        raise ValueError(f"a loopkv cell's vLLM KV tensor is uint8 [num_blocks, page_bytes], got {kv.dtype} "
                         f"{tuple(kv.shape)}")
    num_blocks, size = kv.shape
    if size != page_bytes(bits, heads, head_dim, exact_bytes=torch.empty(0, dtype=dtype).element_size()):
        raise ValueError(f"the KV tensor's blocks have {size} bytes; a {bits}-bit page of {heads} heads x "
                         f"{head_dim} has {page_bytes(bits, heads, head_dim)}")
    flat = kv.view(-1)
    views, offset = [], 0
    for name, shape in pool_field_shapes(bits, num_blocks, heads, head_dim).items():
        kind = pool_field_kind(bits, name)
        t_dtype = dtype if kind == "exact" else _KINDS[kind]
        if shape == (0,):
            views.append(torch.empty(0, dtype=t_dtype, device=kv.device))
            continue
        nbytes = math.prod(shape) * torch.empty(0, dtype=t_dtype).element_size()
        views.append(flat[offset:offset + nbytes].view(t_dtype).view(shape))
        offset += nbytes
    assert offset == flat.numel()
    return tuple(views)


@dataclass(eq=False)
class CellExact:
    """One cell's exact sink and window ring for ``slots`` requests: [slots, H, SINK | RING, D], model dtype."""

    sink_k: Tensor
    sink_v: Tensor
    win_k: Tensor
    win_v: Tensor

    @classmethod
    def allocate(cls, slots: int, heads: int, head_dim: int, *, dtype: torch.dtype, device=None) -> CellExact:
        def z(n):
            return torch.zeros(slots, heads, n, head_dim, dtype=dtype, device=device)

        return cls(z(SINK), z(SINK), z(RING), z(RING))

    @staticmethod
    def nbytes(slots: int, heads: int, head_dim: int, *, dtype_bytes: int = 2) -> int:
        return 2 * slots * heads * (SINK + RING) * head_dim * dtype_bytes


class SlotMap:
    """Which slot of the exact buffers each running request uses, keyed by the request's first block id (unique
    among live requests while prefix caching is off, and fixed for a request's life), with the tokens each slot
    holds (host ints, the step's plan reads them instead of the device).

    A request whose chunk starts at position 0 takes a slot (its own again, or a free one, or the one least recently
    seen that this step does not use); one that continues must find its slot holding exactly the tokens before its
    chunk, else :meth:`assign` raises rather than serve from a wrong state (e.g. a request left unscheduled for so
    long that its slot went to another: more requests in flight than ``slots``)."""

    def __init__(self, slots: int):
        if slots < 1:
            raise ValueError(f"a SlotMap needs at least one slot, got {slots}")
        self.slots = slots
        self.held = [0] * slots
        self._of: dict[int, int] = {}  # first block id -> slot
        self._key = [None] * slots  # slot -> first block id
        self._seen = [-1] * slots
        self._step = 0

    def assign(self, first_blocks: list[int], starts: list[int], ends: list[int]) -> list[int]:
        """Slots of this step's requests (first block id, tokens held before the step, after it); updates the held
        counts."""
        self._step += 1
        live = set(first_blocks)
        if len(live) != len(first_blocks):
            raise RuntimeError(f"two requests of one step share a first block ({first_blocks}): loopkv's vLLM backend "
                               "needs prefix caching off (--no-enable-prefix-caching)")
        out = []
        for fb, start, end in zip(first_blocks, starts, ends, strict=True):
            slot = self._of.get(fb)
            if start == 0:
                if slot is None:
                    slot = self._take(live)
                    self._of[fb], self._key[slot] = slot, fb
            elif slot is None or self.held[slot] != start:
                raise RuntimeError(
                    f"a request continues at position {start}, but loopkv's exact sink and window for it "
                    f"{'are gone' if slot is None else f'hold {self.held[slot]} tokens'}: more requests were in "
                    f"flight than the {self.slots} exact slots (vLLM's max_num_seqs) or a step was skipped")
            self.held[slot] = end
            self._seen[slot] = self._step
            out.append(slot)
        return out

    def _take(self, live: set[int]) -> int:
        candidates = [s for s in range(self.slots) if self._key[s] is None or self._key[s] not in live]
        candidates = [s for s in candidates if self._seen[s] < self._step]
        if not candidates:
            raise RuntimeError(f"more requests in one step than loopkv's {self.slots} exact slots (max_num_seqs)")
        slot = min(candidates, key=lambda s: (self._key[s] is not None, self._seen[s]))
        if self._key[slot] is not None:
            del self._of[self._key[slot]]
            self._key[slot] = None
        self.held[slot] = 0
        return slot


@dataclass(frozen=True)
class Row:
    """One request of the step: its slot, tokens held before the step, and its tokens ``[begin, end)`` in the
    packed batch."""

    slot: int
    start: int
    begin: int
    end: int

    @property
    def decodes(self) -> bool:
        """One token, read and written by the step's decode read: a decode token, the last token of a chunked prompt,
        or a one-token prompt on an empty slot (at position 0 the decode read is the prompt's exact attention)."""
        return self.end - self.begin == 1


@dataclass(frozen=True)
class DecodeRead:
    """The device inputs of a step's decode read (:func:`forward_cell`), views of :class:`StepState`'s buffers: the
    same addresses every step, so a CUDA graph captured for one step reads the next step's.

    token, decoding: per slot the packed token it decodes and whether it does (``loopkv.cache.slots.DecodeStep``).
    row: per packed token (``tokens`` of them, padding included) the slot whose output it takes (0 for none).
    decodes: bool per packed token: whether it is a decode token.
    lengths: int32 per slot: the tokens held before its decode token (decoding slots), or :func:`idle_length` of
    those held after the step (others: ``token_attention_`` writes a zero token there, where the slot's next position
    goes, unread).
    held: int32 [1, slots]: the decoding slots' tokens before the step, ``capacity`` for the others, which
    ``advance_`` leaves alone; each storing cell's ``advance_`` counts in ``scratch`` (a copy) and quantizes the page
    a decode token completes (``loopkv.format.QUANTIZE_LENGTH``), deciding on the device.
    index: int64 [1] of 0: ``advance_``'s one cell and one pool.
    """

    token: Tensor
    decoding: Tensor
    row: Tensor
    decodes: Tensor
    lengths: Tensor
    held: Tensor
    scratch: Tensor
    index: Tensor


@dataclass(frozen=True)
class Step:
    """A step's plan, built on the host once and read by every cell.

    num_tokens: the packed tokens the cells are given (vLLM pads a batch to a CUDA graph's size: tokens past the
    requests' belong to none).
    prompts: rows that are not single tokens (a prompt on an empty slot, or a later chunk).
    dummy: token ranges ``[begin, end)`` of the requests of a vLLM dummy run (:func:`plan_step`) in a step with
    prompts, answered with zeros.
    decode: the decode read's inputs, or ``None`` in a step of prompts only.
    page_table: int32 [slots, pages] on the device: per slot its blocks ``1..`` (its pages).
    """

    num_tokens: int
    prompts: tuple[Row, ...]
    dummy: tuple[tuple[int, int], ...]
    decode: DecodeRead | None
    page_table: Tensor


def idle_length(held: int) -> int:
    """The length a slot that holds ``held`` tokens and decodes nothing is given in a step's decode read: the shortest
    whose position has the same sink or ring slot as position ``held`` (the slot's next position, which no read reaches
    before the slot writes it again), so the zero token ``token_attention_`` writes there lands unread, and the wasted
    read of a slot that waits or whose request has finished covers at most ``SINK + RING`` tokens, not its history."""
    return held if held < SINK + RING else SINK + (held - SINK) % RING


class StepState:
    """What the step plans of one engine keep from step to step: the slot map, and on the device, at fixed addresses,
    the slots' page table and the decode read's inputs (:class:`DecodeRead`), written in place by :func:`plan_step`
    for steps of at most ``max_tokens`` packed tokens, ``pages`` pages per slot."""

    def __init__(self, slots: int, pages: int, max_tokens: int, *, device):
        self.slot_map = SlotMap(slots)
        self.page_table = torch.zeros(slots, pages, dtype=torch.int32, device=device)
        # no per-cell record of the decode tokens' magnitudes (cells=0): forward_cell checks prompts as it writes
        # them; decode tokens in vLLM are not checked codable (docs/vllm.md)
        self.steps = DecodeSteps(rows=slots, max_tokens=max_tokens, device=device, cells=0)
        self.capacity = capacity(pages)
        self._stage = torch.zeros(2 * slots + max_tokens, dtype=torch.long, device=device)  # lengths, held, decodes
        self._lengths = torch.zeros(2, slots, dtype=torch.int32, device=device)
        self._decodes = torch.zeros(max_tokens, dtype=torch.bool, device=device)
        self._scratch = torch.zeros(1, slots, dtype=torch.int32, device=device)
        self._index = torch.zeros(1, dtype=torch.long, device=device)

    def fill(self, decoding: list[Row], lengths: list[int], tokens: int) -> DecodeRead:
        """The step's :class:`DecodeRead`: ``decoding`` its one-token rows, ``lengths`` per slot the tokens held
        after the step (a slot that does not decode is read at :func:`idle_length`), ``tokens`` the packed batch's
        length."""
        slots = self.slot_map.slots
        lengths, held, decodes = [idle_length(n) for n in lengths], [self.capacity] * slots, [0] * tokens
        for r in decoding:
            lengths[r.slot] = held[r.slot] = r.start
            decodes[r.begin] = 1
        steps = self.steps.fill([(r.slot, r.begin) for r in decoding], tokens=tokens)
        host = torch.tensor(lengths + held + decodes, dtype=torch.long)
        if self._stage.device.type == "cuda":  # pinned: the copy does not wait for the device
            host = host.pin_memory()
        self._stage[:host.numel()].copy_(host, non_blocking=True)
        self._lengths.copy_(self._stage[:2 * slots].view(2, slots))
        self._decodes[:tokens].copy_(self._stage[2 * slots:2 * slots + tokens])
        return DecodeRead(token=steps.token, decoding=steps.decoding, row=steps.row, decodes=self._decodes[:tokens],
                          lengths=self._lengths[0], held=self._lengths[1:], scratch=self._scratch, index=self._index)


def plan_step(state: StepState, *, query_start_loc: list[int], seq_lens: list[int], first_blocks: list[int],
              block_table: Tensor, num_tokens: int | None = None) -> Step:
    """The step's :class:`Step` from vLLM's per-request facts (host lists) and block table (device, [reqs, blocks]);
    ``num_tokens``: the packed tokens the cells are given (vLLM's ``num_actual_tokens``, padded to a CUDA graph's
    size), by default the requests'.

    The scheduled requests' rows of ``state.page_table`` are refreshed from ``block_table`` (block ``b >= 1`` is page
    ``b - 1``); a slot not scheduled keeps its row. A step of single tokens only (every decode step, and vLLM's
    capture of its graph) has a decode read and nothing else, whatever its requests: its device work has one shape
    for a given ``num_tokens``."""
    slot_map, page_table = state.slot_map, state.page_table
    reqs = len(seq_lens)
    qlen = [query_start_loc[i + 1] - query_start_loc[i] for i in range(reqs)]
    tokens = query_start_loc[reqs] if reqs else 0
    num_tokens = tokens if num_tokens is None else num_tokens
    if num_tokens < tokens:
        raise ValueError(f"a step of {tokens} tokens given as {num_tokens} packed tokens")
    # vLLM's dummy runs (warm-up, capture; model runner V2 builds attention for them) give requests whose block
    # table row is zeros (block 0 is vLLM's null block, never a request's) and padded requests of no tokens: such a
    # row gets no slot, writes nothing and reads nothing
    real = [i for i in range(reqs) if qlen[i] > 0 and first_blocks[i] != 0]
    starts = [seq_lens[i] - qlen[i] for i in real]
    slots = slot_map.assign([first_blocks[i] for i in real], starts, [seq_lens[i] for i in real])
    device = page_table.device
    pages = page_table.shape[1]
    if real:
        width = min(pages, block_table.shape[1] - 1)
        rows = torch.tensor(slots, dtype=torch.long, device=device)
        index = torch.tensor(real, dtype=torch.long, device=block_table.device)
        page_table[rows, :width] = block_table.index_select(0, index)[:, 1:1 + width].to(device=device,
                                                                                         dtype=torch.int32)
    all_rows = [Row(slot, start, query_start_loc[i], query_start_loc[i + 1])
                for i, slot, start in zip(real, slots, starts, strict=True)]
    decoding = [r for r in all_rows if r.decodes]
    prompts = tuple(r for r in all_rows if not r.decodes)
    dummy = ()
    if prompts:  # a step with prompts runs eagerly: its dummy requests' tokens are answered with zeros
        dummy = tuple((query_start_loc[i], query_start_loc[i + 1]) for i in sorted(set(range(reqs)) - set(real))
                      if qlen[i] > 0)
    decode = state.fill(decoding, slot_map.held, num_tokens) if decoding or not prompts else None
    return Step(num_tokens=num_tokens, prompts=prompts, dummy=dummy, decode=decode, page_table=page_table)


class _OneCell:
    """A layout of one cell (index 0) whose source is index 1 (itself when it stores its own pages)."""

    def __init__(self, shares: bool):
        self.shares = shares

    def cell(self, index: int) -> int:
        return index

    def source(self, cell: int) -> int:
        return 1 if self.shares else cell

    def flat_index(self, cell: int) -> int:
        return cell


class _ContinuationCache:
    """What ``continue_rows`` asks of a cache (``max_batch_size``, ``layout``, ``_rows``, ``_tau``) for one cell at
    index 0 and, for a ``share`` cell, its source at index 1."""

    def __init__(self, rows: CellStorage, tau: float, source: CellStorage | None = None):
        self.rows, self.source, self.tau, self.max_batch_size = rows, source, tau, rows.sink_k.shape[0]
        self.layout = _OneCell(source is not None)

    def _rows(self, layer_idx: int, batch: int) -> CellStorage:
        return self.source if layer_idx == 1 else self.rows

    def _tau(self, layer_idx: int, st) -> float:
        return self.tau


def _storage(cell: CellExact, pool: tuple[Tensor, ...], page_table: Tensor, *, own_bits: int, read_bits: int
             ) -> CellStorage:
    """One cell's slots as a ``CellStorage`` (its lengths a fresh tensor: ``continue_rows`` is given the held counts
    and only writes them)."""
    lengths = torch.zeros(cell.sink_k.shape[0], dtype=torch.int32, device=cell.sink_k.device)
    return CellStorage(option=OPTION_OF_BITS[own_bits], own_bits=own_bits, read_bits=read_bits, sink_k=cell.sink_k,
                       sink_v=cell.sink_v, win_k=cell.win_k, win_v=cell.win_v, lengths=lengths,
                       page_table=page_table, **dict(zip(POOL_FIELDS, pool, strict=True)))


def _exact_prompt(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
    """Exact causal attention over one prompt: q [Hq, S, D], k, v [H, S, D] -> [S, Hq, D]."""
    g = q.shape[0] // k.shape[0]
    if g > 1:
        k, v = k.repeat_interleave(g, dim=0), v.repeat_interleave(g, dim=0)
    out = torch.nn.functional.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True, scale=scale)
    return out[0].transpose(0, 1)


def _write_prompt(cell: CellExact, pool: tuple[Tensor, ...], page_table: Tensor, slot: int, k: Tensor, v: Tensor,
                  bits: int, stores: bool) -> None:
    """Write a prompt (k, v [H, n, D]) into empty ``slot``: sink, the pages stored at ``n`` tokens (a cell that
    ``stores`` its pool; a ``share`` cell's source writes them), the window (as ``LoopKVCache.prefill_cell`` does for
    one row)."""
    n = k.shape[1]
    ns = min(n, SINK)
    cell.sink_k[slot, :, :ns] = k[:, :ns]
    cell.sink_v[slot, :, :ns] = v[:, :ns]
    npg, nst = n_pages(n), stored_pages(n)
    if nst and stores:
        hist = slice(SINK, SINK + PAGE * nst)
        page_k = k[:, hist].unflatten(1, (nst, PAGE)).transpose(0, 1).contiguous()  # [nst, H, PAGE, D]
        page_v = v[:, hist].unflatten(1, (nst, PAGE)).transpose(0, 1).contiguous()
        torch.ops.loopkv.write_pages_(page_k, page_v, page_table[slot, :nst].long(), *pool, bits)
    first = SINK + PAGE * npg
    if n > first:
        ring = (torch.arange(first, n, device=k.device) - SINK) % RING
        cell.win_k[slot][:, ring] = k[:, first:]
        cell.win_v[slot][:, ring] = v[:, first:]


def forward_cell(cell: CellExact, pool: tuple[Tensor, ...], step: Step, query: Tensor, key: Tensor, value: Tensor,
                 output: Tensor, *, bits: int, tau: float, scale: float, name: str = "cell",
                 source: CellExact | None = None) -> Tensor:
    """Write the step's tokens into one cell and attend with the served semantics (module docstring).

    query [T, Hq, D], key, value [T, H, D] (vLLM's packed batch, ``T >= step.num_tokens``); writes ``output``
    [T, Hq, D] for the step's tokens and returns it. ``pool``: the pool the cell reads, of ``bits`` (16, 4, 2).
    ``source``: for a ``share`` cell, its source's exact slots (``pool`` is the source's; the cell writes no pages,
    and a chunk on a used slot may need pages the source has not written yet, encoded from its ring).
    ``name``: the cell's, for errors (vLLM's layer name)."""
    from loopkv.cache import checks
    from loopkv.cache.continuation import continue_rows, share_limit

    stores = source is None
    for begin, end in step.dummy:
        output[begin:end] = 0
    for row in step.prompts:
        q = query[row.begin:row.end].transpose(0, 1)  # [Hq, S, D]
        k = key[row.begin:row.end].transpose(0, 1)  # [H, S, D]
        v = value[row.begin:row.end].transpose(0, 1)
        if row.start == 0:
            if stores and bits in (4, 2) and (checks.uncodable(k) | checks.uncodable(v)).any():
                raise checks.uncodable_error([name])
            _write_prompt(cell, pool, step.page_table, row.slot, k, v, bits, stores)
            out = _exact_prompt(q, k, v, scale)
        else:
            if not stores and row.end - row.begin > share_limit(row.start, row.start):
                raise ValueError(
                    f"{name} is a share cell: a chunk on a request that already holds {row.start} tokens may add at "
                    f"most {share_limit(row.start, row.start)} tokens in one step (its source, a later loop, has not "
                    f"written their pages yet), and vLLM scheduled {row.end - row.begin}. Serve plans with share "
                    "cells with --no-enable-chunked-prefill, or --long-prefill-token-threshold at most "
                    f"{WINDOW}")
            rows = _storage(cell, pool, step.page_table, own_bits=bits if stores else 0, read_bits=bits)
            src = None if stores else _storage(source, pool, step.page_table, own_bits=bits, read_bits=bits)
            # the source (the final loop) runs after this cell: it holds what the row held before the step
            out = continue_rows(_ContinuationCache(rows, tau, src), 0, q[None], k[None], v[None], scale=scale,
                                rows=[row.slot], held=[row.start], source_held=None if stores else [row.start])[0]
        output[row.begin:row.end] = out.to(output.dtype)
    d = step.decode
    if d is not None:  # one read over every slot: the decoding slots' tokens gathered in, zeros for the others
        keep = d.decoding[:, None, None]
        q_all = torch.where(keep, query.index_select(0, d.token), 0)
        k_all = torch.where(keep, key.index_select(0, d.token), 0)[:, :, None]
        v_all = torch.where(keep, value.index_select(0, d.token), 0)[:, :, None]
        out = torch.ops.loopkv.token_attention_(
            q_all, k_all, v_all, cell.sink_k, cell.sink_v, cell.win_k, cell.win_v, d.lengths, step.page_table,
            *pool, bits, tau, scale)
        decoded = out.index_select(0, d.row).to(output.dtype)
        tokens = d.row.shape[0]
        mine = d.decodes[:, None, None]
        # a decode-only step (one shape per packed length: vLLM's CUDA graphs) answers its other tokens (padding,
        # dummy requests) with zeros; a step with prompts keeps their outputs
        output[:tokens] = torch.where(mine, decoded, output[:tokens] if step.prompts else 0)
        if stores:  # the page each decode token completes leaves the ring for its block, decided on the device
            d.scratch.copy_(d.held)
            slots = d.held.shape[1]
            torch.ops.loopkv.advance_(d.index, d.index, d.scratch, cell.win_k.view(1, -1), cell.win_v.view(1, -1),
                                      step.page_table.view(1, -1), *(f.view(1, -1) for f in pool), slots, slots,
                                      cell.win_k.shape[1], cell.win_k.shape[3], step.page_table.shape[1], bits)
    return output
