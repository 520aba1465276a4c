"""loopkv's clean-room Ouro against an independent float64 forward written from the notes' §3.3.

The reference below (`reference_logits`) is plain torch over a state dict with the released parameter
names; it does not call loopkv. Generation is checked against recomputation without a cache.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file
from transformers import AttentionInterface, AutoConfig, AutoModelForCausalLM
from transformers.cache_utils import DynamicCache

from loopkv.models.ouro import OuroConfig, OuroForCausalLM, dense_cache, register_ouro, static_dense_cache
from tests.tolerances import LOGITS_FP32_ATOL, LOGITS_FP32_RTOL

VOCAB, HIDDEN, INTER, LAYERS, LOOPS, HEAD_DIM = 97, 64, 96, 2, 3, 32


def released_config(**overrides) -> dict:
    """A tiny config.json with the released file's field names."""
    cfg = {
        "architectures": ["OuroForCausalLM"],
        "model_type": "ouro",
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "intermediate_size": INTER,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "head_dim": HEAD_DIM,
        "hidden_act": "silu",
        "max_position_embeddings": 256,
        "initializer_range": 0.02,
        "rms_norm_eps": 1e-6,
        "use_cache": True,
        "tie_word_embeddings": False,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": LAYERS,
        "layer_types": ["full_attention"] * LAYERS,
        "attention_dropout": 0.0,
        "total_ut_steps": LOOPS,
        "early_exit_threshold": 1.0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
        "torch_dtype": "float32",
        "transformers_version": "4.55.0",
    }
    cfg.update(overrides)
    return cfg


def released_state_dict(cfg: dict, *, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights under exactly the released names and shapes, scaled so attention is not uniform."""
    gen = torch.Generator().manual_seed(seed)
    h, d = cfg["hidden_size"], cfg["head_dim"]
    hq, hkv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d

    def w(*shape, std=0.15):
        return torch.randn(*shape, generator=gen) * std

    def norm():
        return 1.0 + 0.1 * torch.randn(h, generator=gen)

    sd = {"model.embed_tokens.weight": w(cfg["vocab_size"], h, std=1.0), "model.norm.weight": norm()}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        sd[p + "self_attn.q_proj.weight"] = w(hq, h, std=0.3)
        sd[p + "self_attn.k_proj.weight"] = w(hkv, h, std=0.3)
        sd[p + "self_attn.v_proj.weight"] = w(hkv, h)
        sd[p + "self_attn.o_proj.weight"] = w(h, hq)
        sd[p + "mlp.gate_proj.weight"] = w(cfg["intermediate_size"], h)
        sd[p + "mlp.up_proj.weight"] = w(cfg["intermediate_size"], h)
        sd[p + "mlp.down_proj.weight"] = w(h, cfg["intermediate_size"])
        for name in ("input_layernorm", "input_layernorm_2", "post_attention_layernorm", "post_attention_layernorm_2"):
            sd[p + name + ".weight"] = norm()
    sd["model.early_exit_gate.weight"] = w(1, h)
    sd["model.early_exit_gate.bias"] = w(1)
    sd["lm_head.weight"] = w(cfg["vocab_size"], h, std=0.5)
    return sd


def save_checkpoint(path, cfg: dict, sd: dict[str, torch.Tensor]) -> None:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    save_file({k: v.contiguous() for k, v in sd.items()}, str(path / "model.safetensors"))


def reference_logits(sd, cfg, input_ids, attention_mask=None, *, exit_at_step=None) -> torch.Tensor:
    """Ouro's forward in float64 from the notes (§3.3): Qwen2 RMSNorm, sandwich block, norm after every
    loop, neox RoPE with positions from the padding mask, causal + padding + optional sliding mask."""
    p = {k: v.double() for k, v in sd.items()}
    batch, seq = input_ids.shape
    mask = torch.ones(batch, seq, dtype=torch.long) if attention_mask is None else attention_mask.long()
    pos = (mask.cumsum(-1) - 1).clamp(min=0).double()  # [B, S]
    d, hq, hkv, eps = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["rms_norm_eps"]
    inv = 1.0 / cfg["rope_theta"] ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = pos[..., None] * inv  # [B, S, D/2]
    cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]  # [B, 1, S, D]

    def rope(x):  # [B, H, S, D]
        x1, x2 = x[..., : d // 2], x[..., d // 2 :]
        return x * cos + torch.cat([-x2, x1], -1) * sin

    def rms(x, weight):
        return weight * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)

    i = torch.arange(seq)
    base = (i[None, :] <= i[:, None])[None] & mask[:, None, :].bool()  # [B, S, S]: key j visible to query i
    base = base | torch.eye(seq, dtype=torch.bool)[None]  # pads attend to themselves only (no NaN rows)
    allowed = {}
    for layer, kind in enumerate(cfg["layer_types"]):
        allowed[layer] = base
        if kind == "sliding_attention":
            allowed[layer] = base & (i[None, :] > i[:, None] - cfg["sliding_window"])[None]

    x = p["model.embed_tokens.weight"][input_ids]  # [B, S, H]
    outs = []
    for _ in range(cfg["total_ut_steps"]):
        for layer in range(cfg["num_hidden_layers"]):
            w = {k[len(f"model.layers.{layer}.") :]: v for k, v in p.items() if k.startswith(f"model.layers.{layer}.")}
            a = rms(x, w["input_layernorm.weight"])
            q = (a @ w["self_attn.q_proj.weight"].T).view(batch, seq, hq, d).transpose(1, 2)
            k = (a @ w["self_attn.k_proj.weight"].T).view(batch, seq, hkv, d).transpose(1, 2)
            v = (a @ w["self_attn.v_proj.weight"].T).view(batch, seq, hkv, d).transpose(1, 2)
            q, k = rope(q), rope(k)
            k, v = k.repeat_interleave(hq // hkv, dim=1), v.repeat_interleave(hq // hkv, dim=1)
            scores = (q @ k.transpose(-1, -2)) * d**-0.5
            scores = scores.masked_fill(~allowed[layer][:, None], float("-inf"))
            o = (scores.softmax(-1) @ v).transpose(1, 2).reshape(batch, seq, hq * d)
            x = x + rms(o @ w["self_attn.o_proj.weight"].T, w["input_layernorm_2.weight"])
            m = rms(x, w["post_attention_layernorm.weight"])
            m = torch.nn.functional.silu(m @ w["mlp.gate_proj.weight"].T) * (m @ w["mlp.up_proj.weight"].T)
            x = x + rms(m @ w["mlp.down_proj.weight"].T, w["post_attention_layernorm_2.weight"])
        x = rms(x, p["model.norm.weight"])
        outs.append(x)
    h = outs[-1 if exit_at_step is None else exit_at_step]
    return h @ p["lm_head.weight"].T  # [B, S, V]


def build_model(cfg: dict, *, attn: str = "sdpa", seed: int = 0) -> OuroForCausalLM:
    config = OuroConfig(**{k: v for k, v in cfg.items() if k not in ("architectures", "model_type")})
    config._attn_implementation = attn
    model = OuroForCausalLM(config).eval()
    model.load_state_dict(released_state_dict(cfg, seed=seed), strict=True)
    return model


def generation_config_dict(**overrides) -> dict:
    # eos None: every generate call produces exactly max_new_tokens tokens
    return released_config(eos_token_id=None, **overrides)


def left_padded_batch(lengths, *, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    rows = []
    for b, n in enumerate(lengths):
        row = torch.randint(3, VOCAB, (n,), generator=gen)
        ids[b, width - n :], mask[b, width - n :] = row, 1
        rows.append(row[None])
    return ids, mask, rows


def assert_logits_close(actual, expected, mask=None):
    expected = expected.to(actual.dtype)
    if mask is not None:
        keep = mask.bool()
        actual, expected = actual[keep], expected[keep]
    torch.testing.assert_close(actual, expected, atol=LOGITS_FP32_ATOL, rtol=LOGITS_FP32_RTOL)


# ---------------------------------------------------------------------------------------------- loading


def test_from_pretrained_matches_reference(tmp_path):
    cfg = released_config()
    sd = released_state_dict(cfg)
    save_checkpoint(tmp_path, cfg, sd)
    model = OuroForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert model.config.total_ut_steps == LOOPS
    assert model.config.rope_parameters["rope_theta"] == 10000.0
    assert set(model.state_dict()) == set(sd)
    ids, mask, _ = left_padded_batch([9, 5, 7])
    with torch.no_grad():
        logits = model(ids, attention_mask=mask, use_cache=False).logits
        assert_logits_close(logits, reference_logits(sd, cfg, ids, mask), mask)
        for step in range(LOOPS):
            early = model(ids, attention_mask=mask, use_cache=False, exit_at_step=step).logits
            assert_logits_close(early, reference_logits(sd, cfg, ids, mask, exit_at_step=step), mask)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_forward_matches_reference_gqa(attn):
    cfg = released_config(num_attention_heads=4, num_key_value_heads=2)
    model = build_model(cfg, attn=attn)
    assert model.model.layers[0].self_attn.k_proj.weight.shape == (2 * HEAD_DIM, HIDDEN)
    ids, mask, _ = left_padded_batch([8, 3])
    with torch.no_grad():
        logits = model(ids, attention_mask=mask).logits
    assert_logits_close(logits, reference_logits(model.state_dict(), cfg, ids, mask), mask)


def test_sliding_window_layers_match_reference():
    cfg = released_config(use_sliding_window=True, sliding_window=3, max_window_layers=1, layer_types=None)
    cfg.pop("layer_types")
    model = build_model(cfg)
    cfg["layer_types"] = list(model.config.layer_types)
    assert cfg["layer_types"] == ["full_attention", "sliding_attention"]
    ids, mask, _ = left_padded_batch([10, 6])
    with torch.no_grad():
        logits = model(ids, attention_mask=mask).logits
    assert_logits_close(logits, reference_logits(model.state_dict(), cfg, ids, mask), mask)


def test_auto_classes_after_register(tmp_path):
    cfg = released_config(
        auto_map={
            "AutoConfig": "configuration_ouro.OuroConfig",
            "AutoModelForCausalLM": "modeling_ouro.OuroForCausalLM",
        }
    )
    sd = released_state_dict(cfg)
    save_checkpoint(tmp_path, cfg, sd)
    register_ouro()
    register_ouro()  # idempotent
    assert isinstance(AutoConfig.from_pretrained(tmp_path), OuroConfig)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert type(model) is OuroForCausalLM
    ids = torch.randint(3, VOCAB, (1, 6))
    with torch.no_grad():
        assert_logits_close(model(ids).logits, reference_logits(sd, cfg, ids))


def test_legacy_rope_keys_and_head_checks():
    legacy = OuroConfig(rope_theta=5e5, rope_scaling=None, num_hidden_layers=2)
    assert legacy.rope_parameters == {"rope_type": "default", "rope_theta": 5e5}
    with pytest.raises(ValueError, match="num_key_value_heads"):
        OuroConfig(num_attention_heads=4, num_key_value_heads=3, num_hidden_layers=2)


@pytest.mark.parametrize("change", ["missing", "unexpected", "shape"])
def test_checkpoint_mismatch_raises(tmp_path, change):
    cfg = released_config()
    sd = released_state_dict(cfg)
    if change == "missing":
        del sd["model.layers.1.input_layernorm_2.weight"]
    elif change == "unexpected":
        sd["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(2 * HEAD_DIM)
    else:
        sd["model.early_exit_gate.weight"] = torch.zeros(2, HIDDEN)
    save_checkpoint(tmp_path, cfg, sd)
    with pytest.raises((ValueError, RuntimeError)):
        OuroForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)


# ------------------------------------------------------------------------------------------- generation


def greedy_recompute(model, ids, mask, steps):
    """Greedy decoding by a full forward over the whole sequence at every step, without a cache."""
    ids, mask = ids.clone(), mask.clone()
    for _ in range(steps):
        with torch.no_grad():
            logits = model(ids, attention_mask=mask, use_cache=False).logits[:, -1]
        ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], dim=1)
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
    return ids


GENERATION_SHAPES = {
    "mha": {},
    "gqa": {"num_attention_heads": 4, "num_key_value_heads": 2},
    "sliding": {"use_sliding_window": True, "sliding_window": 3, "max_window_layers": 1, "layer_types": None},
}


@pytest.mark.parametrize("shape", list(GENERATION_SHAPES))
def test_generate_matches_recompute(shape):
    cfg = generation_config_dict(**GENERATION_SHAPES[shape])
    model = build_model(cfg)
    new = 12
    ids, mask, rows = left_padded_batch([11, 4, 8])
    out = model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False)
    assert out.shape == (3, ids.shape[1] + new)
    torch.testing.assert_close(out, greedy_recompute(model, ids, mask, new), rtol=0, atol=0)
    for b, row in enumerate(rows):
        single = model.generate(row, attention_mask=torch.ones_like(row), max_new_tokens=new, do_sample=False)
        torch.testing.assert_close(single, greedy_recompute(model, row, torch.ones_like(row), new), rtol=0, atol=0)
        torch.testing.assert_close(out[b, -new:], single[0, -new:], rtol=0, atol=0)


def test_generate_with_exit_at_step():
    model = build_model(generation_config_dict())
    ids = torch.randint(3, VOCAB, (1, 6))
    out = model.generate(ids, max_new_tokens=6, do_sample=False, exit_at_step=1)
    expected = ids
    for _ in range(6):
        with torch.no_grad():
            logits = model(expected, use_cache=False, exit_at_step=1).logits[:, -1]
        expected = torch.cat([expected, logits.argmax(-1, keepdim=True)], dim=1)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    assert not torch.equal(out, model.generate(ids, max_new_tokens=6, do_sample=False))


def test_cached_logits_match_full_forward():
    """Prefill + decode steps through the default dense cache give the no-cache logits."""
    model = build_model(generation_config_dict())
    ids, mask, _ = left_padded_batch([7, 10])
    extra = torch.randint(3, VOCAB, (2, 3))
    full_ids, full_mask = torch.cat([ids, extra], 1), torch.cat([mask, torch.ones_like(extra)], 1)
    with torch.no_grad():
        expected = model(full_ids, attention_mask=full_mask, use_cache=False).logits
        out = model(ids, attention_mask=mask, use_cache=True)
        cache = out.get("cache", out.get("past_key_values"))
        steps = [out.logits]
        for j in range(extra.shape[1]):
            width = ids.shape[1] + j + 1
            step = model(extra[:, j : j + 1], attention_mask=full_mask[:, :width], past_key_values=cache)
            steps.append(step.logits)
    assert_logits_close(torch.cat(steps, 1), expected, full_mask)


class RecordingCache(DynamicCache):
    """The dense reference cache, recording the cell index of every update."""

    def __init__(self, config):
        cells = config.total_ut_steps * config.num_hidden_layers
        super().__init__(ddp_cache_data=[(None, None)] * cells)
        self.calls: list[int] = []

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        self.calls.append(layer_idx)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)


def test_cells_and_update_order():
    model = build_model(generation_config_dict())
    cells = LOOPS * LAYERS
    assert len(dense_cache(model.config).layers) == cells
    ids = torch.randint(3, VOCAB, (1, 5))
    with torch.no_grad():
        out = model(ids)
    assert len(out.get("cache", out.get("past_key_values")).layers) == cells

    cache = RecordingCache(model.config)
    new = 4
    model.generate(ids, past_key_values=cache, max_new_tokens=new, do_sample=False)
    assert cache.calls == list(range(cells)) * new  # prefill + (new - 1) decode steps, t*L + l in order
    assert len(cache.layers) == cells
    assert all(layer.get_seq_length() == ids.shape[1] + new - 1 for layer in cache.layers)

    result = model.generate(ids, max_new_tokens=2, do_sample=False, return_dict_in_generate=True)
    default = result.get("cache", result.get("past_key_values"))
    assert isinstance(default, DynamicCache)
    assert len(default.layers) == cells


def test_static_cache_implementation_is_refused():
    model = build_model(generation_config_dict())
    with pytest.raises(ValueError, match="cell"):
        model.generate(torch.randint(3, VOCAB, (1, 4)), max_new_tokens=2, cache_implementation="static")


class BoundedCache(RecordingCache):
    """Declares a capacity the way a LoopKVCache does. A property, not an instance attribute: transformers
    5.17's Cache has a read-only (deprecated) ``max_cache_len`` property that an assignment cannot shadow."""

    def __init__(self, config, *, max_cache_len):
        super().__init__(config)
        self._capacity = max_cache_len

    @property
    def max_cache_len(self) -> int:
        return self._capacity


def test_generate_refuses_request_beyond_cache_capacity():
    model = build_model(generation_config_dict())
    ids = torch.randint(3, VOCAB, (1, 7))
    with pytest.raises(ValueError, match=r"7 \+ max_new_tokens 5 = 12.*max_cache_len 10"):
        model.generate(ids, past_key_values=BoundedCache(model.config, max_cache_len=10), max_new_tokens=5)
    cache = BoundedCache(model.config, max_cache_len=12)
    out = model.generate(ids, past_key_values=cache, max_new_tokens=5, do_sample=False)
    assert out.shape == (1, 12)


@pytest.mark.filterwarnings("ignore:Using the model-agnostic default")
def test_generate_without_max_new_tokens_checks_the_length_transformers_settles_on():
    """Neither ``max_new_tokens`` nor ``max_length``: transformers' default length, checked against the
    cache's capacity like any other, and refused before the cache sees a token."""
    model = build_model(generation_config_dict())
    ids = torch.randint(3, VOCAB, (1, 7))
    dense = model.generate(ids, do_sample=False)  # the default length, with the default cache
    total = dense.shape[1]
    assert total > ids.shape[1]
    out = model.generate(ids, past_key_values=BoundedCache(model.config, max_cache_len=total), do_sample=False)
    assert torch.equal(out, dense)
    short = BoundedCache(model.config, max_cache_len=total - 1)
    with pytest.raises(ValueError, match=rf"max_length {total} tokens .*max_cache_len {total - 1}"):
        model.generate(ids, past_key_values=short, do_sample=False)
    assert short.calls == []
    with pytest.raises(ValueError, match=r"max_length 10 tokens .*max_cache_len 9"):
        model.generate(ids, past_key_values=BoundedCache(model.config, max_cache_len=9), max_length=10)


# ------------------------------------------------------------------------------------- loopkv handles


class Handle:
    """What a LoopKVCache returns from update(): not a tensor, flagged for the loopkv attention."""

    is_loopkv_handle = True

    def __init__(self, dense):
        self.dense = dense


class HandleCache(RecordingCache):
    attention_implementation = "loopkv-test-handles"  # as LoopKVCache names "loopkv": what reads the handles

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        k, v = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        return Handle(k), Handle(v)


def test_handles_dispatch_to_loopkv_attention(monkeypatch):
    seen = []

    def loopkv_attention(module, query, key, value, attention_mask, *, scaling, dropout=0.0, **kwargs):
        seen.append((type(key), kwargs["position_ids"].clone()))
        k = key.dense.repeat_interleave(module.num_key_value_groups, dim=1)
        v = value.dense.repeat_interleave(module.num_key_value_groups, dim=1)
        scores = (query @ k.transpose(-1, -2)) * scaling
        n = scores.shape[-1]
        causal = torch.ones(n, n, dtype=torch.bool).tril()  # prefill of an unpadded batch: mask may be None
        allowed = causal if attention_mask is None else attention_mask
        scores = scores.masked_fill(~allowed, float("-inf"))
        return (scores.softmax(-1) @ v).transpose(1, 2), None

    monkeypatch.setitem(AttentionInterface._global_mapping, HandleCache.attention_implementation, loopkv_attention)
    model = build_model(generation_config_dict(num_attention_heads=4, num_key_value_heads=2))
    ids = torch.randint(3, VOCAB, (2, 6))
    with torch.no_grad():
        expected = model(ids, use_cache=False).logits
        got = model(ids, past_key_values=HandleCache(model.config)).logits
    assert_logits_close(got, expected)
    assert len(seen) == LOOPS * LAYERS
    assert all(kind is Handle for kind, _ in seen)
    torch.testing.assert_close(seen[0][1][-1], torch.arange(6), rtol=0, atol=0)


def test_static_dense_cache_generates_like_the_dynamic_reference():
    """``static_dense_cache``: one preallocated layer per cell; greedy tokens equal the DynamicCache
    reference's, and ``reset()`` lets a second generate on the same cache repeat them."""
    model = build_model(generation_config_dict())
    ids = torch.randint(3, VOCAB, (2, 7))
    want = model.generate(ids, past_key_values=dense_cache(model.config), max_new_tokens=6, do_sample=False)
    cache = static_dense_cache(model.config, max_cache_len=16)
    assert len(cache.layers) == LOOPS * LAYERS
    got = model.generate(ids, past_key_values=cache, max_new_tokens=6, do_sample=False)
    assert torch.equal(got, want)
    assert len({id(layer.keys) for layer in cache.layers}) == LOOPS * LAYERS  # no aliasing
    cache.reset()
    assert torch.equal(model.generate(ids, past_key_values=cache, max_new_tokens=6, do_sample=False), want)
    with pytest.raises(ValueError, match="max_cache_len"):
        static_dense_cache(model.config, max_cache_len=0)
