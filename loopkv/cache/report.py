"""What a LoopKVCache really allocates, measured from its tensors' storage (not estimated).

KIVI users found caches that store far more than claimed (KIVI #17); here the bytes are those of the storages the
cells' tensors live in, the stacked buffers' 16-byte padding of each cell's slice included (``loopkv.format.
aligned_bytes``), and are set beside the byte model (``loopkv.planning.bytes``): history bytes per token against
``plan.bytes_per_token``, the rows' exact parts against ``exact_bytes``.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from loopkv.cache.storage import POOL_FIELDS, nbytes
from loopkv.format import PAGE
from loopkv.planning.bytes import ExactBytes, ModelShape, exact_bytes

KIB = 1024
_COMPONENT = {
    "sink_k": "sink", "sink_v": "sink", "win_k": "window", "win_v": "window", "lengths": "lengths",
    "page_table": "page_table", "k_pages": "codes", "v_hi": "codes", "v_lo": "codes",
    "k_scale": "scales", "k_zero": "scales", "v_scale": "scales", "v_zero": "scales",
}
_EXACT = ("sink_k", "sink_v", "win_k", "win_v", "lengths")


@dataclass(frozen=True)
class MemoryReport:
    """Allocated bytes of one cache.

    total_bytes: every byte the cells' tensors hold, padding included (each stacked buffer once).
    by_component: bytes per component (sink, window, codes, scales, page_table, lengths), all cells, each with its
        buffers' padding.
    by_cell: bytes each cell allocated itself (its slices of the stacked buffers, padding included; a ``share``
        cell's pool is its source's), flat index order.
    history_stored_kib: allocated history bytes per history token slot (pools / (rows * pages * 32)),
        summed over cells; equals the byte model's ``stored_kib``.
    model_stored_kib, model_read_kib: the byte model for this plan (``plan.bytes_per_token``), the model's fixed
        exact slots included (``fixed_kib``: prelude/coda full-attention layers; 0 for Ouro; a sliding layer's window
        holds no history).
    exact: the exact parts of all ``max_batch_size`` rows as allocated (every cache index's sink, window ring and
        lengths, the sliding layers' windows), K/V, lengths and padding apart; model_exact: the byte model's
        ``loopkv.planning.bytes.exact_bytes`` for this cache, equal to it.
    """

    total_bytes: int
    by_component: dict
    by_cell: tuple
    history_stored_kib: float
    model_stored_kib: float
    model_read_kib: float
    exact: ExactBytes
    model_exact: ExactBytes

    def __str__(self) -> str:
        lines = [f"LoopKVCache memory: {self.total_bytes / 2**20:.2f} MiB allocated"]
        for name, b in sorted(self.by_component.items(), key=lambda kv: -kv[1]):
            lines.append(f"  {name:<11} {b / 2**20:10.3f} MiB")
        lines.append(f"  history per token: {self.history_stored_kib:.3f} KiB stored (allocated), byte model "
                     f"{self.model_stored_kib:.3f} stored / {self.model_read_kib:.3f} read KiB")
        lines.append(f"  exact parts (sinks, windows, lengths): {self.exact.total / 2**20:.3f} MiB for all rows, "
                     f"{self.exact.padding} bytes of it padding")
        return "\n".join(lines)


def _storage_shares(cache) -> list[dict[str, int]]:
    """Per cache index, the bytes each of its own tensors holds of its storage: a stacked buffer's bytes split evenly
    among the cells that own a slice of it (every slice is one padded row), a tensor of its own all of its storage."""
    owners: dict[int, list[tuple[int, str]]] = {}
    sizes: dict[int, int] = {}
    for i, layer in enumerate(cache.layers):
        for name, t in layer.storage.own_tensors().items():
            storage = t.untyped_storage()
            key = storage.data_ptr() if storage.nbytes() else -1  # empty storages may share address 0
            owners.setdefault(key, []).append((i, name))
            sizes[key] = storage.nbytes()
    shares: list[dict[str, int]] = [{} for _ in cache.layers]
    for key, held in owners.items():
        assert sizes[key] % len(held) == 0, "a stacked buffer's cells own equal padded slices"
        for i, name in held:
            shares[i][name] = sizes[key] // len(held)
    return shares


def memory_report(cache) -> MemoryReport:
    by_component: dict[str, int] = {}
    by_cell = []
    history = 0
    slots = 0
    kv = lengths = exact_held = 0
    for layer, held in zip(cache.layers, _storage_shares(cache), strict=True):
        st = layer.storage
        own: dict[str, Tensor] = st.own_tensors()
        for name, b in held.items():
            comp = _COMPONENT[name]
            by_component[comp] = by_component.get(comp, 0) + b
        by_cell.append(sum(held.values()))
        kv += sum(nbytes(own[n]) for n in _EXACT[:4])
        lengths += nbytes(own["lengths"])
        exact_held += sum(held[n] for n in _EXACT)
        if st.own_bits:
            pages = st.page_table.numel()
            slots = max(slots, pages * PAGE)
            history_cell = sum(nbytes(own[n]) for n in POOL_FIELDS if n in own)
            history += history_cell / max(pages * PAGE, 1)
    shape = ModelShape(cache.layout.loops, cache.layout.layers, cache.kv_heads, cache.head_dim,
                       family=cache.layout.family, fixed=len(cache.layout.fixed("exact")))
    model = cache.plan.bytes_per_token(shape, dtype_bytes=cache.dtype.itemsize)
    return MemoryReport(
        total_bytes=sum(by_cell), by_component=by_component, by_cell=tuple(by_cell),
        history_stored_kib=history / KIB if slots else 0.0,
        model_stored_kib=model.stored_kib + model.fixed_kib, model_read_kib=model.read_kib + model.fixed_kib,
        exact=ExactBytes(kv=kv, lengths=lengths, padding=exact_held - kv - lengths),
        model_exact=exact_bytes(shape, layout=cache.layout, rows=cache.max_batch_size,
                                max_cache_len=cache.max_cache_len, dtype_bytes=cache.dtype.itemsize),
    )
