"""loopkv.families: the cache indices of each family's layout, against the model's own calls.

Ouro's layout must give exactly CellLayout's ``t * L + l``; Dory's is checked against the indices transformers'
``DoryModel.forward`` actually passes to ``Cache.update``, recorded layer by layer (skipped without Dory).
"""

from __future__ import annotations

import pytest
import torch

from loopkv.cells import Cell, CellLayout
from loopkv.families import DORY_MIN_TRANSFORMERS, family_of, layout_of

try:
    from transformers import DoryConfig, DoryForCausalLM
    from transformers.cache_utils import DynamicCache
except ImportError:  # transformers < 5.24 has no Dory
    DoryConfig = None

needs_dory = pytest.mark.skipif(DoryConfig is None, reason=f"needs transformers >= {DORY_MIN_TRANSFORMERS} (Dory)")


def ouro(loops: int, layers: int) -> dict:
    return {"total_ut_steps": loops, "num_hidden_layers": layers, "num_attention_heads": 2}


@pytest.mark.parametrize(("loops", "layers"), [(1, 1), (4, 24), (3, 5)])
def test_ouro_layout_is_todays_cell_layout(loops, layers):
    layout = layout_of(ouro(loops, layers))
    cells = CellLayout(loops, layers)
    assert layout.family == "ouro"
    assert layout.cells == cells
    assert list(layout) == list(cells)
    assert [layout.flat_index(c) for c in cells] == [t * layers + lay for t in range(loops) for lay in range(layers)]
    assert [layout.cell(i) for i in range(loops * layers)] == [cells.cell(i) for i in range(loops * layers)]
    assert layout.call_order == tuple(range(loops * layers))
    assert layout.num_indices == layout.num_cells == loops * layers
    assert layout.physical_layers == tuple(i % layers for i in range(loops * layers))
    assert layout.fixed() == []
    assert layout.reads_without_update == ()
    assert all(layout.source(c) == cells.source(c) for c in cells)


def test_an_unknown_config_is_refused_naming_the_families():
    with pytest.raises(ValueError, match="total_ut_steps.*model_type 'dory'"):
        layout_of({"num_hidden_layers": 4, "model_type": "llama"})


def test_dory_on_an_older_transformers_names_the_release(monkeypatch):
    import transformers

    monkeypatch.setattr(transformers, "__version__", "5.23.0")
    config = {"model_type": "dory", "num_hidden_layers": 4, "n_input_layers": 1, "n_output_layers": 1,
              "n_recurrent_loops": 2}
    assert family_of(config) == "dory"
    with pytest.raises(ValueError, match=r"transformers >= 5\.24\.0 .* this is transformers 5\.23\.0"):
        layout_of(config)


def tiny_dory(**overrides) -> DoryConfig:
    fields = dict(num_hidden_layers=7, n_input_layers=2, n_output_layers=1, n_recurrent_loops=3, hidden_size=32,
                  intermediate_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=16, vocab_size=31,
                  sliding_window=16,
                  layer_types=["full_attention", "sliding_attention", "full_attention", "sliding_attention",
                               "full_attention", "full_attention", "sliding_attention"])
    return DoryConfig(**{**fields, **overrides})


def recorded_updates(config) -> list[tuple[int, int]]:
    """(physical layer, cache index) of every ``Cache.update`` of one forward of transformers' Dory, in order."""
    torch.manual_seed(0)
    model = DoryForCausalLM(config).eval()
    calls, current = [], []
    for i, layer in enumerate(model.model.layers):
        layer.self_attn.register_forward_pre_hook(lambda _m, _a, i=i: current.append(i))

    class Recording(DynamicCache):
        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            calls.append((current[-1], layer_idx))
            return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    with torch.no_grad():
        model(torch.arange(5)[None], cache=Recording(config=config))
    return calls


@needs_dory
def test_dory_per_loop_indices_are_the_ones_dory_passes():
    config = tiny_dory()
    layout = layout_of(config)
    calls = recorded_updates(config)
    assert [index for _, index in calls] == list(layout.call_order)
    assert all(layout.slot(index).layer == layer for layer, index in calls)
    # loop 0 writes the core layer's own index, loop t > 0 num_hidden_layers + (t - 1) * n_recurrent + j
    n, n_in, n_rec = 7, 2, 4
    core = [j for j in range(n_rec) if config.layer_types[n_in + j] == "full_attention"]  # core layers 0, 2, 3
    assert layout.cells == CellLayout(3, len(core))
    for t in range(3):
        for lay, j in enumerate(core):
            assert layout.flat_index(Cell(t, lay)) == (n_in + j if t == 0 else n + (t - 1) * n_rec + j)
    kinds = {index: layout.slot(index).kind for _, index in calls}
    assert sorted(i for i, k in kinds.items() if k == "exact") == [0]  # layer 0 (layer 6 is sliding)
    assert sorted(s.layer for s in layout.fixed("window")) == [1, 3, 3, 3, 6]  # core layer 3 is sliding, 3 loops
    assert layout.sliding_window == 16


@needs_dory
def test_dory_last_loop_writes_only_the_last_loop():
    config = tiny_dory(recurrent_kv_cache_mode="last_loop")
    layout = layout_of(config)
    calls = recorded_updates(config)
    assert [index for _, index in calls] == list(layout.call_order) == list(range(7))
    assert layout.reads_without_update == tuple(Cell(t, lay) for t in range(2) for lay in range(3))
    assert [layout.slot(i).cell for i in (2, 4, 5)] == [Cell(2, 0), Cell(2, 1), Cell(2, 2)]
    with pytest.raises(ValueError, match="no cache index of its own"):
        layout.flat_index(Cell(0, 0))
    # the indices the earlier loops read (shared_kv_states[layer_idx], sliding core layer 3 included)
    torch.manual_seed(0)
    model, read = DoryForCausalLM(config).eval(), []
    for layer in model.model.layers:
        layer.self_attn.register_forward_pre_hook(
            lambda m, _a, kw: read.append(m.layer_idx) if kw.get("shared_kv_states") is not None else None,
            with_kwargs=True)
    with torch.no_grad():
        model(torch.arange(5)[None], cache=DynamicCache(config=config))
    assert read == [2, 3, 4, 5] * 2  # loops 0 and 1 over the core
    assert layout.shared_reads == (2, 3, 4, 5)
