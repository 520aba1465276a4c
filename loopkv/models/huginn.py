"""Clean-room Huginn-style recurrent-depth model (Geiping et al., "Scaling up Test-Time Compute with Latent
Reasoning: A Recurrent Depth Approach") for transformers 5.x.

Loads ``tomg-group-umd/huginn-0125`` with its own parameter names (``transformer.{wte, prelude.i, adapter,
core_block.j, coda.i, ln_f}``, ``lm_head``, the RoPE table ``freqs_cis``) and ``config.json``
(:class:`HuginnConfig`); :func:`register_huginn` registers ``model_type="huginn_raven"`` with the Auto classes
(never at import).

Forward (as the released model computes it, in eval mode):

* ``e = prelude(embed_scale * wte(ids))``; the recurrent state ``s`` starts random (``state_init="like-init"``:
  truncated normal of std ``init_values["std"] * init_scale``, times ``embed_scale``, drawn from
  ``state_generator`` or torch's default generator) or zero (``state_init="zero"``, or ``init_scale=0``);
* ``r`` times (``num_steps``, default ``mean_recurrence``): ``s = core_block(adapter(cat[s, e]))``; with
  ``exit_threshold``, a row stops once its state converges (:mod:`loopkv.models.huginn_exit`);
* ``logits = lm_head(ln_f(coda(ln_f(s))))`` in fp32.

Each layer is a sandwich block ``x = norm_2(x + attn(norm_1(x)))``, ``x = norm_4(x + mlp(norm_3(x)))`` with
RMSNorm, a fused ``Wqkv`` projection, an optional per-head bias on queries and keys (before RoPE), RoPE on
interleaved channel pairs, causal softmax attention at scale ``head_dim**-0.5`` and a gated SiLU MLP with one fused
``fc``. Attention goes through transformers' attention-function registry (a cache that names its own function,
such as ``LoopKVCache``, gets it).

Cache indices (the ``layer_idx`` of ``Cache.update``) are :class:`HuginnCells`' (the Huginn family of
:mod:`loopkv.families`, :mod:`loopkv.models.huginn_config`): prelude, coda, then (step, core layer) step-major.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from transformers import initialization as init
from transformers.cache_utils import Cache
from transformers.generation import GenerationMixin
from transformers.masking_utils import create_causal_mask
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, PreTrainedModel

from loopkv.models.cache_args import OUTPUT_CACHE_FIELD, generate_cache_kwargs, mask_piece, pick_cache
from loopkv.models.generation_checks import (
    GENERATED,
    check_capacity,
    check_continues,
    refuse_layer_cache,
    replace_default_cache,
)
from loopkv.models.huginn_config import FAMILY, HuginnCells, HuginnConfig, dense_cache
from loopkv.models.huginn_exit import ExitRule, Exits
from loopkv.models.ouro import eager_attention_forward  # alike in both models

__all__ = ["HuginnCells", "HuginnConfig", "HuginnForCausalLM", "dense_cache", "register_huginn"]

class HuginnRMSNorm(nn.Module):
    """``weight * (x * rsqrt(mean(x^2) + eps))``, normalised in fp32 and cast back before the weight."""

    def __init__(self, dim: int, *, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., E] -> [..., E]
        xf = at_least_fp32(x)
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def at_least_fp32(x: torch.Tensor) -> torch.Tensor:
    """``x`` in fp32, or as it is when wider (a float64 model computes in float64)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def rope_table(config: HuginnConfig) -> torch.Tensor:
    """``freqs_cis`` fp32 ``[1, block_size, 1, D/2, 2]``: ``(cos, sin)`` of ``position * base**(-2i/D)``."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))  # [D/2]
    angles = torch.outer(torch.arange(config.block_size, dtype=torch.float32), inv_freq)  # [N, D/2]
    return torch.stack([angles.cos(), angles.sin()], dim=-1)[None, :, None]


def apply_rope(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Rotate channel pairs ``(2i, 2i+1)`` of ``x [B, S, H, D]`` by ``table [B|1, S, 1, D/2, 2]``, in fp32."""
    pairs = at_least_fp32(x).unflatten(-1, (-1, 2))  # [B, S, H, D/2, 2]
    cos, sin = table[..., 0], table[..., 1]
    even, odd = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack([even * cos - odd * sin, odd * cos + even * sin], dim=-1)
    return rotated.flatten(-2).type_as(x)


class HuginnAttention(nn.Module):
    """Causal self-attention with a fused ``Wqkv``, ``qk_bias [2, 1, H, D]`` (optional) and output ``proj``."""

    def __init__(self, config: HuginnConfig) -> None:
        super().__init__()
        self.config = config
        self.head_dim = config.head_dim
        self.n_heads, self.n_kv_heads = config.n_heads, config.num_key_value_heads
        self.num_key_value_groups = self.n_heads // self.n_kv_heads
        self.scaling = self.head_dim**-0.5
        self.is_causal = True
        kv = self.n_kv_heads * self.head_dim
        self.split = (config.n_embd, kv, kv)
        self.Wqkv = nn.Linear(config.n_embd, sum(self.split), bias=False)
        if config.qk_bias:
            self.qk_bias = nn.Parameter(torch.zeros(2, 1, self.n_heads, self.head_dim))
        self.proj = nn.Linear(config.n_embd, config.n_embd, bias=False)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, attention_mask: Any, *, cache: Cache | None,
                cache_index: int, exits: Exits | None = None, **kwargs: Any) -> torch.Tensor:
        """``x [B, S, E]`` -> ``[B, S, E]``; writes cache index ``cache_index`` of ``cache`` (a row that has exited,
        ``exits``: its K/V of its last step here)."""
        b, s, _ = x.shape
        q, k, v = self.Wqkv(x).split(self.split, dim=-1)
        q = q.view(b, s, self.n_heads, self.head_dim)  # [B, S, Hq, D]
        k = k.view(b, s, self.n_kv_heads, self.head_dim)  # [B, S, Hkv, D]
        v = v.view(b, s, self.n_kv_heads, self.head_dim)
        if self.config.qk_bias:
            q, k = q + self.qk_bias[0], k + self.qk_bias[1]
        q, k = apply_rope(q, rope).transpose(1, 2), apply_rope(k, rope).transpose(1, 2)  # [B, H, S, D]
        v = v.transpose(1, 2)
        if exits is not None:
            k, v = exits.kv_of(self, k, v)
        if cache is not None:
            k, v = cache.update(k, v, cache_index, {"position_ids": kwargs.get("position_ids")})
        # a cache that needs its own attention function names it (LoopKVCache: "loopkv", registered by the cache)
        implementation = getattr(cache, "attention_implementation", None) or self.config._attn_implementation
        attention: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(implementation, eager_attention_forward)
        out, _ = attention(self, q, k, v, attention_mask, dropout=0.0, scaling=self.scaling, **kwargs)
        return self.proj(out.reshape(b, s, -1))


class HuginnMLP(nn.Module):
    """``proj(silu(a) * g)`` with ``[a, g] = fc(x)`` (one fused input projection)."""

    def __init__(self, config: HuginnConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.n_embd, 2 * config.intermediate_size, bias=False)
        self.proj = nn.Linear(config.intermediate_size, config.n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, g = self.fc(x).chunk(2, dim=-1)
        return self.proj(nn.functional.silu(a) * g)


class HuginnBlock(nn.Module):
    """Sandwich block: ``x = norm_2(x + attn(norm_1(x)))``; ``x = norm_4(x + mlp(norm_3(x)))``."""

    def __init__(self, config: HuginnConfig) -> None:
        super().__init__()
        eps = config.norm_eps
        self.norm_1 = HuginnRMSNorm(config.n_embd, eps=eps)
        self.attn = HuginnAttention(config)
        self.norm_2 = HuginnRMSNorm(config.n_embd, eps=eps)
        self.mlp = HuginnMLP(config)
        self.norm_3 = HuginnRMSNorm(config.n_embd, eps=eps)
        self.norm_4 = HuginnRMSNorm(config.n_embd, eps=eps)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, attention_mask: Any, **kwargs: Any) -> torch.Tensor:
        x = self.norm_2(x + self.attn(self.norm_1(x), rope, attention_mask, **kwargs))
        return self.norm_4(x + self.mlp(self.norm_3(x)))


class HuginnPreTrainedModel(PreTrainedModel):
    config_class = HuginnConfig
    config: HuginnConfig
    base_model_prefix = "model"  # the released model has no base model: its modules hang off the LM itself
    supports_gradient_checkpointing = False
    _no_split_modules = ["HuginnBlock"]
    _supports_sdpa = True
    _supports_flash_attn = False
    _supports_flex_attn = False
    _supports_attention_backend = True
    _keep_in_fp32_modules_strict = {"freqs_cis"}  # the RoPE table stays fp32 when loaded in bf16/fp16

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, HuginnForCausalLM):
            init.copy_(module.freqs_cis, rope_table(module.config))
        elif isinstance(module, HuginnAttention) and module.config.qk_bias:
            init.zeros_(module.qk_bias)
        else:
            super()._init_weights(module)


# the core steps each cache holds tokens of (a cache's cells of other steps hold none of them)
_STEPS_HELD: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def check_steps(cache: Cache | None, steps: int) -> None:
    """Refuse a call of ``steps`` core steps that ``cache`` cannot serve, before anything is written.

    A cache laid out for a family (a ``LoopKVCache``: ``cache.layout``) must be Huginn's, built for ``n >= steps``
    steps (its plan's ``T``, or the ``loops=`` it was built with, whose plan is ``plan.for_loops(n)``: step ``n - 1``
    as the plan's final step). A call of ``n`` steps runs every cell; a call of ``steps < n`` uses the first
    ``steps`` steps' cells as they are, and is refused when cells among them ``share``: their source is step
    ``n - 1``, which such a call never writes (a cache built with ``loops=steps`` serves it). Any cache that holds
    tokens holds them for the steps it was filled with: another ``steps`` is refused until ``cache.reset()``."""
    if cache is None or torch.compiler.is_compiling():
        return
    layout = getattr(cache, "layout", None)
    family = getattr(layout, "family", None)
    if family is not None and family != FAMILY:
        raise ValueError(f"this cache was laid out for a {family} model, not a Huginn model: build it with "
                         "LoopKVCache(plan, config=model.config) and a plan made for this model")
    if family is not None:
        built = layout.loops
        if steps > built:
            raise ValueError(f"num_steps={steps}, but this cache serves at most {built} core steps (its plan's T, or "
                             f"the loops= it was built with): run at most {built} steps, build the cache for "
                             f"{steps} from a plan with T >= {steps}, or make a plan for {steps} "
                             f"(Plan.from_config(config) with config.mean_recurrence = {steps}, or a profile of that "
                             "many)")
        plan = getattr(cache, "plan", None)
        shared = sorted({c.loop for c in layout if c.loop < steps and plan.option(c) == "share"}) if plan else []
        if steps < built and shared:
            raise ValueError(f"num_steps={steps} on a cache built for {built} core steps: steps {shared} of its plan "
                             f"'share' step {built - 1}'s pages, which a call of {steps} steps never writes. Build "
                             f"the cache for this count, LoopKVCache(plan, config=model.config, loops={steps}, ...): "
                             f"step {steps - 1} then stores as the plan's final step and the share cells read it")
    if cache.get_seq_length() == 0:
        _STEPS_HELD[cache] = steps
    elif _STEPS_HELD.setdefault(cache, steps) != steps:
        raise ValueError(f"this cache holds tokens run with num_steps={_STEPS_HELD[cache]}; a call with "
                         f"num_steps={steps} would read steps it never wrote (or skip some): keep num_steps, or "
                         "cache.reset() and send the whole conversation again")


class HuginnForCausalLM(HuginnPreTrainedModel, GenerationMixin):
    """Huginn with its LM head. The default cache is :func:`dense_cache` (the exact reference).

    ``forward`` and ``generate`` take ``num_steps`` (r, default ``config.mean_recurrence``), ``init_scale``
    (the random initial state's scale, 1.0; 0 gives a zero state), ``state_generator`` (a
    ``torch.Generator`` on the model's device for the random state; default torch's own) and the adaptive exit
    (:mod:`loopkv.models.huginn_exit`): ``exit_threshold`` (``None``: off; the released latent-diff default is
    0.03) and ``min_steps`` (steps run before a row may exit), per forward: in ``generate``, per token."""

    _tied_weights_keys = {"lm_head.weight": "transformer.wte.weight"}

    def __init__(self, config: HuginnConfig) -> None:
        super().__init__(config)
        e = config.n_embd
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.padded_vocab_size, e),
            prelude=nn.ModuleList(HuginnBlock(config) for _ in range(config.n_layers_in_prelude)),
            adapter=nn.Linear(2 * e, e, bias=config.bias),
            core_block=nn.ModuleList(HuginnBlock(config) for _ in range(config.n_layers_in_recurrent_block)),
            coda=nn.ModuleList(HuginnBlock(config) for _ in range(config.n_layers_in_coda)),
            ln_f=HuginnRMSNorm(e, eps=config.norm_eps),
        ))
        self.lm_head = nn.Linear(e, config.padded_vocab_size, bias=False)
        self.register_buffer("freqs_cis", rope_table(config), persistent=True)  # [1, block_size, 1, D/2, 2]
        self.cells = HuginnCells.of(config)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.transformer.wte

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.transformer.wte = value

    def initial_state(self, embeds: torch.Tensor, *, init_scale: float = 1.0,
                      generator: torch.Generator | None = None) -> torch.Tensor:
        """The recurrent state before the first core step, ``[B, S, E]`` like ``embeds``."""
        std = self.config.init_values["std"] * init_scale
        if self.config.state_init == "zero" or std <= 0:
            return torch.zeros_like(embeds)
        state = torch.empty_like(embeds, dtype=torch.float32)
        nn.init.trunc_normal_(state, mean=0.0, std=std, a=-3 * std, b=3 * std, generator=generator)
        return (state * self.config.embed_scale).to(embeds.dtype)

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
        num_steps: int | torch.Tensor | None = None,
        init_scale: float = 1.0,
        state_generator: torch.Generator | None = None,
        exit_threshold: float | None = None,
        min_steps: int = 0,
        cache: Cache | None = None,
        **kwargs: Any,
    ) -> CausalLMOutputWithPast:
        """``input_ids [B, S]`` (or ``inputs_embeds [B, S, E]``, before ``embed_scale``) -> logits ``[B, S, V]`` (fp32)
        (the last ``logits_to_keep``), after ``num_steps`` core steps.

        ``attention_mask``: 2-D ``[B, past + S]`` (1 = token, 0 = left padding), a prepared 4-D mask, or
        ``generate``'s ``{"full_attention": mask}``. Without ``position_ids`` they come from the 2-D mask's
        cumulative sum (as ``generate`` does), else from the cache length."""
        for flag in ("output_attentions", "output_hidden_states"):
            if kwargs.pop(flag, None):
                raise ValueError(f"{flag}=True is not supported by loopkv's Huginn; leave it unset")
        kwargs.pop("return_dict", None)
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids and inputs_embeds")
        steps = self.config.steps(num_steps)
        rule = ExitRule.of(exit_threshold, min_steps)
        cache = pick_cache(past_key_values, cache)
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if use_cache and cache is None:
            cache = dense_cache(self.config)
        check_steps(cache, steps)
        if inputs_embeds is None:
            inputs_embeds = self.transformer.wte(input_ids)
        embeds = inputs_embeds * self.config.embed_scale
        position_ids = self._positions(position_ids, attention_mask, cache, embeds)
        limit = getattr(cache, "continuation_limit", None)
        if limit is not None and embeds.shape[1] > limit and not torch.compiler.is_compiling() \
                and cache.get_seq_length():
            call = dict(num_steps=steps, init_scale=init_scale, state_generator=state_generator, use_cache=use_cache,
                        exit_threshold=exit_threshold, min_steps=min_steps, **kwargs)
            logits = self._logits_in_pieces(limit, inputs_embeds, attention_mask, position_ids, cache, **call)
            return self._output(_keep(logits, logits_to_keep), labels, cache if use_cache else None, **kwargs)
        if isinstance(attention_mask, dict):
            mask = attention_mask["full_attention"]
        else:
            # positional: the 4th parameter is `past_key_values` in 5.17 and `cache` in 5.24
            mask = create_causal_mask(self.config, embeds, attention_mask, cache, position_ids=position_ids)
        rope = at_least_fp32(self.freqs_cis[0, position_ids])  # [B|1, S, 1, D/2, 2]
        layer = dict(rope=rope, attention_mask=mask, cache=cache, position_ids=position_ids, **kwargs)

        for i, block in enumerate(self.transformer.prelude):
            embeds = block(embeds, cache_index=self.cells.prelude_index(i), **layer)
        state = self.initial_state(embeds, init_scale=init_scale, generator=state_generator)
        state = self._recur(state, embeds, steps, rule, attention_mask, layer)
        x = self.transformer.ln_f(state)
        for i, block in enumerate(self.transformer.coda):
            x = block(x, cache_index=self.cells.coda_index(i), **layer)
        x = self.transformer.ln_f(x)

        return self._output(at_least_fp32(self.lm_head(_keep(x, logits_to_keep))), labels, cache if use_cache else None,
                            **kwargs)

    def _recur(self, state: torch.Tensor, embeds: torch.Tensor, steps: int, rule: ExitRule | None, attention_mask,
               layer: dict) -> torch.Tensor:
        """The core block ``steps`` times from ``state [B, S, E]``; with an exit ``rule``, rows stop when their state
        converges (:mod:`loopkv.models.huginn_exit`) and their later steps store their last K/V."""
        exits = None if rule is None else Exits(torch.zeros(state.shape[0], dtype=torch.bool, device=state.device))
        real = attention_mask[:, -state.shape[1]:].bool() \
            if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2 else None
        for step in range(steps):
            if exits is not None and exits.all_done():  # only the writes are left
                for j, block in enumerate(self.transformer.core_block):
                    block.attn(block.norm_1(state), cache_index=self.cells.core_index(step, j), exits=exits, **layer)
                continue
            x = self.transformer.adapter(torch.cat([state, embeds], dim=-1))
            for j, block in enumerate(self.transformer.core_block):
                x = block(x, cache_index=self.cells.core_index(step, j), exits=exits, **layer)
            state = x if exits is None else exits.step(rule, step, x, state, real)
        return state

    def _output(self, logits: torch.Tensor, labels, cache: Cache | None, **kwargs: Any) -> CausalLMOutputWithPast:
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.padded_vocab_size,
                                      **kwargs)
        return CausalLMOutputWithPast(loss=loss, logits=logits, **{OUTPUT_CACHE_FIELD: cache})

    def _logits_in_pieces(self, limit, inputs_embeds, attention_mask, position_ids, cache, **call) -> torch.Tensor:
        """A later turn longer than the cache's ``continuation_limit`` (a LoopKVCache plan with ``share`` cells), run
        as consecutive forwards of at most ``limit`` tokens: the same tokens, positions and mask columns."""
        q_len = inputs_embeds.shape[1]
        pieces = []
        for start in range(0, q_len, limit):
            end = min(q_len, start + limit)
            pieces.append(self.forward(
                inputs_embeds=inputs_embeds[:, start:end], position_ids=position_ids[..., start:end], cache=cache,
                attention_mask=mask_piece(attention_mask, q_len, end, end - start), **call).logits)
        return torch.cat(pieces, dim=1)

    @staticmethod
    def _positions(position_ids, attention_mask, cache, embeds) -> torch.Tensor:
        if position_ids is not None:
            return position_ids
        q_len = embeds.shape[1]
        if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2:
            return (attention_mask.long().cumsum(-1) - 1).masked_fill(attention_mask == 0, 0)[:, -q_len:]
        past = cache.get_seq_length() if cache is not None else 0
        return (torch.arange(q_len, device=embeds.device) + past).unsqueeze(0)

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs):
        """Give ``generate`` a :func:`dense_cache` when the user passes no cache (transformers would build
        ``DynamicCache(config=...)`` with one layer per physical layer, ``n_layers``); refuse a request longer
        than a user cache's declared capacity (``check_capacity``) or a ``num_steps`` it cannot serve."""
        user_cache = model_kwargs.get("cache", model_kwargs.get("past_key_values"))
        if user_cache is not None:
            check_capacity(user_cache, generation_config)
            check_steps(user_cache, self.config.steps(model_kwargs.get("num_steps")))
        refuse_layer_cache(generation_config, user_cache, model="Huginn", cell="(step, core layer)")
        super()._prepare_cache_for_generation(generation_config, model_kwargs, *args, **kwargs)
        if user_cache is None:
            replace_default_cache(model_kwargs, dense_cache(self.config))

    def generate(self, inputs: torch.Tensor | None = None, generation_config=None, **kwargs: Any):
        """``GenerationMixin.generate``; ``num_steps``, ``init_scale``, ``state_generator``, ``exit_threshold`` and
        ``min_steps`` reach every forward of the call. A cache passed in holds one conversation (``cache.reset()``
        between unrelated requests): input that does not continue what the previous ``generate`` left in it is
        refused (``check_continues``), as are a request longer than its capacity and a ``num_steps`` it cannot
        serve, before anything is written."""
        generate_cache_kwargs(kwargs)  # past_key_values= where transformers now says cache=
        self.config.steps(kwargs.get("num_steps"))  # a bad r (or exit rule) is refused before anything runs
        ExitRule.of(kwargs.get("exit_threshold"), kwargs.get("min_steps", 0))
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        input_ids = inputs if inputs is not None else kwargs.get("input_ids")
        if isinstance(input_ids, torch.Tensor) and input_ids.dim() == 2 and not input_ids.is_floating_point():
            check_continues(cache, input_ids)
        try:
            out = super().generate(inputs, generation_config=generation_config, **kwargs)
        except BaseException:
            if cache is not None:
                GENERATED.pop(cache, None)  # partly written: what it holds is unknown
            raise
        sequences = out if isinstance(out, torch.Tensor) else getattr(out, "sequences", None)
        if cache is not None and isinstance(sequences, torch.Tensor):
            GENERATED[cache] = sequences.detach().clone()
        return out


def _keep(x: torch.Tensor, logits_to_keep: int | torch.Tensor) -> torch.Tensor:
    """The positions ``[B, S, ...]`` whose logits a call asks for: the last ``logits_to_keep`` (0: all), or those
    indexed."""
    if isinstance(logits_to_keep, int):
        return x[:, -logits_to_keep:] if logits_to_keep else x
    return x[:, logits_to_keep]


def register_huginn() -> None:
    """Register ``model_type="huginn_raven"`` with ``AutoConfig`` and ``AutoModelForCausalLM`` (idempotent), so that
    ``AutoModelForCausalLM.from_pretrained(folder)`` loads a huginn-0125 checkpoint without its remote code."""
    from transformers import AutoConfig, AutoModelForCausalLM

    AutoConfig.register(HuginnConfig.model_type, HuginnConfig, exist_ok=True)
    AutoModelForCausalLM.register(HuginnConfig, HuginnForCausalLM, exist_ok=True)
