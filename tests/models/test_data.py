"""loopkv.models.data: determinism, task well-posedness, train/held-out disjointness."""

import re

import numpy as np
import pytest
import torch

from loopkv.models import data


@pytest.fixture(scope="module")
def corpus():
    return data.load_corpus()


def test_tokens_round_trip():
    raw = bytes(range(256))
    ids = data.encode_bytes(raw)
    assert ids[0] == data.BOS
    assert ids.dtype == np.int64
    assert data.decode_bytes(ids) == raw
    assert data.decode_bytes(torch.tensor([data.BOS, 104, 105, data.EOS, data.PAD])) == b"hi"
    assert data.encode_bytes("é", bos=False).tolist() == [0xC3, 0xA9]
    assert max(data.BOS, data.EOS, data.PAD) < data.VOCAB_SIZE


def test_heldout_split_is_disjoint_and_by_file(corpus):
    train, held = set(corpus.train.paths), set(corpus.heldout.paths)
    assert train.isdisjoint(held)
    assert len(held) > 0
    assert len(train) > 10 * len(held)
    assert all(data.is_heldout(p) for p in held)
    assert not any(data.is_heldout(p) for p in train)
    assert list(corpus.train.paths) == sorted(corpus.train.paths)
    # every document is in the token stream once, delimited by BOS/EOS
    for split in (corpus.train, corpus.heldout):
        assert int((split.tokens == data.BOS).sum()) == len(split.paths)
        assert int((split.tokens == data.EOS).sum()) == len(split.paths)


@pytest.mark.parametrize("task", [data.retrieval_task, data.variable_tracking_task])
def test_tasks_are_deterministic(task, corpus):
    assert task(1024, 3, corpus=corpus) == task(1024, 3, corpus=corpus)
    assert task(1024, 3, corpus=corpus) != task(1024, 4, corpus=corpus)
    assert task(1024, 3, corpus=corpus)[0] != task(2048, 3, corpus=corpus)[0]


@pytest.mark.parametrize("n_tokens", [64, 100, 1024, 2048, 4096])
def test_retrieval_answer_present_and_unique(n_tokens, corpus):
    for seed in range(5):
        prompt, answer = data.retrieval_task(n_tokens, seed, corpus=corpus)
        assert 1 + len(prompt) + len(answer) == n_tokens
        m = re.fullmatch(rb"(?s).*\nkey (\d{5}): ", prompt)
        assert m is not None
        key = m.group(1)
        assert re.fullmatch(rb"\d{4}", answer)
        # the record answering the query exists exactly once, and nothing else holds key or answer
        assert prompt.count(b"\nkey " + key + b": " + answer + b"\n") == 1
        assert prompt.count(key) == 2
        assert prompt.count(answer) == 1
        n_records = len(re.findall(rb"\nkey \d{5}: \d{4}\n", prompt))
        assert n_records == max(2, n_tokens // data.RECORD_SPACING)


@pytest.mark.parametrize("hops", [1, 2, 3])
def test_variable_tracking_chain_resolves(hops, corpus):
    for seed in range(3):
        prompt, answer = data.variable_tracking_task(2048, seed, hops=hops, corpus=corpus)
        assert 1 + len(prompt) + len(answer) == 2048
        assert prompt.count(answer) == 1
        name = re.fullmatch(rb"(?s).*\n\? ([A-Z]{3}) -> ", prompt).group(1)
        # follow the chain backwards through the assignments, in document order
        pattern = rb"\nVAR ([A-Z]{3}) = (\w+)\n"
        assigns = [(m.start(), m.group(1), m.group(2)) for m in re.finditer(pattern, prompt)]
        where = {lhs: (pos, rhs) for pos, lhs, rhs in assigns}
        assert len(where) == len(assigns)  # every name assigned once
        steps = 0
        pos, rhs = where[name]
        while not rhs.isdigit():
            prev_pos, prev_rhs = where[rhs]
            assert prev_pos < pos  # a variable is defined before it is read
            pos, rhs = prev_pos, prev_rhs
            steps += 1
        assert steps == hops
        assert rhs == answer


def test_too_short_is_refused(corpus):
    with pytest.raises(ValueError, match="n_tokens"):
        data.retrieval_task(32, 0, corpus=corpus)
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match="n_tokens too small"):
        data.retrieval_document(rng, corpus.train, n_bytes=100, n_queries=1, n_records=10)


def test_heldout_windows_fixed(corpus):
    a = data.heldout_windows(corpus, n=4, seq_len=256)
    assert torch.equal(a, data.heldout_windows(corpus, n=4, seq_len=256))
    assert not torch.equal(a, data.heldout_windows(corpus, n=4, seq_len=256, seed=1))
    held = corpus.heldout.tokens
    for row in a.numpy():
        assert row[0] == data.BOS
        starts = np.flatnonzero(held == row[1])
        assert any(np.array_equal(held[s : s + 255], row[1:]) for s in starts)


def test_queries_anywhere_follow_their_records(corpus):
    rng = np.random.default_rng(0)
    for n_queries in (1, 5, 12):
        body, queries = data.retrieval_document(
            rng, corpus.train, n_bytes=2047, n_queries=n_queries, n_records=25, placement="anywhere"
        )
        assert queries == []
        assert len(body) == 2047
        lines = re.findall(rb"\nkey (\d{5}): (\d{4})\n", body)
        seen = {}
        for key, value in lines:
            seen.setdefault(key, []).append(value)
        assert len(seen) == 25
        repeated = [k for k, v in seen.items() if len(v) == 2]
        assert len(repeated) == n_queries
        assert all(len(set(v)) == 1 and len(v) <= 2 for v in seen.values())  # a query repeats its record
    with pytest.raises(ValueError, match="placement"):
        data.retrieval_document(rng, corpus.train, n_bytes=2047, n_queries=1, n_records=5, placement="start")
