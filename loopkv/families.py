"""Model families: how a looped model's config maps to planned cells and to the cache indices it passes.

A looped transformer may run layers that are not looped (a *prelude* before the loop and a *coda* after it, each
run once per token), a *core* of layers run ``loops`` times, and sliding-window layers anywhere. loopkv plans only
the core's full-attention layers: ``Cell(loop, layer)`` has ``layer`` in ``[0, L)`` over those layers alone, and a
:class:`~loopkv.planning.plan.Plan` has ``loops x L`` cells. Every other layer the model caches is a *fixed* slot,
kept exact and never planned: a prelude/coda full-attention layer (``"exact"``) or a sliding-window layer
(``"window"``; its window is its cache).

A :class:`ModelLayout` is the one home of this map: per cache index (the ``layer_idx`` the model passes to
``Cache.update``) a :class:`Slot` naming its physical layer, its kind and its planned cell, the order in which the
model updates the slots in one forward, and the inverse map from cells to indices. :func:`layout_of` builds it from
a config:

* **Ouro** (configs with ``total_ut_steps``; also loopkv's small model): every layer looped, full attention, cell
  ``(t, l)`` at index ``t * L + l``. Its cells are exactly :class:`~loopkv.cells.CellLayout`'s.
* **Dory** (transformers' ``DoryForCausalLM``, ``model_type == "dory"``, transformers >= 5.24.0): ``n_input_layers``
  prelude layers, ``n_recurrent_layers`` core layers run ``n_recurrent_loops`` times, ``n_output_layers`` coda
  layers; ``config.layer_types`` marks sliding layers. Cache mode ``per_loop``: loop 0 writes the core layer's own
  index, loop ``t > 0`` writes ``num_hidden_layers + (t - 1) * n_recurrent_layers + j`` for core layer ``j``
  (``DoryModel.forward``'s ``cache_offset``). Mode ``last_loop``: only the last loop writes (its own index); the
  earlier loops read that index's cache (``cache.layers[i].keys``) without calling ``update``, so their cells have
  no index (:attr:`ModelLayout.reads_without_update`, served by ``loopkv/cache/last_loop.py``).

How a new family describes itself: write ``def my_layout(config, loops) -> ModelLayout`` that lists the prelude,
the core and the coda as :class:`Layer` entries (physical index, attention type, and for prelude/coda the cache
index) and gives ``core_index(t, j)``, the cache index core layer ``j`` writes in loop ``t``, then returns
:func:`build_layout` of them; add it to :data:`FAMILIES` with how its configs are recognised
(:func:`family_of`), and the oldest transformers that has the model (or ``None``). ``loops`` is the loop count
(:func:`layout_of`'s ``loops=``): ``None`` means the config's default; a model whose loop count is chosen per call
(recurrent depth, Huginn's ``r``) is laid out for the largest count it will run, and a plan is made for that count;
such a family is in :data:`PER_CALL_LOOPS`, and a cache for calls of fewer loops ``n`` is laid out for ``n`` and
serves ``plan.for_loops(n)`` (its last loop as the plan's final one).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from loopkv.cells import Cell, CellLayout

KINDS = ("looped", "exact", "window")  # a planned cell; a fixed exact full-attention layer; a sliding-window layer
DORY_MIN_TRANSFORMERS = "5.24.0"  # the first transformers release with DoryForCausalLM


@dataclass(frozen=True)
class Layer:
    """One physical decoder layer of a model. ``sliding``: a sliding-window layer. ``index``: the cache index a
    prelude/coda layer writes (core layers take theirs from ``core_index``)."""

    layer: int
    sliding: bool = False
    index: int | None = None


@dataclass(frozen=True)
class Slot:
    """One cache index the model passes to ``update``: the physical ``layer`` that writes it, its ``kind`` (one of
    :data:`KINDS`), its ``loop`` (``None`` outside the loop) and, for a planned slot, its ``cell``."""

    index: int
    layer: int
    kind: str
    loop: int | None = None
    cell: Cell | None = None

    def __post_init__(self) -> None:
        assert self.kind in KINDS, f"slot kind {self.kind!r} is not one of {KINDS}"
        assert (self.cell is not None) == (self.kind == "looped"), "planned slots, and only they, have a cell"


@dataclass(frozen=True)
class ModelLayout:
    """The cache indices of one looped model and its planned cells (see the module docstring).

    family: the family's name (``"ouro"``, ``"dory"``); plans and profiles record it.
    cells: the planned cells, ``loops x layers``; ``cells.layers`` counts the core's full-attention layers.
    slots: one per cache index, ``slots[i].index == i``; the cache holds exactly these.
    call_order: the cache indices in the order the model updates them in one forward.
    sliding_window: tokens a sliding layer attends to (itself included), or ``None`` without sliding layers.
    num_layers: the model's physical decoder layers.
    reads_without_update: cells whose loop reads another loop's cache without an index of its own (Dory's
        ``last_loop`` mode); a plan gives them ``share`` (``loopkv/cache/last_loop.py`` serves their reads).
    shared_reads: the cache indices those loops read (the last loop's core indices, planned and sliding).
    """

    family: str
    cells: CellLayout
    slots: tuple[Slot, ...]
    call_order: tuple[int, ...]
    num_layers: int
    sliding_window: int | None = None
    reads_without_update: tuple[Cell, ...] = ()
    shared_reads: tuple[int, ...] = ()
    _index_of: Mapping[Cell, int] = field(default=None, repr=False, compare=False)  # type: ignore[assignment]

    def __post_init__(self) -> None:
        assert all(s.index == i for i, s in enumerate(self.slots)), "slots are listed by cache index"
        assert sorted(self.call_order) == list(range(len(self.slots))), "call_order names every index once"
        index_of = {s.cell: s.index for s in self.slots if s.cell is not None}
        missing = [c for c in self.cells if c not in index_of and c not in self.reads_without_update]
        assert not missing, f"cells without a cache index: {missing}"
        object.__setattr__(self, "_index_of", index_of)

    # ---- the planned cells (the same questions CellLayout answers, in cache indices)
    @property
    def loops(self) -> int:
        return self.cells.loops

    @property
    def layers(self) -> int:
        """Planned layers per loop (L): the core's full-attention layers."""
        return self.cells.layers

    @property
    def num_cells(self) -> int:
        return self.cells.num_cells

    @property
    def final_loop(self) -> int:
        return self.cells.final_loop

    def __iter__(self) -> Iterator[Cell]:
        return iter(self.cells)

    def flat_index(self, cell: Cell) -> int:
        """The cache index ``cell`` writes."""
        self.cells.flat_index(cell)  # range check with a clear error
        if cell not in self._index_of:
            raise ValueError(f"{cell} has no cache index of its own in this {self.family} layout: its loop reads "
                             "another loop's cache")
        return self._index_of[cell]

    def cell(self, index: int) -> Cell:
        """The planned cell of cache index ``index`` (a ValueError for a fixed slot)."""
        slot = self.slot(index)
        if slot.cell is None:
            raise ValueError(f"cache index {index} is a fixed {slot.kind!r} slot of layer {slot.layer}, not a "
                             "planned cell")
        return slot.cell

    def source(self, cell: Cell) -> Cell:
        """The cell a ``share`` cell reads its history from: the final loop at the same layer."""
        return self.cells.source(cell)

    # ---- every cache index
    @property
    def num_indices(self) -> int:
        """Cache indices the model passes (planned and fixed slots)."""
        return len(self.slots)

    def slot(self, index: int) -> Slot:
        if not 0 <= index < len(self.slots):
            raise ValueError(f"cache index {index} is outside [0, {len(self.slots)}) of this {self.family} layout")
        return self.slots[index]

    @property
    def physical_layers(self) -> tuple[int, ...]:
        """The physical layer of every cache index (where its K/V come from: a device map places it there)."""
        return tuple(s.layer for s in self.slots)

    @property
    def last_index(self) -> int:
        """The cache index the model updates last in a forward (where a decode step is counted)."""
        return self.call_order[-1]

    @property
    def first_index(self) -> int:
        """The cache index the model updates first in a forward."""
        return self.call_order[0]

    def fixed(self, kind: str | None = None) -> list[Slot]:
        """The slots that are not planned (of ``kind`` if given)."""
        return [s for s in self.slots if s.cell is None and (kind is None or s.kind == kind)]


def build_layout(*, family: str, loops: int, prelude: Sequence[Layer], core: Sequence[Layer],
                 coda: Sequence[Layer], core_index: Callable[[int, int], int | None], num_layers: int,
                 sliding_window: int | None = None) -> ModelLayout:
    """A :class:`ModelLayout` from a family's description. ``core_index(t, j)``: the cache index core layer ``j``
    (0-based within the core) writes in loop ``t``, or ``None`` if that loop writes none (it reads another loop's
    cache). The model runs the prelude, then each loop over the core, then the coda."""
    if loops < 1:
        raise ValueError(f"a looped model needs loops >= 1, got {loops}")
    planned = [j for j, layer in enumerate(core) if not layer.sliding]
    if not planned:
        raise ValueError(f"this {family} model has no full-attention layer in its loop: nothing to plan")
    cells = CellLayout(loops, len(planned))
    entries: dict[int, Slot] = {}
    order: list[int] = []
    no_index: list[Cell] = []
    read: set[int] = set()  # indices that a loop without its own index reads: the last loop's, same layer

    def add(index: int, layer: Layer, kind: str, loop: int | None = None, cell: Cell | None = None) -> None:
        if index in entries:  # a later loop writing an index an earlier one wrote: one cache entry, first writer
            return
        entries[index] = Slot(index, layer.layer, kind, loop, cell)
        order.append(index)

    for layer in prelude:
        add(layer.index, layer, "window" if layer.sliding else "exact")
    for t in range(loops):
        for j, layer in enumerate(core):
            index = core_index(t, j)
            cell = None if layer.sliding else Cell(t, planned.index(j))
            if index is None:
                if cell is not None:
                    no_index.append(cell)
                last = core_index(loops - 1, j)
                if last is None:
                    raise ValueError(f"{family} layout: core layer {j} has no cache index in its last loop")
                read.add(last)
                continue
            add(index, layer, "window" if layer.sliding else "looped", t, cell)
    for layer in coda:
        add(layer.index, layer, "window" if layer.sliding else "exact")
    slots = tuple(entries[i] for i in sorted(entries))
    return ModelLayout(family=family, cells=cells, slots=slots, call_order=tuple(order), num_layers=num_layers,
                       sliding_window=sliding_window, reads_without_update=tuple(no_index),
                       shared_reads=tuple(sorted(read)))


# ---- the families ---------------------------------------------------------------------------------------------
def _get(config: Any, name: str) -> Any:
    return config.get(name) if isinstance(config, Mapping) else getattr(config, name, None)


def ouro_layout(config: Any, loops: int | None = None) -> ModelLayout:
    """Ouro: ``total_ut_steps`` loops over all ``num_hidden_layers`` layers, cell ``(t, l)`` at ``t * L + l``."""
    layers = int(_get(config, "num_hidden_layers"))
    loops = int(_get(config, "total_ut_steps")) if loops is None else loops
    return build_layout(family="ouro", loops=loops, prelude=(), core=[Layer(i) for i in range(layers)], coda=(),
                        core_index=lambda t, j: t * layers + j, num_layers=layers)


def dory_layout(config: Any, loops: int | None = None) -> ModelLayout:
    """transformers' Dory (see the module docstring for its cache indices in both cache modes)."""
    n = int(_get(config, "num_hidden_layers"))
    n_in, n_out = int(_get(config, "n_input_layers")), int(_get(config, "n_output_layers"))
    n_rec = _get(config, "n_recurrent_layers")
    n_rec = n - n_in - n_out if n_rec is None else int(n_rec)
    loops = int(_get(config, "n_recurrent_loops")) if loops is None else loops
    mode = _get(config, "recurrent_kv_cache_mode") or "per_loop"
    types = list(_get(config, "layer_types") or ["full_attention"] * n)
    if n_in + n_rec + n_out != n or len(types) != n:
        raise ValueError(f"Dory config: n_input_layers + n_recurrent_layers + n_output_layers ({n_in} + {n_rec} + "
                         f"{n_out}) and len(layer_types) ({len(types)}) must equal num_hidden_layers ({n})")
    if mode not in ("per_loop", "last_loop"):
        raise ValueError(f"Dory config: recurrent_kv_cache_mode must be 'per_loop' or 'last_loop', got {mode!r}")

    def layer(i: int, indexed: bool) -> Layer:
        return Layer(i, types[i] == "sliding_attention", i if indexed else None)

    def core_index(t: int, j: int) -> int | None:
        if mode == "last_loop":
            return n_in + j if t == loops - 1 else None
        return n_in + j if t == 0 else n + (t - 1) * n_rec + j

    sliding = "sliding_attention" in types
    return build_layout(family="dory", loops=loops, prelude=[layer(i, True) for i in range(n_in)],
                        core=[layer(i, False) for i in range(n_in, n_in + n_rec)],
                        coda=[layer(i, True) for i in range(n - n_out, n)], core_index=core_index, num_layers=n,
                        sliding_window=int(_get(config, "sliding_window")) if sliding else None)


def _is_dory(config: Any) -> bool:
    return _get(config, "model_type") == "dory"


def _is_ouro(config: Any) -> bool:
    return _get(config, "total_ut_steps") is not None


# families whose model chooses its loop count per call (Huginn's num_steps): a cache may serve fewer loops than a
# plan has (LoopKVCache(..., loops=n), Plan.for_loops); the other families' models always run every loop
PER_CALL_LOOPS: set[str] = set()

# name -> (recognises a config, its layout, the oldest transformers that has the model or None)
FAMILIES: dict[str, tuple[Callable[[Any], bool], Callable[..., ModelLayout], str | None]] = {
    "dory": (_is_dory, dory_layout, DORY_MIN_TRANSFORMERS),
    "ouro": (_is_ouro, ouro_layout, None),
}


def family_of(config: Any) -> str:
    """The family of ``config`` (a transformers config or a mapping), or a ValueError naming those known."""
    for name, (recognises, _, _) in FAMILIES.items():
        if recognises(config):
            return name
    raise ValueError(
        f"config {type(config).__name__} (model_type {_get(config, 'model_type')!r}) is not a looped model loopkv "
        "knows: Ouro-style configs have total_ut_steps and num_hidden_layers; transformers' DoryConfig has "
        "model_type 'dory'. A new family describes itself in loopkv/families.py")


def known_family(config: Any) -> bool:
    """Whether some family recognises ``config``."""
    return any(recognises(config) for recognises, _, _ in FAMILIES.values())


def check_transformers(family: str) -> None:
    """Refuse a family whose model the installed transformers does not have, naming the release that does."""
    oldest = FAMILIES[family][2]
    if oldest is None:
        return
    import transformers
    from packaging.version import Version

    if Version(transformers.__version__) < Version(oldest):
        raise ValueError(f"{family} models need transformers >= {oldest} (the first release with them); this is "
                         f"transformers {transformers.__version__}: pip install 'transformers>={oldest}'")


def layout_of(config: Any, *, loops: int | None = None) -> ModelLayout:
    """The :class:`ModelLayout` of ``config`` (a transformers config or a mapping with its fields), for ``loops``
    loops (``None``: the config's own count)."""
    family = family_of(config)
    check_transformers(family)
    return FAMILIES[family][1](config, loops)


__all__ = ["DORY_MIN_TRANSFORMERS", "FAMILIES", "KINDS", "PER_CALL_LOOPS", "Layer", "ModelLayout", "Slot",
           "build_layout", "check_transformers", "dory_layout", "family_of", "known_family", "layout_of",
           "ouro_layout"]
