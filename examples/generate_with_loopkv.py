"""Generate with a LoopKVCache on a tiny random Ouro, and compare with the exact dense cache.

    python examples/generate_with_loopkv.py

On a GPU the same code runs the Triton kernels (the cache registers them when built on CUDA) and compiles the
decode step into one CUDA graph (``compile_config``; check your own setup with ``loopkv.check_compile``).
"""

import torch

import loopkv
from loopkv.models.ouro import OuroConfig, OuroForCausalLM

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
config = OuroConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                    num_attention_heads=2, num_key_value_heads=2, head_dim=64, total_ut_steps=4,
                    max_position_embeddings=4096, rope_theta=10000.0)
model = OuroForCausalLM(config).to(device).eval()
prompt = torch.randint(0, 256, (2, 400), device=device)  # long enough for pages to leave the window
mask = torch.ones_like(prompt)

# One option per (loop, layer) cell: INT4 everywhere, loop 3 (index 2) reads loop 4's pages, V precision on.
plan = loopkv.Plan.share_loop(loops=4, layers=2, shared_loops=(2,), option="int4", tau=14.0)
per_token = plan.bytes_per_token(config)
print(f"history KiB per token: {per_token.stored_kib:.3f} stored, {per_token.read_kib:.3f} read")
cache = loopkv.LoopKVCache(plan, config=config, max_batch_size=2, max_cache_len=400 + 64,
                           dtype=torch.float32, device=device)

generate_kwargs = {}
if device == "cuda":
    # the whole decode step (every cell, window exits included) as one CUDA graph; warm the kernels first
    from transformers import CompileConfig

    cache.warmup()
    generate_kwargs["compile_config"] = CompileConfig(fullgraph=True, mode="reduce-overhead")
out = model.generate(prompt, attention_mask=mask, past_key_values=cache, max_new_tokens=64, do_sample=False,
                     **generate_kwargs)
exact = model.generate(prompt, attention_mask=mask, max_new_tokens=64, do_sample=False)  # dense per-cell cache
agree = (out[:, 400:] == exact[:, 400:]).float().mean().item()
print(f"greedy tokens equal to the exact cache: {agree:.1%}")
print(cache.memory_report())

cache.reset()  # reuse the same storage (and compiled graphs) for the next request
