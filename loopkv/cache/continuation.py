"""Several new tokens on a non-empty cell in one pass, with the served semantics (docs/design.md, "Continuations").

A continuation of ``S`` tokens on a row holding ``h`` gives each of them what decoding it alone would have given:
token ``i`` (position ``h + i``, so the row holds ``n = h + i + 1`` tokens when it reads) attends to the sink, to
history pages ``[0, n_pages(n))`` dequantized (V precision included: the cold rule of ``cell_attention`` with the
query's own scores), and to every later position up to itself exactly (the window, and the continuation's own
earlier tokens). The cell ends in the state ``S`` decode steps would leave: the same sink, window ring, lengths and
page codes (pages are encoded from the same exact tokens by the same codec).

Writes first: the sink slots, the pages the continuation completes (encoded in bulk with ``write_pages_``), the
ring and the lengths; then one dense read per row and block of queries, where each key is scored both as stored
exact and as dequantized and each query takes the form its position would have had. The cost is a prefill's, not
``S`` decode steps'.

A ``share`` cell reads its source's pages, and its source (the final loop) runs after it in the same forward. The
pages such a cell needs that are not yet in the pool are encoded here from the source's window ring, which holds
them exact until its own continuation writes them (the same codes). Pages made of *this* continuation's tokens do
not exist yet when the share cell reads, so a share cell takes at most :func:`share_limit` tokens at a time (at least
``WINDOW``); longer turns are split by the model (loopkv's Ouro does) or refused with that fix.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from loopkv.format import PAGE, RING, SINK, cold_threshold, n_pages, stored_pages
from loopkv.ops import codec

_BLOCK_ELEMENTS = 1 << 24  # scores held at once per block of queries (heads x queries x keys)


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
        ws = SINK + PAGE * n_pages(h)  # first window position before the continuation
        exact_k, exact_v = _exact_tail(st, b, h, ws, k[i], v[i])  # positions [ws, end), [H, end - ws, D]
        for pos in range(h, min(end, SINK)):
            st.sink_k[b, :, pos] = k[i, :, pos - h]
            st.sink_v[b, :, pos] = v[i, :, pos - h]
        if st.own_bits:
            _write_pages(st, b, range(stored_pages(h), stored_pages(end)), ws, exact_k, exact_v, st.own_bits)
        elif source is not None:
            sh = source_held[i]
            src_ws = SINK + PAGE * n_pages(sh)
            src_k, src_v = _exact_tail(source, b, sh, src_ws, k[i, :, :0], v[i, :, :0])
            _write_pages(source, b, range(stored_pages(sh), n_pages(end)), src_ws, src_k, src_v, bits)
        first = max(h, SINK, end - RING)  # earlier positions' slots are overwritten within the continuation
        if end > first:
            slots = (torch.arange(first, end, device=k.device) - SINK) % RING
            st.win_k[b, :, slots] = k[i, :, first - h:]
            st.win_v[b, :, slots] = v[i, :, first - h:]
        st.lengths[b] = end
        outs.append(_read_row(st, b, h, ws, query[i], exact_k, exact_v, bits, cache._tau(layer_idx, st), scale))
    return torch.stack(outs)


def _exact_tail(st, b: int, h: int, ws: int, k_new: Tensor, v_new: Tensor) -> tuple[Tensor, Tensor]:
    """The exact tokens of positions ``[ws, h + S)``: the ring's ``[ws, h)`` then the new ones past the sink."""
    old = (torch.arange(ws, h, device=k_new.device) - SINK) % RING if h > ws else None
    skip = max(0, SINK - h)  # new tokens that land in the sink are not part of the tail
    parts_k = [k_new[:, skip:]]
    parts_v = [v_new[:, skip:]]
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


def _read_row(st, b: int, h: int, ws: int, q: Tensor, exact_k: Tensor, exact_v: Tensor, bits: int, tau: float,
              scale: float) -> Tensor:
    """Row ``b``'s continuation queries q [Hq, S, D] -> [S, Hq, D] (see the module docstring)."""
    Hq, S, D = q.shape
    H = exact_k.shape[0]
    g = Hq // H
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    dev = q.device
    qf = q.to(acc).view(H, g, S, D)
    n = torch.arange(h + 1, h + S + 1, device=dev)  # tokens held when each query reads
    npg = n_pages(n)  # [S] history pages read by each query
    P = int(n_pages(h + S)) if bits else 0

    sink_pos = torch.arange(st.sink_k.shape[2], device=dev)  # SINK slots, or a short cache's fewer
    tail_pos = torch.arange(ws, ws + exact_k.shape[1], device=dev)
    sink_k, sink_v = st.sink_k[b].to(acc), st.sink_v[b].to(acc)
    ek, ev = exact_k.to(acc), exact_v.to(acc)
    if P:
        pages = _gather_pages(st, b, P)
        hist_k = codec.decode_k(pages, bits).to(acc) if bits != 16 else pages.k_codes.to(acc)  # [P, H, PAGE, D]
        hist_k = hist_k.permute(1, 0, 2, 3).reshape(H, P * PAGE, D)
        if bits == 16:
            v_full = pages.v_hi.to(acc).permute(1, 0, 2, 3).reshape(H, P * PAGE, D)
        else:
            v_full = codec.decode_v(pages, bits).to(acc).permute(1, 0, 2, 3).reshape(H, P * PAGE, D)
        cold_v = None
        if bits == 4 and not math.isinf(tau):
            every = torch.ones(pages.v_hi.shape[:-1], dtype=torch.bool, device=dev)
            cold_v = codec.decode_v(pages, bits, every).to(acc).permute(1, 0, 2, 3).reshape(H, P * PAGE, D)
        hist_page = torch.arange(P * PAGE, device=dev) // PAGE

    keys = sink_pos.shape[0] + P * PAGE + exact_k.shape[1]
    block = max(1, _BLOCK_ELEMENTS // max(1, Hq * keys))
    out = []
    for lo in range(0, S, block):
        hi = min(S, lo + block)
        qb, nb, npb = qf[:, :, lo:hi], n[lo:hi], npg[lo:hi]
        s_sink = torch.einsum("hgsd,htd->hgst", qb, sink_k) * scale
        s_sink = s_sink.masked_fill(~(sink_pos[None, :] < nb[:, None]), -math.inf)
        first_exact = SINK + PAGE * npb  # [s] positions from here on are read exact
        tail_ok = (tail_pos[None, :] >= first_exact[:, None]) & (tail_pos[None, :] < nb[:, None])
        s_tail = (torch.einsum("hgsd,htd->hgst", qb, ek) * scale).masked_fill(~tail_ok, -math.inf)
        parts = [s_sink, s_tail]
        if P:
            s_hist = torch.einsum("hgsd,htd->hgst", qb, hist_k) * scale
            s_hist = s_hist.masked_fill(~(hist_page[None, :] < npb[:, None]), -math.inf)
            parts.append(s_hist)
        s = torch.cat(parts, dim=-1)
        m = s.amax(dim=-1, keepdim=True)
        p = torch.exp(s - m)
        denom = p.sum(dim=-1, keepdim=True)
        ns = sink_pos.shape[0]
        p_sink, p_tail = p[..., :ns], p[..., ns:ns + ek.shape[1]]
        o = torch.einsum("hgst,htd->hgsd", p_sink, sink_v) + torch.einsum("hgst,htd->hgsd", p_tail, ev)
        if P:
            p_hist = p[..., ns + ek.shape[1]:]
            if cold_v is None:
                o = o + torch.einsum("hgst,htd->hgsd", p_hist, v_full)
            else:  # the cold rule of cell_attention, per query: m_ref = max(sink max, its page's max)
                page_max = s_hist.unflatten(-1, (P, PAGE)).amax(dim=-1)  # [H, g, s, P]
                m_ref = torch.maximum(s_sink.amax(dim=-1, keepdim=True), page_max)
                thr = cold_threshold(m_ref, tau).repeat_interleave(PAGE, dim=-1)
                cold = (s_hist < thr).all(dim=1, keepdim=True)  # cold for every query head of the group
                o = o + torch.einsum("hgst,htd->hgsd", p_hist * ~cold, v_full)
                o = o + torch.einsum("hgst,htd->hgsd", p_hist * cold, cold_v)
        out.append(o / denom)
    return torch.cat(out, dim=2).reshape(Hq, S, D).transpose(0, 1).to(q.dtype)


def _gather_pages(st, b: int, P: int) -> codec.PageCodes:
    """Row ``b``'s history pages ``[0, P)`` as stored (bits 16: exact pages in ``k_codes``/``v_hi``)."""
    phys = st.page_table[b, :P].long()
    if st.k_scale.numel() == 0:  # bf16 pages
        return codec.PageCodes(st.k_pages[phys], st.k_scale, st.k_zero, st.v_hi[phys], st.v_lo, st.v_scale,
                               st.v_zero)
    v_lo = st.v_lo[phys] if st.v_lo.numel() else st.v_lo
    return codec.PageCodes(st.k_pages[phys], st.k_scale[phys], st.k_zero[phys], st.v_hi[phys], v_lo,
                           st.v_scale[phys], st.v_zero[phys])
