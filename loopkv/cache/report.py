"""What a LoopKVCache really allocates, measured from its tensors' ``nbytes`` (not estimated).

KIVI users found caches that store far more than claimed (KIVI #17); here the history bytes per token
are computed from the pools that exist and compared with the byte model (``loopkv.planning.bytes``).
"""

from __future__ import annotations

from dataclasses import dataclass

from loopkv.cache.storage import POOL_FIELDS, nbytes
from loopkv.format import PAGE
from loopkv.planning.bytes import ModelShape

KIB = 1024
_COMPONENT = {
    "sink_k": "sink", "sink_v": "sink", "win_k": "window", "win_v": "window", "lengths": "lengths",
    "page_table": "page_table", "k_pages": "codes", "v_hi": "codes", "v_lo": "codes",
    "k_scale": "scales", "k_zero": "scales", "v_scale": "scales", "v_zero": "scales",
}


@dataclass(frozen=True)
class MemoryReport:
    """Allocated bytes of one cache.

    by_component: bytes per component (sink, window, codes, scales, page_table, lengths), all cells.
    by_cell: bytes each cell allocated itself (a ``share`` cell's pool is its source's), flat index order.
    history_stored_kib: allocated history bytes per history token slot (pools / (rows * pages * 32)),
        summed over cells; equals the byte model's ``stored_kib``.
    model_stored_kib, model_read_kib: the byte model for this plan (``plan.bytes_per_token``), the model's fixed
        exact slots included (``fixed_kib``: prelude/coda full-attention layers; 0 for Ouro; a sliding layer's window
        holds no history).
    exact_bytes_per_row: sink + window ring bytes per row, over all cells and sliding layers' windows
        (``loopkv.cache.paging.exact_bytes_per_row`` computes it from the config).
    """

    total_bytes: int
    by_component: dict
    by_cell: tuple
    history_stored_kib: float
    model_stored_kib: float
    model_read_kib: float
    exact_bytes_per_row: int

    def __str__(self) -> str:
        lines = [f"LoopKVCache memory: {self.total_bytes / 2**20:.2f} MiB allocated"]
        for name, b in sorted(self.by_component.items(), key=lambda kv: -kv[1]):
            lines.append(f"  {name:<11} {b / 2**20:10.3f} MiB")
        lines.append(f"  history per token: {self.history_stored_kib:.3f} KiB stored (allocated), byte model "
                     f"{self.model_stored_kib:.3f} stored / {self.model_read_kib:.3f} read KiB")
        lines.append(f"  exact sink + window per row: {self.exact_bytes_per_row / 2**20:.3f} MiB")
        return "\n".join(lines)


def memory_report(cache) -> MemoryReport:
    by_component: dict[str, int] = {}
    by_cell = []
    history = 0
    slots = 0
    exact = 0
    for layer in cache.layers:
        st = layer.storage
        own = st.own_tensors()
        cell_bytes = 0
        for name, t in own.items():
            b = nbytes(t)
            cell_bytes += b
            comp = _COMPONENT[name]
            by_component[comp] = by_component.get(comp, 0) + b
            if name in ("sink_k", "sink_v", "win_k", "win_v"):
                exact += b
        by_cell.append(cell_bytes)
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
        exact_bytes_per_row=exact // cache.max_batch_size,
    )
