"""Cells: one (loop, layer) pair of a looped transformer, and the map to a flat cache index.

Ouro passes ``layer_idx = t * L + l`` to ``Cache.update`` (docs/design.md). A model with layers outside the
loop or sliding layers (Dory, Huginn) passes other indices: :mod:`loopkv.families` maps its cells to them, with a
:class:`CellLayout` for the planned cells. Bare ints never cross a module boundary as cell identities: use
:class:`Cell` and :class:`CellLayout`.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple


class Cell(NamedTuple):
    """One (loop, layer) pair; ``loop`` in ``[0, T)``, ``layer`` in ``[0, L)``."""

    loop: int
    layer: int


@dataclass(frozen=True)
class CellLayout:
    """The cells of a looped model with ``loops`` (T) loops over ``layers`` (L) layers."""

    loops: int
    layers: int

    def __post_init__(self) -> None:
        if self.loops < 1 or self.layers < 1:
            raise ValueError(f"loops and layers must be >= 1, got loops={self.loops}, layers={self.layers}")

    @property
    def num_cells(self) -> int:
        return self.loops * self.layers

    @property
    def final_loop(self) -> int:
        return self.loops - 1

    def flat_index(self, cell: Cell) -> int:
        """The flat index of ``cell`` in a plan, and Ouro's cache index: ``loop * L + layer``."""
        self._check(cell)
        return cell.loop * self.layers + cell.layer

    def cell(self, flat_index: int) -> Cell:
        """The cell of Ouro's cache index ``flat_index`` (``(idx // L, idx % L)``)."""
        if not 0 <= flat_index < self.num_cells:
            raise ValueError(
                f"cache index {flat_index} is outside [0, {self.num_cells}) for T={self.loops}, L={self.layers}"
            )
        return Cell(flat_index // self.layers, flat_index % self.layers)

    def source(self, cell: Cell) -> Cell:
        """The cell a ``share`` cell reads its history from: the final loop at the same layer."""
        self._check(cell)
        return Cell(self.final_loop, cell.layer)

    def __iter__(self) -> Iterator[Cell]:
        for t in range(self.loops):
            for layer in range(self.layers):
                yield Cell(t, layer)

    def _check(self, cell: Cell) -> None:
        if not (0 <= cell.loop < self.loops and 0 <= cell.layer < self.layers):
            raise ValueError(f"{cell} is outside the layout T={self.loops}, L={self.layers}")
