"""Goodput under a latency SLO: requests arriving over time, served by transformers' continuous-batching engine with
LoopKV storage (loopkv/serving), one arm per plan under the same KV budget, in one process (paper §5.1, §5.4).

    python benchmarks/bench_serving.py [--arms bf16,kivi4,loopkv-r,loopkv-m] [--budget-gib 96] [--max-len 16384]
        [--requests 16] [--min-requests 6] [--trace-s 10] [--outputs 128,512] [--prompts LO,HI]
        [--start-rate auto|R] [--max-trials 4] [--bracket 1.5] [--peak-prompt 4096] [--peak-steps 8] [--ttft-s 10]
        [--tpot-x 3] [--chunked-prefill TOKENS] [--time-budget-s 540] [--seed 0] [--smoke]
        [--out benchmarks/results/serving.json]
    python benchmarks/bench_serving.py --plot benchmarks/results/serving.json   # the figure from a JSON

Model: Ouro-1.4B's shapes with random weights, bf16 (``--smoke``: a tiny one, on the CPU if there is no GPU). Trace:
seeded Poisson arrivals, the same requests at every rate (arrival times scale with 1 / rate); prompts uniform in
[max_len / 2, max_len - the longest output] (``--prompts``), outputs uniform in ``--outputs`` tokens, so contexts lie
between half and all of max_len, where KV memory bounds how many requests run at once. The paper's SLO workload
reaches such contexts by decoding (AIME prompts, 11K output tokens on average) and takes hours per rate; this one
reaches them by prompts, so prefill takes a larger share of the GPU than in the paper (shorter ``--prompts`` and
longer ``--outputs`` move it toward the paper's, at more time per rate). Arms: ``bf16`` stores every cell exact (an
all-bf16 plan: transformers' own paged cache has one layer per physical layer and cannot hold a looped model's
cells), ``kivi4`` INT4 in every cell, ``loopkv-r`` and ``loopkv-m`` the paper's compositions (as in
bench_decode.py). Each arm gets the slots and pages the budget buys: ``slots = (budget - the prompt scratch, with
chunked prefill) // (a slot's exact sink and window + bytes per token x the trace's mean context)``, the rest pages.
Every arm's engine takes ``max_len + slots`` tokens per step, so every prompt is one exact pass, or with
``--chunked-prefill TOKENS`` ``slots + TOKENS``, so a prompt longer than what the step leaves is prefilled in chunks
through the engine's exact scratch (its tokens are the one pass's; loopkv/serving/prompt_chunks.py). Decode-only
steps replay loopkv's CUDA graphs, every bucket's captured when the engine starts (``manager.warmup()``, before any
request: no capture happens while a rate is measured); each arm records that warm-up's seconds (``warm_up_s``) and
the graphs' pool (``graph_pool_mib``).

Steps are timed from the engine cache's own step log (``EngineCache.steps``: when each forward began, its decoding
rows and its prompt tokens; a step lasts until the next begins), so decode is timed apart from prompt steps:

* **the SLO's step**: BF16 with one slot and a pool for one request, one request of max_len / 4 tokens: the median
  decode-only step. SLO, per request: time to first token <= 10 s and mean time per output token <= 3x that step
  (``--ttft-s``, ``--tpot-x``; the smoke run's are loose: its numbers mean nothing, and a busy CPU would miss them);
* **peak decode** per arm: as many requests as the arm's slots and pool hold together (``goodput.peak_batch``: the
  slots are sized for the trace's mean context, so at a long ``--peak-prompt`` the pool holds fewer, and the engine
  admits a prompt beside decoding requests only while its ``safety_margin`` of the pool is free), ``--peak-prompt``
  tokens each, sent at once; once ``--peak-steps`` decode-only steps with all of them decoding have run, they are
  cancelled: tokens/s = batch / the median of those steps (and prompt tokens/s until the first decode-only step);
* **goodput** per arm: a search on the rate (``loopkv.serving.goodput.search``): from ``--start-rate``
  (``auto``: 70% of the lower of the prompts' and the slots' capacity, from a mean prompt's time to first token
  alone and the peak's step, ``goodput.first_rate``) it doubles while a rate meets 95% and halves while it does
  not, then bisects (geometric) between the highest rate met and the lowest missed until they are within
  ``--bracket`` of each other,
  ``--max-trials`` are run or the arm's time is spent. A rate's trace is its arrivals within ``--trace-s`` seconds
  (at least ``--min-requests``, at most ``--requests``); it ends when every request is finished or past its SLO
  deadline (arrival + TTFT bound + (tokens - 1) x TPOT bound, or the TTFT bound if the step ending its prompt has
  not run by then: it counts as a miss and is cancelled), or as soon as misses make 95% impossible
  (``stopped_early``; its attainment is then an upper bound). Attainment = the share of a rate's requests meeting
  the SLO; goodput = the highest tested rate with attainment >= 95% below the lowest tested rate under it
  (``goodput_status``: ``measured`` when such a rate under 95% exists, ``at least`` when none does, ``below
  lowest``).

``--time-budget-s`` bounds the whole run, model building included: every arm gets an equal share of what is left when
it starts, and its peak and search stop at the end of that share (a rate cut short is marked incomplete and does not
count). The JSON is rewritten after every rate, so a run cut short keeps what finished; progress lines carry timings;
the figure (attainment against rate per arm) goes next to the JSON (``.png``).

The engine's steps include its own and loopkv's host work (scheduling, the step's preparation, sampling); compare
the peak with bench_decode.py's static-batch graphs to see that overhead.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import pathlib
import sys
import threading
import time
import zlib

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_decode import ouro_1p4b_config, paper_plans, smoke_config  # noqa: E402
from run_info import RESULTS, run_info, write_json  # noqa: E402

import loopkv  # noqa: E402
from loopkv.models.ouro import OuroForCausalLM  # noqa: E402
from loopkv.serving.goodput import ATTAINMENT, capacity, decode_steps, first_rate, meets_slo, peak_batch, search, trace  # noqa: E402
from loopkv.serving.transformers_cb import engine_cache, engine_config  # noqa: E402

TTFT_SLO_S = 10.0  # the paper's SLO (its defaults here: --ttft-s, --tpot-x)
TPOT_SLO_X = 3.0
STYLE = {"bf16": ("k", "o"), "kivi4": ("tab:blue", "s"), "loopkv-r": ("tab:orange", "^"),
         "loopkv-m": ("tab:red", "v")}
T0 = time.perf_counter()


def log(message: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f} s] {message}", flush=True)


def plans(cfg) -> dict[str, loopkv.Plan]:
    loops, layers = cfg.total_ut_steps, cfg.num_hidden_layers
    return {"bf16": loopkv.Plan.uniform(loops=loops, layers=layers, option="bf16"), **paper_plans(loops, layers)}


def budget_split(plan, cfg, budget: int, mean_context: float, dtype_bytes: int, *,
                 scratch_tokens: int = 0) -> tuple[int, int]:
    """(slots, pool pages) a KV budget buys for ``plan`` after a prompt scratch of ``scratch_tokens`` tokens."""
    from loopkv.cache.paging import pool_pages_for
    from loopkv.planning.bytes import exact_bytes_per_request
    from loopkv.serving.prompt_chunks import scratch_bytes

    reserved = scratch_bytes(cfg, tokens=scratch_tokens, dtype_bytes=dtype_bytes)
    exact = exact_bytes_per_request(cfg, dtype_bytes=dtype_bytes)
    per_token = plan.bytes_per_token(cfg, dtype_bytes=dtype_bytes).stored_kib * 1024
    slots = max(1, int((budget - reserved) // (exact + per_token * mean_context)))
    return slots, pool_pages_for(plan, cfg, budget_bytes=budget, max_batch_size=slots, dtype_bytes=dtype_bytes,
                                 reserved_bytes=reserved)


class Engine:
    """One arm's engine, started once: requests go in with :meth:`submit`, finished ones come back in
    :meth:`collect` with their latencies; :attr:`cache` is loopkv's engine cache (its step log)."""

    def __init__(self, model, plan, *, slots: int, pages: int, max_len: int, chunk: int = 0):
        """``chunk``: with chunked prefill, the prompt tokens a step holds beside every slot decoding (0: whole
        prompts)."""
        from transformers import GenerationConfig

        self.model, self.vocab = model, model.config.vocab_size
        gen = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=0, max_new_tokens=max_len)
        cb = engine_config(pool_pages=pages, max_len=max_len, max_slots=slots, chunked_prefill=chunk > 0,
                           max_batch_tokens=slots + chunk if chunk else None)
        self._context = engine_cache(plan, max_slots=slots, max_len=max_len, chunked_prefill=chunk > 0)
        self._built = self._context.__enter__()
        try:
            self.manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)
            self.manager.warmup()  # builds the engine cache, which captures every decode bucket's graph now
            self.manager.start()
        except BaseException:
            self._context.__exit__(None, None, None)
            raise
        self.submitted: dict[str, float] = {}

    @property
    def safety_margin(self) -> float:
        """The share of the pool the engine's scheduler keeps free before it admits a prompt beside decoding ones."""
        return self.manager.batch_processor.scheduler.safety_margin

    def warm_up(self) -> dict:
        """The engine cache's warm-up: its seconds and the memory its graphs' pool holds (0 on the CPU)."""
        return {"warm_up_s": self.cache.warm_up_s, "graph_pool_mib": self.cache.graphs.pool_bytes() / 2**20}

    @property
    def cache(self):
        if not self._built:
            raise RuntimeError("the engine has not built its cache yet (it does at its first step)")
        return self._built[-1]

    def submit(self, request_id: str, prompt: int, new: int) -> None:
        seed = zlib.crc32(request_id.encode())
        ids = torch.randint(3, self.vocab, (prompt,), generator=torch.Generator().manual_seed(seed))
        self.manager.add_request(ids.tolist(), request_id=request_id, max_new_tokens=new, record_timestamps=True)
        self.submitted[request_id] = time.perf_counter()

    def collect(self, timeout: float) -> dict | None:
        """The next finished request (its id, ttft_s, tpot_s, tokens, token timestamps, error), or None."""
        result = self.manager.get_result(timeout=timeout)
        if result is None:
            if not self.manager.is_running():
                raise RuntimeError("the engine stopped")
            return None
        if not result.is_finished():
            return None
        stamps = result.timestamps or []
        submitted = self.submitted.pop(result.request_id, None)
        if submitted is None:  # cancelled earlier, finished anyway
            return None
        return {"id": result.request_id, "ttft_s": stamps[0] - submitted if stamps else float("inf"),
                "tpot_s": (stamps[-1] - stamps[0]) / (len(stamps) - 1) if len(stamps) > 1 else 0.0,
                "tokens": len(result.generated_tokens), "stamps": stamps, "error": getattr(result, "error", None)}

    def started(self, request_id: str, prompt: int) -> bool:
        """Whether the engine has run the step that ends ``request_id``'s prompt (its first token), from the engine
        cache's record of its steps (``EngineCache.lives``)."""
        lives = self.cache.lives.get(request_id, []) if self._built else []
        return any(pos + n >= prompt for life in list(lives) for pos, n in list(life))

    def cancel(self, request_id: str) -> None:
        self.submitted.pop(request_id, None)
        self.manager.cancel_request(request_id)

    def idle(self, stop_at: float, most_s: float = 30.0) -> None:
        """Wait (by ``stop_at``, ``most_s`` at most) until no request holds a slot, draining finished results."""
        stop_at = min(stop_at, time.perf_counter() + most_s)
        while self._built and self.cache.requests_held and time.perf_counter() < stop_at:
            self.collect(timeout=0.05)

    def close(self) -> None:
        try:
            self.manager.stop(block=True)
            self.model.destroy_cached_continuous_batching_manager()
        finally:
            self._context.__exit__(None, None, None)
            self.manager = None
            self._built.clear()  # the cache's memory goes back before the next arm builds its own
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()

    def run_all(self, requests: dict[str, tuple[int, int]], stop_at: float) -> list[dict]:
        """Submit every request now and wait (by ``stop_at``) for all of them."""
        for rid, (prompt, new) in requests.items():
            self.submit(rid, prompt, new)
        done = []
        while len(done) < len(requests):
            if time.perf_counter() > stop_at:
                raise RuntimeError(f"the engine returned {len(done)} of {len(requests)} requests in its time")
            got = self.collect(timeout=0.2)
            if got is not None:
                done.append(got)
        return done


def median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def peak_decode(engine: Engine, batch: int, prompt: int, new: int, steps: int, stop_at: float) -> dict:
    """``batch`` requests at once (``prompt`` tokens, room for ``new``): once ``steps`` decode-only steps with all of
    them decoding have run, they are cancelled. Decode tokens/s = batch / the median such step; prompt tokens/s until
    the first decode-only step."""
    since = time.perf_counter()
    ids = [f"peak{batch}x{i}" for i in range(batch)]
    for rid in ids:
        engine.submit(rid, prompt, new)
    try:
        while time.perf_counter() < stop_at:
            engine.collect(timeout=0.05)
            durations, _ = decode_steps(engine.cache.steps, since, batch) if engine._built else ([], None)
            if len(durations) >= steps:
                break
    finally:
        for rid in ids:
            engine.cancel(rid)
        engine.idle(stop_at)
    durations, prompt_rate = decode_steps(engine.cache.steps, since, batch)
    step = median(durations) if durations else None
    return {"batch": batch, "prompt": prompt, "decode_steps": len(durations), "step_s": step,
            "tokens_per_s": batch / step if step else None, "prompt_tokens_per_s": prompt_rate}


def run_rate(engine: Engine, name: str, rate: float, reqs, *, ttft_slo: float, tpot_slo: float, trace_s: float,
             min_requests: int, stop_at: float) -> dict:
    """One rate (module docstring); ``reqs`` at 1 request/s. Returns its row."""
    reqs = [(a / rate, p, n) for a, p, n in reqs]
    reqs = reqs[:max(min_requests, sum(a <= trace_s for a, _, _ in reqs))]
    ids = [f"{name}@{rate:.4g}#{i}" for i in range(len(reqs))]
    deadline = {}  # request id -> the time by which it must finish to meet the SLO
    first = {}  # request id -> (the time by which its first token must come, its prompt) until it has come
    results, misses, complete = {}, 0, True
    allowed_misses = int((1 - ATTAINMENT) * len(reqs) + 1e-9)
    start = time.perf_counter()
    pending = list(zip(ids, reqs, strict=True))
    while pending or deadline:
        now = time.perf_counter()
        while pending and start + pending[0][1][0] <= now:
            rid, (arrival, prompt, new) = pending.pop(0)
            engine.submit(rid, prompt, new)
            deadline[rid] = now + ttft_slo + (new - 1) * tpot_slo
            first[rid] = (now + ttft_slo, prompt)
        wait = start + pending[0][1][0] - now if pending else 0.2
        got = engine.collect(timeout=max(0.01, min(wait, 0.2)))
        if got is not None and got["id"] in deadline:
            del deadline[got["id"]]
            got["ok"] = not got["error"] and meets_slo(got["ttft_s"], got["tpot_s"], ttft_slo_s=ttft_slo,
                                                       tpot_slo_s=tpot_slo)
            results[got["id"]] = got
            misses += not got["ok"]
        now = time.perf_counter()
        for rid, (by, prompt) in list(first.items()):
            if rid not in deadline or engine.started(rid, prompt):
                del first[rid]
            elif by < now:  # no first token in time: a miss already
                deadline[rid] = now - 1
        for rid in [r for r, d in deadline.items() if d < now]:  # cannot meet the SLO any more
            engine.cancel(rid)
            del deadline[rid]
            results[rid] = {"ttft_s": float("inf"), "tpot_s": float("inf"), "tokens": 0, "ok": False,
                            "error": "unfinished at its SLO deadline"}
            misses += 1
        if misses > allowed_misses or now > stop_at:  # 95% is out of reach, or the arm's time is spent
            complete = misses > allowed_misses
            for rid in list(deadline):
                engine.cancel(rid)
            break
    wall = time.perf_counter() - start
    for rid, _ in pending:
        engine.submitted.pop(rid, None)
    engine.idle(stop_at)  # the next rate starts on an empty engine
    finished = [r for r in results.values() if r["tokens"]]
    return {"arm": name, "rate": rate, "requests": len(reqs), "judged": len(results), "complete": complete,
            "attainment": 1 - misses / len(reqs),  # an upper bound when stopped early
            "stopped_early": misses > allowed_misses and bool(pending or deadline),
            "tokens_per_s": sum(r["tokens"] for r in finished) / wall, "wall_s": wall,
            "mean_ttft_s": (sum(r["ttft_s"] for r in finished) / len(finished)) if finished else None,
            "mean_tpot_s": (sum(r["tpot_s"] for r in finished) / len(finished)) if finished else None,
            "ttft_misses": sum(r["ttft_s"] > ttft_slo for r in results.values()),
            "tpot_misses": sum(r["tpot_s"] > tpot_slo for r in results.values())}


def summarize(arms: dict, rows: list[dict]) -> dict:
    """Goodput per arm (``goodput.capacity``), its ratios to BF16 and KIVI-4, the peaks."""
    found = {name: capacity([r for r in rows if r["arm"] == name]) for name in arms}
    goodput = {name: g for name, (g, _) in found.items()}
    ratio = {base: {n: (g / goodput[base] if goodput.get(base) else None) for n, g in goodput.items()}
             for base in ("bf16", "kivi4") if base in goodput}
    return {"goodput_rps": goodput, "goodput_status": {name: status for name, (_, status) in found.items()},
            "goodput_vs_bf16": ratio.get("bf16", {}), "goodput_vs_kivi4": ratio.get("kivi4", {}),
            "peak_tokens_per_s": {n: a["peak"]["tokens_per_s"] for n, a in arms.items() if a.get("peak")}}


def plot(result: dict, path) -> None:
    """Attainment against rate per arm, the 95% line, the goodput ratios in the legend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for name in result["arms"]:
        rows = sorted((r for r in result["rows"] if r["arm"] == name and r["complete"]), key=lambda r: r["rate"])
        color, marker = STYLE.get(name, ("tab:gray", "x"))
        ratio = result["goodput_vs_bf16"].get(name)
        label = f"{name}: {result['goodput_rps'][name]:.3g} req/s" + (f" ({ratio:.2f}x BF16)" if ratio else "")
        ax.plot([r["rate"] for r in rows], [100 * r["attainment"] for r in rows], color=color, marker=marker,
                label=label)
    ax.axhline(100 * ATTAINMENT, color="tab:red", lw=0.8, ls="--")
    ax.set_ylim(0, 105)
    if any(r["complete"] for r in result["rows"]):  # a run without a complete rate has no rate to put on a log axis
        ax.set_xscale("log", base=2)
    ax.set_xlabel("arrival rate (requests/s)")
    ax.set_ylabel("requests meeting the SLO (%)")
    slo = result["slo"]
    ax.set_title(f"{result['model']}, max length {result['max_len']}, {result['budget_gib']} GiB KV\n"
                 f"SLO: TTFT <= {slo['ttft_s']:g} s, TPOT <= {1e3 * slo['tpot_s']:.1f} ms", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=150)
    plt.close(fig)


def run_arm(model, name: str, plan, split: tuple[int, int], reqs, args, result: dict, *, tpot_slo: float,
            stop_at: float) -> None:
    """One arm in one engine: warm-up, peak, rate search (module docstring); ``result`` is updated and written after
    every rate."""
    slots, pages = split
    arm = result["arms"][name] = {"slots": slots, "pool_pages": pages, "peak": None}
    log(f"{name}: {slots} slots, {pages} pool pages; {stop_at - time.perf_counter():.0f} s for this arm")
    engine = Engine(model, plan, slots=slots, pages=pages, max_len=args.max_len, chunk=args.chunked_prefill)
    arm |= engine.warm_up()
    log(f"{name}: warm-up {arm['warm_up_s']:.1f} s, graphs' pool {arm['graph_pool_mib']:.0f} MiB")

    def one(rate: float) -> dict:
        row = run_rate(engine, name, rate, reqs, ttft_slo=args.ttft_s, tpot_slo=tpot_slo, trace_s=args.trace_s,
                       min_requests=args.min_requests, stop_at=stop_at) | {"slots": slots, "pool_pages": pages}
        result["rows"].append(row)
        result.update(summarize(result["arms"], result["rows"]))
        write_json(args.out, result)
        log(f"{name} rate {rate:.3g}: {row['requests']} requests, attainment {row['attainment']:.2f} "
            f"({row['ttft_misses']} TTFT / {row['tpot_misses']} TPOT misses), {row['tokens_per_s']:.1f} tok/s, "
            f"{row['wall_s']:.0f} s{'' if row['complete'] else ', cut short: incomplete'}")
        return row

    try:
        engine.run_all({"warm": (64, 4)}, stop_at)
        batch = peak_batch(slots, pages, args.peak_prompt, args.peak_steps, engine.safety_margin)
        arm["peak"] = peak_decode(engine, batch, args.peak_prompt, args.max_len - args.peak_prompt,
                                  args.peak_steps, stop_at)
        log(f"{name}: peak decode {arm['peak']['tokens_per_s'] or 0:.1f} tok/s at batch {batch} "
            f"({arm['peak']['decode_steps']} steps), prompts {arm['peak']['prompt_tokens_per_s'] or 0:.0f} tok/s")
        mean_prompt, mean_new = (sum(r[i] for r in reqs) / len(reqs) for i in (1, 2))
        if args.start_rate == "auto":  # a mean prompt alone: its time to first token
            arm["probe_ttft_s"] = engine.run_all({"probe": (round(mean_prompt), 2)}, stop_at)[0]["ttft_s"]
            start = first_rate(arm["probe_ttft_s"], arm["peak"], mean_new, floor=1 / 64)
            log(f"{name}: a mean prompt ({mean_prompt:.0f} tokens) alone: first token in {arm['probe_ttft_s']:.2f} "
                f"s; the search starts at {start:.3g} req/s")
        else:
            start = float(args.start_rate)
        search(start, one, max_trials=args.max_trials, bracket=args.bracket)
    finally:
        engine.close()
        result.update(summarize(result["arms"], result["rows"]))
        write_json(args.out, result)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arms", default="bf16,kivi4,loopkv-r,loopkv-m")
    ap.add_argument("--budget-gib", type=float, default=96.0)
    ap.add_argument("--max-len", type=int, default=16384)
    ap.add_argument("--requests", type=int, default=16, help="requests per rate at most")
    ap.add_argument("--min-requests", type=int, default=6, help="requests per rate at least")
    ap.add_argument("--trace-s", type=float, default=10.0, help="arrivals per rate within this many seconds")
    ap.add_argument("--start-rate", default="auto", help="the search's first rate (req/s), or auto (first_rate)")
    ap.add_argument("--max-trials", type=int, default=4, help="rates tested per arm at most")
    ap.add_argument("--bracket", type=float, default=1.5,
                    help="stop once the highest rate met and the lowest missed are within this factor")
    ap.add_argument("--peak-prompt", type=int, default=4096, help="prompt tokens of the peak requests")
    ap.add_argument("--outputs", default="128,512", help="output tokens per request: uniform in [lo, hi]")
    ap.add_argument("--prompts", default=None,
                    help="prompt tokens per request: uniform in [lo, hi] (default: max_len/2 .. max_len - longest "
                         "output)")
    ap.add_argument("--peak-steps", type=int, default=8, help="decode-only steps the peak is the median of")
    ap.add_argument("--time-budget-s", type=float, default=540.0, help="the whole run, model building included")
    ap.add_argument("--ttft-s", type=float, default=TTFT_SLO_S, help="the SLO's time to first token")
    ap.add_argument("--tpot-x", type=float, default=TPOT_SLO_X,
                    help="the SLO's time per output token, in BF16 batch-1 steps")
    ap.add_argument("--chunked-prefill", type=int, default=0, metavar="TOKENS",
                    help="prefill in chunks: TOKENS prompt tokens per step beside every slot decoding (0: whole "
                         "prompts, the default); the scratch's bytes come out of the budget")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smoke", action="store_true", help="a tiny model and trace: checks the script, measures nothing")
    ap.add_argument("--out", default=str(RESULTS / "serving.json"))
    ap.add_argument("--plot", metavar="JSON", help="only draw the figure of this JSON (next to it, .png)")
    args = ap.parse_args(argv)
    if args.plot:
        path = pathlib.Path(args.plot)
        plot(json.loads(path.read_text()), path.with_suffix(".png"))
        return {}
    if args.smoke:  # sizes the smoke run overrides unless given
        given = set(argv if argv is not None else sys.argv[1:])
        for flag, value in (("--max-len", 640), ("--requests", 3), ("--min-requests", 3), ("--start-rate", "8"),
                            ("--outputs", "4,12"),
                            ("--max-trials", 1), ("--budget-gib", 0.02), ("--arms", "loopkv-m"),
                            ("--peak-prompt", 64), ("--peak-steps", 3), ("--trace-s", 5.0),
                            ("--ttft-s", 600.0), ("--tpot-x", 100.0)):  # a CPU, maybe busy: every request meets it
            if flag not in given:
                setattr(args, flag[2:].replace("-", "_"), value)
    if args.chunked_prefill < 0:
        raise SystemExit(f"--chunked-prefill {args.chunked_prefill}: pass the prompt tokens per step, or 0 for whole "
                         "prompts")
    stop_all = T0 + args.time_budget_s
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    dtype_bytes = torch.empty(0, dtype=dtype).element_size()
    cfg = smoke_config() if args.smoke else ouro_1p4b_config()
    names = args.arms.split(",")
    unknown = set(names) - set(plans(cfg))
    if unknown:
        raise SystemExit(f"unknown arms {sorted(unknown)}; choose from {sorted(plans(cfg))}")
    arm_plans = {name: plans(cfg)[name] for name in names}
    torch.manual_seed(0)
    with torch.device(device):  # initialized where it runs: minutes less on the host for 1.4B parameters
        model = OuroForCausalLM(cfg).to(dtype=dtype).eval()
    budget = int(args.budget_gib * 2**30)
    log(f"model built on {device}")

    result = run_info(__file__, argv, device) | {
        "model": "smoke" if args.smoke else "Ouro-1.4B shapes, random weights", "dtype": str(dtype),
        "budget_gib": args.budget_gib, "max_len": args.max_len, "requests": args.requests,
        "min_requests": args.min_requests, "trace_s": args.trace_s, "seed": args.seed,
        "chunked_prefill": args.chunked_prefill, "arms": {}, "rows": []}

    # the SLO's step: BF16 with one slot and a pool for one request, through the same engine
    one_stop = time.perf_counter() + min(60.0, (stop_all - time.perf_counter()) / (len(arm_plans) + 1))
    engine = Engine(model, plans(cfg)["bf16"], slots=1, pages=math.ceil(args.max_len / 32), max_len=args.max_len)
    result["slo_engine"] = engine.warm_up()
    try:
        engine.run_all({"warm": (64, 4)}, one_stop)
        one = peak_decode(engine, 1, args.max_len // 4, args.max_len - args.max_len // 4, args.peak_steps, one_stop)
    finally:
        engine.close()
    if one["step_s"] is None:
        raise SystemExit("the BF16 batch-1 step was not measured in its time: raise --time-budget-s")
    base = one["step_s"]
    tpot_slo = args.tpot_x * base
    result["slo"] = {"ttft_s": args.ttft_s, "tpot_s": tpot_slo, "tpot_x": args.tpot_x, "bf16_batch1_step_s": base,
                     "bf16_batch1_steps": one["decode_steps"], "attainment": ATTAINMENT}
    log(f"BF16 batch-1 step {1e3 * base:.1f} ms: TPOT bound {1e3 * tpot_slo:.1f} ms")
    write_json(args.out, result)

    outputs = tuple(int(x) for x in args.outputs.split(","))
    prompts = tuple(int(x) for x in args.prompts.split(",")) if args.prompts else None
    reqs = trace(args.requests, args.max_len, args.seed, outputs, prompts)
    mean_ctx = sum(p + n for _, p, n in reqs) / len(reqs)
    for k, (name, plan) in enumerate(arm_plans.items()):
        stop_at = time.perf_counter() + (stop_all - time.perf_counter()) / (len(arm_plans) - k)
        try:
            split = budget_split(plan, cfg, budget, mean_ctx, dtype_bytes,
                                 scratch_tokens=args.max_len if args.chunked_prefill else 0)
            run_arm(model, name, plan, split, reqs, args, result, tpot_slo=tpot_slo, stop_at=stop_at)
        except (RuntimeError, ValueError) as error:  # this arm failed (out of memory, a stopped engine): the next runs
            log(f"{name} failed: {error!r}")
            result["arms"].setdefault(name, {})["error"] = repr(error)
            result |= summarize(result["arms"], result["rows"])
            write_json(args.out, result)
    plot(result, pathlib.Path(args.out).with_suffix(".png"))
    print(f"{'arm':<10}{'slots':>6}{'goodput req/s':>15}{'':>14}{'x BF16':>8}{'x KIVI-4':>10}{'peak tok/s':>12}")
    for name in arm_plans:
        vs_b, vs_k = result["goodput_vs_bf16"].get(name), result["goodput_vs_kivi4"].get(name)
        peak = result["peak_tokens_per_s"].get(name)
        status = "failed" if "error" in result["arms"][name] else result["goodput_status"][name]
        print(f"{name:<10}{result['arms'][name].get('slots', '-'):>6}{result['goodput_rps'][name]:>15.3g}{status:>14}"
              f"{(f'{vs_b:.2f}' if vs_b else '-'):>8}{(f'{vs_k:.2f}' if vs_k else '-'):>10}"
              f"{(f'{peak:.1f}' if peak else '-'):>12}")
    log("done")
    return result


if __name__ == "__main__":
    threading.excepthook = lambda a: print(f"thread error: {a.exc_value!r}", file=sys.stderr)
    main()
