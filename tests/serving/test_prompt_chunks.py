"""The prompt scratch of chunked prefill (loopkv/serving/prompt_chunks.py): a prompt's chunks attend as the prompt in
one pass would, one request holds it at a time, and its bytes come out of a KV budget before the pool's pages."""

import itertools

import pytest
import torch

import loopkv
from loopkv.cache.paging import pool_pages_for
from loopkv.format import page_bytes
from loopkv.planning.bytes import exact_bytes
from loopkv.serving.prompt_chunks import PromptScratch, scratch_bytes
from loopkv.serving.transformers_cb import pool_pages_within
from tests.cache.driver import tiny_config
from tests.planning.test_bytes import ouro_config


def _causal_reference(q, k, v, scale):
    """float64 causal attention written out (q [Hq, S, D], k, v [S, H, D]; query head h reads KV head h // G)."""
    q, k, v = q.double(), k.double(), v.double()
    Hq, S, _ = q.shape
    g = Hq // k.shape[1]
    out = torch.empty(S, Hq, q.shape[2], dtype=torch.float64)
    for h in range(Hq):
        scores = q[h] @ k[:, h // g].T * scale  # [S, S]
        scores = scores.masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1), float("-inf"))
        out[:, h] = scores.softmax(-1) @ v[:, h // g]
    return out


@pytest.mark.parametrize("bounds", [[0, 70], [0, 1, 33, 70], [0, 40, 41, 69, 70]])
def test_chunks_attend_as_the_prompt_in_one_pass(bounds):
    """A 70-token prompt (4 query heads over 2 KV heads) in chunks at ``bounds``: each chunk's output equals the
    float64 causal attention of the whole prompt at its positions, in every cell."""
    g = torch.Generator().manual_seed(0)
    S, Hq, H, D, cells = bounds[-1], 4, 2, 32, 2
    scratch = PromptScratch(cells=cells, max_len=96, kv_heads=H, head_dim=D, dtype=torch.float32, device="cpu")
    for cell in range(cells):
        q = torch.randn(Hq, S, D, generator=g)
        k, v = torch.randn(S, H, D, generator=g), torch.randn(S, H, D, generator=g)
        expected = _causal_reference(q, k, v, scale=D**-0.5)
        for a, b in itertools.pairwise(bounds):
            out = scratch.attend(cell, q[:, a:b], k[a:b], v[a:b], start=a, scale=D**-0.5)
            torch.testing.assert_close(out.double(), expected[a:b], rtol=1e-5, atol=1e-5)


def test_one_request_holds_the_scratch_at_a_time():
    scratch = PromptScratch(cells=1, max_len=64, kv_heads=1, head_dim=32, dtype=torch.float32, device="cpu")
    scratch.claim("a")
    scratch.claim("a")  # its next chunk
    with pytest.raises(RuntimeError, match="request b starts a prompt in chunks while request a holds the scratch"):
        scratch.claim("b")
    scratch.release("b")  # not its holder: nothing happens
    assert scratch.owner == "a"
    scratch.release("a")
    scratch.claim("b")
    with pytest.raises(ValueError, match="ending at position 65, but the prompt scratch holds 64"):
        scratch.attend(0, torch.zeros(1, 2, 32), torch.zeros(2, 1, 32), torch.zeros(2, 1, 32), start=63, scale=1.0)


def test_the_scratch_holds_a_bf16_cache_of_max_len_tokens():
    """Ouro-1.4B stores 768 KiB of KV per token in BF16 (paper §1), so a 16K-token scratch is 12 GiB; a scratch's
    tensors are the bytes scratch_bytes counts."""
    assert scratch_bytes(ouro_config(), tokens=16384, dtype_bytes=2) == 768 * 1024 * 16384
    cfg = tiny_config()
    loops, layers = cfg.total_ut_steps, cfg.num_hidden_layers
    heads = cfg.num_key_value_heads
    scratch = PromptScratch(cells=loops * layers, max_len=100, kv_heads=heads, head_dim=cfg.head_dim,
                            dtype=torch.bfloat16, device="cpu")
    assert scratch.nbytes == scratch_bytes(cfg, tokens=100, dtype_bytes=2)


def test_chunked_prefill_takes_the_scratch_out_of_the_budget_first():
    """With chunked prefill, a KV budget buys the pages left after the slots' exact parts and the scratch: as many
    fewer as the scratch's bytes hold pages (within one, from the rounding down)."""
    cfg = tiny_config()
    plan = loopkv.Plan.uniform(loops=cfg.total_ut_steps, layers=cfg.num_hidden_layers, option="int4")
    budget_gib = 0.05
    whole = pool_pages_within(plan, cfg, kv_budget_gib=budget_gib, max_slots=2, max_len=512, dtype=torch.bfloat16)
    chunked = pool_pages_within(plan, cfg, kv_budget_gib=budget_gib, max_slots=2, max_len=512, dtype=torch.bfloat16,
                                chunked_prefill=True)
    assert whole == pool_pages_for(plan, cfg, budget_bytes=int(budget_gib * 2**30), max_batch_size=2, dtype_bytes=2)
    per_page = len(plan.options) * page_bytes(4, cfg.num_key_value_heads, cfg.head_dim, exact_bytes=2)
    fewer = scratch_bytes(cfg, tokens=512, dtype_bytes=2) / per_page
    assert fewer - 1 <= whole - chunked <= fewer + 1
    # a budget that buys pages beside the exact parts, but not beside them and the scratch
    tight = (exact_bytes(cfg, rows=2, dtype_bytes=2).total + scratch_bytes(cfg, tokens=512, dtype_bytes=2) // 2) / 2**30
    assert pool_pages_within(plan, cfg, kv_budget_gib=tight, max_slots=2, max_len=512, dtype=torch.bfloat16) > 1
    with pytest.raises(ValueError, match="reserved beside them"):
        pool_pages_within(plan, cfg, kv_budget_gib=tight, max_slots=2, max_len=512, dtype=torch.bfloat16,
                          chunked_prefill=True)
