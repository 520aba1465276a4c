"""Serving many requests: LoopKV storage behind transformers' continuous-batching engine (docs/design.md, "Serving").

``loopkv.serving.generate_batch(model, prompts, plan, max_slots=..., max_len=..., kv_budget_gib=...)``; for a server
that adds requests as they arrive, build the engine inside ``engine_cache(plan, ...)`` with ``engine_config(...)``
(``benchmarks/bench_serving.py`` does).
"""

from loopkv.serving.transformers_cb import engine_cache, engine_config, generate_batch

__all__ = ["engine_cache", "engine_config", "generate_batch"]
