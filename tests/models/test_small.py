"""The shipped small model (loopkv.models.small) and the attention probe the model card and the quality
benchmark use (loopkv.models.attention_stats). The training script's smoke run is a step of .ci/run."""

import pytest
import torch

from loopkv.models import attention_stats, data, small
from loopkv.models.ouro import OuroConfig, OuroForCausalLM
from tests.tolerances import ATTN_FP32_ATOL, ATTN_FP32_RTOL


@pytest.fixture(scope="module")
def corpus():
    return data.load_corpus()


def tiny_model() -> OuroForCausalLM:
    torch.manual_seed(0)
    cfg = OuroConfig(vocab_size=data.VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=2, num_key_value_heads=2, head_dim=32, total_ut_steps=2,
                     max_position_embeddings=256)
    return OuroForCausalLM(cfg).eval()


def greedy_hits(model, tasks: list[tuple[bytes, bytes]]) -> int:
    """How many answers greedy decoding after their prompt reproduces. One teacher-forced pass decides it: greedy
    emits the answer iff every answer byte is the argmax given the prompt and the answer's earlier bytes. The
    tasks' prompt + answer must have one length (``retrieval_task(n, seed)`` gives ``n`` tokens)."""
    ids = torch.stack([torch.from_numpy(data.encode_bytes(p + a)) for p, a in tasks])
    with torch.no_grad():
        pred = model(input_ids=ids, use_cache=False).logits.argmax(-1)
    hits = 0
    for row, (prompt, answer) in enumerate(tasks):
        first = 1 + len(prompt)  # the answer's first position (BOS first)
        hits += torch.equal(pred[row, first - 1 : first - 1 + len(answer)], ids[row, first:])
    return hits


# ----------------------------------------------------------------------------- the attention probe


def test_attention_probe_reproduces_the_attention_output():
    """Weights from cell_attention_weights times V equal what each attention module feeds its o_proj."""
    model = tiny_model().float()
    ids = torch.randint(0, 256, (2, 48))
    queries = 16
    seen = []

    def pre(module, args, kwargs):
        w = attention_stats.cell_attention_weights(module, args[0], kwargs["position_embeddings"], queries=queries)
        b, s, _ = args[0].shape
        v = module.v_proj(args[0]).view(b, s, -1, module.head_dim).transpose(1, 2)
        v = v.repeat_interleave(module.num_key_value_groups, dim=1).double()
        out = (w.double() @ v).transpose(1, 2).reshape(b, queries, -1)  # [B, Q, Hq*D]
        seen.append({"ref": out, "w": w})

    def o_in(module, args):
        seen[-1]["got"] = args[0][:, -queries:]

    handles = []
    for layer in model.model.layers:
        handles.append(layer.self_attn.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(layer.self_attn.o_proj.register_forward_pre_hook(o_in))
    with torch.no_grad():
        model(input_ids=ids, use_cache=False)
    for h in handles:
        h.remove()
    assert len(seen) == model.config.total_ut_steps * model.config.num_hidden_layers
    for cell in seen:
        torch.testing.assert_close(cell["got"].double(), cell["ref"], atol=ATTN_FP32_ATOL, rtol=ATTN_FP32_RTOL)
        torch.testing.assert_close(cell["w"].sum(-1), torch.ones_like(cell["w"][..., 0]))

    mass = attention_stats.attention_mass(model, ids, queries=queries)
    assert len(mass["per_cell"]) == len(seen)
    for t in range(model.config.total_ut_steps):
        first = [mass["per_loop"][f"first_{n}"][t] for n in attention_stats.SINK_TOKENS]
        assert 0 <= first[0] <= first[1] <= first[2] <= 1 + 1e-6
        assert mass["per_loop"]["last_256"][t] == pytest.approx(1.0)  # 48 positions < 256: all local


# ----------------------------------------------------------------------------- the shipped checkpoint


def test_encode_decode():
    ids = small.encode("key 1: value 2")
    assert ids.dtype == torch.int64
    assert ids.dim() == 1
    assert int(ids[0]) == small.BOS
    assert small.decode(ids) == b"key 1: value 2"
    assert small.decode(small.encode(b"\xff\x00", bos=False)[None]) == b"\xff\x00"


def test_load_small_gives_finite_logits():
    model = small.load_small()
    assert isinstance(model, OuroForCausalLM)
    assert not model.training
    assert next(model.parameters()).dtype == torch.float32
    ids = small.encode("import os\n\ndef main():\n    return os.")[None]
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits
    assert logits.shape == (1, ids.shape[1], data.VOCAB_SIZE)
    assert torch.isfinite(logits).all()


def test_load_small_models_heldout_text(corpus):
    """A trained model, not a broken load: held-out stdlib bytes cost ~0.9 nats (uniform: ln 256 = 5.5)."""
    model = small.load_small()
    ids = data.heldout_windows(corpus, n=4, seq_len=512, seed=3)
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits[:, :-1]
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    assert float(loss) < 1.5


def test_load_small_retrieves(corpus):
    """The shipped model answers held-out retrieval prompts (greedy exact match)."""
    model = small.load_small()
    assert greedy_hits(model, [data.retrieval_task(1024, seed, corpus=corpus) for seed in range(4)]) >= 3


@pytest.mark.slow
def test_load_small_retrieves_at_4k(corpus):
    """The same at 4096 tokens, the model's longest training length."""
    model = small.load_small()
    assert greedy_hits(model, [data.retrieval_task(4096, seed, corpus=corpus) for seed in range(4)]) >= 3


def test_load_small_refuses_bad_dtype():
    with pytest.raises(ValueError, match="dtype"):
        small.load_small(dtype=torch.int8)
