"""Calibration documents sampled from the model itself: seeded, fixed length, resumable, refused when the
saved file was made otherwise."""

import pytest
import torch

from loopkv.planning import generate as gen
from loopkv.planning.generate import generate_documents, generated_path
from tests.planning.test_profile import tiny_model

LENGTH = 24  # short: the tiny model samples ~50 tokens a second on a loaded 2-core CPU
EOS, PAD = 2, 3


@pytest.fixture(scope="module")
def model():
    m = tiny_model()
    m.config.bos_token_id, m.config.eos_token_id, m.config.pad_token_id = 1, EOS, PAD
    return m


@pytest.fixture(scope="module")
def three(model):
    return generate_documents(model, n=3, length=LENGTH, seed=0, progress=False)


def test_seeded_fixed_length_without_end_tokens(model, three):
    assert [d.shape for d in three] == [torch.Size([LENGTH])] * 3
    assert all(int(d[0]) == 1 for d in three)  # the BOS prompt
    assert all(not torch.isin(d, torch.tensor([EOS, PAD])).any() for d in three)
    assert not torch.equal(three[0], three[1])  # each document its own stream
    again = generate_documents(model, n=2, length=LENGTH, seed=0, progress=False)
    assert all(torch.equal(a, b) for a, b in zip(again, three, strict=False))  # a document ignores later ones
    other = generate_documents(model, n=1, length=LENGTH, seed=1, progress=False)
    assert not torch.equal(other[0], three[0])


def test_the_masked_tokens_would_be_sampled(model, monkeypatch):
    """Not vacuous: a model that favours EOS samples it when the mask is off, and never with it."""

    def favour_eos(module, args, out):
        out[..., EOS] += 20.0
        return out

    handle = model.lm_head.register_forward_hook(favour_eos)
    try:
        masked = generate_documents(model, n=1, length=LENGTH, seed=0, progress=False)[0]
        monkeypatch.setattr(gen, "_suppressed", lambda m: [])
        unmasked = generate_documents(model, n=1, length=LENGTH, seed=0, progress=False)[0]
    finally:
        handle.remove()
    assert not (masked == EOS).any()
    assert (unmasked[1:] == EOS).float().mean() > 0.9


def test_resumes_after_an_interruption(model, three, tmp_path, monkeypatch):
    out = tmp_path / "docs.generated.pt"
    real = gen._save

    def stop_after_first(path, settings, docs):
        real(path, settings, docs)
        raise KeyboardInterrupt

    monkeypatch.setattr(gen, "_save", stop_after_first)
    with pytest.raises(KeyboardInterrupt):
        generate_documents(model, n=3, length=LENGTH, seed=0, out=out, progress=False)
    monkeypatch.setattr(gen, "_save", real)
    assert len(torch.load(out, weights_only=True)) == 1  # a plain [n, length] tensor: --documents reads it
    resumed = generate_documents(model, n=3, length=LENGTH, seed=0, out=out, progress=False)
    assert all(torch.equal(a, b) for a, b in zip(resumed, three, strict=True))
    with pytest.raises(ValueError, match="seed"):
        generate_documents(model, n=3, length=LENGTH, seed=5, out=out, progress=False)
    with pytest.raises(ValueError, match="length"):
        generate_documents(model, n=3, length=LENGTH + 1, seed=0, out=out, progress=False)


def test_prompts_batches_and_bad_input(model):
    prompts = [torch.tensor([5, 6, 7]), torch.tensor([8, 9, 10])]
    docs = generate_documents(model, n=2, length=LENGTH, prompts=prompts, batch=2, progress=False)
    assert docs[0][:3].tolist() == [5, 6, 7]
    assert docs[1][:3].tolist() == [8, 9, 10]
    with pytest.raises(ValueError, match="batch=1"):
        generate_documents(model, n=2, length=LENGTH, prompts=[torch.tensor([5]), torch.tensor([6, 7])], batch=2)
    with pytest.raises(ValueError, match="must exceed the prompt"):
        generate_documents(model, n=1, length=3, prompts=prompts)
    with pytest.raises(ValueError, match="n must be a positive int"):
        generate_documents(model, n=0, length=LENGTH)
    assert generated_path("runs/profile.json") == "runs/profile.generated.pt"
