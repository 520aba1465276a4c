"""loopkv's clean-room Huginn against an independent float64 forward, with the released checkpoint's names.

The reference below (`reference_logits`) is plain torch over a state dict with huginn-0125's parameter names
(written from the paper's description: prelude, adapter-injected core block repeated r times, coda; sandwich
blocks; RoPE as a complex rotation of channel pairs); it does not call loopkv. Generation through the dense cache
is checked against recomputation without a cache.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.cache_utils import DynamicCache

from loopkv.cells import Cell
from loopkv.families import family_of, layout_of
from loopkv.models.huginn import HuginnCells, HuginnConfig, HuginnForCausalLM, register_huginn
from tests.tolerances import LOGITS_FP32_ATOL, LOGITS_FP32_RTOL

VOCAB, EMBD, HEADS, INTER, BLOCK = 97, 64, 2, 96, 512
PRELUDE, CORE, CODA, STEPS = 1, 2, 1, 3
# float64 model against float64 reference: both are exact math in a different order
FLOAT64_TOL = 1e-9


def released_config(**overrides) -> dict:
    """A tiny config.json with every field name of huginn-0125's released file."""
    cfg = {
        "activation_checkpoint_impl": "per-iteration", "architecture_class_name": "RecurrentGPT",
        "architectures": ["RavenForCausalLM"],
        "auto_map": {"AutoConfig": "raven_config_minimal.RavenConfig",
                     "AutoModelForCausalLM": "raven_modeling_minimal.RavenForCausalLM"},
        "bias": False, "block_class_name": "SandwichBlock", "block_size": BLOCK,
        "effective_expected_depth": PRELUDE + CODA + CORE * STEPS, "head_dim": EMBD // HEADS,
        "init_orthogonal": False, "init_strategy": "takase",
        "init_values": {"embed_scale": math.sqrt(EMBD), "embedding": 0.1, "out_proj": 0.01, "std": 0.1},
        "injection_type": "linear", "intermediate_size": INTER, "mean_backprop_depth": 2,
        "mean_recurrence": STEPS, "mlp_class_name": "GatedMLP", "model_type": "huginn_raven", "n_embd": EMBD,
        "n_heads": HEADS, "n_layers": PRELUDE + CORE + CODA, "n_layers_in_coda": CODA,
        "n_layers_in_prelude": PRELUDE, "n_layers_in_recurrent_block": CORE, "nonlin_name": "SiLU",
        "norm_class_name": "RMSNorm_llama", "norm_eps": 1e-6, "num_key_value_heads": HEADS,
        "padded_vocab_size": VOCAB, "padding_multiple": 1, "qk_bias": True, "rope_base": 10000,
        "sampling_scheme": "poisson-lognormal-filling", "state_init": "like-init", "tie_embeddings": True,
        "torch_dtype": "float32", "transformers_version": "4.44.2", "vocab_size": VOCAB,
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
    }
    cfg.update(overrides)
    return cfg


def released_state_dict(cfg: dict, *, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights under exactly huginn-0125's parameter names and shapes (its safetensors index)."""
    gen = torch.Generator().manual_seed(seed)
    e, d, h, kv = cfg["n_embd"], cfg["head_dim"], cfg["n_heads"], cfg["num_key_value_heads"]

    def w(*shape, std=0.15):
        return torch.randn(*shape, generator=gen) * std

    sd = {"transformer.wte.weight": w(cfg["padded_vocab_size"], e, std=0.3),
          "transformer.adapter.weight": w(e, 2 * e, std=0.05), "transformer.ln_f.weight": 1 + w(e, std=0.1)}
    sd["lm_head.weight"] = sd["transformer.wte.weight"]  # tied, stored under both names as in the release
    parts = {"prelude": cfg["n_layers_in_prelude"], "core_block": cfg["n_layers_in_recurrent_block"],
             "coda": cfg["n_layers_in_coda"]}
    for part, count in parts.items():
        for i in range(count):
            p = f"transformer.{part}.{i}."
            sd[p + "attn.Wqkv.weight"] = w((h + 2 * kv) * d, e, std=0.15)
            sd[p + "attn.qk_bias"] = w(2, 1, h, d, std=0.2)
            sd[p + "attn.proj.weight"] = w(e, h * d)
            sd[p + "mlp.fc.weight"] = w(2 * cfg["intermediate_size"], e)
            sd[p + "mlp.proj.weight"] = w(e, cfg["intermediate_size"])
            for n in range(1, 5):
                sd[p + f"norm_{n}.weight"] = 1 + w(e, std=0.1)
    inv = 1.0 / cfg["rope_base"] ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = torch.arange(cfg["block_size"], dtype=torch.float64)[:, None] * inv
    sd["freqs_cis"] = torch.stack([angles.cos(), angles.sin()], -1)[None, :, None].float()
    return sd


def save_checkpoint(path, cfg: dict, sd: dict[str, torch.Tensor]) -> None:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    sd = dict(sd, **{"lm_head.weight": sd["lm_head.weight"].clone()})  # safetensors stores no shared tensors
    save_file({k: v.contiguous() for k, v in sd.items()}, str(path / "model.safetensors"))


def reference_logits(sd, cfg, ids, mask=None, *, steps, state=None) -> torch.Tensor:
    """The forward in float64: ``state`` is the initial recurrent state ``[B, S, E]`` (zeros if None)."""
    p = {k: v.double() for k, v in sd.items()}
    b, s = ids.shape
    e, h, d = cfg["n_embd"], cfg["n_heads"], cfg["head_dim"]
    mask = torch.ones(b, s, dtype=torch.long) if mask is None else mask
    pos = (mask.cumsum(-1) - 1).clamp(min=0)  # [B, S]
    freq = 1.0 / cfg["rope_base"] ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    turn = torch.polar(torch.ones(b, s, d // 2, dtype=torch.float64), pos[..., None].double() * freq)  # [B, S, D/2]
    # causal over real keys; a pad query reads itself only (its output is never used, but must stay finite)
    allowed = torch.tril(torch.ones(s, s, dtype=torch.bool)) & mask.bool()[:, None, :] | torch.eye(s, dtype=torch.bool)

    def norm(x, wgt):
        return wgt * x / torch.sqrt((x * x).mean(-1, keepdim=True) + cfg["norm_eps"])

    def rotate(x):  # [B, S, H, D]: pairs as complex numbers times e^{i pos freq}
        c = torch.view_as_complex(x.reshape(b, s, h, d // 2, 2).contiguous())
        return torch.view_as_real(c * turn[:, :, None]).reshape(b, s, h, d)

    def block(x, pre):
        y = norm(x, p[pre + "norm_1.weight"])
        q, k, v = (y @ p[pre + "attn.Wqkv.weight"].T).split(e, dim=-1)
        q = rotate(q.reshape(b, s, h, d) + p[pre + "attn.qk_bias"][0])
        k = rotate(k.reshape(b, s, h, d) + p[pre + "attn.qk_bias"][1])
        v = v.reshape(b, s, h, d)
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d)
        scores = scores.masked_fill(~allowed[:, None], float("-inf"))
        att = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v).reshape(b, s, e)
        x = norm(x + att @ p[pre + "attn.proj.weight"].T, p[pre + "norm_2.weight"])
        gate, up = (norm(x, p[pre + "norm_3.weight"]) @ p[pre + "mlp.fc.weight"].T).chunk(2, dim=-1)
        mlp = (gate * torch.sigmoid(gate) * up) @ p[pre + "mlp.proj.weight"].T
        return norm(x + mlp, p[pre + "norm_4.weight"])

    x = p["transformer.wte.weight"][ids] * cfg["init_values"]["embed_scale"]
    for i in range(cfg["n_layers_in_prelude"]):
        x = block(x, f"transformer.prelude.{i}.")
    z = torch.zeros_like(x) if state is None else state.double()
    for _ in range(steps):
        z = torch.cat([z, x], -1) @ p["transformer.adapter.weight"].T
        for j in range(cfg["n_layers_in_recurrent_block"]):
            z = block(z, f"transformer.core_block.{j}.")
    y = norm(z, p["transformer.ln_f.weight"])
    for i in range(cfg["n_layers_in_coda"]):
        y = block(y, f"transformer.coda.{i}.")
    return norm(y, p["transformer.ln_f.weight"]) @ p["lm_head.weight"].T


def left_padded_batch(lengths, *, seed=0):
    gen = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        ids[row, width - n:] = torch.randint(3, VOCAB, (n,), generator=gen)
        mask[row, width - n:] = 1
    return ids, mask


def build_model(cfg: dict, *, dtype=torch.float32, attn="sdpa") -> HuginnForCausalLM:
    config = HuginnConfig(**{k: v for k, v in cfg.items() if k not in ("architectures", "auto_map", "model_type")})
    model = HuginnForCausalLM(config).eval()
    model.load_state_dict(released_state_dict(cfg), strict=True)
    model.set_attn_implementation(attn)
    return model.to(dtype)


def assert_logits_close(got, want, mask, *, atol=LOGITS_FP32_ATOL, rtol=LOGITS_FP32_RTOL):
    keep = mask.bool()  # left pads' logits are garbage in both
    torch.testing.assert_close(got[keep].double(), want[keep], atol=atol, rtol=rtol)


def test_released_names_and_shapes_load_strictly():
    cfg = released_config()
    sd = released_state_dict(cfg)
    model = HuginnForCausalLM(HuginnConfig(**cfg))
    assert {k: tuple(v.shape) for k, v in model.state_dict().items()} == {k: tuple(v.shape) for k, v in sd.items()}
    model.load_state_dict(sd, strict=True)
    assert model.lm_head.weight is model.transformer.wte.weight  # tie_embeddings
    assert model.config.num_hidden_layers == PRELUDE + CORE + CODA
    assert model.config.hidden_size == EMBD
    torch.testing.assert_close(model.freqs_cis, sd["freqs_cis"], atol=1e-6, rtol=0)  # the table it builds itself


def test_released_defaults_are_huginn_0125():
    cfg = HuginnConfig()
    assert (cfg.n_embd, cfg.n_heads, cfg.head_dim, cfg.num_key_value_heads) == (5280, 55, 96, 55)
    assert (cfg.n_layers_in_prelude, cfg.n_layers_in_recurrent_block, cfg.n_layers_in_coda) == (2, 4, 2)
    assert cfg.mean_recurrence == 32
    assert cfg.effective_expected_depth == 132
    assert cfg.init_values["std"] == pytest.approx(0.008703882797784892)  # the released file's values
    assert cfg.embed_scale == pytest.approx(72.6636084983398)


def float64_model(cfg: dict) -> HuginnForCausalLM:
    """The model in float64, its RoPE table too (the checkpoint's table is fp32: 6e-8 off, amplified ~100x by the
    random layers, far above float64's rounding)."""
    model = build_model(cfg, dtype=torch.float64)
    d = cfg["head_dim"]
    inv = 1.0 / cfg["rope_base"] ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = torch.arange(cfg["block_size"], dtype=torch.float64)[:, None] * inv
    model.freqs_cis.copy_(torch.stack([angles.cos(), angles.sin()], -1)[None, :, None])
    return model


@pytest.mark.parametrize("steps", [1, STEPS])
def test_forward_matches_float64_reference(steps):
    cfg = released_config()
    ids, mask = left_padded_batch([9, 5, 7])
    sd = released_state_dict(cfg)
    want = reference_logits(sd, cfg, ids, mask, steps=steps)
    with torch.no_grad():
        got = float64_model(cfg)(ids, attention_mask=mask, num_steps=steps, init_scale=0.0).logits
        assert got.dtype == torch.float64
        assert_logits_close(got, want, mask, atol=FLOAT64_TOL, rtol=FLOAT64_TOL)
        for attn in ("eager", "sdpa"):  # eager's additive mask overflows to NaN rows in float64: fp32 only
            model = build_model(cfg, attn=attn)
            assert_logits_close(model(ids, attention_mask=mask, num_steps=steps, init_scale=0.0).logits, want, mask)


def test_random_initial_state_is_the_released_one_and_seeded():
    """like-init: a truncated normal of std init_values["std"] (|z| <= 3 std) times embed_scale, from the given
    generator; the forward with it equals the reference started from that state."""
    cfg = released_config()
    model = float64_model(cfg)
    ids = torch.randint(3, VOCAB, (2, 6), generator=torch.Generator().manual_seed(1))
    embeds = torch.zeros(2, 6, EMBD, dtype=torch.float64)
    state = model.initial_state(embeds, generator=torch.Generator().manual_seed(5))
    std, scale = cfg["init_values"]["std"], cfg["init_values"]["embed_scale"]
    assert state.abs().max() <= 3 * std * scale
    assert state.std() == pytest.approx(std * scale, rel=0.1)
    with torch.no_grad():
        got = model(ids, num_steps=2, state_generator=torch.Generator().manual_seed(5)).logits
        again = model(ids, num_steps=2, state_generator=torch.Generator().manual_seed(5)).logits
        other = model(ids, num_steps=2, state_generator=torch.Generator().manual_seed(6)).logits
    want = reference_logits(released_state_dict(cfg), cfg, ids, steps=2, state=state)
    torch.testing.assert_close(got, want, atol=FLOAT64_TOL, rtol=FLOAT64_TOL)
    assert torch.equal(got, again)
    assert not torch.allclose(got, other)
    zero = HuginnForCausalLM(HuginnConfig(**dict(cfg, state_init="zero"))).eval()
    assert torch.equal(zero.initial_state(embeds), torch.zeros_like(embeds))


def test_from_pretrained_and_auto_classes(tmp_path):
    cfg = released_config()
    sd = released_state_dict(cfg)
    save_checkpoint(tmp_path, cfg, sd)
    register_huginn()
    register_huginn()  # idempotent
    assert isinstance(AutoConfig.from_pretrained(tmp_path), HuginnConfig)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert type(model) is HuginnForCausalLM
    ids, mask = left_padded_batch([6, 4])
    with torch.no_grad():
        got = model(ids, attention_mask=mask, init_scale=0.0).logits
    assert_logits_close(got, reference_logits(sd, cfg, ids, mask, steps=STEPS), mask)
    half = HuginnForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert half.lm_head.weight.dtype == torch.bfloat16
    assert torch.equal(half.freqs_cis, sd["freqs_cis"])  # the RoPE table is loaded in fp32, not rounded to bf16


@pytest.mark.parametrize(("change", "match"), [
    ({"n_layers": 5}, "n_layers"),
    ({"injection_type": "add"}, "injection_type"),
    ({"state_init": "normal"}, "state_init"),
    ({"test_time_noise": 0.1}, "test_time_noise"),
    ({"num_key_value_heads": 1}, "qk_bias"),
    ({"mean_recurrence": 0}, "mean_recurrence"),
])
def test_config_refuses_what_it_does_not_implement(change, match):
    with pytest.raises(ValueError, match=match):
        HuginnConfig(**dict(released_config(), **change))


def test_bad_num_steps_is_refused():
    model = build_model(released_config())
    ids = torch.randint(3, VOCAB, (1, 4))
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="num_steps"):
            model(ids, num_steps=bad)
        with pytest.raises(ValueError, match="num_steps"):
            model.generate(ids, num_steps=bad, max_new_tokens=2)


def test_a_dense_cache_keeps_its_step_count():
    """A cache filled with r steps holds no cells for other steps: another r is refused until it is empty."""
    model = build_model(released_config())
    cache = DynamicCache()
    ids = torch.randint(3, VOCAB, (1, 5))
    with torch.no_grad():
        model(ids, past_key_values=cache, num_steps=2, init_scale=0.0)
        with pytest.raises(ValueError, match="holds tokens run with num_steps=2"):
            model(ids[:, :1], past_key_values=cache, num_steps=3, init_scale=0.0)
        model(ids[:, :1], past_key_values=cache, num_steps=2, init_scale=0.0)
    assert cache.get_seq_length() == 6


def greedy_recompute(model, ids, mask, new, steps):
    out, mask = ids, mask
    for _ in range(new):
        with torch.no_grad():
            logits = model(out, attention_mask=mask, use_cache=False, num_steps=steps, init_scale=0.0).logits
        out = torch.cat([out, logits[:, -1].argmax(-1, keepdim=True)], 1)
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
    return out


@pytest.mark.parametrize("steps", [1, 4])
def test_generate_matches_recompute(steps):
    """Through the default dense cache, with left padding, for the r of the call."""
    model = build_model(released_config())
    ids, mask = left_padded_batch([11, 4, 8])
    out = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, num_steps=steps,
                         init_scale=0.0, eos_token_id=None)
    torch.testing.assert_close(out, greedy_recompute(model, ids, mask, 6, steps), rtol=0, atol=0)


def test_left_padded_rows_generate_as_alone():
    model = build_model(released_config())
    ids, mask = left_padded_batch([9, 3, 6], seed=2)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, init_scale=0.0,
                         eos_token_id=None)
    for row in range(ids.shape[0]):
        alone = ids[row:row + 1, ~mask[row].eq(0)]
        single = model.generate(alone, max_new_tokens=6, do_sample=False, init_scale=0.0, eos_token_id=None)
        assert torch.equal(out[row, -6:], single[0, -6:])


def test_cache_indices_of_a_call():
    """Every attention layer writes its own index: prelude, coda, then (step, core layer) step-major."""
    cells = HuginnCells(PRELUDE, CORE, CODA)
    seen = []

    class Recording(DynamicCache):
        def update(self, key, value, layer_idx, *args, **kwargs):
            seen.append(layer_idx)
            return super().update(key, value, layer_idx, *args, **kwargs)

    model = build_model(released_config())
    with torch.no_grad():
        model(torch.randint(3, VOCAB, (1, 3)), past_key_values=Recording(), num_steps=2, init_scale=0.0)
    core = [cells.core_index(s, j) for s in range(2) for j in range(CORE)]
    assert seen == [cells.prelude_index(0), *core, cells.coda_index(0)]
    assert sorted(seen) == list(range(PRELUDE + CODA + 2 * CORE))


@pytest.mark.parametrize("loops", [None, 5])
def test_family_layout(loops):
    """The Huginn family: cells (step, core layer) at the model's indices, prelude and coda fixed exact slots; the
    same from a config.json mapping (what the CLI reads)."""
    config = HuginnConfig(**released_config())
    layout = layout_of(config, loops=loops)
    steps = STEPS if loops is None else loops
    cells = HuginnCells.of(config)
    assert family_of(config) == family_of(released_config()) == layout.family == "huginn"
    assert (layout.loops, layout.layers, layout.num_indices) == (steps, CORE, cells.num_indices(steps))
    for t in range(steps):
        for j in range(CORE):
            assert layout.flat_index(Cell(t, j)) == cells.core_index(t, j)
            assert layout.slot(cells.core_index(t, j)).layer == PRELUDE + j  # the physical core layer
    fixed = [(s.index, s.kind) for s in layout.fixed()]
    assert fixed == [(cells.prelude_index(0), "exact"), (cells.coda_index(0), "exact")]
    assert layout.call_order[0] == cells.prelude_index(0)
    assert layout.last_index == cells.coda_index(CODA - 1)  # the coda runs last: where a decode step is counted
    assert layout_of(released_config(), loops=loops) == layout
