"""Serving many requests: LoopKV storage behind transformers' continuous-batching engine (docs/design.md, "Serving").

``loopkv.serving.generate_batch(model, prompts, plan, max_slots=..., max_len=..., kv_budget_gib=...)``.
"""
