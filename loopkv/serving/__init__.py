"""Serving many requests: LoopKV storage behind transformers' continuous-batching engine (docs/design.md, "Serving").

``loopkv.serving.generate_batch(model, prompts, plan, max_slots=..., max_len=..., kv_budget_gib=...)``; for a server
that adds requests as they arrive, build the engine inside ``engine_cache(plan, ...)`` with ``engine_config(...)``
(``benchmarks/bench_serving.py`` does), with ``pool_pages_within(...)`` for the pages a KV budget buys. A long
prompt is one step unless ``chunked_prefill=True`` (docs/design.md, "Prompts").
"""

from loopkv.serving.transformers_cb import engine_cache, engine_config, generate_batch, pool_pages_within

__all__ = ["engine_cache", "engine_config", "generate_batch", "pool_pages_within"]
