"""A LoopKVCache's per-cell pieces: the handle ``update()`` returns and the transformers cache layer of one cell."""

from __future__ import annotations

import torch
from torch import Tensor
from transformers.cache_utils import CacheLayerMixin

from loopkv.cache.storage import CellStorage


def _capturing(device: torch.device) -> bool:
    """True while a CUDA graph is being captured on the current stream (no host syncs allowed then)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _no_host_sync(device: torch.device) -> bool:
    """While compiling or capturing a CUDA graph a host sync would break the graph: read no device value."""
    return torch.compiler.is_compiling() or _capturing(device)


class LoopKVHandle:
    """What ``LoopKVCache.update`` returns in place of dense K/V: the cache, the cell and its new tokens
    (k_new, v_new [B, H, S, D]). Only the ``"loopkv"`` attention function reads it."""

    __slots__ = ("cache", "cell_index", "k_new", "v_new")
    is_loopkv_handle = True

    def __init__(self, cache, cell_index: int, k_new: Tensor, v_new: Tensor):
        self.cache = cache
        self.cell_index = cell_index
        self.k_new = k_new
        self.v_new = v_new

    def __getattr__(self, name: str):
        raise AttributeError(
            f"a LoopKVCache returned a handle from update(), and this model's attention function asked it for "
            f"{name!r}: only the 'loopkv' attention function reads it. Use a model whose attention dispatches to "
            "it (loopkv.models.ouro does), or load the model with attn_implementation='loopkv' after "
            "loopkv.register()"
        )


class LoopKVCell(CacheLayerMixin):
    """One cell's transformers cache layer; its tensors are the named fields of :class:`CellStorage`."""

    is_compileable = True
    is_sliding = False
    is_croppable = False

    read_by = None  # (cache, index) when earlier loops read this index's cache (Dory's last_loop mode)

    def __init__(self, storage: CellStorage, *, max_cache_len: int):
        super().__init__()
        self.storage = storage
        self.max_cache_len = max_cache_len
        self.is_initialized = True

    # transformers' layers hold their K/V as .keys/.values; this one holds no dense tensors. Where earlier loops read
    # this index's cache (loopkv/cache/last_loop.py) they stand for it, a fresh object each time the model takes them
    @property
    def keys(self):
        return self._past("k")

    @keys.setter
    def keys(self, value) -> None:
        assert value is None, "a LoopKVCell holds no dense keys"

    @property
    def values(self):
        return self._past("v")

    @values.setter
    def values(self, value) -> None:
        assert value is None, "a LoopKVCell holds no dense values"

    def _past(self, part: str):
        if self.read_by is None:
            return None
        from loopkv.cache.last_loop import SourcePast

        return SourcePast(*self.read_by, part)

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        """Storage is preallocated at construction: nothing to do."""

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs):
        raise RuntimeError("LoopKVCell is updated through LoopKVCache.update(k, v, layer_idx)")

    def get_mask_sizes(self, query_length) -> tuple[int, int]:
        q = query_length if isinstance(query_length, int) else int(query_length.shape[0])
        # decode: a constant size (no recompiles); the loopkv kernel masks from device lengths
        return (self.max_cache_len, 0) if q == 1 else (q, 0)

    def get_seq_length(self) -> int:
        """Tokens of the longest row; a 0-d tensor while compiling or capturing a CUDA graph (no host sync,
        no graph break; transformers' mask helpers call this every step)."""
        longest = self.storage.lengths.max()
        if _no_host_sync(longest.device):
            return longest
        return int(longest)

    def get_max_length(self) -> int:
        return self.max_cache_len

    def reset(self) -> None:
        self.storage.lengths.zero_()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise RuntimeError("reorder through LoopKVCache.reorder_cache")
