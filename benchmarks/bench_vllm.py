"""vLLM's own BF16 decode throughput on an Ouro-1.4B-shaped model, beside loopkv's StaticCache BF16 number (issue 31).

Stage 1 of the vLLM plugin: does vLLM start with vLLM's native Ouro (``OuroForCausalLM``, one ``Attention`` per
(loop, layer) cell), dummy weights (``load_format="dummy"``) and a BF16 KV cache, and how fast does it decode at 16K?

Steps, each printed with its duration as it ends:

1. ``bench_decode.py``'s ``bf16`` arm (transformers' ``StaticCache``, one layer per cell, the decode step captured as
   one CUDA graph, synthetic fill) in a subprocess, at ``--context`` and the same batches, unless ``--skip-static``.
   It runs before vLLM starts, so this process never holds CUDA while vLLM forks its engine.
2. A config.json with Ouro-1.4B's shapes (``bench_decode.ouro_1p4b_config``) in a temporary folder, no weights.
3. ``vllm.LLM(load_format="dummy", dtype="bfloat16", skip_tokenizer_init=True, enable_prefix_caching=False)``;
   ``model_type="ouro"`` is unknown to transformers, so loopkv's ``OuroConfig`` is registered with ``AutoConfig``
   first (``loopkv.models.register_ouro``; the engine process is forked and inherits it, or runs in this process
   with ``--in-process``).
4. Per batch B: B distinct random token-id prompts of ``--context`` tokens (``TokensPrompt``), greedy, ``ignore_eos``,
   generated twice: ``--base-tokens`` (N1) and N1 + ``--tokens`` (N2) new tokens per request. Both runs prefill the
   same prompts the same way (chunked prefill and any decode steps mixed into it included), so the difference is
   N2 - N1 decode steps of the whole batch: decode tok/s = B * (N2 - N1) / (t(N2) - t(N1)). Each time is the best of
   ``--repeats`` runs; an untimed short generate first warms the engine.

Prints a table last and writes JSON (device, versions, date, command, both engines' numbers) to ``--out``.

On one H200 (the numbers the issue asks for; about 6 minutes):

    python benchmarks/bench_vllm.py

``--quick``: 1K context, 32 + 16 tokens, batches 1 and 4, ``enforce_eager``, no StaticCache run: proves that vLLM
starts and generates (about 2 minutes).

``--plan PLAN.json`` (issue 31 stage 2; docs/vllm.md, "Checks on the GPU"): loopkv's vLLM plugin serving a plan,
against vLLM's own BF16 cache, on one random checkpoint whose logits are not flat. The plan is checked against the
model's config first (no GPU spent on a plan that does not fit or that the plugin cannot serve). Then, each in a
fresh process of this script (``--arm``):

1. ``reference``: loopkv's ``OuroForCausalLM`` of the config above with transformers' random init
   (``torch.manual_seed(CHECKPOINT_SEED)``), saved in bf16 with ``save_pretrained`` (safetensors, about 3 GB at
   Ouro-1.4B's shape) to a temporary folder that every later arm loads (``--weights``); loopkv's parameter names are
   those vLLM's Ouro loads. Then on this GPU, through transformers, the same prompts as the vLLM arms, greedy with
   top-K logprobs, with the dense cache (exact) and, per quantized plan, ``LoopKVCache(plan)``.
2. the vLLM arms (``load_format="safetensors"``), engine in process, ``block_size=32``, prefix caching off, every
   prompt in one chunk (``max_num_batched_tokens`` = ``max_model_len``), greedy ``PLAN_NEW_TOKENS`` tokens with their
   top-``PLAN_LOGPROBS`` logprobs for the same seeded prompts (``PLAN_PROMPT_LENGTHS``, one batch), and the model
   class; with ``--plan-decode-context N`` also decode tok/s at N tokens for each batch size of
   ``--plan-decode-batches`` (B distinct prompts, at most as many as the arm's KV blocks hold at once, so a batch
   larger than an arm's pool measures that arm's peak; ``decode_tok_s`` of a run of ``--plan-decode-base`` and one of
   that plus ``--plan-decode-tokens`` new tokens).

* An all-bf16 plan is a check: arms ``vllm`` (no plugin), ``vllm_again`` (vLLM need not repeat itself across
  processes) and ``loopkv`` (``LOOPKV_PLAN=PLAN.json`` and ``loopkv.vllm.plugin.register()``, so vLLM builds
  ``LoopKVOuroForCausalLM``); exits 1 unless ``loopkv``'s tokens equal ``vllm``'s.
* Any other plan (``int4``, ``int2``, ``bf16`` and ``share`` cells) is a comparison: arms ``vllm`` and ``loopkv``;
  reports per prompt where the tokens first diverge, the logprobs on the positions whose context is still the same
  in both (top-1 agreement, KL over the tokens both top-K lists hold, the gap in the logprob of vLLM's token) and the
  decode rates side by side (``loopkv.vllm.compare``). The served-KL check (``compare.served_kl_check``): the arm's
  KL from vLLM BF16 beside ``LoopKVCache(plan)``'s KL from the dense cache (same definition, same prompts, same
  weights), their ratio, and the bound ``SERVED_KL_FACTOR x (LoopKVCache's KL + vLLM BF16's KL from transformers'
  dense BF16)``. Exits 1 unless ``loopkv`` ran with loopkv's class and generated every token, vLLM BF16 is within
  ``ENGINES_KL_MAX`` of transformers' dense BF16 (it read the checkpoint as loopkv's Ouro), and every arm's served
  KL is within its bound.
  ``--plan`` given more than once (quantized plans only): one ``vllm`` arm and one ``loopkv:NAME`` arm per plan
  (``NAME``: the file's stem), each compared with ``vllm``.

CUDA graphs (every vLLM arm alike, :func:`graph_settings`): ``--enforce-eager`` none; ``--decode-graphs`` no
torch.compile and every decode step one full graph (``FULL_DECODE_ONLY``: loopkv's read inside vLLM's graph), steps
with prompts eager; neither: vLLM's default (torch.compile, 2-3 min per start). ``--eager-check`` adds the last
plan's arm once more with ``--enforce-eager`` (tokens and logprobs, label ``loopkv:NAME:eager``) and exits 1 unless
the graph arm's logprobs are as close to it as two BF16 engines' are to each other
(``loopkv.vllm.compare.graph_eager_check``).

An arm serving a quantized plan runs with chunked prefill off (``enable_chunked_prefill=False``): a plan with
``share`` cells needs it (``loopkv.vllm.settings.check_engine``), and for the others a prompt's later chunks go
through loopkv's continuation, which reads the row's pages once per chunk token (docs/vllm.md, "Chunked
prefill"). vLLM's own arms keep its default. Prints a table and writes ``benchmarks/results/vllm_plan.json`` (or
``--out``):

    python benchmarks/bench_vllm.py --plan PLAN.json --enforce-eager --plan-decode-context 16384

``--write-plans DIR`` writes the paper's uniform-INT4 (KIVI-4), LoopKV-R and LoopKV-M plans for Ouro-1.4B's shape
(``bench_decode.paper_plans``) as ``DIR/kivi4.json``, ``DIR/loopkv-r.json`` and ``DIR/loopkv-m.json`` and exits:

    python benchmarks/bench_vllm.py --write-plans /tmp/plans
    python benchmarks/bench_vllm.py --plan /tmp/plans/kivi4.json --plan /tmp/plans/loopkv-r.json \\
        --plan /tmp/plans/loopkv-m.json --enforce-eager --arm-timeout 130

The decode graphs, with each arm's peak at 16K (docs/vllm.md, "Checks on the GPU"; 8.2 min on one H200):

    python benchmarks/bench_vllm.py --plan /tmp/plans/kivi4.json --plan /tmp/plans/loopkv-m.json \\
        --decode-graphs --eager-check --plan-decode-context 16384 --plan-decode-batches 1,32 \\
        --plan-decode-base 4 --plan-decode-tokens 48 --arm-timeout 150 --reference-timeout 230
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

from loopkv.vllm.compare import (
    ENGINES_KL_MAX,
    SERVED_KL_FACTOR,
    compare_logprobs,
    compare_tokens,
    graph_eager_check,
    greedy_topk,
    served_kl_check,
)

HERE = pathlib.Path(__file__).resolve().parent
GIB = 1 << 30
QUICK = {"context": 1024, "tokens": 16, "base_tokens": 32, "batches": "1,4", "repeats": 1}
# fields of the config that vLLM's ouro.py (0.26) and its model config read; checked in the written file
VLLM_OURO_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                    "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps", "max_position_embeddings",
                    "rope_parameters", "total_ut_steps", "tie_word_embeddings", "max_window_layers")


def log(msg: str) -> None:
    print(f"[bench_vllm {time.strftime('%H:%M:%S')}] {msg}", flush=True)


class Step:
    """``with Step("what"):`` prints what starts, then how long it took (or that it failed)."""

    def __init__(self, what: str):
        self.what = what

    def __enter__(self):
        self.t0 = time.perf_counter()
        log(f"{self.what} ...")
        return self

    def __exit__(self, exc_type, exc, tb):
        self.seconds = time.perf_counter() - self.t0
        log(f"{self.what}: {'FAILED after' if exc_type else 'done in'} {self.seconds:.1f} s")
        return False


def ouro_config_dict(*, max_position_embeddings: int | None = None) -> dict:
    """Ouro-1.4B's config.json as vLLM reads it: ``bench_decode``'s shapes, ``architectures=["OuroForCausalLM"]``."""
    from bench_decode import ouro_1p4b_config

    overrides = {} if max_position_embeddings is None else {"max_position_embeddings": max_position_embeddings}
    d = ouro_1p4b_config(**overrides).to_dict()
    d.update(architectures=["OuroForCausalLM"], model_type="ouro", dtype="bfloat16")
    missing = [f for f in VLLM_OURO_FIELDS if d.get(f) is None]
    if missing:
        raise RuntimeError(f"the Ouro config lacks fields vLLM's ouro.py reads: {missing}")
    return d


def write_model_dir(folder: str | os.PathLike) -> pathlib.Path:
    """A model folder with config.json alone (vLLM's dummy loader needs no weights, and no tokenizer is read)."""
    folder = pathlib.Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(ouro_config_dict(), indent=1) + "\n")
    return folder


def decode_tok_s(batch: int, base_tokens: int, tokens: int, t_base: float, t_full: float) -> float:
    """Decode tokens/s of ``batch`` requests from a run of ``base_tokens`` and one of ``base_tokens + tokens`` new
    tokens per request (same prompts): the ``tokens`` extra steps of the whole batch took ``t_full - t_base``."""
    if t_full <= t_base:
        raise ValueError(f"the longer run ({t_full:.3f} s) did not take longer than the shorter ({t_base:.3f} s)")
    return batch * tokens / (t_full - t_base)


def static_bf16(args, batches: list[int]) -> dict:
    """bench_decode.py's bf16 arm at ``args.context`` and ``batches``, in a subprocess: its rows by batch."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "decode.json")
        cmd = [sys.executable, str(HERE / "bench_decode.py"), "--contexts", str(args.context), "--arms", "bf16",
               "--batches", ",".join(map(str, batches)), "--capture", "graph", "--profile", "none",
               "--shared-process", "--kv-budget-gib", str(args.kv_budget_gib), "--out", out]
        log("running " + " ".join(cmd[1:]))
        proc = subprocess.run(cmd, cwd=HERE.parent, timeout=args.static_timeout)
        if not os.path.exists(out):
            raise RuntimeError(f"bench_decode.py wrote no result (exit status {proc.returncode})")
        result = json.loads(pathlib.Path(out).read_text())
    rows = {r["batch"]: {"tok_s": r["tok_s"], "step_ms": r["step_ms"]} for r in result["rows"] if r["arm"] == "bf16"}
    return {"command": " ".join(cmd[1:-2]), "rows": rows, "errors": result.get("errors", []),
            "exit_status": proc.returncode}


def graph_settings(args, batches: list[int], max_num_seqs: int) -> dict:
    """vLLM's engine arguments for the run's mode of CUDA graphs: ``--enforce-eager``: none (and no torch.compile);
    ``--decode-graphs``: no torch.compile (``compilation_config`` mode NONE, so the engine starts without compiling)
    and every decode step of a batch of at most ``max_num_seqs`` requests captured as one graph
    (``FULL_DECODE_ONLY``), steps with prompts eager; otherwise vLLM's default (torch.compile, ``FULL_AND_PIECEWISE``).
    Graphs are captured for ``batches`` (the decode batch sizes that run) and 1, 2, 4, 8 (vLLM pads a batch to the
    next size captured)."""
    if args.enforce_eager and args.decode_graphs:
        raise ValueError("--enforce-eager runs without CUDA graphs and --decode-graphs with them: give one")
    if args.enforce_eager:
        return {"enforce_eager": True}
    sizes = sorted(b for b in {1, 2, 4, 8, *batches} if b <= max_num_seqs)
    config = {"cudagraph_capture_sizes": sizes}
    if args.decode_graphs:
        config.update(mode=0, cudagraph_mode="FULL_DECODE_ONLY")  # CompilationMode.NONE
    return {"enforce_eager": False, "compilation_config": config}


def run_vllm(args, batches: list[int]) -> dict:
    """Start vLLM on the dummy Ouro-1.4B and measure decode tok/s at each batch (module docstring, step 4)."""
    if args.in_process:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    # vLLM's sampler imports FlashInfer unless told not to; the greedy runs here do not need it, and the carried
    # wheels leave it out (the device has no package index).
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    with Step("import vllm") as s:
        import vllm
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt
    log(f"vllm {vllm.__version__} from {os.path.dirname(vllm.__file__)} ({s.seconds:.1f} s)")

    import loopkv.models

    loopkv.models.register_ouro()  # AutoConfig learns model_type "ouro" (transformers has no Ouro)
    import numpy as np

    result = {"vllm": vllm.__version__, "points": [], "errors": []}
    tmp = tempfile.TemporaryDirectory()
    model_dir = write_model_dir(tmp.name)
    max_len = args.context + args.base_tokens + args.tokens + 64
    engine_kw = dict(model=str(model_dir), load_format="dummy", dtype="bfloat16", kv_cache_dtype="auto",
                     skip_tokenizer_init=True, max_model_len=max_len,
                     gpu_memory_utilization=args.gpu_memory_utilization, enable_prefix_caching=False,
                     max_num_seqs=max(batches), seed=0, **graph_settings(args, batches, max(batches)))
    if args.attention_backend:
        engine_kw["attention_backend"] = args.attention_backend
    result["engine_kwargs"] = {k: v for k, v in engine_kw.items() if k != "model"}
    with Step(f"vllm.LLM(max_model_len={max_len}, enforce_eager={args.enforce_eager})") as s:
        llm = LLM(**engine_kw)
    result["engine_start_s"] = round(s.seconds, 1)
    cache_cfg = llm.llm_engine.vllm_config.cache_config
    result["num_gpu_blocks"] = getattr(cache_cfg, "num_gpu_blocks", None)
    result["block_size"] = getattr(cache_cfg, "block_size", None)
    log(f"KV cache: {result['num_gpu_blocks']} blocks of {result['block_size']} tokens")

    rng = np.random.default_rng(0)
    vocab = ouro_config_dict()["vocab_size"]

    def prompts(batch: int, length: int) -> list:
        return [TokensPrompt(prompt_token_ids=rng.integers(1, vocab, size=length).tolist()) for _ in range(batch)]

    def generate(ps, new_tokens: int) -> tuple[float, int]:
        sp = SamplingParams(max_tokens=new_tokens, min_tokens=new_tokens, ignore_eos=True, temperature=0.0,
                            detokenize=False)
        t0 = time.perf_counter()
        outs = llm.generate(ps, sp, use_tqdm=False)
        seconds = time.perf_counter() - t0
        made = sum(len(o.outputs[0].token_ids) for o in outs)
        if made != len(ps) * new_tokens:
            raise RuntimeError(f"asked for {len(ps)} x {new_tokens} tokens, vLLM generated {made}")
        return seconds, made

    with Step("warm-up generate (2 x 256-token prompts, 8 tokens)"):
        generate(prompts(2, 256), 8)
    n1, n2 = args.base_tokens, args.base_tokens + args.tokens
    for batch in batches:
        try:
            ps = prompts(batch, args.context)
            times = {n1: [], n2: []}
            for rep in range(args.repeats):
                for n in (n1, n2):
                    with Step(f"B={batch} ctx={args.context} generate {n} tokens (run {rep + 1})") as s:
                        generate(ps, n)
                    times[n].append(s.seconds)
            t1, t2 = min(times[n1]), min(times[n2])
            point = {"batch": batch, "context": args.context, "base_tokens": n1, "full_tokens": n2,
                     "t_base_s": [round(t, 4) for t in times[n1]], "t_full_s": [round(t, 4) for t in times[n2]],
                     "decode_s": round(t2 - t1, 4), "tok_s": round(decode_tok_s(batch, n1, n2 - n1, t1, t2), 1),
                     "step_ms": round((t2 - t1) / (n2 - n1) * 1e3, 3),
                     "kv_gib_at_context": round(batch * args.context * bf16_bytes_per_token() / GIB, 2)}
            log(f"vLLM B={batch}: decode {point['tok_s']} tok/s ({point['step_ms']} ms per step)")
            result["points"].append(point)
        except Exception as exc:  # record and go on: the next batch may still run
            import traceback

            result["errors"].append({"batch": batch, "error": traceback.format_exc()[-3000:]})
            log(f"vLLM B={batch} FAILED: {exc!r}")
    tmp.cleanup()
    return result


def bf16_bytes_per_token() -> int:
    """Bytes of BF16 K and V one token stores over every (loop, layer) cell: 768 KiB for Ouro-1.4B."""
    d = ouro_config_dict()
    return 2 * 2 * d["total_ut_steps"] * d["num_hidden_layers"] * d["num_key_value_heads"] * d["head_dim"]


def print_table(result: dict) -> None:
    static = result.get("static_bf16", {}).get("rows", {})
    print(f"\n{'engine':28s} {'ctx':>6s} {'B':>3s} {'decode tok/s':>12s} {'step ms':>8s}")
    for p in result.get("vllm", {}).get("points", []):
        print(f"{'vLLM ' + str(result['vllm']['vllm']) + ' BF16':28s} {p['context']:6d} {p['batch']:3d} "
              f"{p['tok_s']:12.1f} {p['step_ms']:8.3f}")
        s = static.get(str(p["batch"])) or static.get(p["batch"])
        if s:
            print(f"{'StaticCache BF16 (graph)':28s} {p['context']:6d} {p['batch']:3d} {s['tok_s']:12.1f} "
                  f"{s['step_ms']:8.3f}   vLLM / StaticCache = {p['tok_s'] / s['tok_s']:.2f}")
    for e in result.get("vllm", {}).get("errors", []):
        print(f"vLLM {'B=' + str(e['batch']) if e['batch'] else 'start'} failed: "
              f"{e['error'].strip().splitlines()[-1]}")


PLAN_PROMPT_LENGTHS = (17, 290, 1000, 2100)  # inside the sink, just past sink + window (288), a few pages, more
PLAN_NEW_TOKENS = 48
PLAN_LOGPROBS = 20  # top-K logprobs per generated token (vLLM's default max_logprobs)
PLAN_BLOCK_SIZE = 32  # every arm: loopkv's cells need it (one block per page), vLLM's own serve it too
CHECK_ARMS = ("vllm", "vllm_again", "loopkv")  # an all-bf16 plan: the plugin must give vLLM's own tokens
COMPARE_ARMS = ("vllm", "loopkv")  # a quantized plan: how far its tokens and logits stay from vLLM BF16
PLAN_CLASSES = {"vllm": "OuroForCausalLM", "vllm_again": "OuroForCausalLM", "loopkv": "LoopKVOuroForCausalLM"}


def plan_prompts(lengths=PLAN_PROMPT_LENGTHS, *, vocab: int, seed: int = 0) -> list[list[int]]:
    """Seeded random token-id prompts of ``lengths`` (ids in ``[1, vocab)``), the same in every arm."""
    import numpy as np

    rng = np.random.default_rng(seed)
    return [rng.integers(1, vocab, size=n).tolist() for n in lengths]


# The real-weight check: one random checkpoint, the served KL against LoopKVCache's (docs/vllm.md, "Checks on the GPU")
CHECKPOINT_SEED = 0  # torch's seed of the random OuroForCausalLM every arm loads
REFERENCE_ARM = "reference"
EAGER_SUFFIX = ":eager"  # --eager-check: the label of the last plan's arm run with --enforce-eager


def write_checkpoint(folder, config: dict, *, seed: int = CHECKPOINT_SEED, dtype=None, device="cpu"):
    """loopkv's ``OuroForCausalLM`` of ``config`` (a config.json dict, :func:`ouro_config_dict`) with transformers'
    random init under ``torch.manual_seed(seed)``, in ``dtype`` (default bfloat16), saved with ``save_pretrained``
    (safetensors) into ``folder``, whose config.json is then ``config`` itself. loopkv's parameter names are vLLM's
    Ouro's checkpoint names (``model.layers.{l}.self_attn.q_proj.weight``, ..., ``lm_head.weight``; vLLM stacks
    q/k/v and gate/up as it loads), so no renaming. Returns the model (eval mode, on ``device``)."""
    import torch

    from loopkv.models.ouro import OuroConfig, OuroForCausalLM

    folder = pathlib.Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cfg = OuroConfig.from_dict({k: v for k, v in config.items() if k not in ("architectures", "model_type")})
    torch.manual_seed(seed)
    with torch.device(device):
        model = OuroForCausalLM(cfg)
    model = model.to(dtype or torch.bfloat16).eval()
    model.save_pretrained(folder)
    (folder / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    return model


def run_reference_arm(args) -> dict:
    """``--arm reference``: write the checkpoint every arm loads (``--weights``), then the same prompts through
    transformers on this process's device: the dense cache (``dense_cache``: exact) and, per quantized plan,
    ``LoopKVCache(plan)``, greedy with top-K logprobs as the vLLM arms report them. Runs before any vLLM arm; its
    memory goes with its process."""
    import torch

    import loopkv
    from loopkv.models.ouro_config import dense_cache

    device = "cuda" if torch.cuda.is_available() else "cpu"
    config = ouro_config_dict()
    with Step(f"[{REFERENCE_ARM}] random OuroForCausalLM (seed {CHECKPOINT_SEED}) saved to {args.weights}") as s:
        model = write_checkpoint(args.weights, config, device=device)
    result = {"arm": REFERENCE_ARM, "device": device, "seed": CHECKPOINT_SEED, "dtype": "bfloat16",
              "checkpoint_s": round(s.seconds, 1), "plans": {}}
    prompts = plan_prompts(PLAN_PROMPT_LENGTHS, vocab=config["vocab_size"])
    kw = dict(new_tokens=PLAN_NEW_TOKENS, k=PLAN_LOGPROBS)
    with Step(f"[{REFERENCE_ARM}] dense cache, prompts of {PLAN_PROMPT_LENGTHS}"):
        result["dense"] = greedy_topk(model, prompts, lambda n: dense_cache(model.config), **kw)
    for label, arm, path in arm_runs(args.plan):
        plan = loopkv.Plan.from_json(path)
        if arm != "loopkv" or set(plan.options) == {"bf16"}:
            continue

        def new_cache(capacity, plan=plan):
            return loopkv.LoopKVCache(plan, config=model.config, max_batch_size=1, max_cache_len=capacity,
                                      dtype=torch.bfloat16, device=device)

        with Step(f"[{REFERENCE_ARM}] LoopKVCache({pathlib.Path(path).name})"):
            result["plans"][label] = greedy_topk(model, prompts, new_cache, **kw)
    return result


def check_plan(path: str):
    """The plan at ``path``, checked as the plugin will check it on the served model's config and this script's engine
    settings (fails before vLLM)."""
    from bench_decode import ouro_1p4b_config

    from loopkv.vllm.settings import PLAN_ENV, check_engine, load_plan, validate_for_vllm

    plan = load_plan(None, environ={PLAN_ENV: path})
    validate_for_vllm(plan, ouro_1p4b_config())  # the config ouro_config_dict writes
    check_engine(plan, block_size=PLAN_BLOCK_SIZE, prefix_caching=False, speculative=False, chunked_prefill=False)
    return plan


def plan_arms(plan) -> tuple[str, ...]:
    """``CHECK_ARMS`` for an all-bf16 plan (tokens must be vLLM's), else ``COMPARE_ARMS``."""
    return CHECK_ARMS if set(plan.options) == {"bf16"} else COMPARE_ARMS


def arm_runs(paths: list[str]) -> list[tuple[str, str, str]]:
    """(label, arm, plan path) of every arm: one plan's :func:`plan_arms`, or for several (quantized) plans one
    ``vllm`` arm and one ``loopkv:STEM`` arm per plan. Every plan is checked first (:func:`check_plan`)."""
    plans = [check_plan(p) for p in paths]
    if len(plans) == 1:
        return [(arm, arm, paths[0]) for arm in plan_arms(plans[0])]
    checks = [p for p, plan in zip(paths, plans, strict=True) if plan_arms(plan) == CHECK_ARMS]
    if checks:
        raise ValueError(f"{checks} are all-bf16 plans, which are checked alone: give them in a run of their own")
    labels = [f"loopkv:{pathlib.Path(p).stem}" for p in paths]
    if len(set(labels)) != len(labels):
        raise ValueError(f"the plans' file names must differ (arms are named by them): {paths}")
    return [("vllm", "vllm", paths[0])] + [(label, "loopkv", p) for label, p in zip(labels, paths, strict=True)]


def write_paper_plans(folder: str) -> list[str]:
    """Uniform INT4 (KIVI-4), LoopKV-R and LoopKV-M for Ouro-1.4B's shape (``bench_decode.paper_plans``, with its KV
    heads and head_dim) as JSON files in ``folder``; returns their paths."""
    from bench_decode import ouro_1p4b_config, paper_plans

    from loopkv.planning.plan import Plan

    config = ouro_1p4b_config()
    plans = paper_plans(config.total_ut_steps, config.num_hidden_layers)
    pathlib.Path(folder).mkdir(parents=True, exist_ok=True)
    paths = []
    for name in ("kivi4", "loopkv-r", "loopkv-m"):
        plan = Plan.from_grid(plans[name].grid(), tau=list(plans[name].taus), kv_heads=config.num_key_value_heads,
                              head_dim=config.head_dim)
        path = os.path.join(folder, f"{name}.json")
        plan.to_json(path)
        check_plan(path)
        paths.append(path)
    return paths


def run_plan_arm(args) -> dict:
    """One arm of ``--plan``, in this (fresh) process: vLLM in process, greedy tokens and their top-K logprobs for
    the seeded prompts, then (``--plan-decode-context``) decode tok/s of one request at that context."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the plugin's registration must reach the engine
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # apply_model's function
    if args.arm == "loopkv":
        os.environ["LOOPKV_PLAN"] = os.path.abspath(args.plan[0])
        from loopkv.vllm import plugin

        plugin.register()  # what vLLM's entry point does where loopkv is pip-installed
    else:
        os.environ.pop("LOOPKV_PLAN", None)
        os.environ["VLLM_PLUGINS"] = ""  # no general plugin, loopkv's included: vLLM's own Ouro
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    import loopkv.models

    loopkv.models.register_ouro()
    vocab = ouro_config_dict()["vocab_size"]
    prompts = plan_prompts(PLAN_PROMPT_LENGTHS, vocab=vocab)
    ctx, n1, n2 = args.plan_decode_context, args.plan_decode_base, args.plan_decode_base + args.plan_decode_tokens
    if not args.weights or not os.path.isfile(os.path.join(args.weights, "config.json")):
        raise ValueError(f"--arm {args.arm} loads the checkpoint the reference arm writes: --weights "
                         f"{args.weights!r} has no config.json (run --arm {REFERENCE_ARM} first)")
    max_len = max(max(PLAN_PROMPT_LENGTHS) + PLAN_NEW_TOKENS, ctx + n2 if ctx else 0) + 64
    batches = decode_batches(args) if ctx else []
    max_seqs = max([len(prompts), *batches])
    engine_kw = dict(model=args.weights, load_format="safetensors", dtype="bfloat16",
                     kv_cache_dtype="auto", skip_tokenizer_init=True, max_model_len=max_len,
                     gpu_memory_utilization=args.gpu_memory_utilization,
                     enable_prefix_caching=False, block_size=PLAN_BLOCK_SIZE, max_num_seqs=max_seqs, seed=0,
                     max_num_batched_tokens=max_len,  # a prompt in one chunk when the step's budget is free
                     **graph_settings(args, [len(prompts), *batches], max_seqs))
    if args.arm == "loopkv":  # every prompt whole: a share cell's chunks take at most 256 tokens, others' are slow
        engine_kw["enable_chunked_prefill"] = False
    if args.attention_backend:
        engine_kw["attention_backend"] = args.attention_backend
    with Step(f"[{args.arm}] vllm.LLM") as s:
        llm = LLM(**engine_kw)
    result = {"arm": args.arm, "vllm": vllm.__version__, "engine_start_s": round(s.seconds, 1),
              "engine_kwargs": {k: v for k, v in engine_kw.items() if k != "model"},
              "num_gpu_blocks": getattr(llm.llm_engine.vllm_config.cache_config, "num_gpu_blocks", None)}
    try:
        result["model_class"] = llm.apply_model(lambda model: type(model).__name__)
    except Exception as exc:  # the class is a check, not the point: record why it is unknown
        result["model_class"] = None
        result["model_class_error"] = repr(exc)
    sp = SamplingParams(max_tokens=PLAN_NEW_TOKENS, min_tokens=PLAN_NEW_TOKENS, ignore_eos=True, temperature=0.0,
                        detokenize=False, logprobs=PLAN_LOGPROBS)
    with Step(f"[{args.arm}] generate {PLAN_NEW_TOKENS} greedy tokens for prompts of {PLAN_PROMPT_LENGTHS}") as s:
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)
    result["generate_s"] = round(s.seconds, 2)
    result["tokens"] = [list(o.outputs[0].token_ids) for o in outs]
    result["logprobs"] = [[{str(t): round(float(lp.logprob), 5) for t, lp in pos.items()} for pos in
                           (o.outputs[0].logprobs or [])] for o in outs]
    if ctx:
        import numpy as np

        result["decode"] = []
        blocks = result["num_gpu_blocks"]
        per_request = -(-(ctx + n2) // PLAN_BLOCK_SIZE)  # blocks one request of the decode run holds at its end
        for requested in batches:
            # the most requests this arm's pool holds at once: a larger batch would queue or preempt, and its
            # time would not be a decode rate. Each arm's peak is its largest batch up to the one asked for
            batch = min(requested, blocks // per_request) if blocks else requested
            if batch < 1:
                raise RuntimeError(f"{blocks} KV blocks cannot hold one request of {ctx + n2} tokens")
            ps = [TokensPrompt(prompt_token_ids=np.random.default_rng(1 + i).integers(1, vocab, size=ctx).tolist())
                  for i in range(batch)]
            times = {}
            for n in (n1, n2):
                sp = SamplingParams(max_tokens=n, min_tokens=n, ignore_eos=True, temperature=0.0, detokenize=False)
                with Step(f"[{args.arm}] B={batch} ctx={ctx} generate {n} tokens") as s:
                    made = [len(o.outputs[0].token_ids) for o in llm.generate(ps, sp, use_tqdm=False)]
                if made != [n] * batch:
                    raise RuntimeError(f"asked for {n} tokens per request at {ctx}, vLLM generated {made}")
                times[n] = s.seconds
            point = {"context": ctx, "batch": batch, "batch_requested": requested, "base_tokens": n1, "full_tokens": n2,
                     "t_base_s": round(times[n1], 3), "t_full_s": round(times[n2], 3),
                     "tok_s": round(decode_tok_s(batch, n1, n2 - n1, times[n1], times[n2]), 1),
                     "step_ms": round((times[n2] - times[n1]) / (n2 - n1) * 1e3, 3)}
            result["decode"].append(point)
            log(f"[{args.arm}] decode at {ctx}, B={batch}: {point['tok_s']} tok/s")
    return result


def decode_batches(args) -> list[int]:
    """``--plan-decode-batches`` as sorted distinct ints, each at least 1."""
    batches = sorted({int(b) for b in args.plan_decode_batches.split(",") if b.strip()})
    if not batches or batches[0] < 1:
        raise ValueError(f"--plan-decode-batches takes batch sizes of at least 1, got {args.plan_decode_batches!r}")
    return batches


def run_plan(args, out: str) -> dict:
    """``--plan``: check the plan, run its arms in fresh processes, compare their tokens, logprobs and decode rates
    (module docstring)."""
    from run_info import run_info, write_json

    from loopkv.planning.plan import Plan

    t0 = time.perf_counter()
    runs = arm_runs(args.plan)
    if args.eager_check:
        if args.enforce_eager:
            raise ValueError("--eager-check compares the graph arm with an eager one: drop --enforce-eager")
        last = runs[-1]
        if last[1] != "loopkv":
            raise ValueError("--eager-check needs a plan served by loopkv (an all-bf16 plan is vLLM's own)")
        runs.append((f"{last[0]}{EAGER_SUFFIX}", "loopkv", last[2]))
    labels = [label for label, _, _ in runs]
    kinds = {label: arm for label, arm, _ in runs}
    options = {os.path.abspath(p): sorted(set(Plan.from_json(p).options)) for p in args.plan}
    result = {"plans": options, "labels": labels, "mode": "check" if tuple(labels) == CHECK_ARMS else "compare",
              "prompt_lengths": list(PLAN_PROMPT_LENGTHS),
              "new_tokens": PLAN_NEW_TOKENS, "block_size": PLAN_BLOCK_SIZE, "enforce_eager": args.enforce_eager,
              "decode_graphs": args.decode_graphs,
              "weights": f"loopkv's OuroForCausalLM, Ouro-1.4B shape, transformers' random init, torch seed "
                         f"{CHECKPOINT_SEED}, bf16 safetensors (the reference arm writes it)",
              "arms": {}, "errors": []}
    with tempfile.TemporaryDirectory() as tmp:
        weights = os.path.join(tmp, "checkpoint")
        reference = run_reference(args, weights, tmp, result)
        for label, arm, plan_path in runs if reference else []:
            arm_out = os.path.join(tmp, f"{label.replace(':', '_')}.json")
            eager = args.enforce_eager or label.endswith(EAGER_SUFFIX)
            cmd = [sys.executable, str(HERE / "bench_vllm.py"), "--plan", plan_path, "--arm", arm, "--out", arm_out,
                   "--weights", weights,
                   "--gpu-memory-utilization", str(args.gpu_memory_utilization),
                   # the eager twin gives tokens only: its decode rate is not the point
                   "--plan-decode-context", str(0 if label.endswith(EAGER_SUFFIX) else args.plan_decode_context),
                   "--plan-decode-batches", args.plan_decode_batches,
                   "--plan-decode-base", str(args.plan_decode_base),
                   "--plan-decode-tokens", str(args.plan_decode_tokens)]
            cmd += ["--enforce-eager"] if eager else ["--decode-graphs"] if args.decode_graphs else []
            cmd += ["--attention-backend", args.attention_backend] if args.attention_backend else []
            with Step(f"arm {label} (subprocess)"):
                try:
                    proc = subprocess.run(cmd, cwd=HERE.parent, timeout=args.arm_timeout, check=False)
                    status = proc.returncode
                except subprocess.TimeoutExpired:
                    status = f"timed out after {args.arm_timeout} s"
            if status or not os.path.exists(arm_out):
                written = json.loads(pathlib.Path(arm_out).read_text()) if os.path.exists(arm_out) else {}
                result["errors"].append({"arm": label, "exit_status": status, "error": written.get("error")})
                continue
            result["arms"][label] = json.loads(pathlib.Path(arm_out).read_text())
    arms = result["arms"]
    for label, got in arms.items():
        classes = got.get("model_class")
        got["model_class_ok"] = None if classes is None else all(c == PLAN_CLASSES[kinds[label]] for c in classes)
    result["decode_over_vllm"] = {}
    if "vllm" in arms:
        for label in labels[1:]:
            if label in arms:
                cmp = compare_tokens(arms["vllm"]["tokens"], arms[label]["tokens"])
                if arms["vllm"].get("logprobs") and arms[label].get("logprobs"):
                    cmp["logprobs"] = compare_logprobs(arms["vllm"]["tokens"], arms["vllm"]["logprobs"],
                                                       arms[label]["logprobs"], cmp["first_divergence"])
                result[f"{label}_vs_vllm"] = cmp
                # by the batch asked for: where an arm's pool holds fewer requests, its point is its peak
                ref = {p["batch_requested"]: p["tok_s"] for p in arms["vllm"].get("decode") or []}
                got = {p["batch_requested"]: p["tok_s"] for p in arms[label].get("decode") or []}
                if kinds[label] == "loopkv" and set(ref) & set(got):
                    result["decode_over_vllm"][label] = {str(b): round(got[b] / ref[b], 3)
                                                         for b in sorted(set(ref) & set(got))}
    result["served_kl"] = served_kl_check(arms, reference) if reference else None
    if args.eager_check:  # the graph arm against its eager twin: logprobs as close as two BF16 engines'
        graph, eager = labels[-2], labels[-1]
        if graph in arms and eager in arms:
            engines = (result["served_kl"] or {}).get("engines") or {}
            result["graph_vs_eager"] = graph_eager_check(arms[graph], arms[eager], engines.get("kl"))
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    result = {**run_info(__file__, None, device), **result, "wall_s": round(time.perf_counter() - t0, 1)}
    result["complete"] = not result["errors"] and len(arms) == len(labels)
    served = [label for label in labels if kinds[label] == "loopkv"]
    result["loopkv_generates"] = all(
        arms.get(label, {}).get("model_class_ok") is True and bool(arms[label].get("tokens"))
        and all(len(t) == PLAN_NEW_TOKENS for t in arms[label]["tokens"]) for label in served)
    result["loopkv_equals_vllm"] = result["loopkv_generates"] and all(
        result.get(f"{label}_vs_vllm", {}).get("equal") is True for label in served)
    kl = result["served_kl"] or {}
    result["weights_agree"] = kl.get("weights_agree") is True
    result["served_kl_ok"] = result["mode"] == "check" or (
        bool(kl.get("arms")) and all(row["ok"] is True for row in kl["arms"].values()))
    result["graph_matches_eager"] = result.get("graph_vs_eager", {}).get("ok") is True if args.eager_check else None
    result["passed"] = result["weights_agree"] and result["served_kl_ok"] and (
        result["loopkv_equals_vllm"] if result["mode"] == "check" else result["loopkv_generates"]) and (
        result["graph_matches_eager"] is not False)
    write_json(out, result)
    log(f"wrote {out}")
    print_plan_table(result)
    return result


def run_reference(args, weights: str, tmp: str, result: dict) -> dict | None:
    """The reference arm (:func:`run_reference_arm`) in a fresh process: writes the checkpoint to ``weights``;
    returns its result, or None (the error recorded in ``result``) when it failed."""
    out = os.path.join(tmp, f"{REFERENCE_ARM}.json")
    cmd = [sys.executable, str(HERE / "bench_vllm.py"), "--arm", REFERENCE_ARM, "--weights", weights, "--out", out]
    for path in args.plan:
        cmd += ["--plan", path]
    with Step(f"arm {REFERENCE_ARM} (subprocess)"):
        try:
            status = subprocess.run(cmd, cwd=HERE.parent, timeout=args.reference_timeout, check=False).returncode
        except subprocess.TimeoutExpired:
            status = f"timed out after {args.reference_timeout} s"
    written = json.loads(pathlib.Path(out).read_text()) if os.path.exists(out) else {}
    if status or "dense" not in written:
        result["errors"].append({"arm": REFERENCE_ARM, "exit_status": status, "error": written.get("error")})
        return None
    result["reference"] = written
    return written


def print_plan_table(result: dict) -> None:
    print(f"\nplans {result.get('plans')} ({result.get('mode', 'check')}), block size "
          f"{result.get('block_size')}, enforce_eager={result.get('enforce_eager')}, "
          f"decode_graphs={result.get('decode_graphs')}")
    print(f"{'arm':24s} {'model class':24s} {'blocks':>8s} {'prompts = vllm':>15s} {'decode tok/s by B':>20s}  "
          "first divergence")
    for label in result["labels"]:
        got = result["arms"].get(label)
        if got is None:
            print(f"{label:24s} FAILED (see the log)")
            continue
        cmp = result.get(f"{label}_vs_vllm")
        equal = "reference" if label == "vllm" else (f"{cmp['prompts_equal']}/{len(cmp['first_divergence'])}"
                                                     if cmp else "?")
        rate = ", ".join(f"{p['batch']}: {p['tok_s']:.1f}" for p in got.get("decode") or []) or "-"
        print(f"{label:24s} {str((got.get('model_class') or ['?'])[0]):24s} {str(got.get('num_gpu_blocks')):>8s} "
              f"{equal:>15s} {rate:>20s}  {cmp['first_divergence'] if cmp else ''}")
    for label in result["labels"][1:]:
        lp = result.get(f"{label}_vs_vllm", {}).get("logprobs")
        if lp:
            print(f"{label} vs vllm logprobs over {lp['positions']} same-context positions: top-1 agreement "
                  f"{lp['top1_agreement']}, top-{PLAN_LOGPROBS} KL mean {lp['topk_kl_mean']} max "
                  f"{lp['topk_kl_max']}, |logprob gap| of vllm's token mean {lp['ref_token_logprob_gap_mean']}")
    for label, ratios in result.get("decode_over_vllm", {}).items():
        context = result["arms"]["vllm"]["decode"][0]["context"]
        print(f"decode at {context}: {label} / vllm by batch = {ratios}")
    ge = result.get("graph_vs_eager")
    if ge:
        print(f"{result['labels'][-2]} (CUDA graphs) vs {result['labels'][-1]}: top-{PLAN_LOGPROBS} KL mean "
              f"{ge['logprobs']['topk_kl_mean']} over {ge['logprobs']['positions']} same-context positions, at most "
              f"the engines' {ge['engines_kl']}: {result['graph_matches_eager']} (greedy tokens equal {ge['equal']}, "
              f"first divergence {ge['first_divergence']})")
    kl = result.get("served_kl") or {}
    if kl.get("engines"):
        print(f"checkpoint: vLLM BF16 vs transformers dense BF16 top-{PLAN_LOGPROBS} KL {kl['engines']['kl']} "
              f"(top-1 agreement {kl['engines']['top1_agreement']}; at most {ENGINES_KL_MAX}: "
              f"{kl.get('weights_agree')})")
    for label, row in kl.get("arms", {}).items():
        print(f"{label}: served KL {row['served_kl']} vs LoopKVCache KL {row['reference_kl']}, ratio "
              f"{row.get('ratio')}, bound {SERVED_KL_FACTOR} x (LoopKVCache + engines) = {row.get('bound')}: "
              f"{'ok' if row['ok'] else 'FAILED' if row['ok'] is False else '?'}")
    print(f"loopkv generates: {result['loopkv_generates']}; loopkv equals vllm: {result['loopkv_equals_vllm']}; "
          f"served KL within bound: {result.get('served_kl_ok')}; passed: {result.get('passed')}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--context", type=int, default=16384, help="prompt tokens per request")
    p.add_argument("--tokens", type=int, default=256, help="decode steps timed (N2 - N1)")
    p.add_argument("--base-tokens", type=int, default=32, help="new tokens of the shorter run (N1)")
    p.add_argument("--batches", default="1,7",
                   help="comma-separated batches (7: BF16's peak at 16K in bench_decode's 96 GiB KV budget)")
    p.add_argument("--repeats", type=int, default=2, help="runs per length; the fastest counts")
    p.add_argument("--kv-budget-gib", type=float, default=96.0, help="passed to bench_decode.py")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--enforce-eager", action="store_true", help="no torch.compile and no CUDA graphs in vLLM")
    p.add_argument("--decode-graphs", action="store_true",
                   help="no torch.compile; every decode step one full CUDA graph (FULL_DECODE_ONLY), prompts eager")
    p.add_argument("--attention-backend", default=None,
                   help="vLLM's attention backend, e.g. FLASH_ATTN or TRITON_ATTN (default: vLLM chooses)")
    p.add_argument("--in-process", action="store_true",
                   help="vLLM's engine in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0)")
    p.add_argument("--skip-static", action="store_true", help="no StaticCache BF16 run")
    p.add_argument("--static-timeout", type=int, default=240, help="seconds allowed to bench_decode.py")
    p.add_argument("--quick", action="store_true",
                   help=f"first attempt: {QUICK}, enforce_eager, no StaticCache run")
    p.add_argument("--plan", action="append", default=None,
                   help="a plan JSON: all-bf16, check the plugin's greedy tokens against vLLM's; any other, compare "
                        "its tokens, logprobs and decode rate with vLLM BF16 (repeat for several quantized plans)")
    p.add_argument("--write-plans", default=None, metavar="DIR",
                   help="write the paper's KIVI-4, LoopKV-R and LoopKV-M plans for Ouro-1.4B's shape into DIR and exit")
    p.add_argument("--arm", choices=(*CHECK_ARMS, REFERENCE_ARM), default=None,
                   help="with --plan: run one arm in this process")
    p.add_argument("--weights", default=None,
                   help="with --arm: the checkpoint folder (the reference arm writes it, the others load it)")
    p.add_argument("--plan-decode-context", type=int, default=0,
                   help="with --plan: also measure decode tok/s of one request at this context (0: not)")
    p.add_argument("--plan-decode-batches", default="1",
                   help="with --plan-decode-context: comma-separated batch sizes whose decode rate is measured "
                        "(each capped at the requests the arm's KV blocks hold at once: its peak)")
    p.add_argument("--eager-check", action="store_true",
                   help="with --plan and --decode-graphs (or vLLM's default graphs): the last plan once more with "
                        "--enforce-eager; the graph arm's logprobs must be within the BF16 engines' KL of its")
    p.add_argument("--plan-decode-base", type=int, default=16, help="with --plan: N1 of the decode measurement")
    p.add_argument("--plan-decode-tokens", type=int, default=128, help="with --plan: N2 - N1 decode steps timed")
    p.add_argument("--arm-timeout", type=int, default=420, help="with --plan: seconds allowed to each vLLM arm")
    p.add_argument("--reference-timeout", type=int, default=300,
                   help="with --plan: seconds allowed to the reference arm (checkpoint, transformers runs)")
    p.add_argument("--out", default=None, help="JSON path (default: benchmarks/results/vllm.json; "
                                               "with --quick vllm_quick.json, with --plan vllm_plan.json)")
    return p


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    if args.quick:
        for k, v in QUICK.items():
            setattr(args, k, v)
        args.enforce_eager, args.skip_static = True, True
    batches = [int(b) for b in args.batches.split(",") if b]
    out = args.out or str(HERE / "results" / ("vllm_quick.json" if args.quick else "vllm.json"))
    sys.path.insert(0, str(HERE))  # bench_decode and run_info, when imported as a module
    if args.write_plans is not None:
        for path in write_paper_plans(args.write_plans):
            log(f"wrote {path}")
        return {}
    if args.arm is not None:
        if args.plan is None or (len(args.plan) != 1 and args.arm != REFERENCE_ARM):
            raise SystemExit("--arm needs one --plan")
        try:
            arm = run_reference_arm(args) if args.arm == REFERENCE_ARM else run_plan_arm(args)
        except Exception:  # the parent records why this arm failed
            import traceback

            traceback.print_exc()
            pathlib.Path(args.out).write_text(json.dumps({"arm": args.arm, "error": traceback.format_exc()[-4000:]}))
            raise SystemExit(1) from None
        pathlib.Path(args.out).write_text(json.dumps(arm) + "\n")
        return {}
    if args.plan is not None:
        result = run_plan(args, args.out or str(HERE / "results" / "vllm_plan.json"))
        if not result["passed"]:
            raise SystemExit(1)
        return result
    from run_info import run_info, write_json

    t0 = time.perf_counter()
    result = {"args": vars(args), "model": "Ouro-1.4B shape, dummy weights, BF16 weights and KV",
              "decode_method": "B * (N2 - N1) / (t(N2) - t(N1)), same prompts, best of --repeats",
              "complete": False}
    if not args.skip_static:
        with Step("StaticCache BF16 (bench_decode.py, subprocess)"):
            try:
                result["static_bf16"] = static_bf16(args, batches)
            except Exception as exc:  # vLLM is the point of this run: go on without the baseline
                result["static_bf16"] = {"error": repr(exc)}
                log(f"StaticCache run failed: {exc!r}")
    try:
        with Step("vLLM"):
            result["vllm"] = run_vllm(args, batches)
    except Exception:  # vLLM did not start or died: the error is Stage 1's answer, so it goes into the JSON
        import traceback

        traceback.print_exc()
        result["vllm"] = {"vllm": _vllm_version(), "points": [], "errors": [{"batch": None,
                                                                              "error": traceback.format_exc()[-6000:]}]}
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    result = {**run_info(__file__, argv, device), **result, "wall_s": round(time.perf_counter() - t0, 1)}
    result["versions"]["vllm"] = result["vllm"]["vllm"]
    result["complete"] = bool(result["vllm"]["points"]) and not result["vllm"]["errors"]
    write_json(out, result)
    log(f"wrote {out}")
    print_table(result)
    if not result["complete"]:
        raise SystemExit(1)
    return result


def _vllm_version() -> str | None:
    try:
        import vllm
    except Exception:
        return None
    return vllm.__version__


if __name__ == "__main__":
    main()
