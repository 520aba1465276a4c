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
                     skip_tokenizer_init=True, max_model_len=max_len, enforce_eager=args.enforce_eager,
                     gpu_memory_utilization=args.gpu_memory_utilization, enable_prefix_caching=False,
                     max_num_seqs=max(batches), seed=0)
    if args.attention_backend:
        engine_kw["attention_backend"] = args.attention_backend
    if not args.enforce_eager:  # capture only the batch sizes measured (and a few small ones)
        engine_kw["compilation_config"] = {"cudagraph_capture_sizes": sorted({1, 2, 4, *batches})}
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
    p.add_argument("--attention-backend", default=None,
                   help="vLLM's attention backend, e.g. FLASH_ATTN or TRITON_ATTN (default: vLLM chooses)")
    p.add_argument("--in-process", action="store_true",
                   help="vLLM's engine in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0)")
    p.add_argument("--skip-static", action="store_true", help="no StaticCache BF16 run")
    p.add_argument("--static-timeout", type=int, default=240, help="seconds allowed to bench_decode.py")
    p.add_argument("--quick", action="store_true",
                   help=f"first attempt: {QUICK}, enforce_eager, no StaticCache run")
    p.add_argument("--out", default=None, help="JSON path (default: benchmarks/results/vllm.json; "
                                               "with --quick vllm_quick.json)")
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
