"""The served cache, simulated densely over a whole sequence: what the profiler measures.

One teacher-forced forward over a document computes every position at once. Cells of a simulated row
that are *served* attend as the real :class:`~loopkv.LoopKVCache` decode path would, and every other
cell attends exactly. For query position ``i`` of a served cell and key position ``j <= i``:

* ``j`` is *history* iff ``i >= prefill_len`` and ``SINK <= j < SINK + PAGE * n_pages(i + 1)``: its
  page had left the window when token ``i`` was appended (page ``p`` is read from length ``320 + 32 p``
  on; geometry in :mod:`loopkv.format`). Queries of the prefill (``i < prefill_len``) attend exactly,
  as the cache's prefill does.
* history scores use the dequantized K of the page, history values the dequantized V (INT4 with V
  precision ``tau``: cold tokens decode from the high plane, ``4*hi + 1.5``; the cold rule is
  :func:`loopkv.format.cold_threshold` with ``m_ref = max(sink max, page max)``, the same statement the
  reference op uses); the sink and the window use the exact K/V.
* a ``share`` cell takes its history pages from the final loop's cell at the same layer (quantized at
  the source's bits) and its own exact sink and window.

The simulation hooks in through public mechanisms only: a :class:`_SimCache` passed as the model's cache
(the model hands it every cache index it writes and gets back :class:`_SimKV` objects), and an attention
function registered as ``"loopkv_served"`` with ``transformers.AttentionInterface``, which
:func:`served_attention_enabled` switches the model to (``set_attn_implementation``) and back.

Rows name served cells by cache index. Which index is which cell is the model's
:class:`~loopkv.families.ModelLayout` (:func:`loopkv.planning.looped.model_layout`): Ouro's cell ``(t, l)`` is
index ``t*L + l``; Dory's and Huginn's prelude, coda and sliding-window layers are fixed slots that no row serves,
attended exactly (a sliding layer over its ``sliding_window`` tokens, itself included), and a ``share`` cell reads
the final loop's cell at its planned layer.

Share sources: a ``share`` cell's source pages are given (``sources``). Taken from an exact forward
they are right for every page a query reads as long as the document is shorter than 608 tokens (the
source K/V at position ``j`` only change once the shared cell's output at positions ``<= j`` has, i.e.
for ``j >= 320``, and such a page is read only by queries ``i >= j + 288``). Beyond, iterate: take the
sources from the previous pass's own perturbed final loop (``share_passes`` in :func:`simulate_plan`
and in the profiler); every pass carries the perturbation at least 288 positions further, so the passes
reach the served cache's fixed point.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from loopkv.cells import Cell
from loopkv.families import ModelLayout
from loopkv.format import BITS, PAGE, SINK, WINDOW, cold_threshold, n_pages
from loopkv.ops import codec
from loopkv.planning.looped import cache_keyword, model_layout, repeatable_state
from loopkv.planning.resume import Entry, cell_inputs

ATTN_NAME = "loopkv_served"
# The first length at which a history page is read (page 0 from length 320 on): KL and agreement are
# counted from this position on, where decode reads quantized history.
FIRST_HISTORY = SINK + WINDOW + PAGE
# Query positions per block of the dense served attention: bounds the score tensors to
# [rows, heads, QUERY_BLOCK, N] whatever the document length.
QUERY_BLOCK = 256
# Query positions per block of exact_attention(matmul=True): scores [rows, heads, 1024, N] (1 GiB per row and 16
# heads at N = 8K in fp32); larger than QUERY_BLOCK, as these blocks are many (every exact cell) and launch-bound.
MATMUL_BLOCK = 1024


@dataclass(frozen=True)
class Served:
    """How one served cell of a simulated row reads its history.

    bits: 16 (exact history, e.g. own bf16 or a share of a bf16 source), 4 or 2.
    share: the history pages come from the final loop's cell at the same layer.
    tau: V precision threshold for INT4 history (``inf``: off).
    """

    bits: int
    share: bool = False
    tau: float = math.inf

    def __post_init__(self) -> None:
        if self.bits not in (2, 4, 16):
            raise ValueError(f"Served.bits must be 2, 4 or 16, got {self.bits!r}")


RowSpec = Mapping[int, Served]  # cache index (Ouro: t*L + l) -> Served; absent indices attend exactly


def served_for(option: str, *, source_option: str = "int4", tau: float = math.inf) -> Served:
    """The :class:`Served` of a plan option (``share`` reads a ``source_option`` final loop)."""
    if option == "share":
        if source_option not in BITS or source_option == "share":
            raise ValueError(f"source_option must be 'bf16', 'int4' or 'int2', got {source_option!r}")
        return Served(BITS[source_option], share=True, tau=tau if source_option == "int4" else math.inf)
    if option not in BITS:
        raise ValueError(f"option must be one of {tuple(BITS)}, got {option!r}")
    return Served(BITS[option], tau=tau if option == "int4" else math.inf)


def plan_spec(plan: Any, layout: ModelLayout | None = None) -> dict[int, Served]:
    """A whole plan as one row: every cell served at its option (bf16 cells are exact anyway), keyed by the cache
    index ``layout`` gives the cell (default Ouro's, ``t*L + l``)."""
    final = plan.layout.final_loop
    spec = {}
    for index, option in enumerate(plan.options):
        if option == "bf16":
            continue
        source = plan.options[final * plan.layers + index % plan.layers]
        cell = plan.layout.cell(index)
        key = index if layout is None else layout.flat_index(cell)
        spec[key] = served_for(option, source_option=source, tau=plan.taus[index // plan.layers])
    return spec


# ---------------------------------------------------------------------------------- dense attention
def served_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    served: Served,
    scale: float,
    prefill_len: int = 0,
    source_k: Tensor | None = None,
    source_v: Tensor | None = None,
    block: int = QUERY_BLOCK,
) -> Tensor:
    """Causal attention of every query position as the served cache computes it (module docstring).

    q: [R, Hq, N, D]; k, v: [R, H, N, D] the cell's own exact K/V (query head ``h`` reads KV head
    ``h // (Hq // H)``); source_k, source_v: [R or 1, H, N, D] the share source's K/V (needed iff
    ``served.share``). Returns [R, Hq, N, D] in q's dtype; computes in fp32 (fp64 for fp64 input).
    """
    R, Hq, N, D = q.shape
    H = k.shape[1]
    g = Hq // H
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    if served.share and (source_k is None or source_v is None):
        raise ValueError("a share cell needs source_k and source_v (the final loop's K/V at its layer)")
    npg = n_pages(N)
    hist_k, hist_v, cold_v = _history(k, v, source_k, source_v, served, npg, acc)  # [R|1, H, PAGE*npg, D]
    qf = q.to(acc).view(R, H, g, N, D)
    kf, vf = k.to(acc), v.to(acc)
    out = torch.empty(R, H, g, N, D, dtype=acc, device=q.device)
    pos = torch.arange(N, device=q.device)
    for i0 in range(0, N, block):
        i1 = min(N, i0 + block)
        qb = qf[:, :, :, i0:i1]  # [R, H, g, b, D]
        s = torch.einsum("rhgbd,rhkd->rhgbk", qb, kf[:, :, :i1]) * scale  # [R, H, g, b, i1]
        s = s.masked_fill(pos[None, :i1] > pos[i0:i1, None], -math.inf)
        # pages quantized for query i: n_pages(i + 1), none during the prefill
        P = torch.where(pos[i0:i1] >= prefill_len, n_pages(pos[i0:i1] + 1), torch.zeros_like(pos[i0:i1]))
        pmax = int(P.max()) if npg else 0
        if pmax == 0:
            out[:, :, :, i0:i1] = torch.einsum("rhgbk,rhkd->rhgbd", torch.softmax(s, dim=-1), vf[:, :, :i1])
            continue
        end = SINK + PAGE * pmax
        hist = torch.arange(PAGE * pmax, device=q.device)[None, :] < (PAGE * P)[:, None]  # [b, PAGE*pmax]
        s_h = torch.einsum("rhgbd,rhkd->rhgbk", qb, hist_k[:, :, : PAGE * pmax].expand(R, -1, -1, -1)) * scale
        s[..., SINK:end] = torch.where(hist, s_h, s[..., SINK:end])
        p = torch.softmax(s, dim=-1)
        p_hist = p[..., SINK:end] * hist
        p_exact = p.clone()
        p_exact[..., SINK:end] = p[..., SINK:end] * ~hist
        o = torch.einsum("rhgbk,rhkd->rhgbd", p_exact, vf[:, :, :i1])
        vh = hist_v[:, :, : PAGE * pmax].expand(R, -1, -1, -1)
        if cold_v is not None:
            cold = _cold(s, s_h, pmax, served.tau)  # [R, H, 1, b, PAGE*pmax]
            vc = cold_v[:, :, : PAGE * pmax].expand(R, -1, -1, -1)
            o = o + torch.einsum("rhgbk,rhkd->rhgbd", p_hist * cold, vc)
            p_hist = p_hist * ~cold
        out[:, :, :, i0:i1] = o + torch.einsum("rhgbk,rhkd->rhgbd", p_hist, vh)
    return out.reshape(R, Hq, N, D).to(q.dtype)


def _history(k, v, source_k, source_v, served: Served, npg: int, acc):
    """Dequantized history pages aligned with positions SINK .. SINK + PAGE*npg: K, V (full) and V
    decoded cold (INT4 with finite tau, else None), each [R|1, H, PAGE*npg, D] in ``acc``."""
    sk, sv = (source_k, source_v) if served.share else (k, v)
    hist = slice(SINK, SINK + PAGE * npg)
    if served.bits == 16 or npg == 0:
        return sk[:, :, hist].to(acc), sv[:, :, hist].to(acc), None
    Rs, H, _, D = sk.shape

    def pages(x):  # [Rs, H, PAGE*npg, D] -> [Rs, H, npg, PAGE, D]
        return x[:, :, hist].unflatten(2, (npg, PAGE))

    codes = codec.encode_pages(pages(sk), pages(sv), served.bits)

    def flat(x):
        return x.reshape(Rs, H, npg * PAGE, D).to(acc)

    cold = None
    if served.bits == 4 and math.isfinite(served.tau):
        cold = flat(codec.decode_v(codes, 4, cold=torch.ones((), dtype=torch.bool, device=sk.device)))
    return flat(codec.decode_k(codes, served.bits)), flat(codec.decode_v(codes, served.bits)), cold


def _cold(s: Tensor, s_h: Tensor, pmax: int, tau: float) -> Tensor:
    """The cold rule (:func:`loopkv.format.cold_threshold`). s [R, H, g, b, N] (sink scores exact), s_h
    [R, H, g, b, PAGE*pmax] history scores -> bool [R, H, 1, b, PAGE*pmax]: cold for every query head of
    the KV head."""
    sink_max = s[..., :SINK].amax(dim=-1)  # [R, H, g, b]
    pages = s_h.unflatten(-1, (pmax, PAGE))  # [R, H, g, b, pmax, PAGE]
    m_ref = torch.maximum(sink_max[..., None], pages.amax(dim=-1))  # [R, H, g, b, pmax]
    cold_q = pages < cold_threshold(m_ref, tau)[..., None]
    return cold_q.all(dim=2, keepdim=True).flatten(-2)


def exact_attention(q: Tensor, k: Tensor, v: Tensor, *, scale: float, matmul: bool = False,
                    block: int = MATMUL_BLOCK, window: int | None = None) -> Tensor:
    """Plain causal attention. q [R, Hq, N, D], k, v [R, H, N, D] -> [R, Hq, N, D]. ``window``: a sliding-window
    layer's, query ``i`` attending to keys ``i - window < j <= i``.

    matmul: through matmuls over query blocks of ``block`` (keys up to the block's last query), which run in TF32
    when TF32 matmuls are on; otherwise SDPA, whose fp32 CUDA kernel ignores the TF32 switch (3xTF32 on the tensor
    cores, fp32-accurate). ``benchmarks/bench_profile.py`` times both under TF32.
    """
    g = q.shape[1] // k.shape[1]
    if g > 1:
        k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    N = q.shape[2]
    pos = torch.arange(N, device=q.device)
    if not matmul:
        if window is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        seen = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - window)  # [N, N]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=seen, scale=scale)
    out = torch.empty_like(q)
    for i0 in range(0, N, block):
        i1 = min(N, i0 + block)
        s = torch.matmul(q[:, :, i0:i1], k[:, :, :i1].transpose(-1, -2)).mul_(scale)  # [R, Hq, b, i1]
        s.masked_fill_(pos[None, :i1] > pos[i0:i1, None], -math.inf)
        if window is not None:
            s.masked_fill_(pos[None, :i1] <= pos[i0:i1, None] - window, -math.inf)
        out[:, :, i0:i1] = torch.matmul(torch.softmax(s, dim=-1), v[:, :, :i1])
    return out


# -------------------------------------------------------------------------- hooking into the model
class _SimKV:
    """What :class:`_SimCache` returns from ``update``: the cell's new K/V and the simulation state."""

    def __init__(self, state: SimState, cell_index: int, k: Tensor, v: Tensor) -> None:
        self.state, self.cell_index, self.k, self.v = state, cell_index, k, v


@dataclass
class SimState:
    """One simulated forward: which rows serve which cells, the share sources, what to capture.

    rows: one RowSpec per batch row. sources: ``{layer: (k, v)}`` share sources, each [R or 1, H, N, D].
    capture: cache indices whose K/V to record into ``captured`` (``{index: (k, v)}``, [R, H, N, D]; with an
    :class:`~loopkv.planning.resume.Entry`, the rows present at that cell).
    matmul_attention: the cells' exact attention through matmuls (:func:`exact_attention`), not SDPA.
    layout: the model's cache indices (:func:`loopkv.planning.looped.model_layout`); None: Ouro's, index
    ``t*L + l`` for ``layers`` planned layers.
    """

    rows: Sequence[RowSpec]
    prefill_len: int
    layers: int
    sources: Mapping[int, tuple[Tensor, Tensor]]
    capture: frozenset[int] = frozenset()
    block: int = QUERY_BLOCK
    matmul_attention: bool = False  # exact cells through exact_attention(matmul=True)
    layout: ModelLayout | None = None

    def layer_of(self, index: int) -> int:
        """The planned layer of the cell at cache index ``index`` (where its share source is)."""
        return index % self.layers if self.layout is None else self.layout.cell(index).layer

    def __post_init__(self) -> None:
        self.captured: dict[int, tuple[Tensor, Tensor]] = {}
        self.hidden: dict[int, Tensor] = {}  # cell -> the hidden state entering it, [1, N, H] (forward's keep_hidden)


def _sim_cache(state: SimState, num_indices: int):
    from transformers.cache_utils import Cache, DynamicLayer

    class _SimCache(Cache):
        """Hands every cell's new K/V to the ``loopkv_served`` attention function; stores nothing."""

        def __init__(self) -> None:
            super().__init__(layers=[DynamicLayer() for _ in range(num_indices)])

        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            if layer_idx in state.capture:
                state.captured[layer_idx] = (key_states, value_states)
            handle = _SimKV(state, layer_idx, key_states, value_states)
            return handle, handle

    return _SimCache()


def _served_attention_function(module, query, key, value, attention_mask, *, scaling=None, dropout=0.0, **kwargs):
    """transformers attention function ``"loopkv_served"``: returns ``(out [R, N, Hq, D], None)``."""
    if not isinstance(key, _SimKV):
        raise RuntimeError(
            "the 'loopkv_served' attention runs only inside loopkv.planning's simulation; restore the "
            "model's attention implementation with model.set_attn_implementation('sdpa')"
        )
    state, cell, k, v = key.state, key.cell_index, key.k, key.v
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    served_rows = [(r, spec[cell]) for r, spec in enumerate(state.rows) if cell in spec]
    window = kwargs.get("sliding_window")  # a sliding layer's (a fixed slot: no row serves it)
    if window is not None and served_rows:
        raise RuntimeError(f"cache index {cell} is a sliding-window layer, which no plan serves")
    out = exact_attention(query, k, v, scale=scale, matmul=state.matmul_attention, window=window)
    for r, served in served_rows:
        src_k = src_v = None
        if served.share:
            src_k, src_v = state.sources[state.layer_of(cell)]
            if src_k.shape[0] > 1:
                src_k, src_v = src_k[r : r + 1], src_v[r : r + 1]
        out[r : r + 1] = served_attention(
            query[r : r + 1], k[r : r + 1], v[r : r + 1], served=served, scale=scale,
            prefill_len=state.prefill_len, source_k=src_k, source_v=src_v, block=state.block,
        )
    return out.transpose(1, 2).contiguous(), None


def _no_mask(*args, **kwargs):
    """Mask function for ``"loopkv_served"``: none (documents are unpadded; attention is causal)."""
    return None


_REGISTERED = False


def _register() -> None:
    global _REGISTERED
    if _REGISTERED:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_NAME, _served_attention_function)
    AttentionMaskInterface.register(ATTN_NAME, _no_mask)
    _REGISTERED = True


@contextlib.contextmanager
def served_attention_enabled(model) -> Iterator[None]:
    """Switch ``model`` to the ``"loopkv_served"`` attention for the duration of the block, then back."""
    _register()
    before = model.config._attn_implementation
    model.set_attn_implementation(ATTN_NAME)
    try:
        yield
    finally:
        model.set_attn_implementation(before)


def check_model(model) -> tuple[int, int]:
    """(T, L) of the planned cells of a looped model the simulation supports; ValueError otherwise."""
    layout = model_layout(model)
    return layout.loops, layout.layers


def forward(
    model,
    ids: Tensor,
    state: SimState,
    *,
    logits_from: int,
    entry: Entry | None = None,
    keep_hidden: Sequence[int] = (),
) -> Tensor:
    """One simulated forward of ``ids`` [R, N] (call inside :func:`served_attention_enabled`).

    entry: with ``ids`` [1, N], the rows start as one exact carrier row and join at ``entry.starts``, the
        cells before ``entry.at`` skipped (:mod:`loopkv.planning.resume`). Exact when no row serves a cell
        before the cell it joins at; ``state.rows`` are then in the order they join.
    keep_hidden: cells whose entering hidden state (last row, ``[1, N, H]``) is stored in ``state.hidden``.
    Returns the logits of positions ``logits_from .. N-1``: [R, N - logits_from, V] (model dtype).
    """
    layout = model_layout(model)
    cache = {cache_keyword(model): _sim_cache(state, layout.num_indices)}
    keep = ids.shape[1] - logits_from
    if (entry is not None or keep_hidden) and layout.family != "ouro":
        raise ValueError(f"entry= and keep_hidden= resume inside Ouro's loop; a {layout.family} model runs every "
                         "row from its first layer (entry=None, keep_hidden=())")
    if entry is not None:
        late = [(r, min(spec)) for r, (spec, start) in enumerate(zip(state.rows, entry.starts, strict=True))
                if spec and min(spec) < start]
        if ids.shape[0] != 1 or late or (state.capture and min(state.capture) < entry.at):
            raise ValueError(
                f"entry needs ids of one row (got {ids.shape[0]}), rows that serve no cell before the cell they "
                f"join at (rows serving earlier: {late}) and no captured cell before entry.at={entry.at}"
            )
    elif not keep_hidden:
        return model(input_ids=ids, use_cache=True, logits_to_keep=keep, **cache).logits
    with cell_inputs(model, entry=entry, keep=keep_hidden, kept=state.hidden):
        return model(input_ids=ids, use_cache=True, logits_to_keep=keep, **cache).logits


def final_indices(loops: int, layers: int, layout: ModelLayout | None = None) -> list[int]:
    """The cache indices of the final loop's cells, by layer (``layout`` None: Ouro's, ``t*L + l``)."""
    if layout is None:
        return [(loops - 1) * layers + layer for layer in range(layers)]
    return [layout.flat_index(Cell(loops - 1, layer)) for layer in range(layers)]


def final_sources(captured: Mapping[int, tuple[Tensor, Tensor]], *, loops: int, layers: int,
                  layout: ModelLayout | None = None):
    """``{layer: (k, v)}`` from the captured final-loop cells."""
    indices = final_indices(loops, layers, layout)
    return {layer: captured[i] for layer, i in enumerate(indices) if i in captured}


@torch.no_grad()
def simulate_plan(
    model,
    plan: Any,
    document: Tensor,
    *,
    prefill_len: int = FIRST_HISTORY,
    logits_from: int | None = None,
    share_passes: int = 2,
) -> Tensor:
    """The logits a plan's served cache would produce on ``document`` ([N] or [1, N] token ids), by
    dense simulation: [N - logits_from, V] (default from ``max(prefill_len, 320)``).

    Share sources: pass 1 takes them from an exact forward; each further pass (``share_passes``)
    takes them from the previous pass's own final loop, converging to the served cache.
    """
    layout = model_layout(model)
    loops, layers = layout.loops, layout.layers
    plan.validate_for(model.config)
    ids = document.reshape(1, -1).to(model.device)
    start = max(prefill_len, FIRST_HISTORY) if logits_from is None else logits_from
    final = frozenset(final_indices(loops, layers, layout))
    spec = plan_spec(plan, layout)
    common = dict(prefill_len=prefill_len, layers=layers, layout=layout, capture=final)
    with served_attention_enabled(model), repeatable_state(model):
        exact = SimState(rows=[{}], sources={}, **common)
        forward(model, ids, exact, logits_from=ids.shape[1] - 1)
        sources = final_sources(exact.captured, loops=loops, layers=layers, layout=layout)
        logits = None
        for _ in range(max(1, share_passes)):
            state = SimState(rows=[spec], sources=sources, **common)
            logits = forward(model, ids, state, logits_from=start)
            sources = final_sources(state.captured, loops=loops, layers=layers, layout=layout)
    return logits[0]
