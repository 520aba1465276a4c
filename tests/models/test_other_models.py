"""A looped model that is not Ouro, written here against transformers' attention interface, served by LoopKVCache.

``ToyLoopedForCausalLM`` runs its L layers T times per token and writes cell ``loop * L + layer`` through
``cache.update``; its attention module resolves its attention function by the config's name,
``ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, eager)``, as transformers' own models do.
Loaded with ``attn_implementation="loopkv"`` it generates through a LoopKVCache exactly what it generates with a
dense ``DynamicCache`` (an all-bf16 plan stores every token exactly); without it, the cache's handles reach an
attention function that cannot read them and the error says what to do.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel
from transformers.cache_utils import DynamicCache
from transformers.generation import GenerationMixin
from transformers.masking_utils import create_causal_mask
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import loopkv

LOOPS, LAYERS, HEADS, KV_HEADS, HEAD_DIM, HIDDEN, VOCAB = 3, 2, 4, 2, 32, 64, 61
# generate's and the output's name for the cache: "past_key_values" in transformers 5.17, "cache" from ~5.2x on
CACHE = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


class ToyLoopedConfig(PretrainedConfig):
    model_type = "toy_looped"

    def __init__(self, vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, total_ut_steps=LOOPS,
                 num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, **kwargs):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.total_ut_steps = total_ut_steps
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.head_dim = head_dim
        kwargs.setdefault("pad_token_id", 0)
        kwargs.setdefault("bos_token_id", 1)
        kwargs.setdefault("eos_token_id", 2)
        super().__init__(**kwargs)


def toy_eager_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """The toy's own fallback: softmax attention with an additive or boolean mask."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    scores = query @ key.transpose(-1, -2) * scaling
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attention_mask, torch.finfo(scores.dtype).min)
        else:
            scores = scores + attention_mask
    return (scores.softmax(-1) @ value).transpose(1, 2), None


def rope(x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of ``x [B, H, S, D]`` at ``position_ids [B|1, S]`` (half-split, base 10000)."""
    half = x.shape[-1] // 2
    inv_freq = 1.0 / 10000 ** (torch.arange(half, dtype=torch.float32) / half)
    angles = (position_ids[..., None].float() * inv_freq)[:, None]  # [B, 1, S, D/2]
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class ToyAttention(nn.Module):
    def __init__(self, config: ToyLoopedConfig, layer: int):
        super().__init__()
        self.config = config
        self.layer = layer
        self.head_dim = config.head_dim
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = config.head_dim**-0.5
        self.is_causal = True
        self.q = nn.Linear(config.hidden_size, config.num_attention_heads * config.head_dim, bias=False)
        self.k = nn.Linear(config.hidden_size, config.num_key_value_heads * config.head_dim, bias=False)
        self.v = nn.Linear(config.hidden_size, config.num_key_value_heads * config.head_dim, bias=False)
        self.o = nn.Linear(config.num_attention_heads * config.head_dim, config.hidden_size, bias=False)

    def forward(self, x, attention_mask, position_ids, cache, loop):
        B, S, _ = x.shape
        q = rope(self.q(x).view(B, S, -1, self.head_dim).transpose(1, 2), position_ids)
        k = rope(self.k(x).view(B, S, -1, self.head_dim).transpose(1, 2), position_ids)
        v = self.v(x).view(B, S, -1, self.head_dim).transpose(1, 2)
        if cache is not None:
            k, v = cache.update(k, v, loop * self.config.num_hidden_layers + self.layer)
        attention = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, toy_eager_attention)
        out, _ = attention(self, q, k, v, attention_mask, scaling=self.scaling, dropout=0.0)
        return self.o(out.reshape(B, S, -1))


class ToyLoopedForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = ToyLoopedConfig
    base_model_prefix = "toy"
    _supports_sdpa = True
    _supports_attention_backend = True

    def __init__(self, config: ToyLoopedConfig):
        super().__init__(config)
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.attn = nn.ModuleList(ToyAttention(config, i) for i in range(config.num_hidden_layers))
        self.mlp = nn.ModuleList(nn.Sequential(nn.Linear(config.hidden_size, 2 * config.hidden_size), nn.GELU(),
                                               nn.Linear(2 * config.hidden_size, config.hidden_size))
                                 for _ in range(config.num_hidden_layers))
        self.norm = nn.LayerNorm(config.hidden_size)
        self.head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.3 if isinstance(module, nn.Embedding) else 0.15)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None, cache=None,
                use_cache=None, logits_to_keep=0, **kwargs):
        cache = cache if cache is not None else past_key_values  # generate's name for it: 5.17 and 5.24
        x = self.embed(input_ids)
        S = x.shape[1]
        if position_ids is None:
            past = cache.get_seq_length() if cache is not None else 0
            position_ids = (torch.arange(S) + past)[None]
        # positional: the fourth parameter is `past_key_values` in 5.17 and `cache` in 5.24
        mask = create_causal_mask(self.config, x, attention_mask, cache, position_ids=position_ids)
        for loop in range(self.config.total_ut_steps):
            for layer in range(self.config.num_hidden_layers):
                x = x + self.attn[layer](x, mask, position_ids, cache, loop)
                x = x + self.mlp[layer](x)
            x = self.norm(x)
        logits = self.head(x[:, -logits_to_keep:] if logits_to_keep else x)
        return CausalLMOutputWithPast(logits=logits, **{CACHE: cache})


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("toy")
    torch.manual_seed(0)
    ToyLoopedForCausalLM(ToyLoopedConfig()).save_pretrained(path)
    return path


def left_padded_prompts(lengths: list[int], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    n = max(lengths)
    ids = torch.zeros(len(lengths), n, dtype=torch.long)
    mask = torch.zeros(len(lengths), n, dtype=torch.long)
    for row, length in enumerate(lengths):
        ids[row, n - length:] = torch.randint(3, VOCAB, (length,), generator=gen)
        mask[row, n - length:] = 1
    return ids, mask


def loopkv_cache(config, max_cache_len: int, batch: int) -> loopkv.LoopKVCache:
    plan = loopkv.Plan.uniform(loops=LOOPS, layers=LAYERS, option="bf16")
    return loopkv.LoopKVCache(plan, config=config, max_batch_size=batch, max_cache_len=max_cache_len,
                              dtype=torch.float32, device="cpu")


@pytest.mark.parametrize("lengths", [[9, 6], [340, 333]], ids=["sink-and-window", "with-history-pages"])
def test_loaded_with_loopkv_attention_it_generates_what_the_dense_cache_does(checkpoint, lengths):
    """Loaded with ``attn_implementation="loopkv"``, greedy tokens through an all-bf16 LoopKVCache equal those of
    the dense DynamicCache run (left-padded rows of two lengths; the longer case holds pages of history)."""
    loopkv.register()  # the "loopkv" attention and mask functions, before the model names them
    new = 12
    ids, mask = left_padded_prompts(lengths)
    dense_model = ToyLoopedForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    model = ToyLoopedForCausalLM.from_pretrained(checkpoint, dtype=torch.float32, attn_implementation="loopkv").eval()
    assert model.config._attn_implementation == "loopkv"
    kwargs = dict(attention_mask=mask, max_new_tokens=new, do_sample=False, pad_token_id=0, eos_token_id=None)
    want = dense_model.generate(ids, **{CACHE: DynamicCache()}, **kwargs)
    cache = loopkv_cache(model.config, ids.shape[1] + new, len(lengths))
    got = model.generate(ids, **{CACHE: cache}, **kwargs)
    assert want.shape == (len(lengths), ids.shape[1] + new)
    assert torch.equal(got, want)
    # the cache holds each row's own tokens in every cell: prompt + generated, minus the last token (never fed)
    for cell in range(LOOPS * LAYERS):
        held = cache.storage(cell).lengths[: len(lengths)].tolist()
        assert held == [n + new - 1 for n in lengths]


def test_set_attn_implementation_switches_a_loaded_model(checkpoint):
    """``model.set_attn_implementation("loopkv")`` after ``loopkv.register()`` does what loading with it does."""
    loopkv.register()
    ids, mask = left_padded_prompts([7])
    model = ToyLoopedForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    kwargs = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=None)
    want = model.generate(ids, **{CACHE: DynamicCache()}, **kwargs)
    model.set_attn_implementation("loopkv")
    got = model.generate(ids, **{CACHE: loopkv_cache(model.config, 16, 1)}, **kwargs)
    assert torch.equal(got, want)


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_without_loopkv_attention_the_error_says_what_to_do(checkpoint, implementation):
    """Any other attention function gets the cache's handles in place of K/V; the handle's error names the
    attention function it needs and how to select it, instead of a bare missing-attribute message."""
    model = ToyLoopedForCausalLM.from_pretrained(checkpoint, dtype=torch.float32,
                                                 attn_implementation=implementation).eval()
    ids, mask = left_padded_prompts([5])
    with pytest.raises(AttributeError, match="only the 'loopkv' attention function reads it") as info:
        model.generate(ids, attention_mask=mask, **{CACHE: loopkv_cache(model.config, 16, 1)}, max_new_tokens=2,
                       do_sample=False, pad_token_id=0)
    assert "attn_implementation='loopkv'" in str(info.value)


@pytest.mark.parametrize("length", [dict(max_new_tokens=7), dict(max_length=16)], ids=["max_new_tokens", "max_length"])
def test_plain_generate_refuses_a_request_past_max_cache_len_before_any_forward(checkpoint, length):
    """transformers' own ``generate`` (this model has no override) refuses prompt + new tokens beyond the cache's
    ``max_cache_len`` before the prefill: no forward runs and nothing is written (unchecked, the prefill and five
    decode steps would run before the cache refuses the step past its capacity). A request that fits exactly then
    runs on the same cache."""
    loopkv.register()
    model = ToyLoopedForCausalLM.from_pretrained(checkpoint, dtype=torch.float32, attn_implementation="loopkv").eval()
    ids, mask = left_padded_prompts([9, 6])
    cache = loopkv_cache(model.config, ids.shape[1] + 5, 2)
    forwards = []
    model.register_forward_pre_hook(lambda module, args: forwards.append(1))
    kwargs = dict(attention_mask=mask, do_sample=False, pad_token_id=0, eos_token_id=None)
    with pytest.raises(ValueError, match="16 tokens.* exceeds the cache's max_cache_len 14; build the cache with a "
                                         "larger max_cache_len"):
        model.generate(ids, **{CACHE: cache}, **length, **kwargs)
    assert not forwards
    assert all(not cache.storage(cell).lengths.any() for cell in range(LOOPS * LAYERS))
    out = model.generate(ids, **{CACHE: cache}, max_new_tokens=5, **kwargs)
    assert out.shape == (2, ids.shape[1] + 5)
    assert len(forwards) == 5


def test_setting_the_user_defined_mark_outside_generate_checks_nothing(checkpoint):
    """Only generate's own marking of the cache carries a length; a cache marked anywhere else is left to the forward
    checks (the flag still reads back as transformers expects)."""
    cache = loopkv_cache(ToyLoopedConfig(), 8, 1)
    assert cache._is_user_defined is False
    cache._is_user_defined = True
    assert cache._is_user_defined is True
