"""``benchmarks/bench_vllm.py``'s pure parts: the Ouro config.json it writes for vLLM, and its decode-rate arithmetic.
Where vLLM is installed, vLLM's own model config reads the written folder as vLLM's native ``OuroForCausalLM``."""

import json
import pathlib
from types import SimpleNamespace

import pytest

from loopkv.models.ouro import OuroConfig
from tests import benchmark_scripts


@pytest.fixture(scope="module")
def bench():
    return benchmark_scripts.load("bench_vllm")


def test_config_is_bench_decodes_ouro_1p4b(bench, tmp_path):
    folder = bench.write_model_dir(tmp_path / "ouro")
    written = json.loads((folder / "config.json").read_text())
    assert written["architectures"] == ["OuroForCausalLM"]
    assert written["model_type"] == "ouro"
    cfg = OuroConfig.from_pretrained(folder)
    reference = benchmark_scripts.load("bench_decode").ouro_1p4b_config()
    for field in bench.VLLM_OURO_FIELDS:
        assert getattr(cfg, field) == getattr(reference, field), field
    assert (cfg.total_ut_steps, cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim) == (4, 24, 16, 128)
    assert cfg.sliding_window is None  # every cell attends over the whole context
    assert bench.bf16_bytes_per_token() == 768 * 1024  # the README's 768 KiB per token


def test_decode_rate(bench):
    # 7 rows, 256 extra steps in 5.12 s more: 350 tokens/s
    assert bench.decode_tok_s(7, 32, 256, 2.0, 7.12) == pytest.approx(350.0)
    with pytest.raises(ValueError, match="did not take longer"):
        bench.decode_tok_s(1, 32, 256, 3.0, 3.0)


def test_vllm_reads_the_folder_as_its_ouro(bench, tmp_path):
    pytest.importorskip("vllm")
    from vllm.engine.arg_utils import EngineArgs

    import loopkv.models

    loopkv.models.register_ouro()
    folder = bench.write_model_dir(tmp_path / "ouro")
    args = EngineArgs(model=str(folder), load_format="dummy", dtype="bfloat16", skip_tokenizer_init=True,
                      max_model_len=16384 + 512)
    model_config = args.create_model_config()
    assert model_config.architectures == ["OuroForCausalLM"]
    assert model_config.get_head_size() == 128
    assert model_config.hf_config.total_ut_steps == 4


# --plan (issue 31 stage 2): the plugin's greedy tokens against vLLM's; the comparison and the plan check, on CPU

def test_plan_prompts_seeded_and_in_vocab(bench):
    a = bench.plan_prompts(vocab=50)
    assert [len(p) for p in a] == list(bench.PLAN_PROMPT_LENGTHS)
    assert a == bench.plan_prompts(vocab=50)
    assert a != bench.plan_prompts(vocab=50, seed=1)
    assert min(min(p) for p in a) >= 1
    assert max(max(p) for p in a) < 50


def test_compare_tokens(bench):
    ref = [[1, 2, 3], [4, 5, 6], [7, 8]]
    assert bench.compare_tokens(ref, [list(r) for r in ref]) == {"equal": True, "prompts_equal": 3,
                                                                 "first_divergence": [None, None, None]}
    got = bench.compare_tokens(ref, [[1, 2, 3], [4, 9, 6], [7, 8, 9]])
    assert got == {"equal": False, "prompts_equal": 1, "first_divergence": [None, 1, 2]}
    with pytest.raises(ValueError, match="3 reference prompts against 2"):
        bench.compare_tokens(ref, ref[:2])


def test_check_plan_refuses_before_the_gpu(bench, tmp_path):
    from loopkv.planning.plan import Plan

    config = benchmark_scripts.load("bench_decode").ouro_1p4b_config()
    path = tmp_path / "plan.json"
    Plan.from_config(config, option="bf16").to_json(path)
    assert set(bench.check_plan(str(path)).options) == {"bf16"}
    Plan.from_config(config, option="int4").to_json(path)
    assert bench.plan_arms(bench.check_plan(str(path))) == bench.COMPARE_ARMS
    Plan.from_config(config, option="int2", shared_loops=[1]).to_json(path)
    assert bench.plan_arms(bench.check_plan(str(path))) == bench.COMPARE_ARMS
    Plan.from_config(benchmark_scripts.load("bench_decode").smoke_config(), option="bf16").to_json(path)
    with pytest.raises(ValueError, match="does not fit the model"):
        bench.check_plan(str(path))


def _flat(tokens):
    """Logprobs of the arms' format, the greedy token alone at every position (a top-K KL of 0 against another)."""
    return [[{str(t): -0.1} for t in row] for row in tokens]


def _fake_reference(out, dense, plans):
    """What the reference arm writes: the dense cache's greedy tokens and logprobs, and each plan's."""
    pathlib.Path(out).write_text(json.dumps({
        "arm": "reference", "dense": {"tokens": dense, "logprobs": _flat(dense)},
        "plans": {label: {"tokens": t, "logprobs": _flat(t)} for label, t in plans.items()}}))
    return SimpleNamespace(returncode=0)


@pytest.mark.parametrize(("loopkv_tokens", "loopkv_class", "equal"), [
    (None, "LoopKVOuroForCausalLM", True),
    ([[5, 6, 0]], "LoopKVOuroForCausalLM", False),  # a different token at index 2 of the first prompt
    (None, "OuroForCausalLM", False),  # equal tokens, but the plugin's class was not built: not a pass
])
def test_run_plan_compares_the_arms(bench, tmp_path, monkeypatch, loopkv_tokens, loopkv_class, equal):
    from loopkv.planning.plan import Plan

    config = benchmark_scripts.load("bench_decode").ouro_1p4b_config()
    plan_path = tmp_path / "plan.json"
    Plan.from_config(config, option="bf16").to_json(plan_path)
    reference = [[5, 6, 7], [8, 9, 10]]
    arms = {"vllm": (reference, "OuroForCausalLM"), "vllm_again": (reference, "OuroForCausalLM"),
            "loopkv": ((loopkv_tokens or []) + reference[len(loopkv_tokens or []):], loopkv_class)}

    def fake_run(cmd, **kwargs):  # stands for the arm's process: writes what the arm would
        arm, out = cmd[cmd.index("--arm") + 1], cmd[cmd.index("--out") + 1]
        if arm == bench.REFERENCE_ARM:
            return _fake_reference(out, reference, {})
        assert cmd[cmd.index("--weights") + 1].endswith("checkpoint")  # the folder the reference arm wrote
        tokens, cls = arms[arm]
        pathlib.Path(out).write_text(json.dumps({"arm": arm, "tokens": tokens, "logprobs": _flat(tokens),
                                                 "model_class": [cls], "num_gpu_blocks": 100}))
        return SimpleNamespace(returncode=0)

    monkeypatch.setattr(bench, "PLAN_NEW_TOKENS", 3)

    monkeypatch.setattr(bench.subprocess, "run", fake_run)
    args = bench.build_parser().parse_args(["--plan", str(plan_path)])
    result = bench.run_plan(args, str(tmp_path / "out.json"))
    assert result["loopkv_equals_vllm"] is equal
    assert result["passed"] is equal
    assert result["mode"] == "check"
    assert result["complete"]
    assert result["vllm_again_vs_vllm"]["equal"]
    if loopkv_tokens:
        assert result["loopkv_vs_vllm"]["first_divergence"] == [2, None]
    written = json.loads((tmp_path / "out.json").read_text())
    assert written["loopkv_equals_vllm"] is equal


def test_topk_kl(bench):
    import math

    p = {1: math.log(0.5), 2: math.log(0.25), 3: math.log(0.25)}
    assert bench.topk_kl(p, dict(p)) == pytest.approx(0.0, abs=1e-12)
    q = {1: math.log(0.25), 2: math.log(0.5), 9: math.log(0.25)}  # shared: 1, 2 -> p (2/3, 1/3), q (1/3, 2/3)
    want = 2 / 3 * math.log(2) + 1 / 3 * math.log(0.5)
    assert bench.topk_kl(p, q) == pytest.approx(want)
    assert bench.topk_kl({1: 0.0}, {2: 0.0}) is None


def test_compare_logprobs_uses_same_context_positions(bench):
    import math

    lp = lambda d: {str(t): math.log(v) for t, v in d.items()}  # noqa: E731 (JSON keys are strings)
    ref_tokens = [[1, 2, 3], [4, 4]]
    ref = [[lp({1: .6, 2: .4}), lp({2: .7, 1: .3}), lp({3: .9, 1: .1})], [lp({4: .5, 5: .5}), lp({4: .6, 5: .4})]]
    other = [[lp({1: .6, 2: .4}), lp({1: .5, 2: .5}), lp({7: 1.0})], [lp({4: .5, 5: .5}), lp({4: .6, 5: .4})]]
    got = bench.compare_logprobs(ref_tokens, ref, other, [1, None])  # prompt 0 diverges at 1: positions 0, 1
    assert got["positions_per_prompt"] == [2, 2]
    assert got["positions"] == 4
    assert got["top1_agreement"] == pytest.approx(3 / 4)  # position 1 of prompt 0: 2 against 1 (tie -> first)
    assert got["ref_token_logprob_gap_max"] == pytest.approx(abs(math.log(.7) - math.log(.5)))
    assert got["topk_kl_max"] == pytest.approx(.7 * math.log(.7 / .5) + .3 * math.log(.3 / .5))


def test_run_plan_compares_a_quantized_plan(bench, tmp_path, monkeypatch):
    from loopkv.planning.plan import Plan

    config = benchmark_scripts.load("bench_decode").ouro_1p4b_config()
    plan_path = tmp_path / "plan.json"
    Plan.from_config(config, option="int4").to_json(plan_path)
    ran = []

    def fake_run(cmd, **kwargs):
        arm, out = cmd[cmd.index("--arm") + 1], cmd[cmd.index("--out") + 1]
        ran.append(arm)
        if arm == bench.REFERENCE_ARM:
            return _fake_reference(out, [[5, 6, 7], [8, 9, 10]], {"loopkv": [[5, 6, 0], [8, 9, 10]]})
        assert cmd[cmd.index("--plan-decode-context") + 1] == "16384"
        tokens = [[5, 6, 7], [8, 9, 10]] if arm == "vllm" else [[5, 6, 0], [8, 9, 10]]
        lps = [[{str(t): -0.1} for t in row] for row in tokens]
        decode = [{"tok_s": 100.0 if arm == "vllm" else 80.0, "context": 16384, "batch": 1}]
        pathlib.Path(out).write_text(json.dumps({"arm": arm, "tokens": tokens, "logprobs": lps, "decode": decode,
                                                 "model_class": [bench.PLAN_CLASSES[arm]], "num_gpu_blocks": 9}))
        return SimpleNamespace(returncode=0)

    monkeypatch.setattr(bench.subprocess, "run", fake_run)
    monkeypatch.setattr(bench, "PLAN_NEW_TOKENS", 3)
    args = bench.build_parser().parse_args(["--plan", str(plan_path), "--plan-decode-context", "16384"])
    result = bench.run_plan(args, str(tmp_path / "out.json"))
    assert ran == [bench.REFERENCE_ARM, "vllm", "loopkv"]  # the checkpoint first, then vLLM loads it
    assert result["mode"] == "compare"
    assert result["passed"]
    assert result["served_kl"]["arms"]["loopkv"]["ok"]
    assert result["loopkv_generates"]
    assert not result["loopkv_equals_vllm"]
    assert result["loopkv_vs_vllm"]["first_divergence"] == [2, None]
    assert result["loopkv_vs_vllm"]["logprobs"]["positions_per_prompt"] == [3, 3]
    assert result["decode_over_vllm"] == {"loopkv": {"1": 0.8}}


def test_paper_plans_run_as_one_comparison(bench, tmp_path, monkeypatch):
    # --write-plans: KIVI-4, LoopKV-R (int4 + int2) and LoopKV-M (share + int4 + int2) for Ouro-1.4B; R and M in one
    # run, one vLLM arm, one loopkv arm per plan, each compared with vLLM
    from loopkv.planning.plan import Plan

    k_path, r_path, m_path = bench.write_paper_plans(str(tmp_path / "plans"))
    k, r, m = Plan.from_json(k_path), Plan.from_json(r_path), Plan.from_json(m_path)
    assert set(k.options) == {"int4"}
    assert set(r.options) == {"int4", "int2"}
    assert set(m.options) == {"share", "int4", "int2"}
    assert (r.kv_heads, r.head_dim) == (16, 128)
    ran = []

    def fake_run(cmd, **kwargs):
        arm, out, plan = (cmd[cmd.index(flag) + 1] for flag in ("--arm", "--out", "--plan"))
        ran.append((arm, pathlib.Path(plan).name))
        if arm == bench.REFERENCE_ARM:  # every plan given to it
            assert [cmd[i + 1] for i, c in enumerate(cmd) if c == "--plan"] == [r_path, m_path]
            return _fake_reference(out, [[5, 6, 7], [8, 9, 10]], {"loopkv:loopkv-r": [[5, 6, 7], [8, 9, 10]],
                                                                  "loopkv:loopkv-m": [[5, 0, 7], [8, 9, 10]]})
        tokens = [[5, 6, 7], [8, 9, 10]] if arm == "vllm" or plan == r_path else [[5, 0, 7], [8, 9, 10]]
        pathlib.Path(out).write_text(json.dumps({
            "arm": arm, "tokens": tokens, "logprobs": [[{str(t): -0.1} for t in row] for row in tokens],
            "decode": [{"tok_s": (100.0 if arm == "vllm" else 50.0) * b, "context": 16384, "batch": b} for b in (1, 8)],
            "model_class": [bench.PLAN_CLASSES[arm]], "num_gpu_blocks": 9}))
        return SimpleNamespace(returncode=0)

    monkeypatch.setattr(bench.subprocess, "run", fake_run)
    monkeypatch.setattr(bench, "PLAN_NEW_TOKENS", 3)
    args = bench.build_parser().parse_args(["--plan", r_path, "--plan", m_path, "--plan-decode-context", "16384"])
    result = bench.run_plan(args, str(tmp_path / "out.json"))
    assert ran == [(bench.REFERENCE_ARM, "loopkv-r.json"), ("vllm", "loopkv-r.json"), ("loopkv", "loopkv-r.json"),
                   ("loopkv", "loopkv-m.json")]
    assert result["labels"] == ["vllm", "loopkv:loopkv-r", "loopkv:loopkv-m"]
    assert result["passed"]
    assert result["complete"]
    assert result["loopkv:loopkv-r_vs_vllm"]["equal"]
    assert result["loopkv:loopkv-m_vs_vllm"]["first_divergence"] == [1, None]
    assert not result["loopkv_equals_vllm"]
    assert result["decode_over_vllm"] == {label: {"1": 0.5, "8": 0.5} for label in result["labels"][1:]}
    bench.print_plan_table(result)
    Plan.from_config(benchmark_scripts.load("bench_decode").ouro_1p4b_config(), option="bf16").to_json(
        tmp_path / "bf16.json")
    with pytest.raises(ValueError, match="all-bf16 plans, which are checked alone"):
        bench.arm_runs([r_path, str(tmp_path / "bf16.json")])



@pytest.mark.parametrize("twin_equal", [True, False])
def test_decode_graphs_and_the_eager_check(bench, tmp_path, monkeypatch, twin_equal):
    # --decode-graphs: every vLLM arm without torch.compile, decode steps as full CUDA graphs; --eager-check: the last
    # plan once more with --enforce-eager and no decode measurement, its greedy tokens compared with the graph arm's
    k_path, _, m_path = bench.write_paper_plans(str(tmp_path / "plans"))
    cmds = {}

    def fake_run(cmd, **kwargs):
        arm, out, plan = (cmd[cmd.index(flag) + 1] for flag in ("--arm", "--out", "--plan"))
        tokens = [[5, 6, 7], [8, 9, 10]]
        if arm == bench.REFERENCE_ARM:
            return _fake_reference(out, tokens, {"loopkv:kivi4": tokens, "loopkv:loopkv-m": tokens})
        eager = "--enforce-eager" in cmd
        cmds[(arm, pathlib.Path(plan).stem, eager)] = cmd
        if eager and not twin_equal:
            tokens = [[5, 6, 7], [8, 0, 10]]
        ctx = int(cmd[cmd.index("--plan-decode-context") + 1])
        decode = [{"tok_s": 10.0 * b, "context": ctx, "batch": b} for b in (1, 8)] if ctx else None
        pathlib.Path(out).write_text(json.dumps({
            "arm": arm, "tokens": tokens, "logprobs": [[{str(t): -0.1} for t in row] for row in tokens],
            "decode": decode, "model_class": [bench.PLAN_CLASSES[arm]], "num_gpu_blocks": 9}))
        return SimpleNamespace(returncode=0)

    monkeypatch.setattr(bench.subprocess, "run", fake_run)
    monkeypatch.setattr(bench, "PLAN_NEW_TOKENS", 3)
    args = bench.build_parser().parse_args(["--plan", k_path, "--plan", m_path, "--decode-graphs", "--eager-check",
                                            "--plan-decode-context", "16384", "--plan-decode-batches", "1,8"])
    result = bench.run_plan(args, str(tmp_path / "out.json"))
    assert result["labels"] == ["vllm", "loopkv:kivi4", "loopkv:loopkv-m", "loopkv:loopkv-m:eager"]
    assert sorted(cmds) == [("loopkv", "kivi4", False), ("loopkv", "loopkv-m", False), ("loopkv", "loopkv-m", True),
                            ("vllm", "kivi4", False)]
    for (_, _, eager), cmd in cmds.items():
        assert ("--decode-graphs" in cmd) is not eager
        assert cmd[cmd.index("--plan-decode-context") + 1] == ("0" if eager else "16384")
        assert cmd[cmd.index("--plan-decode-batches") + 1] == "1,8"
    assert result["graph_equals_eager"] is twin_equal
    assert result["graph_vs_eager"]["first_divergence"] == ([None, None] if twin_equal else [None, 1])
    assert result["passed"] is twin_equal
    assert result["decode_over_vllm"] == {"loopkv:kivi4": {"1": 1.0, "8": 1.0}, "loopkv:loopkv-m": {"1": 1.0, "8": 1.0}}
    assert set(result["served_kl"]["arms"]) == {"loopkv:kivi4", "loopkv:loopkv-m"}
    bench.print_plan_table(result)
    with pytest.raises(ValueError, match="drop --enforce-eager"):
        bench.run_plan(bench.build_parser().parse_args(["--plan", m_path, "--enforce-eager", "--eager-check"]),
                       str(tmp_path / "x.json"))


def test_graph_settings_are_vllms(bench, tmp_path):
    # the engine arguments of each mode, read by vLLM 0.26's own config classes: --decode-graphs keeps full decode
    # graphs without torch.compile, given the support loopkv's builder declares
    parse = bench.build_parser().parse_args
    assert bench.graph_settings(parse(["--enforce-eager"]), [1, 8], 8) == {"enforce_eager": True}
    assert bench.graph_settings(parse([]), [4, 16], 16)["compilation_config"] == {
        "cudagraph_capture_sizes": [1, 2, 4, 8, 16]}
    graphs = bench.graph_settings(parse(["--decode-graphs"]), [4, 1, 8], 8)
    assert graphs["enforce_eager"] is False
    with pytest.raises(ValueError, match="give one"):
        bench.graph_settings(parse(["--decode-graphs", "--enforce-eager"]), [1], 1)
    pytest.importorskip("vllm")
    from vllm.config import CompilationConfig, CompilationMode, CUDAGraphMode
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.attention.backend import AttentionCGSupport

    from loopkv.vllm.backend import LoopKVMetadataBuilder

    config = EngineArgs(model=str(tmp_path), **graphs).compilation_config
    assert isinstance(config, CompilationConfig)
    assert config.mode == CompilationMode.NONE
    assert config.cudagraph_mode == CUDAGraphMode.FULL_DECODE_ONLY
    assert config.cudagraph_capture_sizes == [1, 2, 4, 8]
    assert not config.cudagraph_mode.requires_piecewise_compilation()  # VllmConfig keeps it without compilation
    support = LoopKVMetadataBuilder.get_cudagraph_support(None, None)
    assert support == AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    assert config.resolve_cudagraph_mode_and_sizes(support, "LoopKVBackend", 1, use_v2_model_runner=True,
                                                   max_num_reqs=8) == CUDAGraphMode.FULL_DECODE_ONLY


# the real-weight check: the reference arm's greedy logprobs, and the served KL against LoopKVCache's

def _lp(*probs):
    import math

    return {str(t + 1): math.log(p) for t, p in enumerate(probs)}  # tokens 1, 2, ...


def _kl(p, q):
    import math

    return sum(a * math.log(a / b) for a, b in zip(p, q, strict=True))


def test_served_kl_check(bench):
    # one prompt, greedy token 1 at three positions; an arm whose tokens diverge at index 1 counts positions 0 and 1
    # only (its third distribution, far off, must not count)
    dense = {"tokens": [[1, 1, 1]], "logprobs": [[_lp(.6, .4)] * 3]}
    vllm = {"tokens": [[1, 1, 1]], "logprobs": [[_lp(.5, .5)] * 3]}
    reference = {"dense": dense, "plans": {"loopkv:far": {"tokens": [[1, 1, 1]], "logprobs": [[_lp(.7, .3)] * 3]},
                                           "loopkv:near": {"tokens": [[1, 1, 1]], "logprobs": [[_lp(.7, .3)] * 3]}}}
    arms = {"vllm": vllm, "loopkv:far": {"tokens": [[1, 1, 1]], "logprobs": [[_lp(.8, .2)] * 3]},
            "loopkv:near": {"tokens": [[1, 2, 2]], "logprobs": [[_lp(.55, .45)] * 2 + [_lp(.01, .99)]]}}
    got = bench.served_kl_check(arms, reference)
    engines, plan_kl = _kl((.6, .4), (.5, .5)), _kl((.6, .4), (.7, .3))
    assert got["engines"]["kl"] == pytest.approx(engines, abs=1e-9)
    assert got["weights_agree"]  # 0.02 nats <= ENGINES_KL_MAX
    far, near = got["arms"]["loopkv:far"], got["arms"]["loopkv:near"]
    assert far["reference_kl"] == pytest.approx(plan_kl, abs=1e-9)
    assert far["served_kl"] == pytest.approx(_kl((.5, .5), (.8, .2)), abs=1e-9)
    assert far["bound"] == pytest.approx(bench.SERVED_KL_FACTOR * (plan_kl + engines), abs=1e-9)
    assert far["ratio"] == pytest.approx(far["served_kl"] / plan_kl)
    assert far["ok"] is False  # 0.22 nats > 2 x (0.023 + 0.020)
    assert near["served_positions"] == 2
    assert near["served_kl"] == pytest.approx(_kl((.5, .5), (.55, .45)), abs=1e-9)
    assert near["ok"] is True
    wrong = {"vllm": {"tokens": [[1, 1, 1]], "logprobs": [[_lp(.99, .01)] * 3]}}
    assert not bench.served_kl_check(wrong, reference)["weights_agree"]  # 1.2 nats: vLLM read other weights


def test_greedy_topk_is_teacher_forced_greedy(bench, tmp_path):
    # the reference arm's loop (prefill, then one token a step through a cache) against full forwards of the
    # prompt and the tokens so far without a cache; the checkpoint written is the model returned
    import torch

    from loopkv.models.ouro import OuroForCausalLM
    from loopkv.models.ouro_config import dense_cache

    d = OuroConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=2, num_key_value_heads=2, head_dim=32,
                   intermediate_size=96, vocab_size=50, total_ut_steps=2, tie_word_embeddings=False).to_dict()
    d.update(architectures=["OuroForCausalLM"], model_type="ouro", dtype="float32")
    model = bench.write_checkpoint(tmp_path, d, dtype=torch.float32)
    assert json.loads((tmp_path / "config.json").read_text()) == json.loads(json.dumps(d))  # JSON's str keys
    again = OuroForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values(),
                                                 strict=True))
    prompts = bench.plan_prompts((3, 9), vocab=50)
    got = bench.greedy_topk(model, prompts, lambda n: dense_cache(model.config), new_tokens=4, k=5)
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


def test_reference_arm_writes_the_checkpoint_and_each_plans_logprobs(bench, tmp_path, monkeypatch):
    # --arm reference at a tiny shape on CPU: the checkpoint the vLLM arms load, the dense cache's greedy logprobs and
    # LoopKVCache's for the quantized plan, under the label of its vLLM arm (an all-bf16 plan gets none)
    import torch

    from loopkv.models.ouro import OuroForCausalLM
    from loopkv.planning.plan import Plan

    config = OuroConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=2, num_key_value_heads=2,
                        head_dim=32, intermediate_size=96, vocab_size=50, total_ut_steps=2, tie_word_embeddings=False)
    d = config.to_dict()
    d.update(architectures=["OuroForCausalLM"], model_type="ouro", dtype="bfloat16")
    Plan.from_config(config, option="int4").to_json(tmp_path / "int4.json")
    Plan.from_config(config, option="bf16").to_json(tmp_path / "bf16.json")
    monkeypatch.setattr(bench, "ouro_config_dict", lambda: d)
    monkeypatch.setattr(bench, "PLAN_PROMPT_LENGTHS", (4, 330))  # 330: pages quantized
    monkeypatch.setattr(bench, "PLAN_NEW_TOKENS", 3)
    monkeypatch.setattr(bench, "arm_runs", lambda paths: [("vllm", "vllm", paths[0])] + [
        (f"loopkv:{pathlib.Path(p).stem}", "loopkv", p) for p in paths])
    plans = ["--plan", str(tmp_path / "int4.json"), "--plan", str(tmp_path / "bf16.json")]
    args = bench.build_parser().parse_args(["--arm", "reference", "--weights", str(tmp_path / "ck"), *plans])
    got = bench.run_reference_arm(args)
    assert got["device"] == "cpu"
    assert list(got["plans"]) == ["loopkv:int4"]
    for run in (got["dense"], got["plans"]["loopkv:int4"]):
        assert [len(t) for t in run["tokens"]] == [3, 3]
        assert all(len(lp) == bench.PLAN_LOGPROBS for row in run["logprobs"] for lp in row)
    assert got["plans"]["loopkv:int4"]["logprobs"][1] != got["dense"]["logprobs"][1]  # INT4 pages were read
    loaded = OuroForCausalLM.from_pretrained(tmp_path / "ck")
    assert loaded.dtype == torch.bfloat16
    assert float(loaded.lm_head.weight.float().std()) == pytest.approx(config.initializer_range, rel=0.1)
