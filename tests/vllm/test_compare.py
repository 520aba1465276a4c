"""loopkv.vllm.compare: where two runs' greedy tokens part, the top-K KL and the logprob comparison over positions of
the same context, the served-KL check and its bound, on made-up runs; the reference side (greedy top-K through
transformers) against full forwards without a cache."""

import math

import pytest
import torch

from loopkv.models.ouro import OuroConfig, OuroForCausalLM
from loopkv.models.ouro_config import dense_cache
from loopkv.vllm.compare import (
    SERVED_KL_FACTOR,
    compare_logprobs,
    compare_tokens,
    graph_eager_check,
    greedy_topk,
    served_kl_check,
    topk_kl,
)


def test_compare_tokens():
    ref = [[1, 2, 3], [4, 5, 6], [7, 8]]
    assert compare_tokens(ref, [list(r) for r in ref]) == {"equal": True, "prompts_equal": 3,
                                                                 "first_divergence": [None, None, None]}
    got = compare_tokens(ref, [[1, 2, 3], [4, 9, 6], [7, 8, 9]])
    assert got == {"equal": False, "prompts_equal": 1, "first_divergence": [None, 1, 2]}
    with pytest.raises(ValueError, match="3 reference prompts against 2"):
        compare_tokens(ref, ref[:2])


def test_topk_kl():
    p = {1: math.log(0.5), 2: math.log(0.25), 3: math.log(0.25)}
    assert topk_kl(p, dict(p)) == pytest.approx(0.0, abs=1e-12)
    q = {1: math.log(0.25), 2: math.log(0.5), 9: math.log(0.25)}  # shared: 1, 2 -> p (2/3, 1/3), q (1/3, 2/3)
    want = 2 / 3 * math.log(2) + 1 / 3 * math.log(0.5)
    assert topk_kl(p, q) == pytest.approx(want)
    assert topk_kl({1: 0.0}, {2: 0.0}) is None


def test_compare_logprobs_uses_same_context_positions():
    lp = lambda d: {str(t): math.log(v) for t, v in d.items()}  # noqa: E731 (JSON keys are strings)
    ref_tokens = [[1, 2, 3], [4, 4]]
    ref = [[lp({1: .6, 2: .4}), lp({2: .7, 1: .3}), lp({3: .9, 1: .1})], [lp({4: .5, 5: .5}), lp({4: .6, 5: .4})]]
    other = [[lp({1: .6, 2: .4}), lp({1: .5, 2: .5}), lp({7: 1.0})], [lp({4: .5, 5: .5}), lp({4: .6, 5: .4})]]
    got = compare_logprobs(ref_tokens, ref, other, [1, None])  # prompt 0 diverges at 1: positions 0, 1
    assert got["positions_per_prompt"] == [2, 2]
    assert got["positions"] == 4
    assert got["top1_agreement"] == pytest.approx(3 / 4)  # position 1 of prompt 0: 2 against 1 (tie -> first)
    assert got["ref_token_logprob_gap_max"] == pytest.approx(abs(math.log(.7) - math.log(.5)))
    assert got["topk_kl_max"] == pytest.approx(.7 * math.log(.7 / .5) + .3 * math.log(.3 / .5))


def _lp(*probs):
    return {str(t + 1): math.log(p) for t, p in enumerate(probs)}  # tokens 1, 2, ...


def _kl(p, q):
    return sum(a * math.log(a / b) for a, b in zip(p, q, strict=True))


def test_served_kl_check():
    # one prompt, greedy token 1 at three positions; an arm whose tokens diverge at index 1 counts positions 0 and 1
    # only (its third distribution, far off, must not count)
    dense = {"tokens": [[1, 1, 1]], "logprobs": [[_lp(.6, .4)] * 3]}
    vllm = {"tokens": [[1, 1, 1]], "logprobs": [[_lp(.5, .5)] * 3]}
    reference = {"dense": dense, "plans": {"loopkv:far": {"tokens": [[1, 1, 1]], "logprobs": [[_lp(.7, .3)] * 3]},
                                           "loopkv:near": {"tokens": [[1, 1, 1]], "logprobs": [[_lp(.7, .3)] * 3]}}}
    arms = {"vllm": vllm, "loopkv:far": {"tokens": [[1, 1, 1]], "logprobs": [[_lp(.8, .2)] * 3]},
            "loopkv:near": {"tokens": [[1, 2, 2]], "logprobs": [[_lp(.55, .45)] * 2 + [_lp(.01, .99)]]}}
    got = served_kl_check(arms, reference)
    engines, plan_kl = _kl((.6, .4), (.5, .5)), _kl((.6, .4), (.7, .3))
    assert got["engines"]["kl"] == pytest.approx(engines, abs=1e-9)
    assert got["weights_agree"]  # 0.02 nats <= ENGINES_KL_MAX
    far, near = got["arms"]["loopkv:far"], got["arms"]["loopkv:near"]
    assert far["reference_kl"] == pytest.approx(plan_kl, abs=1e-9)
    assert far["served_kl"] == pytest.approx(_kl((.5, .5), (.8, .2)), abs=1e-9)
    assert far["bound"] == pytest.approx(SERVED_KL_FACTOR * (plan_kl + engines), abs=1e-9)
    assert far["ratio"] == pytest.approx(far["served_kl"] / plan_kl)
    assert far["ok"] is False  # 0.22 nats > 2 x (0.023 + 0.020)
    assert near["served_positions"] == 2
    assert near["served_kl"] == pytest.approx(_kl((.5, .5), (.55, .45)), abs=1e-9)
    assert near["ok"] is True
    wrong = {"vllm": {"tokens": [[1, 1, 1]], "logprobs": [[_lp(.99, .01)] * 3]}}
    assert not served_kl_check(wrong, reference)["weights_agree"]  # 1.2 nats: vLLM read other weights


def test_graph_eager_check():
    # the eager arm is the reference: a graph arm that flips a near-tie at index 1 counts positions 0 and 1 (its third
    # distribution, after the contexts part, must not count) and passes when its KL is within the engines'
    eager = {"tokens": [[1, 1, 1]], "logprobs": [[_lp(.5, .5)] * 3]}
    near = {"tokens": [[1, 2, 2]], "logprobs": [[_lp(.51, .49), _lp(.49, .51), _lp(.01, .99)]]}
    kl = (_kl((.5, .5), (.51, .49)) + _kl((.5, .5), (.49, .51))) / 2
    got = graph_eager_check(near, eager, engines_kl=10 * kl)
    assert got["equal"] is False
    assert got["first_divergence"] == [1]
    assert got["logprobs"]["positions"] == 2
    assert got["logprobs"]["topk_kl_mean"] == pytest.approx(kl, abs=1e-12)
    assert got["ok"] is True
    assert graph_eager_check(near, eager, engines_kl=kl / 2)["ok"] is False  # farther than two engines
    assert graph_eager_check(near, eager, engines_kl=None)["ok"] is None  # no engines KL: no verdict
    far = {"tokens": [[1, 1, 1]], "logprobs": [[_lp(.9, .1)] * 3]}  # same tokens, far logprobs: a stale replay
    assert graph_eager_check(far, eager, engines_kl=0.01)["ok"] is False


def test_greedy_topk_is_teacher_forced_greedy():
    # prefill, then one token a step through a cache, against full forwards of the prompt and the tokens so far
    # without a cache
    torch.manual_seed(0)
    config = OuroConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=2, num_key_value_heads=2, head_dim=32,
                        intermediate_size=96, vocab_size=50, total_ut_steps=2, tie_word_embeddings=False)
    model = OuroForCausalLM(config).eval()
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 50, (n,), generator=gen).tolist() for n in (3, 9)]
    got = greedy_topk(model, prompts, lambda n: dense_cache(model.config), new_tokens=4, k=5)
    for prompt, tokens, lps in zip(prompts, got["tokens"], got["logprobs"], strict=True):
        seq = list(prompt)
        for token, lp in zip(tokens, lps, strict=True):
            with torch.no_grad():
                want = torch.log_softmax(model(input_ids=torch.tensor([seq])).logits[0, -1].float(), -1)
            top = torch.topk(want, 5)
            assert token == int(top.indices[0])
            assert list(map(int, lp)) == top.indices.tolist()
            assert list(lp.values()) == pytest.approx(top.values.tolist(), abs=1e-4)
            seq.append(token)
