"""The profiler: the dense served simulation is the real cache, damages are sane, runs are deterministic
and resumable, and bad inputs are refused."""

from __future__ import annotations

import math
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

import loopkv
from loopkv.cells import Cell
from loopkv.models.ouro import OuroConfig, OuroForCausalLM
from loopkv.planning import generate as gen
from loopkv.planning.evaluate import served_logits
from loopkv.planning.generate import generate_documents, generated_path
from loopkv.planning.profile_data import Profile
from loopkv.planning.profiler import calibration_documents, documents_hash, model_fingerprint, profile
from loopkv.planning.simulate import FIRST_HISTORY, Served, exact_attention, served_attention, served_for, simulate_plan
from tests.cache.driver import decode, prefill
from tests.tolerances import ATTN_FP32_ATOL, ATTN_FP32_RTOL, LOGITS_FP32_ATOL, LOGITS_FP32_RTOL

LOOPS, LAYERS, HEADS, KV_HEADS, D = 3, 2, 4, 2, 32
VOCAB = 97


def tiny_model(*, seed: int = 0, dtype=torch.float32) -> OuroForCausalLM:
    """A random Ouro: T=3 loops over 2 layers, 4 query heads over 2 KV heads (GQA) of dim 32."""
    torch.manual_seed(seed)
    cfg = OuroConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=LAYERS,
                     num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=D, total_ut_steps=LOOPS,
                     max_position_embeddings=4096, rope_theta=10000.0)
    return OuroForCausalLM(cfg).eval().to(dtype)


def tiny_documents(n: int = 2, length: int = 420, seed: int = 1) -> torch.Tensor:
    """[n, length] token ids: long enough that history pages form (positions >= 320)."""
    return torch.randint(3, VOCAB, (n, length), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture(scope="module")
def docs():
    return tiny_documents()


@pytest.fixture(scope="module")
def full_profile(model, docs):
    return profile(model, docs, batch_cells=8, progress=False)


# ------------------------------------------------------------------------------------- simulation
def _cache_outputs(served_option: str, source_option: str, tau: float, q, k, v, ks, vs, prefill_len: int):
    """Attention outputs of cell (0, 0) of a 2-loop, 1-layer LoopKVCache: prefill, then decode one
    token at a time (the final loop's cell first, so a share cell's source page is written)."""
    plan = loopkv.Plan(loops=2, layers=1, options=(served_option, source_option), tau=tau)
    cfg = SimpleNamespace(total_ut_steps=2, num_hidden_layers=1, num_attention_heads=HEADS,
                          num_key_value_heads=KV_HEADS, head_dim=D, hidden_size=HEADS * D, dtype=torch.float32)
    N = q.shape[2]
    cache = loopkv.LoopKVCache(plan, config=cfg, max_batch_size=1, max_cache_len=N, device="cpu")
    mask = torch.ones(1, prefill_len)
    scale = D**-0.5
    p = slice(0, prefill_len)
    prefill(cache, 1, q[:, :, p], ks[:, :, p], vs[:, :, p], mask, scale)
    outs = [prefill(cache, 0, q[:, :, p], k[:, :, p], v[:, :, p], mask, scale).transpose(1, 2)]  # [1, Hq, P, D]
    for i in range(prefill_len, N):
        t = slice(i, i + 1)
        decode(cache, 1, q[:, :, t], ks[:, :, t], vs[:, :, t], scale)
        outs.append(decode(cache, 0, q[:, :, t], k[:, :, t], v[:, :, t], scale)[:, :, None])
    return torch.cat(outs, dim=2)  # [1, Hq, N, D]


@pytest.mark.parametrize(
    ("option", "source", "tau", "prefill_len"),
    [
        ("int4", "int4", math.inf, 300),
        ("int4", "int4", 1.0, 320),
        ("int2", "int4", math.inf, 330),
        ("bf16", "int4", math.inf, 300),
        ("share", "int4", 1.0, 300),
        ("share", "int2", math.inf, 320),
        ("share", "bf16", math.inf, 300),
    ],
)
def test_served_attention_equals_cache_reads(option, source, tau, prefill_len):
    """Every query position of the dense served attention equals what the cache's prefill and decode
    reads return for that position (pages quantized as they leave the window, V precision, GQA)."""
    g = torch.Generator().manual_seed(7)
    N = 360  # pages leave the window at positions 319 and 351
    q = torch.randn(1, HEADS, N, D, generator=g)
    k, v, ks, vs = (torch.randn(1, KV_HEADS, N, D, generator=g) for _ in range(4))
    want = _cache_outputs(option, source, tau, q, k, v, ks, vs, prefill_len)
    served = served_for(option, source_option=source, tau=tau)
    got = served_attention(q, k, v, served=served, scale=D**-0.5, prefill_len=prefill_len, source_k=ks,
                           source_v=vs, block=64)
    torch.testing.assert_close(got, want, atol=ATTN_FP32_ATOL, rtol=ATTN_FP32_RTOL)
    exact = exact_attention(q, k, v, scale=D**-0.5)
    late = slice(max(prefill_len, FIRST_HISTORY), N)
    if option != "bf16":  # not vacuous: the history really is read differently
        assert (got[:, :, late] - exact[:, :, late]).abs().max() > 100 * ATTN_FP32_ATOL
    torch.testing.assert_close(got[:, :, : FIRST_HISTORY - 1], exact[:, :, : FIRST_HISTORY - 1],
                               atol=ATTN_FP32_ATOL, rtol=ATTN_FP32_RTOL)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_exact_attention_through_matmuls_equals_sdpa(dtype):
    """The matmul form (query blocks, keys up to the block's end; GQA, a length that is no multiple of the block)
    equals SDPA: to float64 round-off in float64, within the fp32 attention tier in fp32."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, HEADS, 200, D, generator=g, dtype=dtype)
    k, v = (torch.randn(2, KV_HEADS, 200, D, generator=g, dtype=dtype) for _ in range(2))
    want = exact_attention(q, k, v, scale=D**-0.5)
    got = exact_attention(q, k, v, scale=D**-0.5, matmul=True, block=64)
    if dtype == torch.float64:
        torch.testing.assert_close(got, want, atol=FP64_REORDER_ATOL, rtol=0)
    else:
        torch.testing.assert_close(got, want, atol=ATTN_FP32_ATOL, rtol=ATTN_FP32_RTOL)
    assert (got[:, :, 1:] - got[:, :, :-1]).abs().max() > 0.1  # not a constant output


def test_served_requires_share_source():
    q = torch.randn(1, HEADS, 8, D)
    k = torch.randn(1, KV_HEADS, 8, D)
    with pytest.raises(ValueError, match="source_k"):
        served_attention(q, k, k, served=Served(4, share=True), scale=1.0)
    with pytest.raises(ValueError, match="bits"):
        Served(8)


@pytest.mark.parametrize(
    ("cells", "tau"),
    [({Cell(0, 1): "int4"}, math.inf), ({Cell(1, 0): "int2"}, math.inf), ({Cell(0, 0): "int4"}, 2.0)],
    ids=["int4", "int2", "int4-tau2"],
)
def test_simulation_is_the_served_cache(model, cells, tau):
    """A single-cell plan: the simulation's per-position logits equal the real LoopKVCache decode path
    (prefill 320, one page leaving the window during decode at position 351)."""
    options = ["bf16"] * (LOOPS * LAYERS)
    for cell, option in cells.items():
        options[cell.loop * LAYERS + cell.layer] = option
    plan = loopkv.Plan(loops=LOOPS, layers=LAYERS, options=tuple(options), tau=tau)
    doc = tiny_documents(1, 360)[0]
    served = served_logits(model, plan, doc)
    simulated = simulate_plan(model, plan, doc)
    assert served.shape == simulated.shape == (360 - FIRST_HISTORY, VOCAB)
    torch.testing.assert_close(simulated, served, atol=LOGITS_FP32_ATOL, rtol=LOGITS_FP32_RTOL)
    exact = simulate_plan(model, loopkv.Plan.uniform(loops=LOOPS, layers=LAYERS, option="bf16"), doc)
    # not vacuous: the plan moves the logits far more than simulation and cache disagree
    assert (served - exact).abs().max() > 100 * (served - simulated).abs().max()


def test_simulation_is_the_served_cache_for_share(model):
    """A shared cell reads the final loop's INT4 page of this very step (regression: the cache once read
    the page before the final loop's append had quantized it, at every window exit)."""
    plan = loopkv.Plan(loops=LOOPS, layers=LAYERS, options=("bf16", "bf16", "share", "bf16", "int4", "int4"))
    doc = tiny_documents(1, 360)[0]
    torch.testing.assert_close(simulate_plan(model, plan, doc), served_logits(model, plan, doc),
                               atol=LOGITS_FP32_ATOL, rtol=LOGITS_FP32_RTOL)


# ---------------------------------------------------------------------------------------- profile
def test_profile_is_complete_nonnegative_and_ordered(full_profile, model):
    p = full_profile
    assert p.is_complete
    assert p.missing() == []
    assert p.kl_share > 0
    assert all(v >= 0 for v in p.damage.values())
    for t in range(LOOPS - 1):
        for layer in range(LAYERS):
            c = Cell(t, layer)
            assert p.damage_of(c, "int2") >= p.damage_of(c, "int4") > 0, c
            assert len(p.per_document[(t * LAYERS + layer, "int4")]) == 2
    assert all(v > 0 for v in p.final_int2)
    assert all(i2 >= i4 > 0 for i4, i2 in zip(p.final_int4, p.final_int2, strict=True))  # the source cells' own damage
    assert p.uncounted() == ()
    assert p.provenance["clamped"] == []
    assert p.provenance["model_fingerprint"] == model_fingerprint(model)
    assert p.provenance["positions"] == 2 * (420 - FIRST_HISTORY)
    p.validate_for(model.config)


def test_profile_is_deterministic_and_batch_independent(full_profile, model, docs):
    again = profile(model, docs, batch_cells=8, progress=False)
    assert again.damage == full_profile.damage
    assert again.kl_share == full_profile.kl_share
    other = profile(model, docs, batch_cells=5, progress=False)  # other batch rows: fp32 round-off only
    for key, value in full_profile.damage.items():
        assert other.damage[key] == pytest.approx(value, rel=1e-3, abs=1e-10), key


def test_profile_resumes_after_interruption(full_profile, model, docs, tmp_path, monkeypatch):
    """Interrupted after its first saved batch, then resumed: the same Profile as an uninterrupted run."""
    out = tmp_path / "profile.json"
    original = Profile.to_json

    def interrupted(self, path):
        original(self, path)
        raise KeyboardInterrupt

    monkeypatch.setattr(Profile, "to_json", interrupted)
    with pytest.raises(KeyboardInterrupt):
        profile(model, docs, out=out, batch_cells=8, progress=False)
    monkeypatch.setattr(Profile, "to_json", original)
    partial = Profile.from_json(out)
    assert not partial.is_complete
    assert partial.kl_share is None  # the unit is measured with the share jobs, at the end
    todo = Profile.partial(loops=LOOPS, layers=LAYERS, kv_heads=KV_HEADS, head_dim=D).missing()
    first = [(c.loop * LAYERS + c.layer, o) for c, o in todo if o != "share"][:8]  # cell-major, shares last
    assert sorted(partial.damage) == sorted(first)
    resumed = profile(model, docs, out=out, batch_cells=8, progress=False)
    assert resumed.is_complete
    assert resumed.damage == full_profile.damage
    assert resumed.per_document == full_profile.per_document
    assert resumed.kl_share == full_profile.kl_share
    assert len(resumed.provenance["resumed"]) == 1
    assert Profile.from_json(out).damage == resumed.damage


def test_resume_refuses_another_setup(model, docs, tmp_path):
    out = tmp_path / "p.json"
    profile(model, docs[:, :330], out=out, options=("int4",), final_options=(), progress=False)
    with pytest.raises(ValueError, match="documents_hash"):
        profile(model, docs[:, :340], out=out, options=("int4",), final_options=(), progress=False)
    with pytest.raises(ValueError, match="tau"):
        profile(model, docs[:, :330], out=out, options=("int4",), final_options=(), tau=3.0, progress=False)
    with pytest.raises(ValueError, match="model_fingerprint"):
        profile(tiny_model(seed=1), docs[:, :330], out=out, options=("int4",), final_options=(), progress=False)
    with pytest.raises(ValueError, match="tf32"):
        profile(model, docs[:, :330], out=out, options=("int4",), final_options=(), tf32=True, progress=False)
    with pytest.raises(ValueError, match="final_options"):
        profile(model, docs[:, :330], out=out, options=("int4",), progress=False)
    # resume=False starts over and overwrites
    fresh = profile(model, docs[:, :340], out=out, options=("int4",), final_options=(), resume=False,
                    progress=False)
    assert Profile.from_json(out).damage == fresh.damage


def test_profile_rejects_bad_inputs(model, docs):
    with pytest.raises(ValueError, match="fp32"):
        profile(tiny_model(dtype=torch.bfloat16), docs, progress=False)
    with pytest.raises(ValueError, match="fewer than 321"):
        profile(model, docs[:, :300], progress=False)
    with pytest.raises(ValueError, match="share_source"):
        profile(model, docs, share_source="fp8", progress=False)
    with pytest.raises(ValueError, match="options"):
        profile(model, docs, options=("int8",), progress=False)
    with pytest.raises(ValueError, match="looped model"):
        profile(torch.nn.Linear(2, 2), docs, progress=False)
    with pytest.raises(ValueError, match="integer token ids"):
        profile(model, docs.float(), progress=False)


def test_provenance_hashes():
    a, b = tiny_model(seed=0), tiny_model(seed=0)
    assert model_fingerprint(a) == model_fingerprint(b)
    with torch.no_grad():
        b.lm_head.weight[0, 0] += 1e-6
    assert model_fingerprint(a) != model_fingerprint(b)
    d = tiny_documents()
    assert documents_hash(d) == documents_hash(list(d))
    assert documents_hash(d) != documents_hash(d.flip(0))


def test_calibration_documents_are_seeded():
    docs = calibration_documents(n=3, length=400, seed=0)
    assert [int(d.numel()) for d in docs] == [400] * 3
    assert all(int(d.max()) < 320 for d in docs)
    assert documents_hash(docs) == documents_hash(calibration_documents(n=3, length=400, seed=0))
    assert documents_hash(docs) != documents_hash(calibration_documents(n=3, length=400, seed=1))


def test_share_sources_reach_the_served_fixed_point(model):
    """Share sources from an exact forward are right below 608 tokens (up to the round-off of the exact
    vs the served attention path); beyond, iterating the sources reaches the served fixed point (a
    source perturbation is read >= 288 positions later)."""
    plan = loopkv.Plan(loops=LOOPS, layers=LAYERS, options=("share", "bf16", "share", "share", "int4", "int4"))
    short = tiny_documents(1, 600)[0]
    torch.testing.assert_close(simulate_plan(model, plan, short), simulate_plan(model, plan, short, share_passes=2),
                               atol=LOGITS_FP32_ATOL, rtol=LOGITS_FP32_RTOL)
    long = tiny_documents(1, 700)[0]
    one, two, three = (simulate_plan(model, plan, long, share_passes=k) for k in (1, 2, 3))
    torch.testing.assert_close(two, three, atol=LOGITS_FP32_ATOL, rtol=LOGITS_FP32_RTOL)
    assert (one - two).abs().max() > 100 * LOGITS_FP32_ATOL


def test_profile_share_passes(model):
    doc = tiny_documents(1, 700)
    one = profile(model, doc, options=("int4", "share"), final_options=(), share_passes=1, progress=False)
    two = profile(model, doc, options=("int4", "share"), final_options=(), progress=False)  # default: 2
    for t in range(LOOPS - 1):
        for layer in range(LAYERS):
            c = Cell(t, layer)
            assert two.damage_of(c, "int4") == pytest.approx(one.damage_of(c, "int4"), rel=1e-6)
            assert two.damage_of(c, "share") != one.damage_of(c, "share")
            assert two.damage_of(c, "share") == pytest.approx(one.damage_of(c, "share"), rel=0.2)
    assert two.provenance["settings"]["share_passes"] == 2


# Two float64 forwards of the same rows that differ only in batch composition (matmul blocking): unit round-off
# 1.1e-16 grows through 6 cells, softmaxes and the LM head to ~1e-14 in the logits; 1e-11 leaves 1000x headroom
# and is still ~1e7x below the smallest difference between two rows' logits in these tests.
FP64_REORDER_ATOL = 1e-11


@pytest.fixture(scope="module")
def model64():
    return tiny_model(dtype=torch.float64)


def test_resumed_rows_equal_rows_run_from_the_first_cell(model64):
    """A forward that starts at a checkpoint from the exact pass's hidden state, each row joining at its own
    first served cell (a carrier row before that), gives every row the logits of a forward that runs all rows
    from the embedding, in float64. Rows join at the checkpoint, after it, together, and the last one late."""
    from loopkv.planning.resume import Entry, entry_for
    from loopkv.planning.simulate import SimState, forward, served_attention_enabled

    doc = tiny_documents(1, 360)
    gen = torch.Generator().manual_seed(0)
    sources = {layer: (torch.randn(1, KV_HEADS, 360, D, dtype=torch.float64, generator=gen),) * 2
               for layer in range(LAYERS)}  # any share source: the same for both forwards
    rows = [{2: served_for("int2")}, {3: served_for("share")}, {3: served_for("int4")},
            {4: served_for("int4"), 5: served_for("share")}]  # served cells 2..5 of T*L = 6

    def run(ids, entry=None, keep=()):
        state = SimState(rows=[{}] if keep else rows, prefill_len=FIRST_HISTORY, layers=LAYERS, sources=sources)
        return forward(model64, ids, state, logits_from=FIRST_HISTORY, entry=entry, keep_hidden=keep), state

    with torch.no_grad(), served_attention_enabled(model64):
        full, _ = run(doc.expand(len(rows), -1))
        _, exact = run(doc, keep=(2, 4))
        assert set(exact.hidden) == {2, 4}
        assert exact.hidden[2].shape == (1, 360, 64)
        for checkpoints in ({2: exact.hidden[2]}, {}):  # resume at cell 2; from the embedding (cell 0)
            entry = entry_for([2, 3, 3, 4], checkpoints)
            assert entry.at == (2 if checkpoints else 0)
            resumed, _ = run(doc, entry)
            assert resumed.shape == full.shape == (4, 360 - FIRST_HISTORY, VOCAB)
            torch.testing.assert_close(resumed, full, atol=FP64_REORDER_ATOL, rtol=0)
        together, _ = run(doc, Entry(starts=(2, 2, 2, 2)))  # every row at the first row's cell
        torch.testing.assert_close(together, full, atol=FP64_REORDER_ATOL, rtol=0)
        assert min((full[i] - full[j]).abs().max() for i in range(4) for j in range(i)) > 1e7 * FP64_REORDER_ATOL
        with pytest.raises(ValueError, match="rows serving earlier"):
            run(doc, Entry(starts=(2, 3, 4, 4)))  # the third row serves cell 3 but would join at 4
        with pytest.raises(ValueError, match="one row"):
            run(doc.expand(4, -1), Entry(starts=(2, 3, 3, 4)))


def test_exact_passes_kept_elsewhere_give_the_same_profile(model, docs):
    """``exact_on``: the exact passes kept on another device (here the CPU, as a GPU profile of many long
    documents would) give the same numbers; a bad device is refused before measuring."""
    kept = profile(model, docs, options=("int4",), final_options=(), progress=False, exact_on="cpu")
    here = profile(model, docs, options=("int4",), final_options=(), progress=False)
    assert dict(kept.damage) == dict(here.damage)
    with pytest.raises(ValueError, match="exact_on must be a torch device"):
        profile(model, docs, options=("int4",), final_options=(), progress=False, exact_on="nowhere")


@pytest.mark.gpu
def test_resumed_profile_on_cuda_with_exact_passes_in_pinned_host_memory(docs):
    """On CUDA: damages with the exact passes kept in pinned host memory equal those kept on the GPU (bit for bit:
    only copies differ), and equal the CPU's within fp32 round-off of a different device."""
    gpu = tiny_model().cuda()
    kept = profile(gpu, docs, options=("int4", "share"), final_options=("int4",), progress=False, exact_on="cpu")
    here = profile(gpu, docs, options=("int4", "share"), final_options=("int4",), progress=False)
    assert dict(kept.damage) == dict(here.damage)
    assert kept.kl_share == here.kl_share
    cpu = profile(tiny_model(), docs, options=("int4", "share"), final_options=("int4",), progress=False)
    assert list(here.damage.values()) == pytest.approx(list(cpu.damage.values()), rel=1e-3)


def test_entry_refuses_bad_schedules():
    from loopkv.planning.resume import Entry

    with pytest.raises(ValueError, match="non-decreasing"):
        Entry(starts=(3, 2))
    with pytest.raises(ValueError, match="must be in"):
        Entry(starts=(2, 3), at=3, hidden=torch.zeros(1, 4, 8))
    with pytest.raises(ValueError, match="needs the exact hidden state"):
        Entry(starts=(2, 3), at=1)


@pytest.mark.parametrize(("start", "every", "n_docs", "picks"), [
    ("resume", None, 1, [[6, 4, 11], [14, 13, 16]]),  # out of order; from loop 1's checkpoint; shares + KL_share
    pytest.param("resume", None, 2, None, marks=pytest.mark.slow),
    pytest.param("resume", 1, 2, None, marks=pytest.mark.slow),
    pytest.param("prefix", None, 2, None, marks=pytest.mark.slow),
])
def test_runner_damages_equal_rows_run_from_the_first_cell(model64, start, every, n_docs, picks):
    """Jobs of a profile (INT4/INT2/share, the final loop, KL_share; two share passes) measured with rows that
    resume from the exact pass's checkpoints (one per loop, or one per cell) or start at the batch's first cell
    give the damages of each job run alone from the first cell, in float64. Slow: every job, batches of 5."""
    from loopkv.planning.profiler import _jobs, _Runner
    from loopkv.planning.simulate import served_attention_enabled

    docs = list(tiny_documents(n_docs, 640))  # > 608 tokens: the second share pass changes the numbers
    jobs = _jobs(Profile.partial(loops=LOOPS, layers=LAYERS, kv_heads=KV_HEADS, head_dim=D))
    batches = [[jobs[i] for i in b] for b in picks] if picks else [jobs[i : i + 5] for i in range(0, len(jobs), 5)]
    args = dict(loops=LOOPS, layers=LAYERS, tau=14.0, share_source="int4", share_passes=2,
                prefill_len=FIRST_HISTORY, first=FIRST_HISTORY)

    def damages(runner, batches):
        with torch.no_grad(), served_attention_enabled(model64):
            return [v[0] for batch in batches for v in runner.measure(batch, _NoBar())]

    alone = [[job] for batch in batches for job in batch]  # the reference: each job on its own, from cell 0
    rows = damages(_Runner(model64, docs, start="rows", **args), alone)
    assert min(rows) > 0
    assert len(set(rows)) == len(rows) == sum(map(len, batches))
    got = damages(_Runner(model64, docs, start=start, checkpoint_every=every, **args), batches)
    # KLs of logits equal within FP64_REORDER_ATOL: ~1e-11 relative at these damages (>= 1e-6 nats)
    assert got == pytest.approx(rows, rel=1e-9, abs=0)


class _NoBar:
    def update(self, n):
        pass


def test_final_loop_int4_damage_is_the_simulated_plans_kl(full_profile, model, docs):
    """The profiled INT4 damage of a final-loop cell is the KL of the one-cell plan's served simulation."""
    final = Cell(LOOPS - 1, 1)
    options = ["bf16"] * (LOOPS * LAYERS)
    options[final.loop * LAYERS + final.layer] = "int4"
    plan = loopkv.Plan(loops=LOOPS, layers=LAYERS, options=tuple(options))
    exact = loopkv.Plan.uniform(loops=LOOPS, layers=LAYERS, option="bf16")
    total = 0.0
    for doc in docs:
        p = torch.log_softmax(simulate_plan(model, exact, doc).double(), -1)
        q = torch.log_softmax(simulate_plan(model, plan, doc).double(), -1)
        total += float((p.exp() * (p - q)).sum())
    measured = total / (docs.shape[0] * (docs.shape[1] - FIRST_HISTORY))
    assert full_profile.damage_of(final, "int4") == pytest.approx(measured, rel=1e-3)


def test_public_profile_is_the_function():
    """``loopkv.planning.profile`` stays the function even after the profiler module is imported."""
    code = ("import loopkv, loopkv.planning.profiler, loopkv.planning.evaluate, loopkv.cli; "
            "print(callable(loopkv.planning.profile), loopkv.planning.profile.__module__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["True", "loopkv.planning.profiler"]


# ---- Calibration documents sampled from the model itself: seeded, fixed length, resumable, refused when the
# saved file was made otherwise.
LENGTH = 24  # short: the tiny model samples ~50 tokens a second on a loaded 2-core CPU
EOS, PAD = 2, 3


@pytest.fixture(scope="module")
def sampler():
    m = tiny_model()
    m.config.bos_token_id, m.config.eos_token_id, m.config.pad_token_id = 1, EOS, PAD
    return m


@pytest.fixture(scope="module")
def three(sampler):
    return generate_documents(sampler, n=3, length=LENGTH, seed=0, progress=False)


def test_seeded_fixed_length_without_end_tokens(sampler, three):
    assert [d.shape for d in three] == [torch.Size([LENGTH])] * 3
    assert all(int(d[0]) == 1 for d in three)  # the BOS prompt
    assert all(not torch.isin(d, torch.tensor([EOS, PAD])).any() for d in three)
    assert not torch.equal(three[0], three[1])  # each document its own stream
    again = generate_documents(sampler, n=2, length=LENGTH, seed=0, progress=False)
    assert all(torch.equal(a, b) for a, b in zip(again, three, strict=False))  # a document ignores later ones
    other = generate_documents(sampler, n=1, length=LENGTH, seed=1, progress=False)
    assert not torch.equal(other[0], three[0])


def test_the_masked_tokens_would_be_sampled(sampler, monkeypatch):
    """Not vacuous: a model that favours EOS samples it when the mask is off, and never with it."""

    def favour_eos(module, args, out):
        out[..., EOS] += 20.0
        return out

    handle = sampler.lm_head.register_forward_hook(favour_eos)
    try:
        masked = generate_documents(sampler, n=1, length=LENGTH, seed=0, progress=False)[0]
        monkeypatch.setattr(gen, "_suppressed", lambda m: [])
        unmasked = generate_documents(sampler, n=1, length=LENGTH, seed=0, progress=False)[0]
    finally:
        handle.remove()
    assert not (masked == EOS).any()
    assert (unmasked[1:] == EOS).float().mean() > 0.9


def test_resumes_after_an_interruption(sampler, three, tmp_path, monkeypatch):
    out = tmp_path / "docs.generated.pt"
    real = gen._save

    def stop_after_first(path, settings, docs):
        real(path, settings, docs)
        raise KeyboardInterrupt

    monkeypatch.setattr(gen, "_save", stop_after_first)
    with pytest.raises(KeyboardInterrupt):
        generate_documents(sampler, n=3, length=LENGTH, seed=0, out=out, progress=False)
    monkeypatch.setattr(gen, "_save", real)
    assert len(torch.load(out, weights_only=True)) == 1  # a plain [n, length] tensor: --documents reads it
    resumed = generate_documents(sampler, n=3, length=LENGTH, seed=0, out=out, progress=False)
    assert all(torch.equal(a, b) for a, b in zip(resumed, three, strict=True))
    with pytest.raises(ValueError, match="seed"):
        generate_documents(sampler, n=3, length=LENGTH, seed=5, out=out, progress=False)
    with pytest.raises(ValueError, match="length"):
        generate_documents(sampler, n=3, length=LENGTH + 1, seed=0, out=out, progress=False)


def test_prompts_batches_and_bad_input(sampler):
    prompts = [torch.tensor([5, 6, 7]), torch.tensor([8, 9, 10])]
    docs = generate_documents(sampler, n=2, length=LENGTH, prompts=prompts, batch=2, progress=False)
    assert docs[0][:3].tolist() == [5, 6, 7]
    assert docs[1][:3].tolist() == [8, 9, 10]
    with pytest.raises(ValueError, match="batch=1"):
        generate_documents(sampler, n=2, length=LENGTH, prompts=[torch.tensor([5]), torch.tensor([6, 7])], batch=2)
    with pytest.raises(ValueError, match="must exceed the prompt"):
        generate_documents(sampler, n=1, length=3, prompts=prompts)
    with pytest.raises(ValueError, match="n must be a positive int"):
        generate_documents(sampler, n=0, length=LENGTH)
    assert generated_path("runs/profile.json") == "runs/profile.generated.pt"
