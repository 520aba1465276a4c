"""A short cache allocates only what its tokens can use (issue 28, item 8; docs/design.md, "Storage layout").

A cache whose ``max_cache_len`` is too short for any page to be stored keeps ``min(SINK, n)`` sink slots, ``n - SINK``
ring slots and no pages, and reads them with the full cache's slot arithmetic (its ring never wraps). Checked here:
the bytes its tensors' storages hold equal ``memory_report()`` and the bytes a row's tokens can use, counted from the
format's constants by brute force over positions; decoding through ``generate`` on a tiny Ouro gives what a long cache
gives, token for token (bf16, int4, int2 and share plans through the references; the Triton kernels under the
interpreter at one small shape); and the capacity refusals still come at ``max_cache_len``.
"""

import gc
import os

import pytest
import torch

import loopkv
from loopkv.format import PAGE, RING, SINK, WINDOW
from tests.cache.driver import tiny_config, tiny_ouro
from tests.tolerances import LOGITS_FP32_ATOL, LOGITS_FP32_RTOL

ROWS, HEADS, HEAD_DIM = 4, 2, 32  # 4 int32 lengths and every sink/ring slot fill whole 16-byte rows: no padding
PLANS = {  # per loop (2 loops x 2 layers); the first loop's 'share' reads the final loop's pool
    "bf16": ["bf16", "bf16"], "int4": ["int4", "int4"], "int2": ["int2", "int2"], "share": ["share", "int4"],
    "mixed": ["int2", "bf16"],
}
# history bits per stored K/V element: the codes plus an fp16 scale and zero per 32 elements (4 + 1, 2 + 1)
CODE_BITS = {"int4": 5, "int2": 3}


def _plan(name: str) -> loopkv.Plan:
    return loopkv.Plan.from_loops(loops=2, layers=2, per_loop=PLANS[name], tau=14.0)


def usable_bytes(options: list[str], max_cache_len: int, *, pool_pages: int | None, itemsize: int) -> int:
    """The bytes a cache's rows can use, from the format's constants alone: page ``p`` is stored when a row reaches
    ``SINK + WINDOW + PAGE - 1 + PAGE * p`` tokens; a row with ``P`` such pages holds up to one token before page
    ``P`` would be stored (else ``max_cache_len``); its exact slots are those its positions land in."""
    quantize_at = SINK + WINDOW + PAGE - 1
    pages = sum(1 for p in range(max_cache_len) if quantize_at + PAGE * p <= max_cache_len)
    held = quantize_at + PAGE * pages - 1 if pages else max_cache_len
    slots = len({pos if pos < SINK else SINK + (pos - SINK) % RING for pos in range(held)})
    total = 0
    for option in options:
        total += 2 * ROWS * HEADS * HEAD_DIM * itemsize * slots + 4 * ROWS  # K and V sink + ring, int32 lengths
        if option == "share":
            continue
        physical = ROWS * pages if pool_pages is None else (pool_pages + 1 if pages else 0)  # + the trash page
        bits = 8 * itemsize if option == "bf16" else CODE_BITS[option]
        total += 4 * ROWS * pages + physical * HEADS * 2 * PAGE * HEAD_DIM * bits // 8  # page table, pool
    return total


def allocated_bytes(cache) -> int:
    """The bytes held by the storages behind every cell's tensors (each stacked buffer once)."""
    storages = {}
    for i in range(len(cache.layers)):
        for t in vars(cache.storage(i)).values():
            if isinstance(t, torch.Tensor):
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values())


@pytest.mark.parametrize("pool_pages", [None, 3])
@pytest.mark.parametrize("plan", ["share", "mixed"])
@pytest.mark.parametrize("max_cache_len", [1, 5, 31, 32, 33, 64, 287, 288, 289, 318, 319, 320, 400])
def test_bytes_allocated_are_the_report_and_what_the_tokens_can_use(max_cache_len, plan, pool_pages):
    cache = loopkv.LoopKVCache(_plan(plan), config=tiny_config(head_dim=HEAD_DIM), max_batch_size=ROWS,
                               max_cache_len=max_cache_len, dtype=torch.float32, device="cpu", pool_pages=pool_pages)
    options = [cache.plan.option(cell) for cell in cache.layout]
    want = usable_bytes(options, max_cache_len, pool_pages=pool_pages, itemsize=4)
    assert allocated_bytes(cache) == cache.memory_report().total_bytes == want


def test_a_short_cache_at_64_tokens_is_a_static_cache_in_size():
    """Issue 28 measured 5x a StaticCache at 64 tokens (the full sink and ring); exact cells now hold what a
    transformers ``StaticCache`` of 64 tokens does, plus the lengths."""
    cache = loopkv.LoopKVCache(_plan("bf16"), config=tiny_config(head_dim=HEAD_DIM), max_batch_size=ROWS,
                               max_cache_len=64, dtype=torch.float32, device="cpu")
    static = 4 * 2 * ROWS * HEADS * 64 * HEAD_DIM * 4  # 4 cells, K and V, fp32
    assert cache.memory_report().total_bytes == static + 4 * 4 * ROWS


@pytest.fixture(scope="module")
def model():
    return tiny_ouro()


def _generate(model, plan, max_cache_len, ids, mask, new, *, pool_pages=None, device="cpu"):
    cache = loopkv.LoopKVCache(plan, config=model.config, max_batch_size=ids.shape[0], max_cache_len=max_cache_len,
                               dtype=torch.float32, device=device, pool_pages=pool_pages)
    out = model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=new, do_sample=False,
                         eos_token_id=None, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    return out.sequences, torch.stack(out.logits), cache


def _prompts(lengths, seed=0):
    """Left-padded random prompts of ``lengths`` tokens (ids 3..96) and their attention mask."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for b, n in enumerate(lengths):
        ids[b, width - n:] = torch.randint(3, 97, (n,), generator=g)
        mask[b, width - n:] = 1
    return ids, mask


@pytest.mark.parametrize(("plan", "max_cache_len", "pool_pages", "device"), [
    ("bf16", 20, None, "cpu"), ("int4", 45, None, "cpu"), ("int2", 20, None, {0: "cpu", 1: "cpu:0"}),
    ("share", 45, None, {0: "cpu", 1: "cpu:0"}), ("share", 20, 2, "cpu")])
def test_a_short_cache_decodes_what_a_long_one_does(model, plan, max_cache_len, pool_pages, device):
    """Rows of n - 16 and n - 12 prompt tokens decoded 12 steps, until the longer one is full: below the sink's end
    (20: no ring at all) and across it (45), with a shared pool (which then has no pages) and in two shards (each
    layer's cells stacked apart, ``loopkv/cache/placement.py``), against one long cache that could store pages."""
    ids, mask = _prompts([max_cache_len - 16, max_cache_len - 12])
    new = max_cache_len - ids.shape[1]
    short, short_logits, cache = _generate(model, _plan(plan), max_cache_len, ids, mask, new, pool_pages=pool_pages,
                                           device=device)
    long, long_logits, _ = _generate(model, _plan(plan), 400, ids, mask, new)
    assert cache.storage(0).win_k.shape[2] == max(0, max_cache_len - SINK)  # it was short
    assert torch.equal(short, long)
    torch.testing.assert_close(short_logits, long_logits, atol=LOGITS_FP32_ATOL, rtol=LOGITS_FP32_RTOL)
    model(input_ids=short[:, -1:], past_key_values=cache)  # generate fed all but its last token: now the row is full
    with pytest.raises(ValueError, match=f"max_cache_len={max_cache_len}"):  # refused, not dropped
        model(input_ids=short[:, -1:], past_key_values=cache)


def test_a_short_cache_continues_a_turn_as_a_long_one_does(model):
    """A later turn of several tokens on a non-empty short cache (``loopkv/cache/continuation.py``), from inside the
    sink to past it, and a turn past ``max_cache_len`` refused before anything is written."""
    ids, _ = _prompts([41])
    logits = {}
    for length in (40, 400):
        cache = loopkv.LoopKVCache(_plan("share"), config=model.config, max_batch_size=1, max_cache_len=length,
                                   dtype=torch.float32, device="cpu")
        model(input_ids=ids[:, :10], past_key_values=cache)
        logits[length] = model(input_ids=ids[:, 10:40], past_key_values=cache).logits
    torch.testing.assert_close(logits[40], logits[400], atol=LOGITS_FP32_ATOL, rtol=LOGITS_FP32_RTOL)
    cache = loopkv.LoopKVCache(_plan("share"), config=model.config, max_batch_size=1, max_cache_len=40,
                               dtype=torch.float32, device="cpu")
    model(input_ids=ids[:, :10], past_key_values=cache)
    with pytest.raises(ValueError, match="max_cache_len=40"):
        model(input_ids=ids[:, 10:], past_key_values=cache)
    assert cache.get_seq_length() == 10


def test_generate_past_a_short_cache_is_refused_before_it_starts(model):
    ids, mask = _prompts([6, 9])
    cache = loopkv.LoopKVCache(_plan("int4"), config=model.config, max_batch_size=2, max_cache_len=20,
                               dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match="21 tokens exceeds the cache's max_cache_len 20"):
        model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=12, do_sample=False,
                       pad_token_id=0)
    assert cache.get_seq_length() == 0


INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@pytest.fixture
def triton_on_cpu(monkeypatch):
    """The Triton launchers as the ops' CPU kernels (run by Triton's interpreter) while the test runs; a launcher that
    would fall back to its reference fails instead, so the kernels are what ran."""
    pytest.importorskip("triton")
    from loopkv.ops import step_ops, triton_attention, triton_chunk, triton_quant
    from loopkv.ops.triton_register import launchers

    def refuse(*args, **kwargs):
        raise AssertionError("a Triton launcher fell back to its reference")

    for module, name in ((step_ops, "token_attention_reference"), (step_ops, "advance_stacks_reference"),
                         (triton_attention, "cell_attention_reference"), (triton_quant, "write_pages_reference"),
                         (triton_chunk, "chunk_attention_reference")):
        monkeypatch.setattr(module, name, refuse)
    lib = torch.library.Library("loopkv", "FRAGMENT")  # the registrations live as long as it does
    for op, launcher in launchers():
        torch.library.impl(f"loopkv::{op._name.split('::')[-1]}", "cpu", launcher, lib=lib)
    yield
    del lib
    gc.collect()


@pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 (set on machines without CUDA)")
@pytest.mark.usefixtures("triton_on_cpu")
def test_triton_kernels_decode_a_short_cache_as_a_long_one():
    """head_dim 64 (the kernels serve 64 to 256), int4, one layer: a row of 31 prompt tokens decoded into the sink's
    last slot and a ring of 4 until it is full (the fused reader's sink and ring strides, the token write), against
    the same kernels on the full sink and ring. One row, few steps: the interpreter runs every program in Python."""
    model = tiny_ouro(layers=1, head_dim=64)
    plan = loopkv.Plan.from_loops(loops=2, layers=1, per_loop=["int4", "int4"], tau=14.0)
    ids, mask = _prompts([31])
    short, short_logits, cache = _generate(model, plan, 36, ids, mask, 5)
    long, long_logits, _ = _generate(model, plan, 320, ids, mask, 5)
    assert tuple(cache.storage(0).win_k.shape) == (1, 2, 36 - SINK, 64)
    assert torch.equal(short, long)
    torch.testing.assert_close(short_logits, long_logits, atol=LOGITS_FP32_ATOL, rtol=LOGITS_FP32_RTOL)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("plan", ["int4", "share"])
@pytest.mark.parametrize("max_cache_len", [20, 45, 64])
def test_gpu_compiled_short_cache_decodes_what_a_long_one_does(plan, max_cache_len):
    """The compiled kernels in one CUDA graph per step (bf16, head_dim 64): no ring (20), a ring whose slot count
    Triton does not specialize as a multiple of 16 (45: 13 slots) and one it does (64). The reader runs the same near
    programs over the same slots and the long cache's history programs hold no page and exit, so the outputs are
    bit-identical."""
    from transformers import CompileConfig

    # dynamo's code cache is shared by every model instance: without a reset, the parametrized cases' cache sizes
    # would pile up until dynamo makes the stacks' shapes dynamic, which the ops do not take (a known limit)
    torch._dynamo.reset()
    model = tiny_ouro(head_dim=64, device="cuda").to(torch.bfloat16)
    ids, mask = (t.cuda() for t in _prompts([6, 9]))
    outs = []
    for length in (max_cache_len, 400):
        cache = loopkv.LoopKVCache(_plan(plan), config=model.config, max_batch_size=2, max_cache_len=length,
                                   dtype=torch.bfloat16, device="cuda")
        cache.warmup()
        out = model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=max_cache_len - 9,
                             do_sample=False, eos_token_id=None, pad_token_id=0, output_logits=True,
                             return_dict_in_generate=True,
                             compile_config=CompileConfig(fullgraph=True, mode="reduce-overhead"))
        outs.append((out.sequences, torch.stack(out.logits)))
    assert torch.equal(outs[0][0], outs[1][0])
    assert torch.equal(outs[0][1], outs[1][1])
