"""LoopKV behind transformers' continuous-batching engine (loopkv/serving): every request's tokens equal the same
request generated alone through a LoopKVCache with the same plan, with requests joining and leaving, a pool small
enough that some are preempted, and every page back at the end.
"""

import itertools

import pytest
import torch
import transformers
from packaging.version import Version
from transformers import GenerationConfig

import loopkv
from loopkv.serving import host_syncs, transformers_cb
from loopkv.serving.transformers_cb import check_version, engine_cache, engine_config, generate_batch
from tests.cache.driver import tiny_ouro

SUPPORTED = transformers_cb.SUPPORTED[0] <= Version(Version(transformers.__version__).base_version) \
    < transformers_cb.SUPPORTED[1]
needs_engine = pytest.mark.skipif(not SUPPORTED, reason=f"the engine of transformers {transformers.__version__} "
                                                        "is not the one loopkv's shim follows")
NEW = 40


@pytest.fixture(scope="module")
def model():
    return tiny_ouro()


def _greedy(new=NEW):
    return GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=-1, pad_token_id=0)


def _replay(model, plan, tokens, steps):
    """The tokens one admission of a request predicts, replayed alone through a batch-1 LoopKVCache fed in the same
    steps (the first a prompt, then prompt chunks or decode tokens): the argmax after each step."""
    cache = loopkv.LoopKVCache(plan, config=model.config, max_batch_size=1, max_cache_len=512, dtype=torch.float32,
                               device="cpu")
    predicted = []
    with torch.no_grad():
        for pos, n in steps:
            logits = model(input_ids=torch.tensor([tokens[pos:pos + n]]), past_key_values=cache).logits
            predicted.append(int(logits[0, -1].argmax()))
    return predicted


@needs_engine
@pytest.mark.parametrize("chunk", [None, 96])
@pytest.mark.parametrize("per_loop", [["int4", "int2"], ["share", "int4"]])
def test_each_request_equals_its_steps_replayed_alone(model, per_loop, chunk):
    """Six requests through three slots and 16 blocks: requests joining as others leave, some preempted and
    prefilled again, every prompt in one step or (``chunk``: chunked prefill, a step of the three slots and 96
    prompt tokens) in chunks. Every token each admission generated equals what a batch-1 LoopKVCache predicts when
    fed the same tokens in the same steps, a prompt in chunks as one prompt (the served semantics per request); with
    a pool large enough for no preemption, that is the request generated alone."""
    plan = loopkv.Plan.from_loops(loops=2, layers=2, per_loop=per_loop, tau=14.0)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 97, (n,), generator=g).tolist() for n in (330, 40, 5, 300, 120, 350)]
    chunked = chunk is not None
    cb = engine_config(pool_pages=16, max_len=512, max_slots=3, chunked_prefill=chunked,
                       max_batch_tokens=3 + chunk if chunked else None)
    with engine_cache(plan, max_slots=3, max_len=512, chunked_prefill=chunked) as built:
        out = model.generate_batch(prompts, generation_config=_greedy(), continuous_batching_config=cb)
    (engine,) = built
    assert type(engine) is transformers_cb.engine_class()
    assert engine.admissions > len(prompts)  # some requests were preempted and prefilled again
    assert max(rows + tokens for _, rows, tokens in engine.steps) <= cb.max_batch_tokens
    in_chunks = 0
    for lives in engine.lives.values():  # each admission: its prompt, whole or in chunks, then one token a step
        for life in lives:
            prompt_steps = [s for s in life if s[1] > 1 or s[0] == 0]
            assert [pos for pos, _ in prompt_steps] == [0, *itertools.accumulate(n for _, n in prompt_steps[:-1])]
            assert all(n == 1 for _, n in life[len(prompt_steps):]), life
            in_chunks += len(prompt_steps) > 1
    assert (in_chunks > 0) == chunked
    _assert_replays(model, plan, prompts, out, engine, new=NEW)


@needs_engine
def test_a_request_preempted_while_its_prompt_is_in_chunks_gives_the_scratch_back(model):
    """Three requests through three slots and 16 blocks, 32 prompt tokens per step: the first request, preempted
    once it has decoded, comes back with its output as a longer prompt in chunks and is preempted again before its
    last chunk. The scratch goes back with its slot (the third request's prompt and the first's next admission are
    then prefilled in chunks through it), and every token is the one its steps give replayed alone."""
    plan = loopkv.Plan.from_loops(loops=2, layers=2, per_loop=["share", "int4"], tau=14.0)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 97, (n,), generator=g).tolist() for n in (100, 100, 350)]
    cb = engine_config(pool_pages=16, max_len=512, max_slots=3, chunked_prefill=True, max_batch_tokens=3 + 32)
    with engine_cache(plan, max_slots=3, max_len=512, chunked_prefill=True) as built:
        out = model.generate_batch(prompts, generation_config=_greedy(80), continuous_batching_config=cb)
    (engine,) = built
    cut = [life for life in engine.lives["req_0"][1:-1] if len(life) > 1 and life[-1][1] > 1]
    assert cut, engine.lives["req_0"]  # an admission that ended in its prompt's chunks
    _assert_replays(model, plan, prompts, out, engine, new=80)


def _assert_replays(model, plan, prompts, out, engine, *, new):
    """Every block and the scratch back; every token each admission generated equals what a batch-1 LoopKVCache
    predicts fed the same tokens in the same steps (a prompt in chunks as one pass)."""
    assert engine.cache.pages_in_use == 0
    assert engine.free_block_count() == engine.num_blocks
    assert engine.chunk_owner is None
    checked = 0
    for rid, o in out.items():
        prompt = prompts[int(rid.split("_")[1])]
        tokens = prompt + o.generated_tokens
        assert len(o.generated_tokens) == new
        known = len(prompt)  # tokens the request had when (re)admitted: a preempted one comes back with its output
        for life in engine.lives[rid]:
            if sum(n for pos, n in life if pos < known) < known:
                continue  # preempted before its prompt's last chunk: it generated nothing
            life = [(0, known)] + [(pos, n) for pos, n in life if pos >= known]  # a prompt in chunks as one pass
            predicted = _replay(model, plan, tokens, life)
            for (pos, n), token in zip(life, predicted, strict=True):
                end = pos + n
                if known <= end < len(tokens):  # this step generated tokens[end]
                    assert token == tokens[end], (rid, pos, n)
                    checked += 1
            last = life[-1][0] + life[-1][1]  # a later admission's prompt ends with this step's output, if any
            known = last + 1 if last >= known else known
    assert checked == len(prompts) * new  # every generated token, in the admission that generated it


@needs_engine
def test_requests_the_engine_could_never_finish_are_refused_up_front(model):
    plan = loopkv.Plan.uniform(loops=2, layers=2, option="int4")
    with pytest.raises(ValueError, match="request 1 has an empty prompt"):  # nothing runs
        generate_batch(model, [[5, 6], []], plan, max_slots=2, max_len=512, pool_pages=16,
                       generation_config=_greedy())
    with pytest.raises(ValueError, match="request 0 needs 560 tokens"):
        generate_batch(model, [[5] * 520], plan, max_slots=2, max_len=512, pool_pages=16,
                       generation_config=_greedy())
    with pytest.raises(ValueError, match=r"max_batch_tokens >= max_len \+ max_slots = 514.*chunked_prefill=True"):
        engine_config(pool_pages=16, max_batch_tokens=513, max_len=512, max_slots=2)
    with pytest.raises(ValueError, match=r"max_batch_tokens=2 is too small.*max_batch_tokens > max_slots"):
        engine_config(pool_pages=16, max_batch_tokens=2, max_len=512, max_slots=2, chunked_prefill=True)
    assert engine_config(pool_pages=16, max_len=512, max_slots=2, chunked_prefill=True).max_batch_tokens == 2 + 512
    long = engine_config(pool_pages=16, max_len=16384, max_slots=2, chunked_prefill=True).max_batch_tokens
    assert long == 2 + transformers_cb.DEFAULT_CHUNK < 2 + 16384


@needs_engine
def test_the_engine_cache_follows_the_installed_engine():
    """transformers 5.24 renamed and regrouped the engine's cache calls (and block_size became page_size): the class
    the engine builds and the config's names are the installed version's."""
    have = Version(Version(transformers.__version__).base_version)
    expected = transformers_cb.EngineCache524 if have >= Version("5.24") else transformers_cb.EngineCache517
    assert transformers_cb.engine_class() is expected
    cb = engine_config(pool_pages=16, max_len=64, max_slots=2)
    page = cb.page_size if have >= Version("5.24") else cb.block_size
    assert (page, cb.num_blocks, cb.max_blocks_per_request, cb.cpu_offload_space) == (32, 16, 0, 0.0)
    assert cb.max_batch_tokens == 66  # the longest request next to every slot decoding
    assert cb.use_cuda_graph is False
    assert cb.use_async_batching is False
    for name in ("page_size", "block_size", "cpu_offload_space"):
        with pytest.raises(ValueError, match=name):
            engine_config(pool_pages=16, max_len=64, max_slots=2, **{name: 1})


@pytest.mark.parametrize("version", ["5.16.1", "5.25.0.dev0", "6.0.0"])
def test_an_unsupported_engine_is_refused_by_name(monkeypatch, version):
    monkeypatch.setattr(transformers, "__version__", version)
    with pytest.raises(NotImplementedError, match=f"this is transformers {version}"):
        check_version()
    with pytest.raises(NotImplementedError), engine_cache(None, max_slots=1, max_len=32):
        pass


@needs_engine
def test_with_room_for_everything_each_request_is_generate_alone(model):
    """Blocks and a step budget that need neither chunks nor preemption: each request's tokens are what
    ``model.generate`` gives it alone through a LoopKVCache with the same plan."""
    plan = loopkv.Plan.uniform(loops=2, layers=2, option="int4", tau=14.0)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 97, (n,), generator=g).tolist() for n in (330, 7, 290)]
    loopkv.register()  # what building a LoopKVCache does, whichever test of this worker runs first
    model.set_attn_implementation("loopkv")  # as README's generate example leaves it; the engines refuse the name
    out = generate_batch(model, prompts, plan, max_slots=3, max_len=512, pool_pages=48, max_batch_tokens=1024,
                         generation_config=_greedy())
    assert model.config._attn_implementation == "loopkv"  # given back
    model.set_attn_implementation("sdpa")
    for rid, o in out.items():
        prompt = prompts[int(rid.split("_")[1])]
        cache = loopkv.LoopKVCache(plan, config=model.config, max_batch_size=1, max_cache_len=512,
                                   dtype=torch.float32, device="cpu")
        alone = model.generate(torch.tensor([prompt]), past_key_values=cache, max_new_tokens=NEW, do_sample=False,
                               eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        assert o.generated_tokens == alone, rid


@needs_engine
@pytest.mark.parametrize("chunked", [False, True])
def test_parallel_samples_are_prefilled_as_requests_of_their_own(model, chunked):
    """``num_return_sequences > 1``: no child shares its parent's slot (loopkv forks nothing; the engine prefills each
    child from scratch). With top-k 1 every output is its prompt's greedy continuation alone. The 5.24 engine splits
    a parent's prompt before its last token to fork it, a prompt then a decode token, also with chunked prefill on
    (the scheduler took the prompt whole)."""
    plan = loopkv.Plan.uniform(loops=2, layers=2, option="int4", tau=14.0)
    prompts = [[5, 6, 7, 8, 9], [8, 9, 10]]
    config = GenerationConfig(max_new_tokens=6, do_sample=True, top_k=1, eos_token_id=-1, pad_token_id=0,
                              num_return_sequences=2)
    out = generate_batch(model, prompts, plan, max_slots=4, max_len=64, pool_pages=8, generation_config=config,
                         chunked_prefill=chunked)
    # 5.24 returns the children too (req_0__child#0); 5.17's generate_batch returns the parents only
    newer = Version(Version(transformers.__version__).base_version) >= Version("5.24")
    assert len(out) == (4 if newer else 2)
    for rid, o in out.items():
        prompt = prompts[int(rid.split("__")[0].split("_")[1])]
        cache = loopkv.LoopKVCache(plan, config=model.config, max_batch_size=1, max_cache_len=64,
                                   dtype=torch.float32, device="cpu")
        alone = model.generate(torch.tensor([prompt]), past_key_values=cache, max_new_tokens=6, do_sample=False,
                               eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        assert o.generated_tokens == alone, rid


def test_a_model_that_does_not_take_its_attention_from_the_cache_is_refused():
    from transformers import LlamaConfig, LlamaForCausalLM

    llama = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=2, head_dim=32))
    plan = loopkv.Plan.uniform(loops=1, layers=2, option="int4")
    with pytest.raises(NotImplementedError, match="attention function from the cache"):
        generate_batch(llama, [[1, 2]], plan, max_slots=1, max_len=64, pool_pages=4, generation_config=_greedy())


@needs_engine
def test_a_request_longer_than_max_len_fails_alone_in_a_running_engine(model, caplog):
    """Added to a running engine (no up-front check), a request that can never fit is failed by itself, the log
    naming max_len; the requests beside it finish as if it had not come."""
    plan = loopkv.Plan.uniform(loops=2, layers=2, option="int4", tau=14.0)
    prompts = {"ok1": [3 + i % 90 for i in range(50)], "bad": [3 + i % 90 for i in range(600)], "ok2": [5] * 30}
    with engine_cache(plan, max_slots=2, max_len=512):
        cb = engine_config(pool_pages=40, max_len=512, max_slots=2)
        manager = model.init_continuous_batching(generation_config=_greedy(8), continuous_batching_config=cb)
        manager.start()
        try:
            for rid, ids in prompts.items():
                manager.add_request(ids, request_id=rid, max_new_tokens=8)
            results = {r.request_id: r for r in (manager.get_result(timeout=120) for _ in prompts) if r is not None}
        finally:
            manager.stop(block=True)
            model.destroy_cached_continuous_batching_manager()
    assert results["bad"].error
    assert "max_len=512" in caplog.text
    for rid in ("ok1", "ok2"):
        assert results[rid].error is None
        cache = loopkv.LoopKVCache(plan, config=model.config, max_batch_size=1, max_cache_len=512,
                                   dtype=torch.float32, device="cpu")
        alone = model.generate(torch.tensor([prompts[rid]]), past_key_values=cache, max_new_tokens=8,
                               do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(prompts[rid]):].tolist()
        assert results[rid].generated_tokens == alone, rid


@needs_engine
def test_a_decode_step_reads_nothing_back_from_the_device(model):
    """The segments come from the engine's host-side scheduling and the decoding rows and new prompts' writes go to
    the device once per step: in a decode step, loopkv's cache and shim make no call that would wait for a GPU
    (``tolist``, ``item``, ``bool``/``int`` of a tensor, a tensor built from host data on a device), while the
    counter does see the engine's own (it builds its index tensors from host lists every step). (The check of the
    step's decode tokens reads a host copy after the forward, once its CUDA event says the step has ended, which the
    engine waits for next anyway to read the step's tokens; neither is a call this counter sees.)"""
    requests = 3
    prompts = [[3 + (i * 7 + j) % 90 for j in range(8)] for i in range(requests)]
    plan = loopkv.Plan.uniform(loops=2, layers=2, option="int4", tau=14.0)
    cb = engine_config(pool_pages=requests * 16, max_len=512, max_slots=requests)
    with engine_cache(plan, max_slots=requests, max_len=512), host_syncs.record_steps() as steps, torch.no_grad():
        model.generate_batch(prompts, generation_config=_greedy(8), continuous_batching_config=cb)
    timed = host_syncs.between(steps)
    decode = [c for step, _, c in timed if step.tokens <= requests]  # every packed token a decoding row's
    decode = decode[len(decode) // 4:]  # past the first steps
    assert len(decode) >= 3
    syncs = host_syncs.mean_per_step(decode)
    assert syncs.get("transformers:tensor(device=)", 0) > 0  # the counter counts
    assert not {name: n for name, n in syncs.items() if name.startswith("loopkv:")}
    # a step with prompts reads one thing back: whether a prompt token was uncodable (an INT4 plan), at its end;
    # the page table's update, when the step's rows get pages, is the one blocking copy (two tensors)
    prompt_steps = [c for step, _, c in timed if step.tokens > requests]
    assert len(prompt_steps) >= 1
    prompt = {name: n for name, n in host_syncs.mean_per_step(prompt_steps).items() if name.startswith("loopkv:")}
    assert prompt.pop("loopkv:tolist") == 1
    assert prompt.pop("loopkv:tensor(device=)", 0) <= 2
    assert not prompt


@needs_engine
@pytest.mark.parametrize("per_loop", [["int4", "int4"], ["share", "int4"]])
def test_a_prompt_waits_for_a_step_with_room_for_all_of_it(model, per_loop):
    """Four prompts sent at once with room for 516 tokens per step: after 330 and 40 tokens, the 300-token prompt does
    not fit the 146 left. The engine alone would split it; loopkv's engine leaves it for the next step, where it is
    prefilled in one pass, and takes the 5-token prompt behind it first. Every request's tokens are what it generates
    alone through a LoopKVCache with the same plan."""
    prompts = [[3 + (7 * i + j) % 90 for j in range(n)] for i, n in enumerate((330, 40, 300, 5))]
    plan = loopkv.Plan.from_loops(loops=2, layers=2, per_loop=per_loop, tau=14.0)
    cb = engine_config(pool_pages=64, max_len=512, max_slots=4)
    with engine_cache(plan, max_slots=4, max_len=512) as built:
        out = model.generate_batch(prompts, generation_config=_greedy(8), continuous_batching_config=cb)
    (engine,) = built
    assert cb.max_batch_tokens == 516
    assert engine.steps[0][2] == 330 + 40 + 5  # the first step's prompt tokens: the 300 waited
    assert {rid: lives[0][0] for rid, lives in engine.lives.items()} == {
        f"req_{i}": (0, len(p)) for i, p in enumerate(prompts)}
    for rid, o in out.items():
        prompt = prompts[int(rid.split("_")[1])]
        cache = loopkv.LoopKVCache(plan, config=model.config, max_batch_size=1, max_cache_len=512,
                                   dtype=torch.float32, device="cpu")
        alone = model.generate(torch.tensor([prompt]), past_key_values=cache, max_new_tokens=8, do_sample=False,
                               eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        assert o.generated_tokens == alone, rid


@needs_engine
def test_the_peak_batch_is_the_most_requests_the_engine_decodes_together(model):
    """Eight 300-token prompts sent at once (one per step: the step holds 521 tokens) to 9 slots and a pool of 80
    blocks (10 per request): the pool holds all eight, but the engine's scheduler admits a prompt beside decoding ones
    only while 15% of the pool is free, so the eighth waits until another finishes. ``goodput.peak_batch`` predicts
    7, the most that decode in one step, and 8 with no margin; the eighth request still gets the tokens it generates
    alone, and every block comes back."""
    from loopkv.serving.goodput import peak_batch

    prompts = [[3 + (5 * i + j) % 90 for j in range(300)] for i in range(8)]
    plan = loopkv.Plan.uniform(loops=2, layers=2, option="int4", tau=14.0)
    new = 12
    cb = engine_config(pool_pages=80, max_len=512, max_slots=9, safety_margin=0.15)
    with engine_cache(plan, max_slots=9, max_len=512) as built:
        out = model.generate_batch(prompts, generation_config=_greedy(new), continuous_batching_config=cb)
    (engine,) = built
    assert peak_batch(9, 80, 300, new, 0.0) == 8
    assert peak_batch(9, 80, 300, new, 0.15) == 7
    assert max(rows for _, rows, prompt in engine.steps if prompt == 0) == 7
    cache = loopkv.LoopKVCache(plan, config=model.config, max_batch_size=1, max_cache_len=512, dtype=torch.float32,
                               device="cpu")
    alone = model.generate(torch.tensor([prompts[7]]), past_key_values=cache, max_new_tokens=new, do_sample=False,
                           eos_token_id=None, pad_token_id=0)[0, 300:].tolist()
    assert out["req_7"].generated_tokens == alone
    assert engine.free_block_count() == 80
