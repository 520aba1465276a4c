"""LoopKVCache: a transformers ``Cache`` with one paged, quantized layer per (loop, layer) cell.

``model.generate(ids, past_key_values=LoopKVCache(plan, config=model.config, max_batch_size=B,
max_cache_len=N))``. ``update()`` returns lightweight handles (:class:`LoopKVHandle`); the attention function
registered as ``"loopkv"`` (``loopkv/cache/attention.py``) reads and writes the cell. One decode path
(docs/design.md, "The decode step"):

* Decode (one token per row): each cell's read, ``torch.ops.loopkv.token_attention_``, also writes the cell's new
  token into its sink or window ring; after the step's last cell, one ``torch.ops.loopkv.advance_`` per kind of
  pool counts every cell's token and quantizes the pages that leave the window. Decided per row on the device: no
  host sync, so a compiled step is one CUDA graph.
* Prefill (several tokens on an empty cell): the attention function knows the padding (from the mask) and writes
  the cell (:meth:`LoopKVCache.prefill_cell`): sink and window exact, the pages in between quantized in bulk
  (``write_pages_``); attention over the prompt itself is exact.
* Several tokens on a non-empty cell (a later turn): one pass with the served semantics, each token reading what
  decoding it would have (``loopkv/cache/continuation.py``).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor
from transformers.cache_utils import Cache

from loopkv.cache import checks, last_loop, placement, window
from loopkv.cache import layer as cell_layer
from loopkv.cache.layer import LoopKVCell, LoopKVHandle
from loopkv.cache.paging import PagePool
from loopkv.cache.storage import OWN_FIELDS, POOL_FIELDS, CellStorage, allocate_cell, rows2d
from loopkv.cells import Cell
from loopkv.format import PAGE, RING, SINK, WINDOW, capacity, check_head_dim, max_pages, n_pages, stored_pages
from loopkv.ops import cache_ops, cell_attention, step_ops  # noqa: F401  (registers torch.ops.loopkv.*)


class LoopKVCache(Cache):
    """The paged bit-plane cache of a looped transformer; one :class:`LoopKVCell` per cell.

    Args:
        plan: a :class:`loopkv.Plan` (one option per cell, V precision ``tau``, one value or one per loop).
        config: the model config (Ouro: ``total_ut_steps``, ``num_hidden_layers``, heads, ``head_dim``; transformers'
            ``DoryConfig``); its family's layout (``loopkv/families.py``) gives the cache indices: planned cells,
            and fixed exact cells for layers outside the loop and sliding-window layers.
        max_batch_size: rows preallocated; a batch may be smaller.
        max_cache_len: tokens per row (prompt + generated).
        dtype: the model's activation dtype (exact sink/window/bf16 pages); default ``config.dtype`` or fp32.
        device: where the storage lives; default CUDA if available, else CPU. A model spread over devices
            (``device_map``): ``{layer: device}`` for each physical layer (``loopkv.layer_devices(model)``),
            and each cell lives with its layer (``loopkv/cache/placement.py``).
        pool_pages: ``None`` reserves every row's history pages for ``max_cache_len`` tokens; a number makes one
            pool of that many pages, handed to rows as they grow and taken back by :meth:`release` / ``reset()``
            (``loopkv/cache/paging.py``; ``paging.pool_pages_for`` sizes it from a memory budget). Eager only.
        loops: for a model whose loop count is chosen per call (Huginn's ``num_steps``), the count of the calls this
            cache serves, at most the plan's ``T``; ``None``: ``T``. The cache then holds ``plan.for_loops(loops)``
            (``self.plan``): the plan's first ``loops - 1`` loops, and its final loop's options in loop ``loops - 1``,
            whose pages the ``share`` cells read.

    The cells' tensors are slices of a few stacked buffers (:class:`~loopkv.cache.storage.CellStacks`), so a
    compiled step lifts a few tensors, not every cell's. A decode step must update and then read every cell once,
    in order, with the ``"loopkv"`` attention function (Ouro does, ``exit_at_step`` included): the read writes the
    token, and the last cell's read counts the step. Eagerly, cells driven one at a time are counted when next
    updated or looked at (:meth:`flush`).
    """

    attention_implementation = "loopkv"  # the name, in transformers' attention registry, of what reads the handles

    def __init__(self, plan, *, config, max_batch_size: int, max_cache_len: int,
                 dtype: torch.dtype | None = None, device: torch.device | str | Mapping | None = None,
                 pool_pages: int | None = None, loops: int | None = None):
        from loopkv.cache.attention import register
        from loopkv.planning.plan import Plan

        if not isinstance(plan, Plan):
            raise ValueError(f"plan must be a loopkv.Plan (e.g. loopkv.Plan.uniform(loops=..., layers=...) or "
                             f"Plan.from_json(path)), got {type(plan).__name__}")
        max_batch_size = checks.positive_int("max_batch_size", max_batch_size)
        max_cache_len = checks.positive_int("max_cache_len", max_cache_len)
        if pool_pages is not None:
            pool_pages = checks.positive_int("pool_pages", pool_pages)
        register()
        plan.validate_for(config)
        plan = checks.plan_for_loops(plan, loops)  # the loops a call runs (Plan.for_loops)
        self.layout = checks.model_layout(config, loops=plan.loops)  # planned cells and fixed slots, by cache index
        last_loop.check_plan(self.layout, plan)
        _, _, kv_heads, head_dim = checks.model_shape(config)
        if any(o != "bf16" for o in plan.options):
            check_head_dim(head_dim)
        dtype = checks.resolve_dtype(config, dtype)
        devices = placement.cell_devices(device, self.layout)
        device = devices[0]

        self.plan = plan
        self._max_batch_size = max_batch_size
        self._max_cache_len = max_cache_len
        self.dtype = dtype
        self.device = device
        self.kv_heads, self.head_dim = kv_heads, head_dim
        self.q_heads = config.num_attention_heads
        self.taus = tuple(float(t) for t in plan.taus)  # V precision threshold per loop (inf: off)

        # shapes first (meta), then each stacked buffer allocated once
        dims = dict(batch=max_batch_size, heads=kv_heads, head_dim=head_dim, max_cache_len=max_cache_len,
                    dtype=dtype, device="meta", pool_pages=pool_pages)
        storages: dict[Cell, CellStorage] = {}
        final = [c for c in self.layout if c.loop == self.layout.final_loop]
        for cell in final + [c for c in self.layout if c.loop != self.layout.final_loop]:
            option = plan.option(cell)
            source = storages.get(self.layout.source(cell)) if option == "share" else None
            storages[cell] = allocate_cell(option, source=source, **dims)
        # by cache index; a fixed slot (loopkv/families.py): a prelude/coda layer is an exact cell, a sliding layer a
        # ring of its window (loopkv/cache/window.py), kept outside the stacks
        windows = {s.index: min(self.layout.sliding_window, max_cache_len) for s in self.layout.fixed("window")}
        ordered = [storages[s.cell] if s.cell is not None else
                   window.allocate_window(batch=max_batch_size, heads=kv_heads, head_dim=head_dim,
                                          slots=windows[s.index], dtype=dtype, device="meta")
                   if s.index in windows else allocate_cell("bf16", source=None, **dims) for s in self.layout.slots]
        for d in dict.fromkeys(devices):
            checks.check_fits([st for st, dd in zip(ordered, devices, strict=True) if dd == d], d)
        self._devices = devices
        self._shards = placement.build_shards([None if i in windows else st for i, st in enumerate(ordered)], devices,
                                              trash=pool_pages)  # fields become views of stacks
        for i, slots in windows.items():
            ordered[i] = window.allocate_window(batch=max_batch_size, heads=kv_heads, head_dim=head_dim, slots=slots,
                                                dtype=dtype, device=devices[i])
        # a shared page pool (loopkv/cache/paging.py), or every row's pages reserved (None)
        self._pool = None if pool_pages is None else PagePool(pool_pages, max_batch_size, max_pages(max_cache_len))
        self._shard_of = {i: (shard, j) for shard in self._shards for j, i in enumerate(shard.cells)}
        cells = [LoopKVCell(st, max_cache_len=max_cache_len) for st in ordered]
        super().__init__(layers=cells)
        last_loop.attach(self)  # Dory's last_loop: what earlier loops read (loopkv/cache/last_loop.py)
        # eager bookkeeping (none while compiling: a compiled step reads every cell, the last one advances)
        self._unread: set[int] = set()  # cells updated whose "loopkv" read has not yet written the token
        self._read: set[int] = set()  # cells whose read wrote the step's token, not yet counted by advance_
        self._read_batch = 0
        self._uncodable: dict[int, Tensor] = {}  # eager decode: per quantized cell, whether its token is uncodable
        # left pads of each row's prompt: transformers counts positions as a dense cache holds them (pads included),
        # so the host-side length of a row is its tokens plus its pads (get_seq_length)
        self._pads = torch.zeros(max_batch_size, dtype=torch.int64)
        # Every tensor a step can mutate must be a static address, the empty placeholders included: one unmarked
        # input makes CUDA-graph trees skip the whole step.
        for t in (t for shard in self._shards for t in shard.tensors()):
            torch._dynamo.mark_static_address(t)
            torch._dynamo.mark_static(t)
        for layer in cells:  # the views too (a compiled step reads cell 0's lengths through get_seq_length)
            for t in layer.storage.own_tensors().values():
                torch._dynamo.mark_static_address(t)
                torch._dynamo.mark_static(t)
        if any(d.type == "cuda" for d in devices):
            from loopkv.ops.triton_register import register_triton_kernels

            register_triton_kernels()

    # transformers 5.17's Cache declares these as read-only properties; 5.23 removed them
    @property
    def max_batch_size(self) -> int:
        return self._max_batch_size

    @property
    def max_cache_len(self) -> int:
        return self._max_cache_len

    @property
    def is_compileable(self) -> bool:
        """Whether a compiled step can drive this cache (transformers' generate compiles its forward when True, on
        CUDA): not with a shared page pool, whose pages are handed out on the host between steps."""
        return self._pool is None and all(layer.is_compileable for layer in self.layers)

    @property
    def _is_user_defined(self) -> bool:
        return self.__dict__.get("_user_defined", False)

    @_is_user_defined.setter
    def _is_user_defined(self, value: bool) -> None:
        """transformers' ``generate`` sets this on a cache passed in, before its prefill: there a request longer than
        ``max_cache_len`` is refused, for every model (:func:`loopkv.models.generation_checks.check_from_generate`)."""
        from loopkv.models.generation_checks import check_from_generate

        self.__dict__["_user_defined"] = value
        if value:
            check_from_generate(self, sys._getframe(1))

    # ---- the transformers Cache API -------------------------------------------------------------
    def update(self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args: Any, **kwargs: Any):
        """Take the new K/V of cell ``layer_idx`` (``t * L + l``) and return ``(handle, handle)``.

        key_states, value_states: [B, H, S, D] (post-RoPE). The ``"loopkv"`` attention function writes them: a
        decode token (S == 1) inside the cell's read, a prompt (S > 1) knowing its padding.
        """
        B, H, S, D = key_states.shape
        if B > self.max_batch_size:
            raise ValueError(f"batch of {B} rows exceeds max_batch_size={self.max_batch_size} of this "
                             "LoopKVCache; build it with a larger max_batch_size")
        if (H, D) != (self.kv_heads, self.head_dim):
            raise ValueError(f"K/V of shape {tuple(key_states.shape)} do not match the cache's "
                             f"{self.kv_heads} KV heads x head_dim {self.head_dim}")
        home = self._devices[layer_idx]
        if key_states.dtype != self.dtype or not placement.same_device(key_states.device, home):
            raise ValueError(
                f"K/V of cell {layer_idx} are {key_states.dtype} on {key_states.device}, the cache was built for "
                f"{self.dtype} on {home}: pass dtype=/device= to LoopKVCache matching the model (a model spread "
                "over devices: device=loopkv.layer_devices(model))"
            )
        if S == 1 and not cell_layer._no_host_sync(self.device):
            if layer_idx in self._unread:
                raise RuntimeError(
                    f"cell {layer_idx} was updated again before the 'loopkv' attention function read its previous "
                    "token (that read writes the token into the cache). Run the attention after each update (the "
                    "model does); after an interrupted step call cache.reset()")
            if layer_idx in self._read:  # a new step for this cell: count the tokens read so far first
                self.flush()
            # one host check per step (the first cell updated; every cell holds as many tokens)
            if layer_idx == self.layout.first_index:
                lengths = self.layers[0].storage.lengths.cpu()
                if int(lengths[:B].max()) >= self.max_cache_len:
                    raise ValueError(f"a row already holds max_cache_len={self.max_cache_len} tokens; build the "
                                     "LoopKVCache with a larger max_cache_len")
                self._check_rows_beyond(lengths, B)
                if self._pool is not None:  # the pages this step stores
                    self.reserve({b: int(lengths[b]) + 1 for b in range(B)})
            self._unread.add(layer_idx)
        return (LoopKVHandle(self, layer_idx, key_states, value_states),) * 2

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Positions held, as transformers counts them for a dense cache: the padded prompt length + generated tokens
        (each row stores only its own tokens; its left pads are added back here). While compiling or capturing, the
        longest row's tokens as a 0-d tensor (no host sync; the decode step's masks do not depend on it)."""
        if not cell_layer._no_host_sync(self.device):
            self.flush()
            held = self.layers[layer_idx].storage.lengths.cpu().long()
            return int((held + self._pads).max()) if held.any() else 0
        if torch.compiler.is_compiling():
            # the lengths stack's slice, not the cell's view: a compiled step must not lift two inputs that share
            # memory. AOTAutograd merges such inputs into a "synthetic base", and its metadata then forgets which
            # inputs are static addresses, so CUDA-graph trees skip the step ("mutated inputs")
            if layer_idx not in self._shard_of:  # a sliding layer's window: its own tensor, no stack
                return self.layers[layer_idx].storage.lengths.max()
            shard, j = self._shard_of[layer_idx]
            return shard.stacks.own_slice("lengths", j).max()
        return self.layers[layer_idx].get_seq_length()

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return self.max_cache_len

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return self.max_cache_len

    def reset(self) -> None:
        """Forget every sequence, keeping the same tensors (and compiled graphs): lengths gate every read. A shared
        pool gets every page back."""
        if self._pool is not None:
            self._free_pages(range(self.max_batch_size))
        for layer in self.layers:
            layer.reset()
        self._unread.clear()
        self._read.clear()
        self._uncodable.clear()
        self._pads.zero_()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: gather rows exactly (codes, scales and exact parts; nothing is re-quantized). The batch becomes
        ``len(beam_idx)`` rows; rows after it are emptied, as a dense cache drops them."""
        if self._pool is not None:
            raise NotImplementedError(
                "reorder_cache (beam search) copies rows' pages, and rows of a shared page pool would then share "
                "pages they go on writing: use a LoopKVCache without pool_pages for beam search")
        self.flush()
        # Refused before anything moves: index_select's own errors ("index out of range in self", a size mismatch)
        # did not name the problem, a float index was truncated silently, and an index of a row outside the batch
        # (empty, or left over from a larger batch) was gathered silently where a dense cache raises.
        if not isinstance(beam_idx, Tensor) or beam_idx.dim() != 1 or beam_idx.dtype not in (
                torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8):
            raise ValueError(f"beam_idx must be a 1-D integer tensor of row indices, got {beam_idx!r}")
        if not 1 <= beam_idx.shape[0] <= self.max_batch_size:
            raise ValueError(f"beam_idx selects {beam_idx.shape[0]} rows; this LoopKVCache holds 1 to "
                             f"max_batch_size={self.max_batch_size}")
        held = self.layers[0].storage.lengths.cpu()  # an empty cache: any row (nothing moves)
        bad = [i for i in beam_idx.tolist() if not (0 <= i < self.max_batch_size and (held[i] > 0 or not held.any()))]
        if bad:
            raise ValueError(f"beam_idx {bad} are not rows of the batch this LoopKVCache holds (rows "
                             f"{held.nonzero().flatten().tolist()}): reorder only rows of that batch")
        B = beam_idx.shape[0]
        for layer in self.layers:
            st = layer.storage
            idx = beam_idx.to(st.lengths.device).long()
            for name, t in st.own_tensors().items():
                if name == "page_table":
                    continue
                if name in POOL_FIELDS:
                    if t.numel() == 0:
                        continue
                    per_row = st.page_table.shape[1]
                    rows = t.view(self.max_batch_size, per_row, *t.shape[1:])
                    rows[:B].copy_(rows.index_select(0, idx))
                else:
                    t[:B].copy_(t.index_select(0, idx))
        self._pads[:B] = self._pads.index_select(0, idx.cpu())
        for layer in self.layers:  # rows after the new batch are no longer part of it
            layer.storage.lengths[B:].zero_()
        self._pads[B:] = 0

    def crop(self, max_length: int) -> None:
        raise NotImplementedError(
            "LoopKVCache cannot crop: pages that left the window are quantized and cannot be restored. "
            "Assisted/speculative decoding is not supported; use cache.reset() and generate again."
        )

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("LoopKVCache has a fixed max_batch_size; expand the inputs before prefill")

    def batch_select_indices(self, indices: Tensor) -> None:
        raise NotImplementedError("LoopKVCache cannot shrink its batch; use reorder_cache or a new cache")

    # ---- reads and writes (called by the "loopkv" attention function) -----------------------------
    @property
    def _paged(self) -> CellStorage:
        """A stacked cell's storage: its page count and row capacity are every stacked cell's (a sliding layer's
        window has neither)."""
        return self.layers[self._shards[0].cells[0]].storage

    def sliding_window(self, layer_idx: int) -> int | None:
        """The window of cache index ``layer_idx`` if it is a sliding layer's, else ``None``."""
        return self.layout.sliding_window if self.layers[layer_idx].storage.option == window.OPTION else None

    def _rows(self, layer_idx: int, batch: int) -> CellStorage:
        """The cell's storage restricted to the first ``batch`` rows (the whole tensors when full).

        While Dynamo traces, built from the stacks with constant indices (not from the cell's view fields), so
        that a compiled step lifts the stacks, a few tensors, instead of every cell's views; the same memory.
        Eagerly, the cell's own views (no per-call slicing on the host)."""
        st = self.layers[layer_idx].storage
        if torch.compiler.is_compiling() and layer_idx in self._shard_of:  # (a window is no stack's)
            shard, i = self._shard_of[layer_idx]
            stacks = shard.stacks
            bits, j = stacks.pool_of[i]
            st = CellStorage(option=st.option, own_bits=st.own_bits, read_bits=st.read_bits,
                             **{n: stacks.own_slice(n, i) for n in OWN_FIELDS},
                             **{n: stacks.pool_slice(bits, n, j) for n in ("page_table", *POOL_FIELDS)})
        if batch == self.max_batch_size:
            return st
        pages = st.page_table.shape[1] * batch
        pool = {n: (t[:pages] if t.numel() else t) for n, t in zip(POOL_FIELDS, st.pool(), strict=True)}
        return CellStorage(option=st.option, own_bits=st.own_bits, read_bits=st.read_bits,
                           sink_k=st.sink_k[:batch], sink_v=st.sink_v[:batch], win_k=st.win_k[:batch],
                           win_v=st.win_v[:batch], lengths=st.lengths[:batch],
                           page_table=st.page_table[:batch], **pool)

    def _tau(self, layer_idx: int, st: CellStorage) -> float:
        """The V precision threshold cell ``layer_idx`` reads with: its loop's, for INT4 pages only."""
        return self.taus[self.layout.cell(layer_idx).loop] if st.read_bits == 4 else math.inf

    def read_cell(self, layer_idx: int, query: Tensor, *, scale: float) -> Tensor:
        """Attention of cell ``layer_idx`` over what it holds, writing nothing: query [B, Hq, D] -> [B, Hq, D]."""
        st = self._rows(layer_idx, query.shape[0])
        return torch.ops.loopkv.cell_attention(
            query, st.sink_k, st.sink_v, st.win_k, st.win_v, st.lengths, st.page_table, *st.pool(),
            st.read_bits, self._tau(layer_idx, st), scale,
        )

    def decode_cell(self, layer_idx: int, query: Tensor, k: Tensor, v: Tensor, *, scale: float) -> Tensor:
        """One decode token of cell ``layer_idx``: write k, v [B, H, 1, D] and read with query [B, Hq, D] in one op
        (``token_attention_``); the step's last cell counts the step (``advance_``)."""
        B = query.shape[0]
        st = self._rows(layer_idx, B)
        if st.option == window.OPTION:  # a sliding layer's ring: written, read and counted at once
            out = window.decode_(st, query, k, v, scale=scale)
        else:
            out = torch.ops.loopkv.token_attention_(
                query, k, v, st.sink_k, st.sink_v, st.win_k, st.win_v, st.lengths, st.page_table, *st.pool(),
                st.read_bits, self._tau(layer_idx, st), scale,
            )
        if torch.compiler.is_compiling():  # a compiled step reads every cell: the last read advances them all
            if self._pool is not None:
                raise NotImplementedError(
                    "a shared page pool (pool_pages) hands pages out on the host between steps, which a compiled "
                    "step cannot do: compile with a LoopKVCache without pool_pages")
            if layer_idx == self.layout.last_index:
                for shard in self._shards:
                    self._advance(shard, B, shard.stacks.own["lengths"], shard.groups)
            return out
        if self._read and B != self._read_batch:
            raise ValueError(f"cells of one decode step were read with {self._read_batch} and {B} rows")
        if st.own_bits in (4, 2):  # checked on the device; the step's count (flush) reads it once
            self._uncodable[layer_idx] = (checks.uncodable(k) | checks.uncodable(v)).any()
        self._unread.discard(layer_idx)
        self._read.add(layer_idx)
        self._read_batch = B
        if layer_idx == self.layout.last_index:  # the step's last cell has been read
            self.flush()
        return out

    def continue_cell(self, layer_idx: int, query: Tensor, k: Tensor, v: Tensor, *, scale: float) -> Tensor:
        """Several tokens on a non-empty cell in one pass, with the served semantics (each token reads what decoding
        it would have; ``loopkv/cache/continuation.py``). query [B, Hq, S, D], k, v [B, H, S, D] -> [B, S, Hq, D].
        Refused whole, before anything is written, if a row would pass ``max_cache_len`` (or, for a ``share`` cell,
        if the turn is longer than :meth:`continuation_limit`)."""
        from loopkv.cache.continuation import continue_rows

        if self.layout.reads_without_update:  # Dory's last_loop mode (loopkv/cache/last_loop.py)
            last_loop.refuse_later_turn()
        self.flush()
        B, S = k.shape[0], k.shape[2]
        held_by_row = self.layers[layer_idx].storage.lengths.cpu()
        self._check_rows_beyond(held_by_row, B)
        lengths = held_by_row[:B]
        if not lengths.all():
            empty = lengths.eq(0).nonzero().flatten().tolist()
            raise ValueError(
                f"rows {empty} of this {B}-row batch hold no tokens while the others hold a conversation: the batch "
                "does not match the one that filled the cache (e.g. num_return_sequences or a larger batch on a "
                "later turn). Continue with the same rows, or cache.reset() and send the whole conversation")
        held = int(lengths.max())
        if held + S > self.max_cache_len:
            raise ValueError(f"{S} more tokens on a row holding {held} exceed max_cache_len={self.max_cache_len}; "
                             "build the LoopKVCache with a larger max_cache_len")
        self.reserve({b: int(lengths[b]) + S for b in range(B)})
        self._unread.discard(layer_idx)
        st = self.layers[layer_idx].storage
        if st.option == window.OPTION:
            return window.extend(st, query, k, v, scale=scale, window=self.layout.sliding_window,
                                 held=lengths.tolist())
        return continue_rows(self, layer_idx, query, k, v, scale=scale)

    @property
    def continuation_limit(self) -> int | None:
        """The most new tokens one forward may append to a non-empty cache, or ``None`` for no limit: a plan with
        ``share`` cells takes at most ``WINDOW`` at a time (their pages come from the final loop, which runs after
        them; ``loopkv/cache/continuation.py``). loopkv's Ouro splits longer turns itself."""
        return WINDOW if "share" in self.plan.options else None

    @staticmethod
    def _check_rows_beyond(lengths: Tensor, batch: int) -> None:
        """Refuse a step of ``batch`` rows while rows past it still hold a conversation (they would be left behind
        silently; a dense cache raises on the batch mismatch)."""
        beyond = lengths[batch:].nonzero().flatten()
        if len(beyond):
            raise ValueError(
                f"this step has {batch} rows but rows {(beyond + batch).tolist()} of the cache still hold tokens: "
                "drop rows with cache.reorder_cache(indices) (which empties the rows it leaves out), or "
                "cache.reset() before a request with fewer rows")

    def flush(self) -> None:
        """Eagerly: count the tokens that reads have written since the last count (``advance_``).

        The last cell's read of a decode step does this; so does everything that looks at the cache from the host
        (``get_seq_length``, ``storage``, ``is_empty``, ``memory_report``, ``reorder_cache``) and an update of a cell
        already read in this step, so that a caller that drives cells one at a time sees each cell complete."""
        if not self._read:
            return
        cells = sorted(self._read)
        self._read.clear()
        if self._uncodable:
            flags = torch.stack(list(self._uncodable.values())).cpu()
            bad = [c for c, f in zip(self._uncodable, flags.tolist(), strict=True) if f]
            self._uncodable.clear()
            if bad:
                raise checks.uncodable_error(bad)
        for shard in self._shards:
            groups = shard.groups
            if len(cells) < len(self.layers):  # some cells only (a caller driving cells one at a time): their pairs
                keep = {j for j, i in enumerate(shard.cells) if i in cells}
                groups = []
                for bits, c, p in shard.groups:
                    pairs = [(i, j) for i, j in zip(c.tolist(), p.tolist(), strict=True) if i in keep]
                    if pairs:
                        groups.append((bits, *(torch.tensor(x, dtype=torch.int32, device=shard.device)
                                               for x in zip(*pairs, strict=True))))
            if groups:
                self._advance(shard, self._read_batch, shard.stacks.own["lengths"], groups)

    def _advance(self, shard: placement.Shard, batch: int, lengths: Tensor, groups: list) -> None:
        own = shard.stacks.own
        max_pages = self._paged.page_table.shape[1]
        for bits, cells, pools in groups:
            pool = shard.stacks.pools[bits] if bits else {}
            fields = [rows2d(pool.get(n, shard.no_pool)) for n in ("page_table", *POOL_FIELDS)]
            torch.ops.loopkv.advance_(cells, pools, lengths, rows2d(own["win_k"]), rows2d(own["win_v"]), *fields,
                                      batch, self.max_batch_size, self.kv_heads, self.head_dim, max_pages, bits,
                                      self._paged.capacity)

    def prefill_cell(self, layer_idx: int, k: Tensor, v: Tensor, pad: Tensor, *, rows: list[int] | None = None
                     ) -> None:
        """Write a left-padded prompt into an empty cell. k, v: [B, H, S, D]; pad: int [B] pads per row.
        ``rows``: the cache rows the B prompts go to (default ``0 .. B-1``; a serving engine's slots), each empty."""
        self.flush()
        B, H, S, D = k.shape
        st = self._rows(layer_idx, B if rows is None else self.max_batch_size)
        if st.option == window.OPTION:  # a sliding layer's ring (loopkv/cache/window.py)
            rows = list(range(B)) if rows is None else rows
            window.prefill(st, k, v, pad, rows)
            if layer_idx == 0:
                self._pads[rows] = pad.cpu().long()
            return
        rows = list(range(B)) if rows is None else rows
        if rows != list(range(B)) and st.lengths[rows].any():
            raise ValueError(f"rows {rows} of cell {layer_idx} must be empty for a prompt: cache.release(rows) first")
        pads = [int(p) for p in pad.tolist()]
        longest = S - min(pads)
        if longest > self.max_cache_len:
            raise ValueError(f"prompt of {longest} tokens exceeds max_cache_len={self.max_cache_len}")
        self.reserve({row: S - p for row, p in zip(rows, pads, strict=True)})
        if st.own_bits in (4, 2):
            real = torch.arange(S, device=k.device)[None, :] >= pad.to(k.device)[:, None]  # [B, S]
            if (real[:, None, :, None] & (checks.uncodable(k) | checks.uncodable(v))).any():
                raise checks.uncodable_error([layer_idx])
        maxp = st.page_table.shape[1]
        page_k, page_v, page_ids = [], [], []
        for i, (b, p) in enumerate(zip(rows, pads, strict=True)):
            n = S - p
            kb, vb = k[i, :, p:], v[i, :, p:]  # [H, n, D]
            ns = min(n, SINK)
            st.sink_k[b, :, :ns] = kb[:, :ns]
            st.sink_v[b, :, :ns] = vb[:, :ns]
            npg, nst = n_pages(n), stored_pages(n)  # read as history / already in the pool (loopkv.format)
            assert nst <= maxp
            assert n <= capacity(maxp)
            if nst and st.own_bits:
                hist = slice(SINK, SINK + PAGE * nst)
                page_k.append(kb[:, hist].unflatten(1, (nst, PAGE)).transpose(0, 1))  # [nst, H, PAGE, D]
                page_v.append(vb[:, hist].unflatten(1, (nst, PAGE)).transpose(0, 1))
                page_ids.append(st.page_table[b, :nst].long())
            start = SINK + PAGE * npg
            if n > start:
                slots = (torch.arange(start, n, device=k.device) - SINK) % RING
                st.win_k[b, :, slots] = kb[:, start:]
                st.win_v[b, :, slots] = vb[:, start:]
            st.lengths[b] = n
            if layer_idx == 0:
                self._pads[b] = p
        if page_ids:
            torch.ops.loopkv.write_pages_(torch.cat(page_k).contiguous(), torch.cat(page_v).contiguous(),
                                          torch.cat(page_ids), *st.pool(), st.own_bits)

    # ---- loopkv-specific -------------------------------------------------------------------------
    def warmup(self, *, q_heads: int | None = None) -> None:
        """JIT-compile (CUDA: Triton) every kernel this cache launches, before any CUDA-graph capture, so nothing
        compiles or allocates inside capture. A no-op on the CPU.

        Besides the kernels on dummy tensors (``triton_register.warmup``), every cell is read once at batch 1 and at
        ``max_batch_size`` with its own tensors and zero lengths, into scratch exact parts (nothing is written to
        the cache): the reader's launch config depends on the rows read and on the pools' sizes. Between the two
        ends, a batch can still need one more binary where Triton specializes the split count differently.
        """
        if not any(d.type == "cuda" for d in self._devices):
            return
        from loopkv.ops.triton_register import register_triton_kernels, warmup

        if not register_triton_kernels():
            return
        q_heads = q_heads or self.q_heads
        for shard in self._shards:
            if shard.device.type != "cuda":
                continue
            storages = [self.layers[i].storage for i in shard.cells]
            warmup(batch_size=self.max_batch_size, kv_heads=self.kv_heads, q_heads=q_heads,
                   head_dim=self.head_dim, max_pages=storages[0].page_table.shape[1], dtype=self.dtype,
                   read_bits=tuple(sorted({s.read_bits for s in storages})),
                   own_bits=tuple(sorted({s.own_bits for s in storages})), tau=min(self.taus), device=shard.device)
            for batch in sorted({1, self.max_batch_size}):
                query = torch.zeros(batch, q_heads, self.head_dim, dtype=self.dtype, device=shard.device)
                token = torch.zeros(batch, self.kv_heads, 1, self.head_dim, dtype=self.dtype, device=shard.device)
                st = self._rows(shard.cells[0], batch)
                scratch = [torch.zeros_like(t) for t in (st.sink_k, st.sink_v, st.win_k, st.win_v)]
                for idx in shard.cells:
                    st = self._rows(idx, batch)
                    torch.ops.loopkv.token_attention_(
                        query, token, token, *scratch, torch.zeros_like(st.lengths), st.page_table, *st.pool(),
                        st.read_bits, self._tau(idx, st), self.head_dim**-0.5,
                    )
                # on scratch lengths from 0: counts a token, encodes no page
                self._advance(shard, batch, torch.zeros_like(shard.stacks.own["lengths"]), shard.groups)
            torch.cuda.synchronize(shard.device)

    # ---- the shared page pool (loopkv/cache/paging.py) -------------------------------------------
    @property
    def pages_in_use(self) -> int:
        """Physical pages held by rows: of the shared pool, or every row's reserved pages without one."""
        if self._pool is None:
            return self.max_batch_size * self._paged.page_table.shape[1]
        return self._pool.in_use

    def release(self, rows) -> None:
        """Forget rows (a finished request): their lengths become 0 in every cell and a shared pool gets their pages
        back. The other rows are untouched."""
        self.flush()
        rows = [checks.row_index(r, self.max_batch_size) for r in rows]
        if self._pool is not None:
            self._free_pages(rows)
        for layer in self.layers:
            layer.storage.lengths[rows] = 0
        self._pads[rows] = 0

    def reserve(self, tokens: dict[int, int]) -> None:
        """Give each row the pages that holding ``tokens[row]`` tokens stores, before the writes (a shared pool only;
        the cache does this itself for prefill, later turns and eager decode steps); all or nothing (``PoolFull``)."""
        if self._pool is None:
            return
        entries = self._pool.ensure({b: stored_pages(n) for b, n in tokens.items()})
        if entries:
            rows, logical, physical = zip(*entries, strict=True)
            self._set_table(list(rows), list(logical), list(physical))

    def _free_pages(self, rows) -> None:
        for b in rows:
            pages = self._pool.release(b)
            if pages:
                n = len(pages)
                self._set_table([b] * n, list(range(n)), [self._pool.trash] * n)

    def _set_table(self, rows: list[int], logical: list[int], physical: list[int]) -> None:
        """Point (row, logical page) at ``physical`` in every own pool's page table (one stacked buffer per kind)."""
        for shard in self._shards:
            at = [torch.tensor(x, device=shard.device) for x in (rows, logical)]
            vals = torch.tensor(physical, dtype=torch.int32, device=shard.device)
            for fields in shard.stacks.pools.values():
                fields["page_table"][:, at[0], at[1]] = vals

    def storage(self, cell: Cell | int) -> CellStorage:
        """The cell's tensors (the tokens of a step in progress counted first: :meth:`flush`)."""
        if not cell_layer._no_host_sync(self.device):
            self.flush()
        idx = cell if isinstance(cell, int) else self.layout.flat_index(cell)
        return self.layers[idx].storage

    def is_empty(self, layer_idx: int) -> bool:
        self.flush()
        return int(self.layers[layer_idx].storage.lengths.max()) == 0

    def memory_report(self):
        """Bytes actually allocated, per component and per cell, and KiB per history token."""
        self.flush()
        from loopkv.cache.report import memory_report

        return memory_report(self)

    def __repr__(self) -> str:
        counts = {o: self.plan.options.count(o) for o in sorted(set(self.plan.options))}
        return (f"LoopKVCache(T={self.layout.loops}, L={self.layout.layers}, cells={counts}, "
                f"max_batch_size={self.max_batch_size}, max_cache_len={self.max_cache_len}, "
                f"dtype={self.dtype}, device={self.device})")
