"""Where the rows of a simulated forward enter the model: the profiler resumes from the exact pass.

A row whose first perturbed cell is ``c`` (flat index ``t*L + l``) computes, up to the input of cell ``c``,
exactly what the exact pass computes. So a batch of such rows needs no forward of its own before that. The
exact pass of a document keeps the hidden state entering a few *checkpoint* cells (:func:`checkpoint_cells`,
one per loop by default); a batch's forward starts at the last checkpoint at or before its first row's cell,
from that hidden state, on one *carrier* row that stays exact. Each row joins at its own first perturbed
cell as a copy of the carrier, and the carrier is dropped once the last row has joined. A batch of ``R`` rows
starting at cells ``c_1 <= ... <= c_R`` from checkpoint ``a`` therefore costs ``(c_R - a) + sum(T*L - c_r)``
cell-rows instead of ``R * T*L``. Cells before the checkpoint run on a one-token stand-in (the carrier's
first position, with its position embedding): the model's own forward is kept whole and computes next to
nothing there.

The mechanism is a forward pre-hook on every decoder layer (``model.model.layers``, called once per cell in
cell order, with ``cell_index``, ``position_embeddings`` and ``position_ids`` among its keyword arguments as
Ouro passes them) that replaces the hidden state entering the cell (and, for a skipped cell, the position
arguments). Rows are ordered by the cell they join at, so that row ``r`` of the hidden state is
``state.rows[r]`` from the moment it has joined; the carrier, while there is one, is the last row.
"""

from __future__ import annotations

import bisect
import contextlib
from collections.abc import Iterator, MutableMapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class Entry:
    """How the rows of one simulated forward enter the model (module docstring).

    starts: per row, the flat index of the cell it joins at, non-decreasing; a row serves no cell before it.
    at: the first cell computed (``<= starts[0]``); the cells before it run on a one-token stand-in.
    hidden: the exact hidden state entering cell ``at``, ``[1, N, hidden_size]``; None only with ``at == 0``,
        where the carrier is the model's own embedding of the (one-row) ids.
    """

    starts: tuple[int, ...]
    at: int = 0
    hidden: Tensor | None = None

    def __post_init__(self) -> None:
        starts = tuple(int(s) for s in self.starts)
        object.__setattr__(self, "starts", starts)
        if not starts or any(b < a for a, b in zip(starts, starts[1:], strict=False)):
            raise ValueError(f"Entry.starts must be a non-empty, non-decreasing sequence of cells, got {starts}")
        if not 0 <= self.at <= starts[0]:
            raise ValueError(f"Entry.at={self.at} must be in [0, starts[0]={starts[0]}]: rows join after it")
        if self.hidden is None and self.at != 0:
            raise ValueError(f"Entry.at={self.at} needs the exact hidden state entering that cell (hidden=)")
        if self.hidden is not None and (self.hidden.dim() != 3 or self.hidden.shape[0] != 1):
            raise ValueError(f"Entry.hidden must be [1, N, hidden_size], got {tuple(self.hidden.shape)}")

    def rows_entering(self, cell: int, hidden: Tensor) -> Tensor:
        """The hidden state entering ``cell`` after the rows that join there have joined: ``[rows, N, H]``."""
        if cell < self.at:
            return hidden[:1, :1]
        if cell == self.at and self.hidden is not None:
            hidden = self.hidden.to(hidden.dtype)
        joined = bisect.bisect_left(self.starts, cell)
        joining = bisect.bisect_right(self.starts, cell) - joined
        later = len(self.starts) - joined - joining
        assert hidden.shape[0] == joined + (1 if joining or later else 0), "rows out of step with Entry.starts"
        if joining == 0:
            return hidden
        carrier = hidden[joined : joined + 1]
        parts = [hidden[:joined], carrier.expand(joining, *carrier.shape[1:])]
        return torch.cat(parts + ([carrier] if later else []))


def checkpoint_cells(loops: int, layers: int, *, every: int | None = None) -> tuple[int, ...]:
    """The cells whose entering hidden state the exact pass keeps: every ``every`` cells (default ``layers``,
    the first cell of each loop), cell 0 included. Each costs ``N * hidden_size`` activations per document."""
    every = layers if every is None else every
    if not isinstance(every, int) or every < 1:
        raise ValueError(f"checkpoint every must be a positive int (cells), got {every!r}")
    return tuple(range(0, loops * layers, every))


def entry_for(starts: Sequence[int], checkpoints: dict[int, Tensor]) -> Entry:
    """The :class:`Entry` of rows joining at ``starts`` from the last checkpoint at or before ``starts[0]``
    (``checkpoints``: ``{cell: hidden [1, N, H]}`` from the exact pass, cell 0 optional)."""
    at = max((c for c in checkpoints if c <= min(starts)), default=0)
    return Entry(starts=tuple(starts), at=at, hidden=checkpoints.get(at) if at else None)


@contextlib.contextmanager
def cell_inputs(model, *, entry: Entry | None = None, keep: Sequence[int] = (),
                kept: MutableMapping[int, Tensor] | None = None) -> Iterator[None]:
    """Inside the block, the hidden state entering each decoder cell of ``model`` follows ``entry`` (if given),
    and the last row of the hidden state entering each cell of ``keep`` is stored into ``kept``
    (``{cell: [1, N, H]}``; in a one-row exact pass, that row is the exact state)."""
    layer_modules = getattr(getattr(model, "model", None), "layers", None)
    if layer_modules is None:
        raise ValueError("resuming needs a model whose decoder layers are model.model.layers (Ouro's layout)")
    keep = frozenset(keep)
    if keep and kept is None:
        raise ValueError("keep= needs a kept= mapping to store the hidden states into")
    calls = [0]

    def hook(module, args, kwargs):
        cell = kwargs.get("cell_index", calls[0])
        calls[0] += 1
        hidden = args[0] if args else kwargs["hidden_states"]
        new = hidden if entry is None else entry.rows_entering(cell, hidden)
        if cell in keep:
            kept[cell] = new[-1:]
        if new is hidden:
            return None
        if entry is not None and cell < entry.at:  # the stand-in token's position arguments
            cos, sin = kwargs["position_embeddings"]
            kwargs = {**kwargs, "position_embeddings": (cos[:, :1], sin[:, :1])}
            if kwargs.get("position_ids") is not None:
                kwargs["position_ids"] = kwargs["position_ids"][:, :1]
        return ((new, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": new})

    handles = [m.register_forward_pre_hook(hook, with_kwargs=True) for m in layer_modules]
    try:
        yield
    finally:
        for h in handles:
            h.remove()
