"""Goodput under a latency SLO: requests arriving over time, served by transformers' continuous-batching engine with
LoopKV storage (loopkv/serving), one arm per plan under the same KV budget, in one process (paper §5.1, §5.4).

    python benchmarks/bench_serving.py [--arms bf16,kivi4,loopkv-r,loopkv-m] [--budget-gib 96] [--max-len 16384]
        [--rates 0.125,0.25,0.5,1,2,4,8,16] [--requests 24] [--trace-s 20] [--start auto|lowest]
        [--peak-prompt 512] [--peak-batch N] [--ttft-s 10] [--tpot-x 3] [--time-budget-s 420] [--seed 0] [--smoke]
        [--out benchmarks/results/serving.json]
    python benchmarks/bench_serving.py --plot benchmarks/results/serving.json   # the figure from a JSON

Model: Ouro-1.4B's shapes with random weights, bf16 (``--smoke``: a tiny one, on the CPU if there is no GPU). Trace:
seeded Poisson arrivals at each rate, the same requests at every rate; prompts uniform in [max_len / 16, max_len / 2],
outputs uniform in [16, 128] tokens (capped to max_len): the paper's SLO workload (AIME, 11K output tokens on
average) takes hours per ladder, this one minutes. Arms: ``bf16`` stores every cell exact (an all-bf16 plan:
transformers' own paged cache has one layer per physical layer and cannot hold a looped model's cells), ``kivi4``
INT4 in every cell, ``loopkv-r`` and ``loopkv-m`` the paper's compositions (as in bench_decode.py). Each arm gets the
slots and pages the budget buys: ``slots = budget // (a slot's exact sink and window + bytes per token x the trace's
mean context)``, the rest pages.

SLO, per request: time to first token <= 10 s and mean time per output token <= 3x the BF16 batch-1 decode step
(measured first, in this run, through the same engine with one slot); ``--ttft-s`` and ``--tpot-x`` change the bounds
(the smoke run's are loose: its numbers mean nothing, and a busy CPU would miss the paper's). Attainment = the share
of a rate's requests meeting it; goodput = the highest tested rate with attainment >= 95% below the lowest tested rate
under it (``goodput_status``: ``measured`` when such a rate under 95% exists, ``at least`` when none does, ``below
lowest``).

Each arm runs in one engine (built and started once): a warm-up request (builds the kernels; the BF16 batch-1 engine
has one too), the peak decode throughput (``--peak-batch`` requests, default the arm's slots, of ``--peak-prompt``
tokens sent at once: prompt tokens per second until the last first token, then decode tokens per second while every
one of them decodes), then the ladder. It starts (``--start auto``) at the highest rate at most half of what the arm
could finish at its peak's speeds (:func:`first_rate`), goes up while a rate meets 95% and down while it does not,
and stops once two neighbouring rates bracket the goodput, at the ends of ``--rates``, or when the arm's share of
``--time-budget-s`` (what is left, split over the arms left) runs out: that rate is marked incomplete and does not
count. ``--start lowest`` walks up from the lowest rate. A rate's trace is its first ``--requests`` arrivals within
``--trace-s`` seconds. It ends when every request is finished or past its SLO deadline (arrival + TTFT bound +
(tokens - 1) x TPOT bound: a request unfinished then cannot meet the SLO, so it counts as a miss and is cancelled),
or as soon as misses make 95% impossible (``stopped_early``; its attainment is then an upper bound). The JSON is
rewritten after every rate, so a run cut short keeps what finished; progress lines carry timings; the figure
(attainment against rate per arm) goes next to the JSON (``.png``).

The engine runs eagerly (no CUDA graphs: loopkv's shim splits prompts from decode tokens on the host), so these
numbers include the engine's and the shim's host time; compare the peak with bench_decode.py's static-batch graphs
to see that overhead.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import pathlib
import random
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
from loopkv.serving.transformers_cb import engine_cache, engine_config  # noqa: E402

TTFT_SLO_S = 10.0  # the paper's SLO (its defaults here: --ttft-s, --tpot-x)
TPOT_SLO_X = 3.0
ATTAINMENT = 0.95
STYLE = {"bf16": ("k", "o"), "kivi4": ("tab:blue", "s"), "loopkv-r": ("tab:orange", "^"),
         "loopkv-m": ("tab:red", "v")}
T0 = time.perf_counter()


def log(message: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f} s] {message}", flush=True)


def plans(cfg) -> dict[str, loopkv.Plan]:
    loops, layers = cfg.total_ut_steps, cfg.num_hidden_layers
    return {"bf16": loopkv.Plan.uniform(loops=loops, layers=layers, option="bf16"), **paper_plans(loops, layers)}


def trace(rate: float, n: int, max_len: int, seed: int, smoke: bool) -> list[tuple[float, int, int]]:
    """(arrival s, prompt tokens, output tokens) per request; the same requests at every rate."""
    rng = random.Random(seed)
    t, out = 0.0, []
    lo_out, hi_out = (4, 12) if smoke else (16, 128)
    for _ in range(n):
        t += rng.expovariate(1.0) / rate
        prompt = rng.randint(max_len // 16, max_len // 2)
        out.append((t, prompt, min(rng.randint(lo_out, hi_out), max_len - prompt)))
    return out


def budget_split(plan, cfg, budget: int, mean_context: float, dtype_bytes: int) -> tuple[int, int]:
    """(slots, pool pages) a KV budget buys for ``plan``."""
    from loopkv.cache.paging import exact_bytes_per_row, pool_pages_for

    exact = exact_bytes_per_row(cfg, dtype_bytes=dtype_bytes)
    per_token = plan.bytes_per_token(cfg, dtype_bytes=dtype_bytes).stored_kib * 1024
    slots = max(1, int(budget // (exact + per_token * mean_context)))
    return slots, pool_pages_for(plan, cfg, budget_bytes=budget, max_batch_size=slots, dtype_bytes=dtype_bytes)


class Engine:
    """One arm's engine, started once: requests go in with :meth:`submit`, finished ones come back in
    :meth:`collect` with their latencies."""

    def __init__(self, model, plan, *, slots: int, pages: int, max_len: int):
        from transformers import GenerationConfig

        self.model, self.vocab = model, model.config.vocab_size
        gen = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=0, max_new_tokens=max_len)
        cb = engine_config(plan, pool_pages=pages, max_batch_tokens=256 if "share" in plan.options else 1024)
        self._context = engine_cache(plan, max_slots=slots, max_len=max_len)
        self._context.__enter__()
        try:
            self.manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)
            self.manager.start()
        except BaseException:
            self._context.__exit__(None, None, None)
            raise
        self.submitted: dict[str, float] = {}

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

    def cancel(self, request_id: str) -> None:
        self.submitted.pop(request_id, None)
        self.manager.cancel_request(request_id)

    def close(self) -> None:
        try:
            self.manager.stop(block=True)
            self.model.destroy_cached_continuous_batching_manager()
        finally:
            self._context.__exit__(None, None, None)
            self.manager = None
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()

    def run_all(self, requests: dict[str, tuple[int, int]], timeout: float) -> list[dict]:
        """Submit every request now and wait for all of them."""
        for rid, (prompt, new) in requests.items():
            self.submit(rid, prompt, new)
        done, deadline = [], time.perf_counter() + timeout
        while len(done) < len(requests):
            if time.perf_counter() > deadline:
                raise RuntimeError(f"the engine returned {len(done)} of {len(requests)} requests in {timeout} s")
            got = self.collect(timeout=1.0)
            if got is not None:
                done.append(got)
        return done


def peak_decode(engine: Engine, slots: int, prompt: int, new: int, timeout: float) -> dict:
    """``slots`` requests at once: decode tokens per second while all of them decode (from the last first token to
    the first finish), and prompt tokens per second until the last first token."""
    sent = time.perf_counter()
    done = engine.run_all({f"peak{i}": (prompt, new) for i in range(slots)}, timeout)
    start = max(r["stamps"][0] for r in done)
    end = min(r["stamps"][-1] for r in done)
    tokens = sum(start < t <= end for r in done for t in r["stamps"])
    return {"batch": slots, "prompt": prompt, "new": new, "window_s": end - start,
            "tokens_per_s": tokens / (end - start) if end > start else None,
            "prompt_tokens_per_s": slots * prompt / (start - sent)}


def run_rate(engine: Engine, name: str, rate: float, reqs, *, ttft_slo: float, tpot_slo: float, trace_s: float,
             stop_at: float) -> dict:
    """One rate of the ladder (module docstring); returns its row."""
    reqs = [r for r in reqs if r[0] <= trace_s] or reqs[:1]
    ids = [f"{name}@{rate}#{i}" for i in range(len(reqs))]
    deadline = {}  # request id -> the time by which it must finish to meet the SLO
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
        wait = start + pending[0][1][0] - now if pending else 0.2
        got = engine.collect(timeout=max(0.01, min(wait, 0.2)))
        if got is not None and got["id"] in deadline:
            del deadline[got["id"]]
            got["ok"] = got["ttft_s"] <= ttft_slo and got["tpot_s"] <= tpot_slo and not got["error"]
            results[got["id"]] = got
            misses += not got["ok"]
        now = time.perf_counter()
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
    finished = [r for r in results.values() if r["tokens"]]
    return {"arm": name, "rate": rate, "requests": len(reqs), "judged": len(results), "complete": complete,
            "attainment": 1 - misses / len(reqs),  # an upper bound when stopped early
            "stopped_early": misses > allowed_misses and bool(pending or deadline),
            "tokens_per_s": sum(r["tokens"] for r in finished) / wall, "wall_s": wall,
            "mean_ttft_s": (sum(r["ttft_s"] for r in finished) / len(finished)) if finished else None,
            "mean_tpot_s": (sum(r["tpot_s"] for r in finished) / len(finished)) if finished else None,
            "ttft_misses": sum(r["ttft_s"] > ttft_slo for r in results.values()),
            "tpot_misses": sum(r["tpot_s"] > tpot_slo for r in results.values())}


def capacity(rows: list[dict]) -> tuple[float, str]:
    """An arm's goodput from its complete rows: the highest rate meeting 95% below the lowest rate missing it, and
    whether that is bracketed (``measured``: the next tested rate up missed), ``at least`` (no tested rate missed) or
    ``below lowest`` (the lowest tested rate missed: 0)."""
    rows = [r for r in rows if r["complete"]]
    failed = [r["rate"] for r in rows if r["attainment"] < ATTAINMENT]
    ceiling = min(failed, default=math.inf)
    met = [r["rate"] for r in rows if r["attainment"] >= ATTAINMENT and r["rate"] < ceiling]
    if not met:
        return 0.0, "below lowest" if failed else "no complete rate"
    return max(met), "measured" if failed else "at least"


def summarize(arms: dict, rows: list[dict]) -> dict:
    """Goodput per arm (:func:`capacity`), its ratios to BF16 and KIVI-4, the peaks."""
    found = {name: capacity([r for r in rows if r["arm"] == name]) for name in arms}
    goodput = {name: g for name, (g, _) in found.items()}
    ratio = {base: {n: (g / goodput[base] if goodput.get(base) else None) for n, g in goodput.items()}
             for base in ("bf16", "kivi4") if base in goodput}
    return {"goodput_rps": goodput, "goodput_status": {name: status for name, (_, status) in found.items()},
            "goodput_vs_bf16": ratio.get("bf16", {}), "goodput_vs_kivi4": ratio.get("kivi4", {}),
            "peak_tokens_per_s": {n: a["peak"]["tokens_per_s"] for n, a in arms.items() if a.get("peak")}}


def ladder(rates: list[float], first: int, run) -> list[dict]:
    """Run ``run(rate) -> row`` from ``rates[first]``: up while a rate meets 95%, down while it does not, until two
    neighbouring rates bracket the goodput, an end of ``rates`` is passed, or a row is incomplete."""
    rows, tested, i = [], set(), first
    while 0 <= i < len(rates) and i not in tested:
        rows.append(run(rates[i]))
        if not rows[-1]["complete"]:
            break
        tested.add(i)
        i += 1 if rows[-1]["attainment"] >= ATTAINMENT else -1
    return rows


def first_rate(rates: list[float], peak: dict, mean_prompt: float, mean_new: float, start: str) -> int:
    """The ladder's first rate: the lowest, or (``auto``) the highest at most half the rate the arm could finish at
    its peak's speeds (1 / (mean prompt / prompt tok/s + mean output / decode tok/s); queueing, longer contexts and
    the SLO make the real one lower)."""
    if start == "lowest" or not peak["tokens_per_s"]:
        return 0
    estimate = 1 / (mean_prompt / peak["prompt_tokens_per_s"] + mean_new / peak["tokens_per_s"]) / 2
    return max([i for i, r in enumerate(rates) if r <= estimate], default=0)


def plot(result: dict, path) -> None:
    """Attainment against rate per arm, the 95% line, the goodput ratios in the legend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for name in result["arms"]:
        rows = [r for r in result["rows"] if r["arm"] == name and r["complete"]]
        color, marker = STYLE.get(name, ("tab:gray", "x"))
        ratio = result["goodput_vs_bf16"].get(name)
        label = f"{name}: {result['goodput_rps'][name]:.3g} req/s" + (f" ({ratio:.2f}x BF16)" if ratio else "")
        ax.plot([r["rate"] for r in rows], [100 * r["attainment"] for r in rows], color=color, marker=marker,
                label=label)
    ax.axhline(100 * ATTAINMENT, color="tab:red", lw=0.8, ls="--")
    ax.set_ylim(0, 105)
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
    """One arm in one engine: warm-up, peak, ladder (module docstring); ``result`` is updated and written after
    every rate."""
    slots, pages = split
    small_new, timeout = (8, 120) if args.smoke else (64, 300)
    arm = result["arms"][name] = {"slots": slots, "pool_pages": pages, "peak": None}
    log(f"{name}: {slots} slots, {pages} pool pages; {stop_at - time.perf_counter():.0f} s for this arm")
    engine = Engine(model, plan, slots=slots, pages=pages, max_len=args.max_len)

    def one(rate: float) -> dict:
        row = run_rate(engine, name, rate, [(a / rate, p, n) for a, p, n in reqs], ttft_slo=args.ttft_s,
                       tpot_slo=tpot_slo, trace_s=args.trace_s, stop_at=stop_at) | {"slots": slots, "pool_pages": pages}
        result["rows"].append(row)
        result.update(summarize(result["arms"], result["rows"]))
        write_json(args.out, result)
        log(f"{name} rate {rate:g}: {row['requests']} requests, attainment {row['attainment']:.2f} "
            f"({row['ttft_misses']} TTFT / {row['tpot_misses']} TPOT misses), {row['tokens_per_s']:.1f} tok/s, "
            f"{row['wall_s']:.0f} s{'' if row['complete'] else ', cut short: incomplete'}")
        return row

    try:
        engine.run_all({"warm": (args.peak_prompt, 4)}, timeout)
        batch = min(slots, args.peak_batch or slots)
        arm["peak"] = peak_decode(engine, batch, args.peak_prompt, small_new, timeout)
        log(f"{name}: peak decode {arm['peak']['tokens_per_s'] or 0:.1f} tok/s at batch {batch}")
        rates = [float(r) for r in args.rates.split(",")]
        mean_prompt, mean_new = (sum(r[i] for r in reqs) / len(reqs) for i in (1, 2))
        ladder(rates, first_rate(rates, arm["peak"], mean_prompt, mean_new, args.start), one)
    finally:
        engine.close()
        result.update(summarize(result["arms"], result["rows"]))
        write_json(args.out, result)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arms", default="bf16,kivi4,loopkv-r,loopkv-m")
    ap.add_argument("--budget-gib", type=float, default=96.0)
    ap.add_argument("--max-len", type=int, default=16384)
    ap.add_argument("--rates", default="0.125,0.25,0.5,1,2,4,8,16", help="requests per second, increasing")
    ap.add_argument("--requests", type=int, default=24, help="requests per rate at most")
    ap.add_argument("--trace-s", type=float, default=20.0, help="arrivals per rate within this many seconds")
    ap.add_argument("--peak-prompt", type=int, default=512,
                    help="prompt tokens of the warm-up and peak-throughput requests (past 319: pages get written)")
    ap.add_argument("--peak-batch", type=int, default=0, help="peak-throughput requests (0: the arm's slots)")
    ap.add_argument("--time-budget-s", type=float, default=420.0, help="the whole run, model building included")
    ap.add_argument("--start", choices=("auto", "lowest"), default="auto",
                    help="the ladder's first rate: from the arm's peak throughput, or the lowest (first_rate)")
    ap.add_argument("--ttft-s", type=float, default=TTFT_SLO_S, help="the SLO's time to first token")
    ap.add_argument("--tpot-x", type=float, default=TPOT_SLO_X,
                    help="the SLO's time per output token, in BF16 batch-1 steps")
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
        for flag, value in (("--max-len", 640), ("--requests", 3), ("--rates", "8"), ("--budget-gib", 0.02),
                            ("--arms", "loopkv-m"), ("--peak-prompt", 64), ("--peak-batch", 2), ("--trace-s", 5.0),
                            ("--ttft-s", 600.0), ("--tpot-x", 100.0)):  # a CPU, maybe busy: every request meets it
            if flag not in given:
                setattr(args, flag[2:].replace("-", "_"), value)
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
    rates = [float(r) for r in args.rates.split(",")]
    if rates != sorted(set(rates)):
        raise SystemExit("--rates must increase")
    torch.manual_seed(0)
    with torch.device(device):  # initialized where it runs: minutes less on the host for 1.4B parameters
        model = OuroForCausalLM(cfg).to(dtype=dtype).eval()
    budget = int(args.budget_gib * 2**30)
    small_new = 8 if args.smoke else 64
    timeout = 120 if args.smoke else 300
    log(f"model built on {device}")

    result = run_info(__file__, argv, device) | {
        "model": "smoke" if args.smoke else "Ouro-1.4B shapes, random weights", "dtype": str(dtype),
        "budget_gib": args.budget_gib, "max_len": args.max_len, "requests": args.requests, "trace_s": args.trace_s,
        "seed": args.seed, "arms": {}, "rows": []}

    # the SLO's step: BF16 with one slot, through the same engine (after a warm-up request)
    bf16 = plans(cfg)["bf16"]
    engine = Engine(model, bf16, slots=1, pages=budget_split(bf16, cfg, budget, args.max_len, dtype_bytes)[1],
                    max_len=args.max_len)
    try:
        engine.run_all({"warm": (args.peak_prompt, 4)}, timeout)
        base = engine.run_all({"one": (args.max_len // 4, small_new)}, timeout)[0]["tpot_s"]
    finally:
        engine.close()
    tpot_slo = args.tpot_x * base
    result["slo"] = {"ttft_s": args.ttft_s, "tpot_s": tpot_slo, "tpot_x": args.tpot_x, "bf16_batch1_step_s": base,
                     "attainment": ATTAINMENT}
    log(f"BF16 batch-1 step {1e3 * base:.1f} ms: TPOT bound {1e3 * tpot_slo:.1f} ms")
    write_json(args.out, result)

    reqs = trace(1.0, args.requests, args.max_len, args.seed, args.smoke)
    mean_ctx = sum(p + n for _, p, n in reqs) / len(reqs)
    for k, (name, plan) in enumerate(arm_plans.items()):
        stop_at = time.perf_counter() + (stop_all - time.perf_counter()) / (len(arm_plans) - k)
        try:
            run_arm(model, name, plan, budget_split(plan, cfg, budget, mean_ctx, dtype_bytes), reqs, args, result,
                    tpot_slo=tpot_slo, stop_at=stop_at)
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
    return result


if __name__ == "__main__":
    threading.excepthook = lambda a: print(f"thread error: {a.exc_value!r}", file=sys.stderr)
    main()
