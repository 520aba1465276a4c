"""Generate with a LoopKVCache on the small looped model loopkv ships, and compare with the exact dense cache.

    python examples/generate_with_loopkv.py

Profile -> plan -> cache -> generate: the small model's shipped profile (``loopkv profile`` makes one for your own
model) is solved into the memory-optimized plan (LoopKV-M), a cache is built from the plan, and the model answers a
retrieval prompt of 1024 tokens greedily, once through the cache and once through the exact dense cache. On a GPU
the same code runs loopkv's Triton kernels and compiles the whole decode step into one CUDA graph
(``compile_config``; ``loopkv.check_compile(model, cache)`` reports graph breaks on your own setup).
"""

import torch

import loopkv
from loopkv.models.data import retrieval_task
from loopkv.models.small import SMALL_DIR, decode, encode, load_small

device = "cuda" if torch.cuda.is_available() else "cpu"
dtype = torch.bfloat16 if device == "cuda" else torch.float32
model = load_small(dtype=dtype, device=device)

# 1-2. The profile (per-cell damage of each option) and the plan: one option per (loop, layer) cell.
profile = loopkv.planning.Profile.from_json(SMALL_DIR / "profile.json")
plan = loopkv.planning.solve_preset(profile, "m", tau=14.0)
per_token = plan.bytes_per_token(model.config)
bf16 = loopkv.Plan.uniform(loops=plan.loops, layers=plan.layers, option="bf16").bytes_per_token(model.config)
print(f"plan: {len(plan.options)} cells, {plan.options.count('share')} shared, {plan.options.count('int2')} INT2; "
      f"history KiB per token: {per_token.stored_kib:.2f} stored, {per_token.read_kib:.2f} read "
      f"(BF16: {bf16.stored_kib:.2f})")

# A prompt whose answer is a value stored ~1000 tokens earlier.
prompt, answer = retrieval_task(1024, seed=0)
ids = encode(prompt)[None].to(device)
mask = torch.ones_like(ids)
new_tokens = len(answer) + 4

# 3. The cache: everything preallocated for max_batch_size rows of max_cache_len tokens.
cache = loopkv.LoopKVCache(plan, config=model.config, max_batch_size=1, max_cache_len=ids.shape[1] + new_tokens,
                           dtype=dtype, device=device)
model.set_attn_implementation("loopkv")  # registered by LoopKVCache

# 4. Generate.
generate_kwargs = {}
if device == "cuda":  # the whole decode step (every cell, window exits included) as one CUDA graph
    from transformers import CompileConfig

    cache.warmup()  # build every kernel before capture
    generate_kwargs["compile_config"] = CompileConfig(fullgraph=True, mode="reduce-overhead")
out = model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=new_tokens, do_sample=False,
                     **generate_kwargs)
model.set_attn_implementation("sdpa")
exact = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False)  # dense cache
got, want = decode(out[0, ids.shape[1]:]), decode(exact[0, ids.shape[1]:])
print(f"expected answer: {answer!r}")
print(f"LoopKV-M cache:  {got!r}")
print(f"exact cache:     {want!r}")
same = (out[:, ids.shape[1]:] == exact[:, ids.shape[1]:]).float().mean()
print(f"greedy tokens equal to the exact cache: {same:.0%}")
print(cache.memory_report())

cache.reset()  # reuse the same storage (and compiled graph) for the next request of the same shape
