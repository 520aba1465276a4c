"""transformers' ``pipeline("text-generation")`` on the shipped small model with its shipped tokenizer, with and
without a LoopKVCache, and what happens when one cache is reused across requests."""

from __future__ import annotations

import pytest
import torch
from transformers import pipeline
from transformers.cache_utils import DynamicCache

import loopkv
from loopkv.models.ouro import OuroForCausalLM, dense_cache
from loopkv.models.small import SMALL_DIR, decode, encode, load_small

PROMPT = "def add(a, b):\n    return"
OTHER = "import os\nimport sys\nimport "
NEW = 6


@pytest.fixture(scope="module")
def pipe():
    loopkv.models.register_ouro()
    return pipeline("text-generation", model=str(SMALL_DIR), dtype=torch.float32)


@pytest.fixture(scope="module")
def small():
    return load_small()


def greedy_text(model, text: str) -> str:
    """``text`` and the model's greedy continuation, through loopkv's own byte tokens (no transformers tokenizer)."""
    ids = encode(text)[None]
    out = model.generate(ids, max_new_tokens=NEW, do_sample=False, eos_token_id=None)
    return text + decode(out[0, ids.shape[1]:]).decode("utf-8")


def loopkv_cache(config) -> loopkv.LoopKVCache:
    plan = loopkv.Plan.uniform(loops=config.total_ut_steps, layers=config.num_hidden_layers, option="int4")
    return loopkv.LoopKVCache(plan, config=config, max_batch_size=1, max_cache_len=128, dtype=torch.float32,
                              device="cpu")


def generated(pipe, text: str, **kwargs) -> str:
    out = pipe(text, max_new_tokens=NEW, do_sample=False, eos_token_id=None, **kwargs)
    return out[0]["generated_text"]


def test_the_pipeline_loads_the_small_model_and_its_tokenizer(pipe, small):
    assert type(pipe.model) is OuroForCausalLM
    assert pipe.tokenizer(PROMPT)["input_ids"] == encode(PROMPT).tolist()
    want = greedy_text(small, PROMPT)
    assert len(want) == len(PROMPT) + NEW
    assert generated(pipe, PROMPT) == want


def test_the_pipeline_generates_through_a_loopkv_cache(pipe, small):
    """Prompts shorter than the sink + window are held exactly, so an INT4 plan gives the dense tokens."""
    cache = loopkv_cache(pipe.model.config)
    assert generated(pipe, PROMPT, past_key_values=cache) == greedy_text(small, PROMPT)
    assert cache.get_seq_length() == len(encode(PROMPT)) + NEW - 1


@pytest.mark.parametrize("make_cache", [loopkv_cache, dense_cache], ids=["LoopKVCache", "dense"])
def test_a_new_prompt_on_a_used_cache_is_refused_until_reset(pipe, small, make_cache):
    """One cache, one conversation: an unrelated prompt (longer or shorter than what the cache holds) is refused
    before anything is written; the same conversation continues; after ``cache.reset()`` the new prompt is served
    as on a fresh cache."""
    cache = make_cache(pipe.model.config)
    first = generated(pipe, PROMPT, past_key_values=cache)
    held = cache.get_seq_length()
    for prompt in (OTHER, OTHER * 4):
        with pytest.raises(ValueError, match=r"call cache\.reset\(\)"):
            generated(pipe, prompt, past_key_values=cache)
        assert cache.get_seq_length() == held
    turn = first + "\n#"  # a short turn: LoopKVCache appends a continuation token by token
    assert generated(pipe, turn, past_key_values=cache) == greedy_text(small, turn)
    if isinstance(cache, loopkv.LoopKVCache):
        cache.reset()
    else:  # DynamicCache.reset() of transformers 5.17 zeroes the tensors and keeps their length: a new cache
        cache = make_cache(pipe.model.config)
    assert generated(pipe, OTHER, past_key_values=cache) == greedy_text(small, OTHER)


def test_generate_checks_the_rows_it_holds(small):
    """Outside a pipeline: the check compares every row the previous generate returned, left pads included."""
    ids = torch.stack([encode("abcdef"), encode("uvwxyz")])
    cache = DynamicCache()
    out = small.generate(ids, past_key_values=cache, max_new_tokens=3, do_sample=False, eos_token_id=None)
    other = out.clone()
    other[1, 4] = ord("Q")
    with pytest.raises(ValueError, match=r"row 1, position 4"):
        small.generate(torch.cat([other, ids[:, 1:3]], dim=1), past_key_values=cache, max_new_tokens=2)
    continued = small.generate(torch.cat([out, ids[:, 1:3]], dim=1), past_key_values=cache, max_new_tokens=2,
                               do_sample=False, eos_token_id=None)
    assert continued.shape == (2, out.shape[1] + 2 + 2)
