"""Where a LoopKVCache's cells live: one device, or each physical layer's own (a model spread over GPUs with
``device_map``), and the shards that follow from it (docs/design.md, D4a).

A cell ``(t, l)`` lives where physical layer ``l`` runs, as transformers' static cache puts each layer where its
K/V arrive; a ``share`` cell and its source (the final loop, same layer) are therefore always together. The cells of
one device form a *shard*: their tensors are slices of that shard's stacked buffers, and a decode step's ``advance_``
runs once per kind of pool and shard.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from loopkv.cache.storage import CellStacks, CellStorage, stack_cells
from loopkv.families import ModelLayout


def cell_devices(device, layout: ModelLayout) -> list[torch.device]:
    """The device of every cache index from ``device``: ``None`` (CUDA if available, else CPU), one
    device, or a mapping ``{physical layer: device}`` covering every layer (:func:`layer_devices` builds it)."""
    if isinstance(device, Mapping):
        if set(device) != set(range(layout.num_layers)):
            raise ValueError(f"a device map must name each of the model's {layout.num_layers} layers (keys 0.."
                             f"{layout.num_layers - 1}), got keys {list(device)}; loopkv.layer_devices(model) "
                             "builds it from where the model's layers are")
        per_layer = [torch.device(device[i]) for i in range(layout.num_layers)]
        return [per_layer[layer] for layer in layout.physical_layers]
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return [torch.device(device)] * layout.num_indices


def layer_devices(model) -> dict[int, torch.device]:
    """``{layer: device}`` of each decoder layer of ``model``, from where its parameters are (e.g. after
    ``from_pretrained(..., device_map="auto")``): pass it as ``LoopKVCache(..., device=layer_devices(model))``."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", model)
    layers = getattr(decoder, "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__} has no decoder layers at .get_decoder().layers; pass "
                         "LoopKVCache a {layer: device} map yourself")
    return {i: next(layer.parameters()).device for i, layer in enumerate(layers)}


def same_device(a: torch.device, b: torch.device) -> bool:
    """``a`` and ``b`` are the same memory (``cpu`` and ``cpu:0`` are; ``cuda`` means the current CUDA device)."""
    if a.type != b.type:
        return False
    if a.type != "cuda":
        return True
    current = torch.cuda.current_device() if torch.cuda.is_available() else 0
    return (a.index if a.index is not None else current) == (b.index if b.index is not None else current)


@dataclass(eq=False)
class Shard:
    """The cells of one device. cells: their flat indices (layout order); stacks: their stacked buffers (a cell's
    slice is its position in ``cells``); groups: ``(bits, cells, pools)`` per kind of pool, the int32 tensors a
    step's ``advance_`` takes (local indices); no_pool: the empty page table and pool of the ``share`` group."""

    device: torch.device
    cells: list[int]
    stacks: CellStacks
    groups: list[tuple[int, Tensor, Tensor]]
    no_pool: Tensor

    def tensors(self) -> list[Tensor]:
        """Every tensor a step may mutate or read as an index (each must be a static address)."""
        return [*self.stacks.tensors(), *(t for g in self.groups for t in g[1:]), self.no_pool]


def build_shards(templates: list[CellStorage | None], devices: list[torch.device], *, trash: int | None = None
                 ) -> list[Shard]:
    """Allocate the cells' stacked buffers, one set per device (``templates`` on ``meta``, flat index order; ``None``
    for a slot kept outside the stacks, a sliding layer's window), and point every template's fields at its slices
    (``trash``: a shared pool's trash page, see ``stack_cells``)."""
    shards = []
    for device in dict.fromkeys(devices):
        cells = [i for i, d in enumerate(devices) if d == device and templates[i] is not None]
        if not cells:
            continue
        storages = [templates[i] for i in cells]
        stacks = stack_cells(storages, device, trash=trash)
        shards.append(Shard(device=device, cells=cells, stacks=stacks, groups=_advance_groups(storages, stacks,
                                                                                                device),
                            no_pool=torch.zeros(0, dtype=torch.int32, device=device)))
    return shards


def _advance_groups(storages: list[CellStorage], stacks: CellStacks, device) -> list[tuple[int, Tensor, Tensor]]:
    """(bits, cells, pools) per kind of pool, and (0, share cells, zeros): what a step's ``advance_`` launches."""
    groups = []
    for bits in sorted({s.own_bits for s in storages}, reverse=True):
        cells = [i for i, s in enumerate(storages) if s.own_bits == bits]
        pools = [stacks.pool_of[i][1] for i in cells]
        cells, pools = (torch.tensor(x, dtype=torch.int32, device=device) for x in (cells, pools))
        groups.append((bits, cells, pools))  # separate tensors: a compiled step's inputs must not share memory
    return groups
