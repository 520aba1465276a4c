"""Clean-room Ouro (ByteDance's looped transformer) for transformers 5.x.

Ouro runs one block of ``L = num_hidden_layers`` sandwich-norm decoder layers ``T = total_ut_steps`` times
per token. Every (loop ``t``, layer ``l``) pair is a *cell* with its own KV cache, reached through
``Cache.update(k, v, t * L + l, cache_kwargs)``. This module loads the released checkpoints with their
own parameter names and ``config.json`` and registers ``model_type="ouro"`` with the Auto classes when
:func:`register_ouro` is called (never at import).

Forward semantics (those the released checkpoints were trained with): Qwen2-style RMSNorm,
``h = x + norm2(attn(norm1(x)))`` then ``h + norm4(mlp(norm3(h)))``, ``model.norm`` applied at the end of
*every* loop (the normed state is the next loop's input), neox RoPE computed once per forward and shared by
all loops. All T loops always run and write their cells; the logits come from the final loop unless
``exit_at_step`` is given.

Works with transformers 5.17 (cache argument ``past_key_values``) and 5.24 (renamed to ``cache``): the
forward accepts both names and returns the cache under the name the installed version's
``CausalLMOutputWithPast`` uses.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache
from transformers.generation import GenerationMixin
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
from transformers.modeling_outputs import CausalLMOutputWithPast, ModelOutput
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, PreTrainedModel

from loopkv.models.cache_args import OUTPUT_CACHE_FIELD, generate_cache_kwargs, mask_piece, pick_cache
from loopkv.models.generation_checks import (
    GENERATED,
    check_capacity,
    check_continues,
    refuse_layer_cache,
    replace_default_cache,
)
from loopkv.models.ouro_config import OuroConfig, dense_cache, static_dense_cache

__all__ = [
    "OuroConfig",
    "OuroForCausalLM",
    "OuroModel",
    "OuroModelOutput",
    "OuroPreTrainedModel",
    "dense_cache",
    "register",
    "register_ouro",
    "static_dense_cache",
]

class OuroRMSNorm(nn.Module):
    """Qwen2-style RMSNorm: fp32 ``x * rsqrt(mean(x^2) + eps)``, cast back, *then* times the weight."""

    def __init__(self, hidden_size: int, *, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:  # [..., H] -> [..., H]
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class OuroMLP(nn.Module):
    """``down(act(gate(x)) * up(x))``, no biases."""

    def __init__(self, config: OuroConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def _default_inv_freq(config: OuroConfig) -> torch.Tensor:
    """``theta ** (-2i / D)`` for ``i in [0, D/2)``, fp32 ``[D/2]``."""
    params = config.rope_parameters or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise ValueError(
            f"rope type {rope_type!r} is not supported by loopkv's Ouro (the released models use none); "
            "set rope_scaling / rope_parameters to the default RoPE"
        )
    base = params.get("rope_theta", config.default_theta)
    dim = config.head_dim
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float) / dim))


class OuroRotaryEmbedding(nn.Module):
    """Neox RoPE tables: ``cos, sin`` of ``position * inv_freq``, duplicated over both halves."""

    def __init__(self, config: OuroConfig) -> None:
        super().__init__()
        self.config = config
        self.register_buffer("inv_freq", _default_inv_freq(config), persistent=False)  # [D/2]

    @torch.no_grad()
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``position_ids [B|1, S]`` -> ``(cos, sin)``, each ``[B|1, S, D]`` in ``x.dtype``."""
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Neox RoPE: ``x [B, H, S, D]``, ``cos/sin [B|1, S, D]``."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + _rotate_half(x) * sin


def _repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """``[B, H_kv, S, D]`` -> ``[B, H_kv * groups, S, D]`` (each KV head repeated for its query heads)."""
    if groups == 1:
        return x
    b, h, s, d = x.shape
    return x[:, :, None].expand(b, h, groups, s, d).reshape(b, h * groups, s, d)


def eager_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain softmax attention. ``query [B, Hq, S, D]``, ``key/value [B, Hkv, N, D]``, additive mask
    ``[B, 1, S, N]`` -> ``(out [B, S, Hq, D], weights [B, Hq, S, N])``."""
    key = _repeat_kv(key, module.num_key_value_groups)
    value = _repeat_kv(value, module.num_key_value_groups)
    weights = torch.matmul(query, key.transpose(2, 3)) * scaling
    if attention_mask is not None:
        weights = weights + attention_mask
    weights = nn.functional.softmax(weights, dim=-1, dtype=torch.float32).to(query.dtype)
    weights = nn.functional.dropout(weights, p=dropout, training=module.training)
    out = torch.matmul(weights, value).transpose(1, 2).contiguous()
    return out, weights


class OuroAttention(nn.Module):
    """Ouro self-attention: no biases, neox RoPE, ``scaling = head_dim**-0.5``, causal, GQA-capable.

    One module serves all T loops of its layer; the cell index ``t * L + layer_idx`` is passed per call.
    """

    def __init__(self, config: OuroConfig, layer_idx: int) -> None:
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx  # physical layer l, not the cell
        self.head_dim = config.head_dim
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.attention_dropout = config.attention_dropout
        self.is_causal = True
        layer_type = config.layer_types[layer_idx]
        self.sliding_window = config.sliding_window if layer_type == "sliding_attention" else None
        h, hq, hkv = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
        self.q_proj = nn.Linear(h, hq * self.head_dim, bias=False)
        self.k_proj = nn.Linear(h, hkv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(h, hkv * self.head_dim, bias=False)
        self.o_proj = nn.Linear(hq * self.head_dim, h, bias=False)

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: Any,
        *,
        cache: Cache | None,
        cell_index: int,
        **kwargs: Any,
    ) -> torch.Tensor:
        """``hidden_states [B, S, H]`` -> ``[B, S, H]``; writes cell ``cell_index`` of ``cache``."""
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)  # [B, Hq, S, D]
        key = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)  # [B, Hkv, S, D]
        value = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)  # [B, Hkv, S, D]
        cos, sin = position_embeddings
        query, key = apply_rope(query, cos, sin), apply_rope(key, cos, sin)

        if cache is not None:
            cache_kwargs = {"sin": sin, "cos": cos, "position_ids": kwargs.get("position_ids")}
            key, value = cache.update(key, value, cell_index, cache_kwargs)

        # a cache that needs its own attention function names it (LoopKVCache: "loopkv", registered by the cache)
        implementation = getattr(cache, "attention_implementation", None) or self.config._attn_implementation
        attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(implementation, eager_attention_forward)
        if self.sliding_window is not None:
            kwargs["sliding_window"] = self.sliding_window
        out, _ = attention_interface(
            self,
            query,
            key,
            value,
            attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling,
            **kwargs,
        )
        out = out.reshape(*input_shape, -1).contiguous()  # [B, S, Hq * D]
        return self.o_proj(out)


class OuroDecoderLayer(nn.Module):
    """Sandwich block: ``h = x + ln2(attn(ln1(x)))``; ``out = h + ln4(mlp(ln3(h)))``."""

    def __init__(self, config: OuroConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = OuroAttention(config, layer_idx)
        self.mlp = OuroMLP(config)
        eps = config.rms_norm_eps
        self.input_layernorm = OuroRMSNorm(config.hidden_size, eps=eps)
        self.input_layernorm_2 = OuroRMSNorm(config.hidden_size, eps=eps)
        self.post_attention_layernorm = OuroRMSNorm(config.hidden_size, eps=eps)
        self.post_attention_layernorm_2 = OuroRMSNorm(config.hidden_size, eps=eps)

    def forward(self, hidden_states: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        attn = self.self_attn(self.input_layernorm(hidden_states), **kwargs)
        hidden_states = hidden_states + self.input_layernorm_2(attn)
        mlp = self.mlp(self.post_attention_layernorm(hidden_states))
        return hidden_states + self.post_attention_layernorm_2(mlp)


class OuroPreTrainedModel(PreTrainedModel):
    config_class = OuroConfig
    attention_from_cache = True  # a cache naming an attention function gets it (loopkv.serving relies on this)
    config: OuroConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = False
    _no_split_modules = ["OuroDecoderLayer"]
    _supports_sdpa = True
    _supports_flash_attn = False
    _supports_flex_attn = False
    _supports_attention_backend = True
    _can_compile_fullgraph = True

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, OuroRotaryEmbedding):
            init.copy_(module.inv_freq, _default_inv_freq(module.config))
        else:
            super()._init_weights(module)


@dataclasses.dataclass
class OuroModelOutput(ModelOutput):
    """``last_hidden_state [B, S, H]``: the normed output of the selected loop (the final one by default);
    ``cache``: the cache that was written (``None`` without ``use_cache``)."""

    last_hidden_state: torch.Tensor | None = None
    cache: Cache | None = None


def _as_dense_mask(attention_mask: Any) -> torch.Tensor | None:
    return attention_mask if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2 else None


class OuroModel(OuroPreTrainedModel):
    """Embedding, the L shared layers run T times, the final norm (after every loop), the exit gate."""

    def __init__(self, config: OuroConfig) -> None:
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList([OuroDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = OuroRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.early_exit_gate = nn.Linear(config.hidden_size, 1, bias=True)
        self.rotary_emb = OuroRotaryEmbedding(config)
        self.has_sliding_layers = "sliding_attention" in config.layer_types
        self.post_init()

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: Any = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        exit_at_step: int | None = None,
        cache: Cache | None = None,
        **kwargs: Any,
    ) -> OuroModelOutput:
        """``input_ids [B, S]`` (or ``inputs_embeds [B, S, H]``) -> normed hidden states ``[B, S, H]``.

        ``attention_mask``: 2-D ``[B, past + S]`` (1 = token, 0 = left padding), a prepared 4-D mask,
        or a ``{layer_type: mask}`` dict from ``generate``. Without ``position_ids`` they come from the
        2-D mask's cumulative sum (as ``generate`` does), else from the cache length.
        """
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids and inputs_embeds")
        steps = self.config.total_ut_steps
        if exit_at_step is not None and not 0 <= exit_at_step < steps:
            raise ValueError(f"exit_at_step must be in [0, {steps}) (total_ut_steps), got {exit_at_step}")
        cache = pick_cache(past_key_values, cache)
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        if use_cache and cache is None:
            cache = dense_cache(self.config)

        q_len = inputs_embeds.shape[1]
        if position_ids is None:
            mask_2d = _as_dense_mask(attention_mask)
            if mask_2d is not None:
                position_ids = (mask_2d.long().cumsum(-1) - 1).masked_fill(mask_2d == 0, 0)[:, -q_len:]
            else:
                past = cache.get_seq_length() if cache is not None else 0
                position_ids = (torch.arange(q_len, device=inputs_embeds.device) + past).unsqueeze(0)

        limit = getattr(cache, "continuation_limit", None)
        if limit is not None and q_len > limit and not torch.compiler.is_compiling() and cache.get_seq_length():
            return self._forward_in_pieces(limit, inputs_embeds, attention_mask, position_ids, cache, use_cache,
                                           exit_at_step, **kwargs)

        if getattr(cache, "builds_no_mask", False):  # a continuous-batching engine's packed step (loopkv/serving)
            mask_by_type = dict.fromkeys(self.config.layer_types, None)
        elif isinstance(attention_mask, dict):
            mask_by_type = attention_mask
        else:
            # positional: the 4th parameter is `past_key_values` in 5.17 and `cache` in 5.24
            mask_args = (self.config, inputs_embeds, attention_mask, cache)
            mask_by_type = {"full_attention": create_causal_mask(*mask_args, position_ids=position_ids)}
            if self.has_sliding_layers:
                mask_by_type["sliding_attention"] = create_sliding_window_causal_mask(
                    *mask_args, position_ids=position_ids
                )

        hidden_states = inputs_embeds
        position_embeddings = self.rotary_emb(hidden_states, position_ids)
        num_layers = self.config.num_hidden_layers
        selected = None
        for t in range(steps):
            for layer_idx, layer in enumerate(self.layers):
                hidden_states = layer(
                    hidden_states,
                    position_embeddings=position_embeddings,
                    attention_mask=mask_by_type[self.config.layer_types[layer_idx]],
                    cache=cache,
                    cell_index=t * num_layers + layer_idx,
                    position_ids=position_ids,
                    **kwargs,
                )
            hidden_states = self.norm(hidden_states)
            if t == exit_at_step:
                selected = hidden_states
        return OuroModelOutput(
            last_hidden_state=hidden_states if selected is None else selected,
            cache=cache if use_cache else None,
        )


    def _forward_in_pieces(self, limit, inputs_embeds, attention_mask, position_ids, cache, use_cache,
                           exit_at_step, **kwargs) -> OuroModelOutput:
        """A later turn longer than the cache's ``continuation_limit`` (a LoopKVCache plan with ``share`` cells),
        run as consecutive forwards of at most ``limit`` tokens: the same tokens, positions and mask columns."""
        q_len = inputs_embeds.shape[1]
        pieces = []
        for start in range(0, q_len, limit):
            end = min(q_len, start + limit)
            pieces.append(self.forward(
                inputs_embeds=inputs_embeds[:, start:end], attention_mask=mask_piece(attention_mask, q_len, end,
                                                                                     end - start),
                position_ids=position_ids[..., start:end], cache=cache, use_cache=use_cache,
                exit_at_step=exit_at_step, **kwargs,
            ).last_hidden_state)
        return OuroModelOutput(last_hidden_state=torch.cat(pieces, dim=1), cache=cache if use_cache else None)


def _kept(hidden_states: torch.Tensor, logits_to_keep: int | torch.Tensor) -> torch.Tensor:
    """The positions whose logits are wanted: the last ``logits_to_keep`` (0: all), or those a tensor indexes."""
    if isinstance(logits_to_keep, int):
        return hidden_states[:, -logits_to_keep:] if logits_to_keep else hidden_states
    return hidden_states[:, logits_to_keep]


class OuroForCausalLM(OuroPreTrainedModel, GenerationMixin):
    """Ouro with its LM head. The default cache is :func:`dense_cache` (the exact reference)."""

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: OuroConfig) -> None:
        super().__init__(config)
        self.model = OuroModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    @classmethod
    def from_pretrained(cls, *args: Any, strict: bool = True, **kwargs: Any):
        """``PreTrainedModel.from_pretrained``, but with ``strict=True`` (the default) a checkpoint whose
        parameter names or shapes differ from the model's raises ``ValueError`` instead of leaving
        randomly initialized weights."""
        want_info = kwargs.pop("output_loading_info", False)
        model, info = super().from_pretrained(*args, output_loading_info=True, **kwargs)
        if strict:
            problems = {
                name: sorted(str(k) for k in info.get(name) or ())
                for name in ("missing_keys", "unexpected_keys", "mismatched_keys")
            }
            if any(problems.values()):
                details = "; ".join(f"{name}: {keys}" for name, keys in problems.items() if keys)
                raise ValueError(
                    f"checkpoint does not match {cls.__name__} ({details}); check the checkpoint and "
                    "config.json, or pass strict=False to load anyway"
                )
        return (model, info) if want_info else model

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: Any = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        exit_at_step: int | None = None,
        cache: Cache | None = None,
        **kwargs: Any,
    ) -> CausalLMOutputWithPast:
        """Logits ``[B, S, V]`` (or the last ``logits_to_keep`` positions) from the final loop, or from
        loop ``exit_at_step`` (0-based) when given; all loops run and write their cells either way."""
        for flag in ("output_attentions", "output_hidden_states"):
            if kwargs.pop(flag, None):
                raise ValueError(f"{flag}=True is not supported by loopkv's Ouro; leave it unset")
        kwargs.pop("return_dict", None)
        cache = pick_cache(past_key_values, cache)
        if hasattr(cache, "run_step"):  # a continuous-batching engine's step: its cache prepares and runs it

            def logits_of(*, input_ids, position_ids, logits_to_keep):
                out = self.model(input_ids=input_ids, position_ids=position_ids, cache=cache, use_cache=False)
                return self.lm_head(_kept(out.last_hidden_state, logits_to_keep))

            logits = cache.run_step(logits_of, input_ids=input_ids, position_ids=position_ids,
                                    logits_to_keep=logits_to_keep)
            return CausalLMOutputWithPast(logits=logits)
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            exit_at_step=exit_at_step,
            cache=cache,
            **kwargs,
        )
        logits = self.lm_head(_kept(outputs.last_hidden_state, logits_to_keep))
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.vocab_size, **kwargs)
        return CausalLMOutputWithPast(loss=loss, logits=logits, **{OUTPUT_CACHE_FIELD: outputs.cache})

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs):
        """Give ``generate`` a :func:`dense_cache` with ``T * L`` cells when the user passes no cache
        (transformers would build ``DynamicCache(config=...)`` with only ``L`` layers); refuse a request
        longer than a user cache's declared capacity (``check_capacity``)."""
        user_cache = model_kwargs.get("cache", model_kwargs.get("past_key_values"))
        if user_cache is not None:
            check_capacity(user_cache, generation_config)
        refuse_layer_cache(generation_config, user_cache, model="Ouro", cell="(loop, layer)")
        super()._prepare_cache_for_generation(generation_config, model_kwargs, *args, **kwargs)
        if user_cache is None:
            replace_default_cache(model_kwargs, dense_cache(self.config))

    def generate(self, inputs: torch.Tensor | None = None, generation_config=None, **kwargs: Any):
        """``GenerationMixin.generate``; a request longer than the cache's capacity is refused before the
        prefill (``_prepare_cache_for_generation``).

        A cache passed in holds one conversation: ``cache.reset()`` between unrelated requests. A cache that a
        previous ``generate`` filled is checked here: input that does not start with the positions it holds (a new,
        unrelated prompt) is refused with that fix, before anything is written."""
        generate_cache_kwargs(kwargs)  # past_key_values= where transformers now says cache=
        cache = kwargs.get("cache")
        if cache is None:
            cache = kwargs.get("past_key_values")
        input_ids = inputs if inputs is not None else kwargs.get("input_ids")
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.is_floating_point():
            input_ids = None  # embeddings or an encoder input: nothing to compare
        check_continues(cache, input_ids)
        try:
            out = super().generate(inputs, generation_config=generation_config, **kwargs)
        except BaseException:
            if cache is not None:
                GENERATED.pop(cache, None)  # partly written: what it holds is unknown
            raise
        if cache is not None:
            sequences = out if isinstance(out, torch.Tensor) else getattr(out, "sequences", None)
            if isinstance(sequences, torch.Tensor):
                GENERATED[cache] = sequences.detach().clone()
        return out


def register_ouro() -> None:
    """Register ``model_type="ouro"`` with ``AutoConfig`` and ``AutoModelForCausalLM`` (idempotent), so that
    ``AutoModelForCausalLM.from_pretrained(folder_or_hub_id)`` and ``pipeline("text-generation", model=...)`` load
    an Ouro checkpoint (``loopkv.models.register_ouro`` is this function)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    AutoConfig.register(OuroConfig.model_type, OuroConfig, exist_ok=True)
    AutoModelForCausalLM.register(OuroConfig, OuroForCausalLM, exist_ok=True)


register = register_ouro
