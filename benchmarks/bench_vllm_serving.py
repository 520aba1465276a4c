"""Goodput under a latency SLO of Ouro-1.4B served by vLLM, with vLLM's BF16 cache and with loopkv's plans, measured
by vLLM's own client, ``vllm bench serve``, on a seeded trace (issue #31; paper §5.1, §5.4; docs/vllm.md, "Goodput
through vllm bench serve").

    python benchmarks/bench_vllm_serving.py --arms bf16[,kivi4,loopkv-r,loopkv-m] [--rates 0.2,0.3,...]
        [--start-rate 0.45] [--num-prompts 20] [--seed 0] [--max-len 16384] [--outputs 128,512] [--ttft-s 10]
        [--tpot-x 3] [--gpu-memory-utilization 0.9] [--time-budget-s 540] [--continue]
        [--out benchmarks/results/vllm_serving.json]
    python benchmarks/bench_vllm_serving.py --write-model-dir DIR   # the model folder alone (CPU, no vLLM)

Needs vLLM 0.26 and loopkv's plugin entry point installed (``pip install 'loopkv[vllm]'``; on a machine without a
package index, ``tools/carry_vllm.py``). Every arm is one ``vllm serve`` process on the same model folder, with
the same engine settings and the same ``--gpu-memory-utilization`` (so the same memory for KV; loopkv's exact sink
and window are model buffers and come out of it), then one ``vllm bench serve`` per tested rate against it:

* **the model**: a folder with Ouro-1.4B's config.json (``bench_vllm.ouro_config_dict``) and a tokenizer of the
  config's vocabulary whose words have equal width (``write_tokenizer``: a prompt of random ids decodes and
  re-encodes to the same ids, so the trace's lengths are exact), weights ``--load-format dummy`` (the rate a cache
  sustains does not depend on the weights' values; ``--ignore-eos`` fixes every output's length).
  ``model_type="ouro"`` is unknown to transformers, so the server starts through vLLM's CLI after
  ``loopkv.models.register_ouro()`` (its engine process is forked and inherits it).
* **the engine**, every arm: BF16 weights and activations, ``--max-model-len --max-len``, ``--block-size 32``,
  prefix caching off, chunked prefill off with ``--max-num-batched-tokens`` = ``--max-len`` (every prompt scheduled
  whole: plans with ``share`` cells need it, docs/vllm.md), no torch.compile and every decode step one full CUDA
  graph (``FULL_DECODE_ONLY``, as ``bench_vllm.py --decode-graphs``). ``--max-num-seqs``: for ``bf16`` 32, more
  than its KV blocks hold at the trace's contexts (the blocks bound its batch); for a plan, as many requests of the
  trace's mean context as the BF16 arm's KV memory holds at the plan's bytes per block plus its exact sink and window
  per request (``loopkv.vllm.layout``; the sink and window are allocated for ``--max-num-seqs`` requests up front),
  so ``bf16`` runs first (in this or an earlier call with the same ``--out``). ``bf16`` is vLLM alone
  (``VLLM_PLUGINS=""``); a plan arm sets ``LOOPKV_PLAN``, and must have more KV blocks than ``bf16`` (else the
  plugin did not load: the arm stops).
* **the trace** (``vllm bench serve --dataset-name random --seed``): ``--num-prompts`` requests, prompts uniform in
  [max_len / 2, max_len - the longest output] and outputs uniform in ``--outputs`` (``bench_serving.py``'s trace),
  Poisson arrivals at the tested rate; the same requests at every rate and in every arm.
* **the SLO** (the serving issue's): time to first token <= ``--ttft-s`` and mean time per output token <=
  ``--tpot-x`` x tau0, where tau0 is vLLM BF16's time per output token of one request alone at max_len / 4 tokens of
  context (``bench_serving.py``'s rule), measured in the ``bf16`` arm before its rates. The same arm also records
  tau0 at the trace's mean context (the paper's second rule), not used. vLLM's own ``--goodput`` gets the same
  bounds, so each rate's JSON also carries vLLM's ``request_goodput`` (good requests per second of the run).
* **goodput**: a rate is met when at least 95% of its requests meet the SLO (``loopkv.serving.goodput.ATTAINMENT``;
  each request scored from vLLM's per-request records: its time to first token, and the sum of its inter-token
  latencies over its tokens after the first); rates are searched over the grid ``--rates`` from ``--start-rate``,
  up while met and down while missed, until a met rate and the next grid rate above it, missed, are both measured
  (``loopkv.serving.goodput.search``). Goodput is the highest rate met below the lowest missed
  (``goodput.capacity``). Before its rates, each arm serves two requests of the longest prompt, untimed (Triton's
  compilation and vLLM's first steps), and each rate records the server's preemptions (``/metrics``).

``--time-budget-s`` bounds the call: each arm gets an equal share of what is left when it starts, and a rate that
would not finish in it is not started; ``--continue`` lets a later call go on with an arm's search. The JSON
(``--out``) keeps arms measured by earlier calls with the same ``--out`` and is rewritten after every rate; a
server's log and each rate's ``vllm bench serve`` JSON are written beside it (``--keep``). Prints a table last.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import pathlib
import re
import shlex
import signal
import statistics
import subprocess
import sys
import time
import urllib.request

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_vllm import PLAN_BLOCK_SIZE, bf16_bytes_per_token, ouro_config_dict, write_paper_plans  # noqa: E402
from run_info import ROOT, run_info, write_json  # noqa: E402

from loopkv.serving.goodput import (  # noqa: E402
    ATTAINMENT,
    capacity,
    search,
    vllm_bench_attainment,
    vllm_bench_requests,
)

ARMS = ("bf16", "kivi4", "loopkv-r", "loopkv-m")
BLOCK = PLAN_BLOCK_SIZE  # vLLM's block size in every arm: one loopkv page per block
RATES = (0.1, 0.15, 0.2, 0.3, 0.45, 0.675, 1.0, 1.5, 2.25, 3.375)  # requests/s, a 1.5x grid
TAU0_REQUESTS = 3  # requests alone (one at a time) for each tau0; the median of their times per output token
TAU0_TOKENS = 65  # each generates this many, so 64 decode steps
WARMUP_REQUESTS = 2
SERVER_START_S = 420  # at most, for a server to answer /health (graph capture of every batch size included)
PORT = 8731
BF16_MAX_SEQS = 32  # more than vLLM BF16's blocks hold at the trace's contexts (about 13 on an H200)


def log(msg: str) -> None:
    print(f"[bench_vllm_serving {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ----------------------------------------------------------------------------- the model folder


def write_tokenizer(folder: pathlib.Path, vocab: int) -> None:
    """A tokenizer of ``vocab`` words of equal width, written without separators: token ``i`` is ``i`` in base 36,
    zero-padded to the width of ``vocab - 1`` (4 characters for Ouro's 49,152), and text is split every that many
    characters. vLLM's server refuses a prompt longer than its token budget times the longest word
    (vllm/renderers/params.py, ``_text_len_check``): with words of equal width and no spaces every prompt that fits
    in tokens fits in characters."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    width = len(base36(vocab - 1))
    words = Tokenizer(models.WordLevel({base36(i).rjust(width, "0"): i for i in range(vocab)}, unk_token="0" * width))
    words.pre_tokenizer = pre_tokenizers.Split(Regex(f".{{{width}}}"), behavior="isolated")
    words.decoder = decoders.Fuse()
    PreTrainedTokenizerFast(tokenizer_object=words, model_max_length=1 << 30).save_pretrained(folder)


def base36(n: int) -> str:
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"
    out = digits[n % 36]
    while n >= 36:
        n //= 36
        out = digits[n % 36] + out
    return out


def write_model_dir(folder: str | os.PathLike) -> pathlib.Path:
    """Ouro-1.4B's config.json and the word-level tokenizer of its vocabulary in ``folder`` (no weights)."""
    folder = pathlib.Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = ouro_config_dict()
    (folder / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    write_tokenizer(folder, config["vocab_size"])
    return folder


# ----------------------------------------------------------------------------- the trace and the SLO


def trace_args(max_len: int, outputs: tuple[int, int]) -> dict:
    """``vllm bench serve``'s random-dataset arguments for prompts uniform in [max_len / 2, max_len - outputs[1]]
    and outputs uniform in ``outputs``: a mean and a range ratio each (vLLM draws integers in [floor(mean (1 - r)),
    ceil(mean (1 + r))]; half a token short of each bound, so float rounding cannot step past it)."""
    lo_out, hi_out = outputs
    lo_in, hi_in = max_len // 2, max_len - hi_out
    if not 1 <= lo_out <= hi_out or lo_in > hi_in:
        raise ValueError(f"--outputs {lo_out},{hi_out} leaves no prompt length in [{lo_in}, {hi_in}] "
                         f"within --max-len {max_len}")

    def mean_ratio(lo: int, hi: int) -> tuple[int, float]:
        mean = (lo + hi) // 2
        return mean, max(0.0, (min(mean - lo, hi - mean) - 0.5) / mean) if hi > lo else 0.0

    (in_len, in_r), (out_len, out_r) = mean_ratio(lo_in, hi_in), mean_ratio(lo_out, hi_out)
    return {"input_len": in_len, "output_len": out_len, "range_ratio": {"input": in_r, "output": out_r},
            "prompts": [lo_in, hi_in], "outputs": [lo_out, hi_out]}


# ----------------------------------------------------------------------------- the server


def vllm_cli(*args: str) -> list[str]:
    """vLLM's command line after registering loopkv's Ouro config with transformers (``model_type="ouro"``)."""
    boot = ("import sys, loopkv.models; loopkv.models.register_ouro(); "
            "from vllm.entrypoints.cli.main import main; sys.argv = ['vllm', *sys.argv[1:]]; main()")
    return [sys.executable, "-c", boot, *args]


def arm_env(arm: str, plan_path: str | None) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1", "VLLM_USE_FLASHINFER_SAMPLER": "0"}
    env.pop("LOOPKV_PLAN", None)
    if plan_path is None:
        env["VLLM_PLUGINS"] = ""  # no general plugin, loopkv's included: vLLM's own Ouro
    else:
        env.pop("VLLM_PLUGINS", None)
        env["LOOPKV_PLAN"] = plan_path
    return env


def serve_args(model: pathlib.Path, *, max_len: int, max_seqs: int, utilization: float, port: int) -> list[str]:
    """``vllm serve``'s arguments, the same in every arm but ``--max-num-seqs`` (module docstring)."""
    sizes = sorted({1, 2, 4, 8, *range(16, max_seqs + 1, 8), max_seqs} & set(range(1, max_seqs + 1)))
    compilation = {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY", "cudagraph_capture_sizes": sizes}
    return ["serve", str(model), "--load-format", "dummy", "--dtype", "bfloat16", "--kv-cache-dtype", "auto",
            "--max-model-len", str(max_len), "--block-size", str(BLOCK), "--no-enable-prefix-caching",
            "--no-enable-chunked-prefill", "--max-num-batched-tokens", str(max_len), "--max-num-seqs", str(max_seqs),
            "--gpu-memory-utilization", str(utilization), "--compilation-config", json.dumps(compilation),
            "--seed", "0", "--host", "127.0.0.1", "--port", str(port)]


class Server:
    """``with Server(cmd, env, log_path) as s:`` one ``vllm serve`` process, ready when entered (``/health`` answers),
    stopped with its children when left."""

    def __init__(self, cmd: list[str], env: dict, log_path: pathlib.Path, port: int, timeout_s: float):
        self.cmd, self.env, self.log_path, self.port, self.timeout_s = cmd, env, log_path, port, timeout_s

    def __enter__(self) -> Server:
        self.log_file = self.log_path.open("w")
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(self.cmd, env=self.env, cwd=ROOT, stdout=self.log_file, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        while True:
            if self.proc.poll() is not None:
                self.__exit__(None, None, None)
                raise RuntimeError(f"vllm serve exited with {self.proc.returncode} before it was ready; its log "
                                   f"ends:\n{self.tail()}")
            with contextlib.suppress(OSError):
                if urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2).status == 200:
                    break
            if time.perf_counter() - t0 > self.timeout_s:
                self.__exit__(None, None, None)
                raise RuntimeError(f"vllm serve was not ready within {self.timeout_s:.0f} s; its log ends:\n"
                                   f"{self.tail()}")
            time.sleep(2)
        self.start_s = time.perf_counter() - t0
        return self

    def __exit__(self, *exc) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log_file.close()
        wait_gpu_free()

    def tail(self, lines: int = 25) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def log_text(self) -> str:
        if not self.log_file.closed:
            self.log_file.flush()
        return self.log_path.read_text(errors="replace")

    def kv_blocks(self) -> int:
        """The KV blocks vLLM sized its pool at, from its log (``GPU KV cache size: N tokens``)."""
        found = re.findall(r"GPU KV cache size: ([\d,]+) tokens", self.log_text())
        if not found:
            raise RuntimeError(f"no 'GPU KV cache size' line in {self.log_path}")
        return int(found[-1].replace(",", "")) // BLOCK

    def preemptions(self) -> float:
        """vLLM's count of preemptions so far (``vllm:num_preemptions_total`` of ``/metrics``)."""
        text = urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=10).read().decode()
        return sum(float(m) for m in re.findall(r"^vllm:num_preemptions_total(?:\{[^}]*\})? ([0-9.e+]+)$", text,
                                                 re.MULTILINE))


def bench(model: pathlib.Path, port: int, out: pathlib.Path, *, input_len: int, output_len: int, range_ratio,
          num_prompts: int, rate: float, seed: int, goodput: dict | None = None, max_concurrency: int | None = None,
          timeout_s: float) -> dict:
    """One ``vllm bench serve`` run against the server; its JSON (per-request records included)."""
    args = ["bench", "serve", "--backend", "vllm", "--host", "127.0.0.1", "--port", str(port), "--model", str(model),
            "--dataset-name", "random", "--random-input-len", str(input_len), "--random-output-len", str(output_len),
            "--random-range-ratio", json.dumps(range_ratio) if isinstance(range_ratio, dict) else str(range_ratio),
            "--num-prompts", str(num_prompts), "--request-rate", "inf" if math.isinf(rate) else repr(rate),
            "--seed", str(seed), "--ignore-eos", "--disable-tqdm", "--save-result", "--save-detailed",
            "--result-dir", str(out.parent), "--result-filename", out.name,
            "--percentile-metrics", "ttft,tpot,itl,e2el"]
    if goodput:
        args += ["--goodput", *(f"{k}:{v:g}" for k, v in goodput.items())]
    if max_concurrency:
        args += ["--max-concurrency", str(max_concurrency)]
    proc = subprocess.run(vllm_cli(*args), cwd=ROOT, capture_output=True, text=True, timeout=timeout_s,
                          env=arm_env("bf16", None))
    if proc.returncode != 0 or not out.exists():
        raise RuntimeError(f"vllm bench serve failed ({proc.returncode}): {shlex.join(args)}\n"
                           f"{(proc.stdout + proc.stderr)[-3000:]}")
    return json.loads(out.read_text())


def tau0(server: Server, model: pathlib.Path, out: pathlib.Path, context: int, seed: int) -> dict:
    """Time per output token of one request alone at ``context`` tokens of prompt: the median over
    ``TAU0_REQUESTS`` requests sent one at a time, each ``TAU0_TOKENS`` tokens."""
    result = bench(model, server.port, out, input_len=context, output_len=TAU0_TOKENS, range_ratio=0.0,
                   num_prompts=TAU0_REQUESTS, rate=math.inf, seed=seed, max_concurrency=1, timeout_s=300)
    tpots = [tpot for ok, _, tpot in vllm_bench_requests(result) if ok]
    if len(tpots) != TAU0_REQUESTS:
        raise RuntimeError(f"tau0 at {context}: {len(tpots)} of {TAU0_REQUESTS} requests succeeded: "
                           f"{result['errors']}")
    return {"context": context, "tpot_s": statistics.median(tpots), "tpots_s": tpots}


# ----------------------------------------------------------------------------- arms


def plan_for(arm: str, folder: pathlib.Path) -> str | None:
    """The plan file of ``arm`` (written into ``folder``), or None for ``bf16``."""
    if arm == "bf16":
        return None
    paths = {pathlib.Path(p).stem: p for p in write_paper_plans(str(folder))}
    return paths[arm]


def max_seqs_for(plan_path: str, *, kv_bytes: int, mean_context: int) -> int:
    """The requests of ``mean_context`` tokens that ``kv_bytes`` hold at the plan's bytes per block plus its exact
    sink and window per request (module docstring)."""
    from bench_decode import ouro_1p4b_config

    from loopkv.planning.plan import Plan
    from loopkv.vllm.layout import block_bytes, exact_bytes_per_request, kv_layout

    config = ouro_1p4b_config()
    plan = Plan.from_json(plan_path)
    blocks = -(-mean_context // BLOCK) + 1  # a plan's requests also hold block 0, the sink's (docs/vllm.md)
    per_request = block_bytes(kv_layout(plan, config)) * blocks + exact_bytes_per_request(plan, config)
    return max(1, kv_bytes // per_request)


def gpu_name() -> str:
    out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True)
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else "unknown"


def wait_gpu_free(limit_mib: int = 2048, timeout_s: float = 90) -> None:
    """Wait until the GPU's used memory is under ``limit_mib`` (a stopped server's processes have exited)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True)
        if out.returncode != 0 or int(out.stdout.split()[0]) < limit_mib:
            return
        time.sleep(2)
    raise RuntimeError(f"the GPU still holds over {limit_mib} MiB {timeout_s:.0f} s after the server stopped")


def run_arm(args, arm: str, model: pathlib.Path, work: pathlib.Path, result: dict, deadline: float) -> dict:
    """One arm: its server, (``bf16``) tau0, the warm-up, then the search over rates."""
    trace = result["trace"]
    mean_context = trace["input_len"] + trace["output_len"] // 2
    plan_path = plan_for(arm, work / "plans")
    if arm != "bf16" and "bf16" not in result["arms"]:
        raise RuntimeError(f"arm {arm} sizes --max-num-seqs from the bf16 arm's KV memory: run --arms bf16 first "
                           f"(same --out, {args.out})")
    # bf16's blocks bound its batch (it keeps nothing per request outside them); a plan's exact sink and window are
    # allocated for --max-num-seqs requests up front, out of the same memory
    max_seqs = BF16_MAX_SEQS if plan_path is None else max_seqs_for(
        plan_path, kv_bytes=result["arms"]["bf16"]["kv_bytes"], mean_context=mean_context)
    row = {"arm": arm, "plan": None if plan_path is None else json.loads(pathlib.Path(plan_path).read_text()),
           "max_num_seqs": max_seqs, "rates": [], "calls": 1}
    earlier = result["arms"].get(arm)
    if args.continue_search and earlier:  # the same arm, measured by an earlier call: its search goes on
        if earlier["max_num_seqs"] != max_seqs or earlier["plan"] != row["plan"]:
            raise RuntimeError(f"--continue: arm {arm} was measured with other settings in {args.out}")
        row["rates"] = [r for r in earlier["rates"] if r["complete"]]
        row["calls"] = earlier.get("calls", 1) + 1
    env = arm_env(arm, plan_path)
    cmd = vllm_cli(*serve_args(model, max_len=args.max_len, max_seqs=max_seqs,
                               utilization=args.gpu_memory_utilization, port=args.port))
    row["serve_command"] = shlex.join(cmd[3:])
    log(f"[{arm}] vllm serve (max_num_seqs {max_seqs}) ...")
    with Server(cmd, env, work / f"{arm}.serve.log", args.port, SERVER_START_S) as server:
        row["start_s"] = round(server.start_s, 1)
        row["kv_blocks"] = server.kv_blocks()
        if plan_path is not None and row["kv_blocks"] <= result["arms"]["bf16"]["kv_blocks"]:
            raise RuntimeError(f"arm {arm}: {row['kv_blocks']} KV blocks, no more than BF16's: vLLM did not size "
                               f"its pool by the plan (did loopkv's plugin load? see {server.log_path})")
        log(f"[{arm}] ready in {server.start_s:.0f} s: {row['kv_blocks']} KV blocks")
        if arm == "bf16":
            row["kv_bytes"] = row["kv_blocks"] * BLOCK * bf16_bytes_per_token()
            result["tau0"] = tau0(server, model, work / "tau0.json", args.max_len // 4, args.seed)
            result["tau0_mean_context"] = tau0(server, model, work / "tau0_mean.json", mean_context, args.seed)
            result["slo"] = {"ttft_s": args.ttft_s, "tpot_s": args.tpot_x * result["tau0"]["tpot_s"],
                             "rule": f"ttft <= {args.ttft_s:g} s and tpot <= {args.tpot_x:g} x tau0 (vLLM BF16, one "
                                     f"request at {args.max_len // 4} tokens)"}
            log(f"[{arm}] tau0 {result['tau0']['tpot_s'] * 1e3:.2f} ms at {args.max_len // 4} tokens, "
                f"{result['tau0_mean_context']['tpot_s'] * 1e3:.2f} ms at {mean_context}: SLO tpot "
                f"{result['slo']['tpot_s'] * 1e3:.2f} ms")
        slo = result["slo"]
        bench(model, server.port, work / f"{arm}.warmup.json", input_len=trace["prompts"][1], output_len=8,
              range_ratio=0.0, num_prompts=WARMUP_REQUESTS, rate=math.inf, seed=args.seed + 1, timeout_s=300)
        arm_deadline = time.monotonic() + (deadline - time.monotonic()) / args.arms_left

        def run_rate(rate: float) -> dict:
            expect_s = args.num_prompts / rate + 60  # arrivals, then the last requests' prompts and outputs
            if time.monotonic() + expect_s > arm_deadline:
                log(f"[{arm}] rate {rate:g}: not started, {arm_deadline - time.monotonic():.0f} s left")
                return {"rate": rate, "complete": False, "attainment": 0.0}
            before = server.preemptions()
            t0 = time.perf_counter()
            got = bench(model, server.port, work / f"{arm}.rate{rate:g}.json", input_len=trace["input_len"],
                        output_len=trace["output_len"], range_ratio=trace["range_ratio"],
                        num_prompts=args.num_prompts, rate=rate, seed=args.seed,
                        goodput={"ttft": slo["ttft_s"] * 1e3, "tpot": slo["tpot_s"] * 1e3},
                        timeout_s=max(60.0, arm_deadline - time.monotonic() + 60))
            scored = vllm_bench_attainment(got, ttft_slo_s=slo["ttft_s"], tpot_slo_s=slo["tpot_s"])
            rate_row = {"rate": rate, "complete": True, **scored, "wall_s": round(time.perf_counter() - t0, 1),
                        "preemptions": server.preemptions() - before,
                        "vllm_request_goodput": got.get("request_goodput"),
                        "vllm_attainment": (got["request_goodput"] * got["duration"] / args.num_prompts
                                            if got.get("request_goodput") is not None else None),
                        **{k: got.get(k) for k in ("duration", "completed", "failed", "request_throughput",
                                                   "output_throughput", "mean_ttft_ms", "median_ttft_ms",
                                                   "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms",
                                                   "max_concurrent_requests")},
                        "input_lens": got.get("input_lens"), "output_lens": got.get("output_lens")}
            row["rates"].append(rate_row)
            write_json(args.out, result)
            log(f"[{arm}] rate {rate:g}/s: {scored['met']}/{scored['requests']} met the SLO "
                f"(vLLM's goodput {rate_row['vllm_request_goodput']}), {rate_row['preemptions']:g} preemptions, "
                f"{rate_row['wall_s']} s")
            return rate_row

        result["arms"][arm] = row
        rows = grid_search(args.rates, args.start_rate, run_rate, done=list(row["rates"]))
    row["goodput"], row["goodput_status"] = capacity(rows)
    return row


def grid_search(grid: list[float], start: float, run, done: list[dict] = ()) -> list[dict]:
    """``loopkv.serving.goodput.search`` on the grid: its rates snapped to the nearest grid rate, and it stops
    once a met grid rate and the grid rate above it, missed, are measured (or the grid ends either way). ``done``:
    complete rows measured before, which are not run again."""
    grid = sorted(grid)
    seen: dict[float, dict] = {r["rate"]: r for r in done if r["complete"]}

    def snap(rate: float) -> float:
        return min(grid, key=lambda g: abs(math.log(g / rate)))

    def run_snapped(rate: float) -> dict:
        g = snap(rate)
        if g not in seen:
            seen[g] = run(g)
        return seen[g]

    ratio = grid[1] / grid[0] if len(grid) > 1 else 2.0
    search(snap(start), run_snapped, max_trials=len(grid), bracket=ratio * 1.01, factor=ratio)
    return list(seen.values())


# ----------------------------------------------------------------------------- main


def print_table(result: dict) -> None:
    slo = result.get("slo", {})
    print(f"\nvLLM goodput (SLO: {slo.get('rule')}; tpot bound {slo.get('tpot_s', 0) * 1e3:.1f} ms)")
    print(f"{'arm':10s} {'blocks':>7s} {'seqs':>5s} {'goodput':>9s} {'x bf16':>7s}  rates (attainment, preemptions)")
    base = result["arms"].get("bf16", {}).get("goodput")
    for arm, row in result["arms"].items():
        ladder = ", ".join(f"{r['rate']:g}: {r['attainment']:.2f}/{r.get('preemptions', 0):g}"
                           for r in sorted(row["rates"], key=lambda r: r["rate"]) if r["complete"])
        x = f"{row['goodput'] / base:.2f}" if base and row.get("goodput") is not None else "-"
        print(f"{arm:10s} {row.get('kv_blocks', '-'):>7} {row.get('max_num_seqs', '-'):>5} "
              f"{row.get('goodput', float('nan')):>9.3g} {x:>7s}  {ladder}  [{row.get('goodput_status')}]")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arms", default="bf16", help=f"comma-separated, of {', '.join(ARMS)} (bf16 first, or in an "
                   "earlier call with the same --out)")
    p.add_argument("--rates", default=",".join(f"{r:g}" for r in RATES), help="the grid of rates (requests/s)")
    p.add_argument("--start-rate", type=float, default=0.45)
    p.add_argument("--num-prompts", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-len", type=int, default=16384)
    p.add_argument("--outputs", default="128,512")
    p.add_argument("--ttft-s", type=float, default=10.0)
    p.add_argument("--tpot-x", type=float, default=3.0)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--port", type=int, default=PORT)
    p.add_argument("--time-budget-s", type=float, default=540.0)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "vllm_serving.json"))
    p.add_argument("--continue", dest="continue_search", action="store_true",
                   help="an arm already in --out keeps its complete rates and its search goes on from them "
                   "(a later call of the same session; else the arm is measured anew)")
    p.add_argument("--keep", default=None, help="folder for the servers' logs and vllm bench serve's JSON "
                   "(default: beside --out, in <out stem>_runs/)")
    p.add_argument("--write-model-dir", metavar="DIR", help="write the model folder to DIR and exit")
    return p


def main(argv=None) -> dict | None:
    args = build_parser().parse_args(argv)
    if args.write_model_dir:
        folder = write_model_dir(args.write_model_dir)
        log(f"wrote {folder}")
        return None
    deadline = time.monotonic() + args.time_budget_s
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = sorted(set(arms) - set(ARMS))
    if unknown or not arms:
        raise SystemExit(f"--arms {args.arms}: unknown {unknown}; choose from {', '.join(ARMS)}")
    args.rates = sorted(float(r) for r in args.rates.split(","))
    lo_out, hi_out = (int(x) for x in args.outputs.split(","))
    out = pathlib.Path(args.out)
    work = pathlib.Path(args.keep) if args.keep else out.with_name(out.stem + "_runs")
    work.mkdir(parents=True, exist_ok=True)
    result = json.loads(out.read_text()) if out.exists() else {}
    trace = trace_args(args.max_len, (lo_out, hi_out))
    if result.get("trace", trace) != trace or result.get("num_prompts", args.num_prompts) != args.num_prompts:
        raise SystemExit(f"{out} holds arms of another trace; give another --out")
    # no CUDA in this process: every GPU byte is the servers'
    result.update({**run_info(__file__, argv, "cpu"), "device": gpu_name()})
    result.update(trace=trace, num_prompts=args.num_prompts, seed=args.seed, max_len=args.max_len,
                  gpu_memory_utilization=args.gpu_memory_utilization, attainment=ATTAINMENT)
    result.setdefault("arms", {})
    from importlib.metadata import version

    result["versions"]["vllm"] = version("vllm")
    model = write_model_dir(work / "model")
    wait_gpu_free(timeout_s=30)  # a server left by an earlier call would take memory from this one
    for i, arm in enumerate(arms):
        args.arms_left = len(arms) - i
        try:
            run_arm(args, arm, model, work, result, deadline)
        except Exception as exc:  # record why, keep the arms that ran
            log(f"[{arm}] FAILED: {exc}")
            result.setdefault("errors", {})[arm] = repr(exc)[-4000:]
        write_json(out, result)
    base = result["arms"].get("bf16", {}).get("goodput")
    result["goodput_over_bf16"] = {a: (r["goodput"] / base if base and r.get("goodput") is not None else None)
                                   for a, r in result["arms"].items()}
    write_json(out, result)
    print_table(result)
    return result


if __name__ == "__main__":
    main()
