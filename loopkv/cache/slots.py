"""Rows as request slots: what a continuous-batching engine needs from a LoopKVCache (docs/design.md, "Serving").

An engine's step mixes requests at different stages: some slots decode one token, some start a prompt, some add a
chunk of a longer prompt, the rest wait. Per cell, in the model's order:

* :func:`prefill` writes a new request's prompt into its empty slot (``LoopKVCache.prefill_cell`` with ``rows``);
  its attention over the prompt is exact, as in ``generate``. An engine writes all of a step's new prompts at once
  with :func:`prefill_step`: where each prompt token goes (sink slot, ring slot, history page) is a
  :class:`PrefillStep`, device index tensors built on the host once per step from the lengths the host knows, so a
  cell's writes are a few gathers and scatters and read nothing back;
* :func:`extend` adds several tokens to a slot that holds some (a prompt's next chunk), with the served semantics
  (``loopkv/cache/continuation.py``);
* :func:`decode` reads and writes one token for each decoding slot: one ``token_attention_`` over every row of the
  cache, the decoding slots' tokens gathered from the packed batch, the others given zeros; which rows decode, and
  which packed token each reads, is a :class:`DecodeStep`, device tensors built once per step (no host work per
  cell). A cell that stores INT4/INT2 pages also records, per row, the largest magnitude of the token's K and V
  (``DecodeStep.largest``, on the device): the engine reads it once per step, after the forward, to find a token the
  codec could not store (:func:`uncodable_rows`);

and after the step's last cell, :func:`end_step` counts the decoding slots' tokens in every cell (``advance_``) and
puts every other row's length back. A row's read and write touch only that row, and a waiting row's write lands
at its next position, which no read reaches before that row writes it again; so a step over all rows equals a step
over the decoding ones, with fixed shapes (the same kernels and, on CUDA, one graph for any mix). Pages for the
step's tokens come first: ``LoopKVCache.reserve({slot: tokens after the step})``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from loopkv.format import PAGE, RING, SINK, n_pages, stored_pages


def prefill(cache, cell: int, slot: int, k: Tensor, v: Tensor) -> None:
    """Write a prompt (k, v [H, n, D]) into empty ``slot`` of ``cell``."""
    cache.prefill_cell(cell, k[None], v[None], torch.zeros(1, dtype=torch.long), rows=[slot])


def extend(cache, cell: int, slot: int, held: int, query: Tensor, k: Tensor, v: Tensor, *, scale: float,
           check: bool = True) -> Tensor:
    """Several tokens (k, v [H, n, D], query [Hq, n, D]) after the ``held`` tokens ``slot`` holds in every cell
    before the step (the caller's count: reading it from the device would wait for it); returns [n, Hq, D].
    ``check=False``: the caller checks the tokens are codable itself (an engine, once per step)."""
    from loopkv.cache.continuation import continue_rows

    if k.shape[1] + held > cache.max_cache_len:
        raise ValueError(f"slot {slot} would pass max_cache_len={cache.max_cache_len}")
    return continue_rows(cache, cell, query[None], k[None], v[None], scale=scale, rows=[slot], held=[held],
                         source_held=[held], check=check)[0]


@dataclass(frozen=True)
class PrefillStep:
    """Where the tokens of a step's new prompts go, as device index tensors (``*_src``: the packed token; ``*_row``:
    the slot): sink slots, ring slots, history pages (``page_src`` holds each page's ``PAGE`` tokens in order) and
    each slot's length after the step. Every cell of a step writes the same places (a ``share`` cell no pages)."""

    sink_src: Tensor
    sink_row: Tensor
    sink_pos: Tensor
    win_src: Tensor
    win_row: Tensor
    win_slot: Tensor
    page_src: Tensor  # [pages * PAGE]
    page_row: Tensor  # [pages]
    page_logical: Tensor  # [pages]
    rows: Tensor
    lengths: Tensor

    @classmethod
    def build(cls, prompts: list[tuple[int, int, int]], *, device) -> PrefillStep:
        """``prompts``: (row, first packed token, tokens) of each new prompt of the step (each row empty before).
        The same placement as ``LoopKVCache.prefill_cell``: positions ``< SINK`` in the sink, the pages stored at
        ``n`` tokens (``stored_pages``) from position ``SINK`` on, the positions from ``SINK + PAGE * n_pages(n)``
        on in the ring."""
        parts: dict[str, list[int]] = {name: [] for name in cls.__dataclass_fields__}
        for row, start, n in prompts:
            ns = min(n, SINK)
            parts["sink_src"] += range(start, start + ns)
            parts["sink_row"] += [row] * ns
            parts["sink_pos"] += range(ns)
            nst = stored_pages(n)
            parts["page_src"] += range(start + SINK, start + SINK + PAGE * nst)
            parts["page_row"] += [row] * nst
            parts["page_logical"] += range(nst)
            first = SINK + PAGE * n_pages(n)
            parts["win_src"] += range(start + first, start + n)
            parts["win_row"] += [row] * max(0, n - first)
            parts["win_slot"] += [(p - SINK) % RING for p in range(first, n)]
            parts["rows"].append(row)
            parts["lengths"].append(n)
        host = torch.tensor([x for xs in parts.values() for x in xs], dtype=torch.long)
        if torch.device(device).type == "cuda":  # pinned: the copy does not wait for the device
            host = host.pin_memory()
        buf = host.to(device, non_blocking=True)
        fields, at = {}, 0
        for name, xs in parts.items():
            fields[name] = buf[at:at + len(xs)]
            at += len(xs)
        fields["lengths"] = fields["lengths"].to(torch.int32)  # as the cells' lengths, cast once per step
        return cls(**fields)


def prefill_step(cache, cell: int, step: PrefillStep, k: Tensor, v: Tensor) -> None:
    """Write every new prompt of ``step`` (k, v: the packed batch [T, H, D]) into ``cell``: the same tensors as
    ``LoopKVCache.prefill_cell`` per prompt, with a few gathers and scatters and no host read. The caller has
    reserved the pages, knows the rows were empty and checks that the tokens are codable."""
    st = cache._rows(cell, cache.max_batch_size)
    if step.sink_src.numel():
        st.sink_k[step.sink_row, :, step.sink_pos] = k.index_select(0, step.sink_src)
        st.sink_v[step.sink_row, :, step.sink_pos] = v.index_select(0, step.sink_src)
    if step.win_src.numel():
        st.win_k[step.win_row, :, step.win_slot] = k.index_select(0, step.win_src)
        st.win_v[step.win_row, :, step.win_slot] = v.index_select(0, step.win_src)
    pages = step.page_row.numel()
    if pages and st.own_bits:
        H, D = k.shape[1:]
        page_k = k.index_select(0, step.page_src).view(pages, PAGE, H, D).transpose(1, 2).contiguous()
        page_v = v.index_select(0, step.page_src).view(pages, PAGE, H, D).transpose(1, 2).contiguous()
        ids = st.page_table[step.page_row, step.page_logical].long()
        torch.ops.loopkv.write_pages_(page_k, page_v, ids, *st.pool(), st.own_bits)
    st.lengths[step.rows] = step.lengths


@dataclass(frozen=True)
class DecodeStep:
    """Which packed tokens of a step decode, as device tensors whose shapes depend only on the cache's rows and the
    step's packed tokens: written on the host once per step, one copy to the device, read by every cell."""

    token: Tensor  # int64 [rows]: the packed token each row decodes (0 for a row that does not decode)
    decoding: Tensor  # bool [rows]: the row decodes a token this step
    row: Tensor  # int64 [tokens]: the row whose output each packed token takes (0 for a token that does not decode)
    # float32 [cells, 2, rows]: the largest |K| (0) and |V| (1) of each row's token in each cell that stores INT4/INT2
    # pages, NaN if one is NaN (0 for a row that does not decode; other cells' stay 0): written by decode, every step
    largest: Tensor


class DecodeSteps:
    """The device tensors of every :class:`DecodeStep` of an engine, allocated once: each step's are written in place,
    so they keep their addresses from step to step (what a captured CUDA graph of a decode step reads)."""

    def __init__(self, *, rows: int, max_tokens: int, device, cells: int):
        self.rows, self.max_tokens, self.device = rows, max_tokens, torch.device(device)
        self._buf = torch.zeros(2 * rows + max_tokens, dtype=torch.long, device=device)  # token, decoding, row
        self._decoding = torch.zeros(rows, dtype=torch.bool, device=device)
        self.largest = torch.zeros(cells, 2, rows, dtype=torch.float32, device=device)

    def fill(self, pairs: list[tuple[int, int]], *, tokens: int) -> DecodeStep:
        """This step's :class:`DecodeStep`: ``pairs`` (row, packed token) of each decoding row, ``tokens`` the packed
        batch's length (at most ``max_tokens``); its ``row`` is a view of the first ``tokens`` entries."""
        rows = self.rows
        if tokens > self.max_tokens:
            raise ValueError(f"a step of {tokens} packed tokens, but these decode steps hold at most {self.max_tokens}")
        token, decoding, row = [0] * rows, [0] * rows, [0] * tokens
        for r, t in pairs:
            token[r], decoding[r], row[t] = t, 1, r
        host = torch.tensor(token + decoding + row, dtype=torch.long)
        if self.device.type == "cuda":  # pinned: the copy does not wait for the device
            host = host.pin_memory()
        self._buf[:host.numel()].copy_(host, non_blocking=True)
        self._decoding.copy_(self._buf[rows:2 * rows])
        return DecodeStep(token=self._buf[:rows], decoding=self._decoding, row=self._buf[2 * rows:2 * rows + tokens],
                          largest=self.largest)


def decode(cache, cell: int, step: DecodeStep, query: Tensor, k: Tensor, v: Tensor, *, scale: float) -> Tensor:
    """One token for each decoding row of ``step``, read from a packed batch (query [T, Hq, D], k, v [T, H, D]);
    returns [T, Hq, D]: each decoding token's attention (rows for the other tokens: another token's, unused)."""
    rows = cache.max_batch_size
    st = cache._rows(cell, rows)
    keep = step.decoding[:, None, None]
    q_all = torch.where(keep, query.index_select(0, step.token), 0)
    kv_all = torch.where(keep, torch.stack((k.index_select(0, step.token), v.index_select(0, step.token))), 0)
    if st.own_bits in (4, 2):  # what the codec will be given when the token's page leaves the window
        torch.linalg.vector_norm(kv_all, ord=math.inf, dim=(2, 3), dtype=torch.float32, out=step.largest[cell])
    k_all, v_all = kv_all[:, :, :, None]  # kv_all [2, rows, H, D] -> [rows, H, 1, D] each
    out = torch.ops.loopkv.token_attention_(
        q_all, k_all, v_all, st.sink_k, st.sink_v, st.win_k, st.win_v, st.lengths, st.page_table, *st.pool(),
        st.read_bits, cache._tau(cell, st), scale,
    )
    return out.index_select(0, step.row)


def uncodable_rows(largest: Tensor, rows: list[int]) -> dict[int, list[int]]:
    """Of ``rows`` (rows that decoded), those whose token the codec cannot store in some cell, with those cells (a
    value NaN or beyond fp16's range: ``loopkv.cache.checks.uncodable``). ``largest``: a copy of a step's
    :attr:`DecodeStep.largest` in host memory (a device tensor is refused: this never waits for a device)."""
    from loopkv.cache import checks

    if largest.device.type != "cpu":
        raise ValueError(f"uncodable_rows reads a host copy of the step's record, not a {largest.device} tensor")
    bad = checks.uncodable(largest).any(1).numpy()  # [cells, rows], read as host memory
    return {r: [int(c) for c in bad[:, r].nonzero()[0]] for r in rows if bad[:, r].any()}


def end_step(cache, step: DecodeStep) -> None:
    """After the step's last cell: count the token of each decoding row of ``step`` in every cell; every other row
    keeps its length (its pages and positions are untouched: see the module docstring)."""
    rows = cache.max_batch_size
    for shard in cache._shards:
        decoding = step.decoding.to(shard.device)
        lengths = shard.stacks.own["lengths"]
        before = lengths[:, :rows].clone()
        cache._advance(shard, rows, lengths, shard.groups)
        lengths[:, :rows] = torch.where(decoding, lengths[:, :rows], before)
