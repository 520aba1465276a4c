"""A model spread over devices: each cell's storage lives on its layer's device, in one shard of stacks per device.

No second GPU here: placement is checked with the ``meta`` device beside the CPU, and the multi-shard decode path
with two shards on the CPU (``cpu`` and ``cpu:0`` name it twice), which must equal the one-shard cache exactly.
"""

import pytest
import torch

import loopkv
from tests.cache.driver import tiny_config, tiny_ouro

PLAN = loopkv.Plan.from_loops(loops=2, layers=2, per_loop=["share", "int4"], tau=14.0)


def test_each_cell_lives_on_its_layers_device_with_its_source():
    cache = loopkv.LoopKVCache(PLAN, config=tiny_config(loops=2, layers=2), max_batch_size=2, max_cache_len=500,
                               device={0: "cpu", 1: "meta"})
    for idx, layer in enumerate(cache.layers):
        want = "cpu" if idx % 2 == 0 else "meta"  # cell (t, l) has flat index 2 t + l
        for name, t in vars(layer.storage).items():
            if isinstance(t, torch.Tensor):
                assert t.device.type == want, (idx, name)
    assert [s.device.type for s in cache._shards] == ["cpu", "meta"]
    share, source = cache.storage(1), cache.storage(3)  # loop 0 shares loop 1's pages, layer 1 (meta)
    assert share.k_pages is source.k_pages
    k = torch.zeros(2, 2, 3, 32)
    with pytest.raises(ValueError, match="layer_devices"):  # layer 1's K/V computed on the CPU
        cache.update(k, k, 1)


def test_a_device_map_must_name_every_layer():
    with pytest.raises(ValueError, match="each of the model's 2 layers"):
        loopkv.LoopKVCache(PLAN, config=tiny_config(loops=2, layers=2), max_batch_size=1, max_cache_len=64,
                           device={0: "cpu"})


def test_two_shards_generate_exactly_what_one_does():
    model = tiny_ouro()
    cfg = model.config
    assert loopkv.layer_devices(model) == {0: torch.device("cpu"), 1: torch.device("cpu")}
    ids = torch.randint(3, 97, (2, 330), generator=torch.Generator().manual_seed(1))
    outs = []
    for device in ("cpu", {0: "cpu", 1: "cpu:0"}):
        cache = loopkv.LoopKVCache(PLAN, config=cfg, max_batch_size=2, max_cache_len=420, dtype=torch.float32,
                                   device=device)
        out = model.generate(ids, past_key_values=cache, max_new_tokens=40, do_sample=False, eos_token_id=None,
                             pad_token_id=0, output_logits=True, return_dict_in_generate=True)
        outs.append((out.sequences, torch.stack(out.logits), len(cache._shards)))
    assert outs[0][2] == 1
    assert outs[1][2] == 2
    assert torch.equal(outs[0][0], outs[1][0])
    assert torch.equal(outs[0][1], outs[1][1])
