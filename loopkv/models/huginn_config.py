"""The configuration of a Huginn-style recurrent-depth model, and its dense reference cache.

Field names are those of the released ``tomg-group-umd/huginn-0125`` ``config.json`` (``model_type
"huginn_raven"``): a prelude of ``n_layers_in_prelude`` layers run once, a core block of
``n_layers_in_recurrent_block`` layers run ``r`` times (``mean_recurrence`` by default; chosen per call), a coda of
``n_layers_in_coda`` layers run once. :mod:`loopkv.models.huginn` re-exports every name here; see that module for
the model.

The Huginn family (:mod:`loopkv.families`, registered there as ``"huginn"`` when this module is imported): the
planned cells are (step ``t``, core layer ``j``) for ``T`` steps (``mean_recurrence`` unless a layout is asked for
another count); prelude and coda layers are fixed exact slots, never planned. Cache indices (:class:`HuginnCells`):
prelude layer ``i`` -> ``i``, coda layer ``i`` -> ``P + i``, core layer ``j`` of step ``t`` -> ``P + C + t * R + j``,
so the indices of a call with ``r`` steps do not depend on ``r`` and are the first ``P + C + r * R`` of a layout
for ``T >= r`` steps. A cache for calls of ``r < T`` steps (``LoopKVCache(plan, config=..., loops=r)``) is laid out
for ``r`` steps and serves ``plan.for_loops(r)``: step ``r - 1`` takes the plan's final step's options, and the
``share`` cells read its pages.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from huggingface_hub.dataclasses import strict
from transformers.cache_utils import DynamicCache
from transformers.configuration_utils import PreTrainedConfig

from loopkv.families import FAMILIES, PER_CALL_LOOPS, Layer, ModelLayout, build_layout

__all__ = ["FAMILY", "HuginnCells", "HuginnConfig", "dense_cache", "huginn_layout"]

FAMILY = "huginn"
MODEL_TYPE = "huginn_raven"  # the released config.json's model_type

# What loopkv's Huginn implements; a config naming anything else is refused (the released model uses these).
SUPPORTED = {
    "block_class_name": "SandwichBlock",
    "norm_class_name": "RMSNorm_llama",
    "mlp_class_name": "GatedMLP",
    "nonlin_name": "SiLU",
    "injection_type": "linear",
}
STATE_INITS = ("like-init", "zero")


@strict
class HuginnConfig(PreTrainedConfig):
    """Configuration of a Huginn-style model; defaults are huginn-0125's (2 prelude + 4 core + 2 coda layers,
    r = 32, 55 MHA heads x 96, vocab 65536, RoPE base 50000).

    ``head_dim`` is ``n_embd // n_heads``; ``num_key_value_heads`` defaults to ``n_heads``. ``init_values`` (the
    scales the released file stores: ``std`` of the random initial state, ``embed_scale`` = sqrt(n_embd)) and
    ``effective_expected_depth`` are derived when absent. ``state_init`` is ``"like-init"`` (the released model:
    the recurrent state starts as a truncated normal of std ``init_values["std"]``, times ``embed_scale``) or
    ``"zero"`` (a deterministic zero state). Fields of the training code (``init_strategy``, ``sampling_scheme``,
    ``mean_backprop_depth``, ...) are kept for the file format; inference runs ``r`` steps without gradients.
    """

    model_type = MODEL_TYPE
    keys_to_ignore_at_inference = ["past_key_values", "cache"]
    attribute_map = {"num_attention_heads": "n_heads", "hidden_size": "n_embd", "num_hidden_layers": "n_layers"}

    n_embd: int = 5280
    n_heads: int = 55
    n_layers: int = 8
    block_size: int = 4096
    vocab_size: int = 65536
    padded_vocab_size: int | None = None
    padding_multiple: int = 4096
    tie_embeddings: bool = True
    intermediate_size: int = 17920
    bias: bool = False
    architecture_class_name: str = "RecurrentGPT"
    block_class_name: str = "SandwichBlock"
    norm_class_name: str = "RMSNorm_llama"
    norm_eps: float = 1e-6
    mlp_class_name: str = "GatedMLP"
    nonlin_name: str = "SiLU"
    init_strategy: str = "takase"
    init_orthogonal: bool = False
    state_init: str = "like-init"
    injection_type: str = "linear"
    n_layers_in_recurrent_block: int = 4
    mean_recurrence: int = 32
    sampling_scheme: str = "poisson-lognormal-filling"
    mean_backprop_depth: int = 8
    n_layers_in_prelude: int = 2
    n_layers_in_coda: int = 2
    qk_bias: bool = True
    activation_checkpoint_impl: str = "per-iteration"
    rope_base: float | int = 50_000
    test_time_noise: float | int = 0.0
    test_time_noise_type: str = "none"
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    effective_expected_depth: int | None = None
    init_values: dict | None = None
    use_cache: bool = True
    tie_word_embeddings: bool | None = None
    bos_token_id: int | None = 65504
    eos_token_id: int | list[int] | None = 65505
    pad_token_id: int | None = 65509

    def __post_init__(self, **kwargs):
        if self.padded_vocab_size is None:
            self.padded_vocab_size = self.vocab_size
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.n_heads
        if self.head_dim is None:
            self.head_dim = self.n_embd // self.n_heads
        if self.effective_expected_depth is None:
            self.effective_expected_depth = (self.n_layers_in_prelude + self.n_layers_in_coda
                                             + self.n_layers_in_recurrent_block * self.mean_recurrence)
        if self.init_values is None:
            std = math.sqrt(2 / (5 * self.n_embd))
            self.init_values = {"std": std, "out_proj": std / math.sqrt(2 * self.effective_expected_depth),
                                "embedding": std, "embed_scale": math.sqrt(self.n_embd)}
        # the released file has both names; tie_embeddings is the model's own
        self.tie_word_embeddings = self.tie_embeddings
        self._check()
        super().__post_init__(**kwargs)

    def _check(self) -> None:
        # plain ValueErrors: `validate_*` methods would raise huggingface_hub's own error type
        for name, value in SUPPORTED.items():
            if getattr(self, name) != value:
                raise ValueError(f"{name}={getattr(self, name)!r} is not supported by loopkv's Huginn (only "
                                 f"{value!r}, as in huginn-0125); use a checkpoint of that architecture")
        if self.state_init not in STATE_INITS:
            raise ValueError(f"state_init must be one of {STATE_INITS}, got {self.state_init!r}")
        if self.test_time_noise:
            raise ValueError(f"test_time_noise={self.test_time_noise} is not supported by loopkv's Huginn; set it "
                             "to 0 (huginn-0125 runs without it)")
        parts = (self.n_layers_in_prelude, self.n_layers_in_recurrent_block, self.n_layers_in_coda)
        if min(parts) < 0 or self.n_layers_in_recurrent_block < 1 or sum(parts) != self.n_layers:
            raise ValueError(f"n_layers ({self.n_layers}) must equal n_layers_in_prelude + "
                             f"n_layers_in_recurrent_block + n_layers_in_coda ({' + '.join(map(str, parts))}), "
                             "with at least one core layer")
        if self.mean_recurrence < 1:
            raise ValueError(f"mean_recurrence (the default number of core steps) must be >= 1, got "
                             f"{self.mean_recurrence}")
        if self.n_heads * self.head_dim != self.n_embd:
            raise ValueError(f"n_heads * head_dim ({self.n_heads} * {self.head_dim}) must equal n_embd "
                             f"({self.n_embd})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim ({self.head_dim}) must be even (RoPE rotates channel pairs)")
        if self.n_heads % self.num_key_value_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must be a multiple of num_key_value_heads "
                             f"({self.num_key_value_heads})")
        if self.qk_bias and self.num_key_value_heads != self.n_heads:
            raise ValueError(f"qk_bias adds one bias per query head to the keys too, so it needs num_key_value_heads "
                             f"== n_heads ({self.n_heads}), got {self.num_key_value_heads}; set qk_bias=False for "
                             "grouped heads")

    @property
    def embed_scale(self) -> float:
        """The factor on the token embeddings (and on a random initial state): ``init_values["embed_scale"]``."""
        return float(self.init_values["embed_scale"])

    def steps(self, num_steps: Any = None) -> int:
        """The number of core steps ``r`` of a call: ``num_steps`` (an int or a 0-d/1-element tensor), else
        ``mean_recurrence``; a ``ValueError`` names a bad value."""
        if num_steps is None:
            return self.mean_recurrence
        if hasattr(num_steps, "numel") and num_steps.numel() == 1:
            num_steps = num_steps.item()
        if isinstance(num_steps, bool) or not hasattr(num_steps, "__index__") or num_steps.__index__() < 1:
            raise ValueError(f"num_steps (the core block's repetitions r) must be a positive int, got {num_steps!r}")
        return num_steps.__index__()


def dense_cache(config: HuginnConfig) -> DynamicCache:
    """The exact reference cache: a ``DynamicCache`` that adds one dense layer per cache index as the model first
    writes it (prelude and coda layers, and one per (step, core layer) for however many steps a call runs)."""
    return DynamicCache()


def _get(config: Any, name: str) -> Any:
    return config.get(name) if isinstance(config, Mapping) else getattr(config, name, None)


@dataclass(frozen=True)
class HuginnCells:
    """The cache index of every attention layer a call runs: ``P`` prelude, ``R`` core and ``C`` coda layers."""

    prelude: int
    core: int
    coda: int

    @classmethod
    def of(cls, config: Any) -> HuginnCells:
        """From a :class:`HuginnConfig` or a mapping with its fields."""
        return cls(*(int(_get(config, f"n_layers_in_{part}")) for part in ("prelude", "recurrent_block", "coda")))

    def prelude_index(self, i: int) -> int:
        return i

    def coda_index(self, i: int) -> int:
        return self.prelude + i

    def core_index(self, step: int, j: int) -> int:
        return self.prelude + self.coda + step * self.core + j

    def num_indices(self, steps: int) -> int:
        """Cache indices a call of ``steps`` core steps writes."""
        return self.prelude + self.coda + steps * self.core


def huginn_layout(config: Any, loops: int | None = None) -> ModelLayout:
    """The Huginn family's :class:`~loopkv.families.ModelLayout` for ``loops`` core steps (default
    ``mean_recurrence``): planned cells (step, core layer), prelude and coda layers as fixed exact slots."""
    cells = HuginnCells.of(config)
    loops = int(_get(config, "mean_recurrence")) if loops is None else loops
    p, r = cells.prelude, cells.core
    return build_layout(
        family=FAMILY, loops=loops,
        prelude=[Layer(i, index=cells.prelude_index(i)) for i in range(p)],
        core=[Layer(p + j) for j in range(r)],
        coda=[Layer(p + r + i, index=cells.coda_index(i)) for i in range(cells.coda)],
        core_index=cells.core_index, num_layers=p + r + cells.coda,
    )


def _is_huginn(config: Any) -> bool:
    return _get(config, "model_type") == MODEL_TYPE


FAMILIES.setdefault(FAMILY, (_is_huginn, huginn_layout, None))  # loopkv's own table: layout_of(HuginnConfig)
PER_CALL_LOOPS.add(FAMILY)  # r is chosen per call: LoopKVCache(plan, config=..., loops=r)
