"""Ouro's configuration and the dense reference caches with one layer per (loop, layer) cell.

:mod:`loopkv.models.ouro` re-exports every name here; see that module for the model.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from huggingface_hub.dataclasses import strict
from transformers.cache_utils import DynamicCache, StaticCache
from transformers.configuration_utils import PreTrainedConfig
from transformers.modeling_rope_utils import RopeParameters

from loopkv.cells import CellLayout

__all__ = ["OuroConfig", "dense_cache", "static_dense_cache"]


@strict
class OuroConfig(PreTrainedConfig):
    """Configuration of an Ouro model; field names are those of the released ``config.json``.

    Defaults are Ouro-1.4B's (L=24 layers, T=4 loops, 16 MHA heads x 128, vocab 49152, θ=1e6).
    ``early_exit_threshold`` is kept for the file format only: inference always runs all T loops and reads
    the final loop (the released value, 1.0, means exactly that), or loop ``exit_at_step`` when asked.
    Legacy ``rope_theta`` / ``rope_scaling`` keys (as in the released files) are folded into
    ``rope_parameters`` by transformers; only the default (unscaled) RoPE is supported.
    ``head_dim`` defaults to ``hidden_size // num_attention_heads``.
    """

    model_type = "ouro"
    keys_to_ignore_at_inference = ["past_key_values", "cache"]
    default_theta = 1_000_000.0

    vocab_size: int = 49152
    hidden_size: int = 2048
    intermediate_size: int = 5632
    num_hidden_layers: int = 24
    num_attention_heads: int = 16
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    hidden_act: str = "silu"
    max_position_embeddings: int = 65536
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-6
    use_cache: bool = True
    tie_word_embeddings: bool = False
    rope_parameters: RopeParameters | dict | None = None
    use_sliding_window: bool = False
    sliding_window: int | None = 4096
    max_window_layers: int = 28
    layer_types: list[str] | None = None
    attention_dropout: float | int = 0.0
    total_ut_steps: int = 4
    early_exit_threshold: float | int = 1.0
    pad_token_id: int | None = 0
    bos_token_id: int | None = 0
    eos_token_id: int | list[int] | None = 0

    def __post_init__(self, **kwargs):
        self.sliding_window = self.sliding_window if self.use_sliding_window else None
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.layer_types is None:
            self.layer_types = [
                "sliding_attention"
                if self.sliding_window is not None and i >= self.max_window_layers
                else "full_attention"
                for i in range(self.num_hidden_layers)
            ]
        self._check_loops_and_heads()
        super().__post_init__(**kwargs)

    def _check_loops_and_heads(self) -> None:
        # a plain ValueError here: `validate_*` methods would raise huggingface_hub's own error type
        if self.total_ut_steps < 1:
            raise ValueError(f"total_ut_steps must be >= 1, got {self.total_ut_steps}")
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of num_key_value_heads "
                f"({self.num_key_value_heads})"
            )

    @property
    def cell_layout(self) -> CellLayout:
        """The (loop, layer) cells: T = ``total_ut_steps``, L = ``num_hidden_layers``."""
        return CellLayout(loops=self.total_ut_steps, layers=self.num_hidden_layers)


def dense_cache(config: OuroConfig) -> DynamicCache:
    """The exact reference cache: a ``DynamicCache`` with one dense layer per cell (``T * L`` layers).

    transformers' own ``DynamicCache(config=...)`` builds only ``L`` layers (IndexError at cell ``L``);
    this one is built through ``DynamicCache``'s per-layer constructor path, empty, with a sliding
    layer wherever ``config.layer_types[cell % L]`` is ``"sliding_attention"``.
    """
    layout = config.cell_layout
    entries: list[tuple[Any, ...]] = []
    for cell in layout:
        if config.layer_types[cell.layer] == "sliding_attention":
            entries.append((None, None, torch.tensor(config.sliding_window, dtype=torch.long)))
        else:
            entries.append((None, None))
    return DynamicCache(ddp_cache_data=entries)


def static_dense_cache(config: OuroConfig, *, max_cache_len: int) -> StaticCache:
    """transformers' ``StaticCache`` with one preallocated dense layer per cell (``T * L`` layers).

    The dense BF16 baseline a transformers user compiles (``generate(..., compile_config=...)``).
    ``StaticCache(config=...)`` alone builds ``L`` layers; this copies each (still empty, lazily
    allocated) layer of the physical layer ``cell % L`` into every loop, so sliding layers stay sliding.
    """
    if not isinstance(max_cache_len, int) or max_cache_len < 1:
        raise ValueError(f"max_cache_len must be a positive int, got {max_cache_len!r}")
    cache = StaticCache(config=config, max_cache_len=max_cache_len)
    per_layer = list(cache.layers)
    cache.layers = [copy.deepcopy(per_layer[cell.layer]) for cell in config.cell_layout]
    return cache
