"""Several new tokens on a non-empty cell in one pass, with the served semantics (docs/design.md, "The decode step").

A continuation of ``S`` tokens on a row holding ``h`` gives each of them what decoding it alone would have given:
token ``i`` (position ``h + i``, so the row holds ``n = h + i + 1`` tokens when it reads) attends to the sink, to
history pages ``[0, n_pages(n))`` dequantized (V precision included) and to every later position up to itself exactly
(the window, and the continuation's own earlier tokens). The cell ends in the state ``S`` decode steps would leave:
the same sink, window ring, lengths and page codes (pages are encoded from the same exact tokens by the same codec).

Writes first: the sink slots, the pages the continuation completes (encoded in bulk with ``write_pages_``), the
ring and the lengths. Then one ``torch.ops.loopkv.chunk_attention`` call per row reads the whole chunk
(``loopkv/ops/chunk_attention.py``): it takes the row's sink and page table, the pool a decode of the cell reads (a
``share`` cell: its source's) and the *exact tail* (positions ``[ws, h + S)``: the ring before the continuation, then
the new tokens past the sink), and gives each query what its decode read gives. Its reference (the CPU kernel) reads
each query as a virtual row of the decode op ``cell_attention``, so on the CPU a continuation equals decoding it token
by token bit for bit; its Triton kernel (CUDA) reads each page once per block of queries.

A ``share`` cell reads its source's pages, and its source (the final loop) runs after it in the same forward. The
pages such a cell needs that are not yet in the pool are encoded here from the source's window ring, which holds
them exact until its own continuation writes them (the same codes). Pages made of *this* continuation's tokens do
not exist yet when the share cell reads, so a share cell takes at most :func:`share_limit` tokens at a time (at least
``WINDOW``); longer turns are split by the model (loopkv's Ouro does) or refused with that fix.
"""

from __future__ import annotations

import torch
from torch import Tensor

from loopkv.format import PAGE, RING, SINK, n_pages, stored_pages
from loopkv.ops.chunk_attention import window_start  # (and registers torch.ops.loopkv.chunk_attention)


def share_limit(held: int, source_held: int) -> int:
    """The most tokens a ``share`` cell whose rows hold ``held`` (its source ``source_held``) can continue by in one
    pass: every page its queries read must be made of tokens its source already holds. At least ``WINDOW``."""
    whole = max(stored_pages(source_held), max(0, (source_held - SINK) // PAGE))  # pages the source can provide
    s = 0
    while n_pages(held + s + 1) <= whole:
        s += 1
    return s


def continue_rows(cache, layer_idx: int, query: Tensor, k: Tensor, v: Tensor, *, scale: float,
                  rows: list[int] | None = None, held: list[int] | None = None,
                  source_held: list[int] | None = None, check: bool = True) -> Tensor:
    """Write ``k, v`` [B, H, S, D] after what rows ``rows`` (default ``0 .. B-1``) of cell ``layer_idx`` hold and
    attend ``query`` [B, Hq, S, D] with the served semantics; returns [B, S, Hq, D]. The caller has checked the rows
    and the capacity and reserved the pages.

    ``held`` (and, for a ``share`` cell, ``source_held``): the tokens each row (its source's row) holds, where the
    caller knows them on the host; otherwise they are read from the device (a wait per row on a GPU). ``check=False``:
    the caller checks that the new tokens are codable itself (a serving engine, once per step: a token found uncodable
    after it was written fails the step, and the engine frees its requests)."""
    B, H, S, D = k.shape
    rows = list(range(B)) if rows is None else rows
    st = cache._rows(layer_idx, cache.max_batch_size)
    held = [int(st.lengths[r]) for r in rows] if held is None else list(held)
    bits = st.read_bits
    source = None
    if st.own_bits == 0 and bits:
        source = cache._rows(cache.layout.flat_index(cache.layout.source(cache.layout.cell(layer_idx))),
                             cache.max_batch_size)
        if source_held is None:
            source_held = [int(source.lengths[r]) for r in rows]
        limits = [share_limit(h, sh) for h, sh in zip(held, source_held, strict=True)]
        if S > min(limits):
            raise ValueError(
                f"cell {layer_idx} shares its source's pages and can take {min(limits)} new tokens in one forward "
                f"here, not {S}: the pages its tokens would read do not exist until its source (the final loop) has "
                f"run on them. Feed the turn in pieces of at most {min(limits)} tokens (loopkv's Ouro does this "
                "itself), or use a plan without 'share' cells")
    if check and st.own_bits in (4, 2):
        from loopkv.cache import checks

        if (checks.uncodable(k) | checks.uncodable(v)).any():
            raise checks.uncodable_error([layer_idx])

    outs = []
    for i, b in enumerate(rows):
        h, end = held[i], held[i] + S
        ws = window_start(h)  # first window position before the continuation
        exact_k, exact_v = _exact_tail(st, b, h, ws, k[i], v[i])  # positions [ws, end), [H, end - ws, D]
        for pos in range(h, min(end, SINK)):
            st.sink_k[b, :, pos] = k[i, :, pos - h]
            st.sink_v[b, :, pos] = v[i, :, pos - h]
        if st.own_bits:
            _write_pages(st, b, range(stored_pages(h), stored_pages(end)), ws, exact_k, exact_v, st.own_bits)
        elif source is not None:
            sh = source_held[i]
            src_ws = window_start(sh)
            src_k, src_v = _exact_tail(source, b, sh, src_ws, k[i, :, :0], v[i, :, :0])
            _write_pages(source, b, range(stored_pages(sh), n_pages(end)), src_ws, src_k, src_v, bits)
        first = max(h, SINK, end - RING)  # earlier positions' slots are overwritten within the continuation
        if end > first:
            slots = (torch.arange(first, end, device=k.device) - SINK) % RING
            st.win_k[b, :, slots] = k[i, :, first - h:]
            st.win_v[b, :, slots] = v[i, :, first - h:]
        st.lengths[b] = end
        outs.append(torch.ops.loopkv.chunk_attention(
            query[i].transpose(0, 1), st.sink_k[b], st.sink_v[b], exact_k, exact_v, h, st.win_k.shape[2],
            st.page_table[b], *st.pool(), bits, cache._tau(layer_idx, st), scale))
    return torch.stack(outs)


def _exact_tail(st, b: int, h: int, ws: int, k_new: Tensor, v_new: Tensor) -> tuple[Tensor, Tensor]:
    """The exact tokens of positions ``[ws, h + S)``, in the cache's dtype (as the ring stores them): the ring's
    ``[ws, h)`` then the new ones past the sink."""
    old = (torch.arange(ws, h, device=k_new.device) - SINK) % RING if h > ws else None
    skip = max(0, SINK - h)  # new tokens that land in the sink are not part of the tail
    parts_k = [k_new[:, skip:].to(st.win_k.dtype)]
    parts_v = [v_new[:, skip:].to(st.win_v.dtype)]
    if old is not None:
        parts_k.insert(0, st.win_k[b][:, old])
        parts_v.insert(0, st.win_v[b][:, old])
    return torch.cat(parts_k, dim=1), torch.cat(parts_v, dim=1)


def _write_pages(st, b: int, pages: range, ws: int, exact_k: Tensor, exact_v: Tensor, bits: int) -> None:
    """Encode history pages ``pages`` of row ``b`` from the exact tail (which starts at position ``ws``)."""
    if not len(pages):
        return
    start = SINK + PAGE * pages.start - ws
    n = len(pages)
    page_k = exact_k[:, start:start + PAGE * n].unflatten(1, (n, PAGE)).transpose(0, 1)  # [n, H, PAGE, D]
    page_v = exact_v[:, start:start + PAGE * n].unflatten(1, (n, PAGE)).transpose(0, 1)
    ids = st.page_table[b, pages.start:pages.stop].long()
    torch.ops.loopkv.write_pages_(page_k.contiguous(), page_v.contiguous(), ids, *st.pool(), bits)
