"""Huginn's adaptive exit (``exit_threshold``, ``min_steps``) against the released semantics restated.

The reference (``reference_generate``) is a plain loop over the model's layers at batch 1: each token runs core steps
until its state's relative change is below the threshold (the released ``latent-diff`` rule) and only those steps'
K/V exist; a cache (``LatestStepCache``) answers a step's read of a token that exited earlier with that token's K/V
of the latest step it ran at the same core layer (the released ``latest-m4`` lookup). loopkv instead writes that K/V
into the later steps' cells; the tests check that the two agree, and that a LoopKVCache (bf16, and a share + INT4 /
INT2 plan through the codec reference) serves it.

The tiny random model's state does not converge (relative changes 0.85-1.7 per step), so the threshold here sits
inside that range (1.5) to make tokens exit after different numbers of steps; the rule is the same at any value.
"""

from __future__ import annotations

import pytest
import torch
from transformers.cache_utils import DynamicCache

import loopkv
from loopkv.models.huginn import HuginnCells
from tests.models.test_huginn import VOCAB, build_model, released_config
from tests.models.test_huginn_steps import GRID, T
from tests.models.test_huginn_steps import _reference as codec_reference
from tests.tolerances import LOGITS_FP32_ATOL, LOGITS_FP32_RTOL

THRESHOLD, MIN_STEPS = 1.5, 1
EXIT = dict(exit_threshold=THRESHOLD, min_steps=MIN_STEPS, init_scale=0.0)


@pytest.fixture(scope="module")
def model():
    return build_model(released_config(mean_recurrence=T))


class LatestStepCache:
    """Per cache index and position, the K/V a token stored; a read at core step ``t``, layer ``j`` takes, per
    position, the entry of the latest step ``s <= t`` that the token ran at ``j`` (batch 1)."""

    def __init__(self, cells: HuginnCells):
        self.cells, self.entries, self.seen = cells, {}, 0

    def update(self, k, v, index, *args, **kwargs):
        at = self.entries.setdefault(index, {})
        for i in range(k.shape[2]):
            at[self.seen + i] = (k[:, :, i:i + 1], v[:, :, i:i + 1])
        step_layer = self._step_layer(index)
        keys, values = [], []
        for pos in range(self.seen + k.shape[2]):
            source = index
            if step_layer is not None:
                t, j = step_layer
                source = max(self.cells.core_index(s, j) for s in range(t + 1)
                              if pos in self.entries.get(self.cells.core_index(s, j), {}))
            keys.append(self.entries[source][pos][0])
            values.append(self.entries[source][pos][1])
        return torch.cat(keys, 2), torch.cat(values, 2)

    def _step_layer(self, index):
        first = self.cells.prelude + self.cells.coda
        return None if index < first else divmod(index - first, self.cells.core)


def reference_generate(model, ids, new):
    """Greedy decoding of ``new`` tokens at batch 1 with the released exit rule and lookup; -> tokens, logits, and the
    steps each forward ran."""
    cells, t_max = HuginnCells.of(model.config), model.config.mean_recurrence
    tf = model.transformer
    cache, x_in, tokens, logits, ran = LatestStepCache(cells), ids, [], [], []
    with torch.no_grad():
        for _ in range(new):
            pos = torch.arange(cache.seen, cache.seen + x_in.shape[1])[None]
            kw = dict(rope=model.freqs_cis[0, pos].float(), attention_mask=None, cache=cache, position_ids=pos)
            e = tf.wte(x_in) * model.config.embed_scale
            for i, block in enumerate(tf.prelude):
                e = block(e, cache_index=cells.prelude_index(i), **kw)
            s = torch.zeros_like(e)
            for t in range(t_max):
                x = tf.adapter(torch.cat([s, e], -1))
                for j, block in enumerate(tf.core_block):
                    x = block(x, cache_index=cells.core_index(t, j), **kw)
                change = ((x - s).norm(dim=-1) / x.norm(dim=-1)).mean()
                s = x
                if t >= MIN_STEPS and change < THRESHOLD:
                    break
            ran.append(t + 1)
            y = tf.ln_f(s)
            for i, block in enumerate(tf.coda):
                y = block(y, cache_index=cells.coda_index(i), **kw)
            logits.append(model.lm_head(tf.ln_f(y))[:, -1].float())
            cache.seen += x_in.shape[1]
            x_in = logits[-1].argmax(-1, keepdim=True)
            tokens.append(x_in)
    return torch.cat(tokens, 1), torch.stack(logits, 1), ran


def _generate(model, ids, new, cache=None, **kwargs):
    out = model.generate(ids, past_key_values=cache, max_new_tokens=new, do_sample=False, output_logits=True,
                         return_dict_in_generate=True, eos_token_id=None, pad_token_id=0, **(EXIT | kwargs))
    return out.sequences[:, ids.shape[1]:], torch.stack(out.logits, 1)


def _prompt(n, seed):
    return torch.randint(3, VOCAB, (1, n), generator=torch.Generator().manual_seed(seed))


def test_exits_read_the_latest_step_a_token_ran(model):
    """The dense cache, each later step's cell holding an exited token's last K/V, equals the released lookup; tokens
    exit after different numbers of steps (the check can tell)."""
    ids = _prompt(20, seed=1)
    ref_tokens, ref_logits, ran = reference_generate(model, ids, 10)
    assert len(set(ran)) > 1
    assert min(ran) < T
    tokens, logits = _generate(model, ids, 10)
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(logits, ref_logits, atol=LOGITS_FP32_ATOL, rtol=LOGITS_FP32_RTOL)
    _, every_step = _generate(model, ids, 10, exit_threshold=None, min_steps=0)
    assert not torch.allclose(logits, every_step)


def test_rows_of_a_batch_exit_on_their_own(model):
    """Two left-padded rows in one call equal each row alone (each row's exits are its own)."""
    a, b = _prompt(12, seed=2), _prompt(7, seed=3)
    ids = torch.zeros(2, 12, dtype=torch.long)
    ids[0], ids[1, 5:] = a[0], b[0]
    mask = (ids != 0).long()
    mask[0] = 1
    with torch.no_grad():
        both = model(ids, attention_mask=mask, **EXIT).logits
        alone = [model(x, **EXIT).logits[0] for x in (a, b)]
    torch.testing.assert_close(both[0], alone[0], atol=LOGITS_FP32_ATOL, rtol=LOGITS_FP32_RTOL)
    torch.testing.assert_close(both[1, 5:], alone[1], atol=LOGITS_FP32_ATOL, rtol=LOGITS_FP32_RTOL)


def test_a_bf16_plan_serves_exits_as_the_dense_cache(model):
    """A LoopKVCache with every cell exact equals the dense cache through generate with exits, across the window's
    first exit (rows pass 320 tokens)."""
    ids = _prompt(314, seed=4)
    ref_tokens, ref_logits = _generate(model, ids, 8, DynamicCache())
    cache = loopkv.LoopKVCache(loopkv.Plan.from_config(model.config, option="bf16"), config=model.config,
                               max_batch_size=1, max_cache_len=322, dtype=torch.float32, device="cpu")
    tokens, logits = _generate(model, ids, 8, cache)
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(logits, ref_logits, atol=LOGITS_FP32_ATOL, rtol=LOGITS_FP32_RTOL)


@pytest.mark.parametrize("steps", [3, T])
def test_a_share_plan_serves_exits_through_the_codec(model, steps):
    """The share + INT4 / INT2 plan of test_huginn_steps, for r = 3 (loops=3) and r = T, with exits: the dense cache
    with the codec's round trip on the pages read, share cells reading step r-1's (which holds the exited tokens'
    last K/V too)."""
    ids = _prompt(316, seed=5)
    ref_tokens, ref_logits = _generate(model, ids, 8, codec_reference(model, steps), num_steps=steps)
    cache = loopkv.LoopKVCache(loopkv.Plan.from_grid(GRID, family="huginn"), config=model.config, max_batch_size=1,
                               max_cache_len=324, dtype=torch.float32, device="cpu", loops=steps)
    tokens, logits = _generate(model, ids, 8, cache, num_steps=steps)
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(logits, ref_logits, atol=LOGITS_FP32_ATOL, rtol=LOGITS_FP32_RTOL)


def test_bad_exit_arguments_are_refused(model):
    ids = _prompt(4, seed=6)
    for bad in (0, -1.0, float("nan"), "auto", True):
        with pytest.raises(ValueError, match="exit_threshold must be a positive number"):
            model.generate(ids, exit_threshold=bad, max_new_tokens=1)
    with pytest.raises(ValueError, match="min_steps must be an int >= 0"):
        model(ids, exit_threshold=0.1, min_steps=-1)
    with pytest.raises(ValueError, match="min_steps applies to the adaptive exit"):
        model(ids, min_steps=2)


@pytest.mark.slow
def test_a_decode_step_with_exits_is_one_graph_equal_to_eager(model, error_on_recompile):
    """The decode step with exits on a cache for r = 3 (share + INT4 / INT2) compiles to one graph (no break, no
    recompile: a compiled step runs every step, exited rows frozen, where eager skips to the writes) and equals the
    eager step across the first window exit."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    plan = loopkv.Plan.from_grid(GRID, family="huginn")
    compiled_cache, eager_cache = (loopkv.LoopKVCache(plan, config=model.config, max_batch_size=2, max_cache_len=340,
                                                      dtype=torch.float32, device="cpu", loops=3) for _ in range(2))

    def step(ids, pos, cache):
        return model(input_ids=ids, position_ids=pos, past_key_values=cache, num_steps=3, **EXIT).logits

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="eager")
    counters.clear()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        ids = torch.randint(3, VOCAB, (2, 310), generator=g)
        for cache in (compiled_cache, eager_cache):
            model(input_ids=ids, past_key_values=cache, num_steps=3, **EXIT)
        tok = torch.randint(3, VOCAB, (2, 1), generator=g)
        for i in range(16):
            pos = torch.full((2, 1), 310 + i)
            got = compiled(tok, pos, compiled_cache)
            want = step(tok, pos, eager_cache)
            torch.testing.assert_close(got, want, atol=LOGITS_FP32_ATOL, rtol=LOGITS_FP32_RTOL)
            tok = got[:, -1].argmax(-1, keepdim=True)
    assert counters["stats"]["unique_graphs"] == 1
    assert not counters["graph_break"]
