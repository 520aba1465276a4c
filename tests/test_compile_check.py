"""loopkv.check_compile reports graph breaks and recompiles, with reasons."""

import torch

import loopkv
from loopkv.models.ouro import OuroConfig, OuroForCausalLM


def _model(**kw):
    torch.manual_seed(0)
    cfg = OuroConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=2,
                     num_key_value_heads=2, head_dim=32, total_ut_steps=2, max_position_embeddings=1024,
                     rope_theta=10000.0)
    return OuroForCausalLM(cfg).eval(), cfg


def test_loopkv_decode_is_one_graph():
    model, cfg = _model()
    cache = loopkv.LoopKVCache(loopkv.Plan.uniform(loops=2, layers=2, option="int4", tau=14.0), config=cfg,
                               max_batch_size=1, max_cache_len=64, dtype=torch.float32, device="cpu")
    report = loopkv.check_compile(model, cache, steps=6, backend="aot_eager")
    assert report.ok, str(report)
    assert report.graphs == 1
    assert cache.get_seq_length() == 0  # reset afterwards


def test_a_graph_break_is_reported_with_its_reason():
    model, cfg = _model()

    class Breaking(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner, self.config = inner, inner.config

        def forward(self, **kw):
            out = self.inner(**kw)
            torch._dynamo.graph_break()
            return out

    cache = loopkv.LoopKVCache(loopkv.Plan.uniform(loops=2, layers=2), config=cfg, max_batch_size=1,
                               max_cache_len=64, dtype=torch.float32, device="cpu")
    report = loopkv.check_compile(Breaking(model), cache, steps=4, backend="aot_eager")
    assert not report.ok
    assert sum(report.graph_breaks.values()) >= 1
    assert "graph break" in str(report)
    assert any("graph_break" in m or "Graph break" in m for m in report.messages)  # the reason, from the logs
