"""How long the profile of an Ouro-1.4B-sized model takes on one GPU (paper §3.1: "about 3 GPU-hours").

The model has Ouro-1.4B's shapes (4 loops x 24 layers, 16 MHA heads of 128, hidden 2048, vocabulary 49152) with
seeded random weights, in fp32 activations as the profiler requires. The profile is the paper's: 16 documents of
8K tokens (``--docs``, ``--doc-len``), every non-final cell at int4, int2 and share, every final-loop cell at int4
and int2, and KL_share: 265 evaluations (one evaluation = one (cell, option) measured over all documents), cut
into batches of ``--batch-cells`` rows exactly as ``loopkv.planning.profile`` cuts them.

What is measured and what is extrapolated. A sample of the profile's own batches (``--sample-batches``, spread
evenly over the batches without and with ``share`` jobs; 0 takes every batch) is timed on ``--measure-docs``
documents of the full length, with the document's exact forward (reference logits, share sources, checkpoints)
timed apart. The full profile's time is extrapolated, and the JSON says so (``"how": "extrapolated"``, and the
measured fraction of the work) unless every batch ran on every document (``"how": "measured"``):

* over documents, linearly: each document is its own forward, so a batch's time is the sum of its documents';
* over batches, by a cost model fitted on the sampled ones. A batch runs ``p`` passes (2 with ``share`` jobs)
  over rows whose first perturbed cells are ``c_1 <= ... <= c_R`` (of ``TL = T*L``); in model-forward units it
  costs ``p * R`` when every row runs from the first cell (``rows``), ``p * (c_1 + R * (TL - c_1)) / TL`` with
  the exact prefix run once on one row (``prefix``), and ``p * ((c_R - a) + sum(TL - c_r)) / TL`` resumed from
  the exact pass's checkpoint ``a`` with each row joining at its own cell (``resume``, the profiler's way). Seconds
  per unit is the sampled batches' total time over their total units; each sampled batch also records the time
  the fit predicts for it. The plain mean time per sampled batch times the number of batches is reported beside.

Arms (``--arms``): ``fp32-rows``, ``fp32-prefix`` (the profiler before it resumed from the exact pass), ``fp32``
(resumed), ``tf32`` (resumed, TF32 matmuls), ``tf32-host`` (the same with each document's exact pass kept in host
memory, ``profile(exact_on="cpu")``, as 16 documents of 8K need on one GPU) and ``tf32-mm`` (TF32 with the exact
attention through matmuls, which TF32 speeds up, instead of SDPA, whose fp32 kernel it does not: an experiment, not
what the profiler does). The TF32 check compares damages measured in fp32 and TF32 (and ``tf32-mm``'s way) against
their noise floor: on this model (random weights: its KLs say little about a trained model's; ``--tf32-docs``
documents, the standard error over them when there are two or more) and on loopkv's trained small model, whose
whole profile is taken both ways on ``--small-docs`` documents; a damage is "within the noise floor" when the two
differ by less than its standard error over documents.

    PYTHONPATH=. python benchmarks/bench_profile.py --out benchmarks/results/profile.json      # H200: 5-7 minutes

Order: the first arm (``tf32``), the TF32 checks, the other arms. ``--budget-s`` (390) bounds the run: past it no
further batch is sampled (each arm keeps at least one) and the remaining checks are skipped, and the JSON is
written after every step, so a run cut short keeps what it measured. Memory: the run's peak, and the profile's
projected peak at ``--docs`` documents (the profiler keeps every document's exact pass: logits, share sources,
checkpoints).

``--model small`` times loopkv's trained small model on its calibration documents instead (a whole profile a CPU
runs in minutes; with ``--clock process`` and ``OMP_NUM_THREADS=1``, this process's CPU time on a shared CPU).
``--smoke`` runs a tiny model on the CPU in seconds and checks the script; it measures nothing.

``--compare-plans`` runs only this arm: do TF32's moves change the plans? It profiles the trained small model in fp32
and in TF32 on the same ``--small-docs`` calibration documents (seed 0, the TF32 check's), solves a plan from each
profile at the presets R and M and at a ladder of damage budgets (``--ladder``, in KL_share, each without a storage
budget and with M's, 0.65 of uniform INT4), at the tau ``loopkv plan`` records (14), and compares the two plans cell
by cell. Then it measures plans' real KL (:func:`loopkv.planning.evaluate.measure_kl`, through the LoopKVCache, TF32
off) on ``--eval-docs`` held-out calibration documents (seed ``--eval-seed``, none equal to a profile document),
first ``--eval-positions`` counted positions each: the presets' plans always (one measurement when the two are
equal), then both plans of every ladder budget where they differ, until ``--budget-s`` (default 200 with this arm)
has passed; the rest are named as skipped. A budget whose plans differ is *within the eval's noise* when the two
measured KLs differ by less than the fp32-profiled plan's standard error over the held-out documents; equal plans
are trivially so. Also given: the paired standard error of the per-document differences, and the TF32 plan's damage
by the fp32 profile against the budget. It writes ``benchmarks/results/profile_tf32_plans.json`` unless ``--out``.

    PYTHONPATH=. python benchmarks/bench_profile.py --compare-plans      # one GPU; KL measured until --budget-s

TF32 only acts on CUDA: on a CPU (and with ``--smoke``, a tiny random model) the two profiles are equal, so the run
proves only the plumbing.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import time
from collections.abc import Sequence

import torch
from run_info import RESULTS, run_info, write_json

from loopkv.planning.compare import differing_cells, kl_verdict, standard_error
from loopkv.planning.profile_data import Profile

SEED = 0
# (how rows start, TF32, exact_on, exact attention through matmuls)
ARMS = {"fp32-rows": ("rows", False, None, False), "fp32-prefix": ("prefix", False, None, False),
        "fp32": ("resume", False, None, False), "tf32": ("resume", True, None, False),
        "tf32-host": ("resume", True, "cpu", False), "tf32-mm": ("resume", True, None, True)}
CLOCKS = {"wall": time.perf_counter, "process": time.process_time}
SMOKE = {"docs": 2, "doc_len": 352, "measure_docs": 1, "sample_batches": 2, "small_docs": 1, "small_len": 352,
         "tf32_jobs": 2, "tf32_docs": 2}
# --compare-plans: the damage budgets (KL_share) of the ladder, the held-out documents' seed, the arm's time budget
LADDER = "0.25,0.5,0.75,1,1.5,2,3,4"
EVAL_SEED = 1
COMPARE = {"budget_s": 200.0}
SMOKE_COMPARE = {"small_docs": 2, "small_len": 330, "eval_docs": 2, "eval_len": 330, "eval_positions": 2, "ladder": "1"}


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--model", choices=("ouro-1.4b", "small"), default="ouro-1.4b",
                   help="ouro-1.4b: Ouro-1.4B's shapes, random weights, random tokens; small: loopkv's trained small "
                        "model on its calibration documents (a whole profile a CPU measures in minutes)")
    p.add_argument("--docs", type=int, default=16, help="documents of the profile being extrapolated to")
    p.add_argument("--doc-len", type=int, default=8192, help="tokens per document")
    p.add_argument("--measure-docs", type=int, default=1, help="documents each sampled batch is timed on")
    p.add_argument("--sample-batches", type=int, default=4, help="batches of the profile timed per arm (0: all)")
    p.add_argument("--batch-cells", type=int, default=8, help="measurements per forward (the profiler's default)")
    p.add_argument("--arms", default="tf32,fp32,tf32-mm,tf32-host,fp32-prefix",
                   help=f"comma-separated, from {','.join(ARMS)}")
    p.add_argument("--budget-s", type=float, default=390.0,
                   help="stop sampling batches (each arm keeps at least one) and skip the remaining checks once "
                        "this many seconds have passed; the JSON is written after every arm")
    p.add_argument("--tf32-jobs", type=int, default=3, help="jobs whose damage is compared in fp32 and TF32 (0: skip)")
    p.add_argument("--tf32-docs", type=int, default=2, help="documents of that comparison (2+: a noise floor)")
    p.add_argument("--small-docs", type=int, default=4, help="documents of the small model's TF32 check (0: skip)")
    p.add_argument("--small-len", type=int, default=1024, help="tokens per document of the small model's check")
    p.add_argument("--clock", choices=("wall", "process"), default="wall",
                   help="process: this process's CPU time (a CPU shared with other work; run with OMP_NUM_THREADS=1)")
    p.add_argument("--compare-plans", action="store_true",
                   help="only the plan comparison: the small model profiled in fp32 and TF32, plans solved from "
                        "both and compared, their KL measured (module docstring); default --out "
                        "benchmarks/results/profile_tf32_plans.json, --budget-s 200")
    p.add_argument("--ladder", default=LADDER, help="--compare-plans: damage budgets in KL_share, comma-separated")
    p.add_argument("--eval-docs", type=int, default=4, help="--compare-plans: held-out documents of the KL")
    p.add_argument("--eval-len", type=int, default=1024, help="--compare-plans: tokens per held-out document")
    p.add_argument("--eval-positions", type=int, default=256,
                   help="--compare-plans: counted positions per held-out document (from position 320)")
    p.add_argument("--eval-seed", type=int, default=EVAL_SEED,
                   help=f"--compare-plans: seed of the held-out documents (the profile's are seed {SEED})")
    p.add_argument("--smoke", action="store_true", help="a tiny model on the CPU: checks the script")
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/profile.json, or "
                                               "profile_tf32_plans.json with --compare-plans)")
    first = p.parse_args(argv)
    if first.compare_plans:
        p.set_defaults(**COMPARE)
    if first.smoke:  # the smoke sizes, unless given on the command line
        p.set_defaults(**{**SMOKE, **(SMOKE_COMPARE if first.compare_plans else {})}, device="cpu")
    args = p.parse_args(argv)
    if args.clock == "process" and torch.device(args.device).type != "cpu":
        p.error("--clock process times the CPU's work; on a GPU use the wall clock (the default)")
    bad = [a for a in args.arms.split(",") if a not in ARMS]
    if bad:
        p.error(f"--arms: unknown arm(s) {bad}; choose from {list(ARMS)}")
    if args.compare_plans:
        try:
            args.ladder = tuple(float(x) for x in args.ladder.split(",") if x.strip())
        except ValueError:
            p.error(f"--ladder takes comma-separated damage budgets in KL_share, e.g. {LADDER}; got {args.ladder!r}")
        if not args.ladder or min(args.ladder) <= 0 or not all(map(math.isfinite, args.ladder)):
            p.error(f"--ladder: budgets must be positive and finite, got {args.ladder}")
        if args.small_docs < 2 or args.eval_docs < 2:
            p.error("--compare-plans needs --small-docs and --eval-docs of 2 or more (a standard error over documents)")
        if args.eval_seed == SEED:
            p.error(f"--eval-seed must differ from the profile documents' seed {SEED} (held-out documents)")
        if args.eval_positions < 1:
            p.error("--eval-positions must be positive")
    return args


def ouro_config(smoke: bool):
    from loopkv.models.ouro import OuroConfig

    if smoke:
        return OuroConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                          num_attention_heads=2, num_key_value_heads=2, head_dim=32, total_ut_steps=3,
                          max_position_embeddings=4096)
    return OuroConfig(vocab_size=49152, hidden_size=2048, intermediate_size=5632, num_hidden_layers=24,
                      num_attention_heads=16, num_key_value_heads=16, head_dim=128, total_ut_steps=4,
                      max_position_embeddings=65536, rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False)


def build(config, device):
    from loopkv.models.ouro import OuroForCausalLM

    torch.manual_seed(SEED)
    with torch.device(device):
        model = OuroForCausalLM(config)
    return model.float().eval()


def runner(model, docs, *, start: str, exact_on=None, matmul_attention: bool = False):
    from loopkv.planning.profiler import _Runner
    from loopkv.planning.simulate import FIRST_HISTORY

    c = model.config
    return _Runner(model, docs, loops=c.total_ut_steps, layers=c.num_hidden_layers, tau=math.inf,
                   share_source="int4", share_passes=2, prefill_len=FIRST_HISTORY, first=FIRST_HISTORY,
                   start=start, exact_on=exact_on, matmul_attention=matmul_attention)


def profile_batches(config, batch_cells: int) -> list[list]:
    """The profile's batches, as ``loopkv.planning.profile`` cuts them (default options)."""
    from loopkv.planning.profiler import _jobs

    base = Profile.partial(loops=config.total_ut_steps, layers=config.num_hidden_layers,
                           kv_heads=config.num_key_value_heads, head_dim=config.head_dim)
    jobs = _jobs(base)
    return [jobs[i : i + batch_cells] for i in range(0, len(jobs), batch_cells)]


def cost_units(run, batch, *, start: str) -> float:
    """Model-forward units of a batch per document (module docstring)."""
    from loopkv.planning.resume import checkpoint_cells

    cells = run.loops * run.layers
    passes = run.share_passes if any(s.share for job in batch for s in run._spec(job).values()) else 1
    starts = sorted(run.first_cell(job) for job in batch)
    if start == "rows":
        return passes * len(batch)
    if start == "prefix":
        return passes * (starts[0] + len(batch) * (cells - starts[0])) / cells
    at = max(c for c in checkpoint_cells(run.loops, run.layers) if c <= starts[0])
    return passes * ((starts[-1] - at) + sum(cells - c for c in starts)) / cells


def sample(batches: list, k: int) -> list[int]:
    """``k`` batch indices spread evenly over the batches without and with share jobs (half each); all for 0."""
    if k == 0:
        return list(range(len(batches)))
    plain = [i for i, b in enumerate(batches) if all(j != "kl_share" and j[1] != "share" for j in b)]
    shared = [i for i in range(len(batches)) if i not in plain]
    picks = []
    for group, n in ((plain, (k + 1) // 2), (shared, k // 2)):
        n = min(n, len(group))
        picks += [group[round(x * (len(group) - 1) / max(n - 1, 1))] for x in range(n)] if n else []
    return sorted(set(picks))


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def _bar():
    from tqdm import tqdm

    return tqdm(disable=True)


def time_arm(model, docs, batches, picks, *, start: str, tf32: bool, device, n_docs: int, exact_on=None,
             matmul_attention: bool = False, deadline: float = math.inf, clock=time.perf_counter) -> dict:
    """One arm: the exact pass per document and the sampled batches (those begun before ``deadline``, at least
    one), timed; the full profile extrapolated (or measured, when every batch ran on every document)."""
    from loopkv.planning.profiler import tf32_matmuls
    from loopkv.planning.simulate import served_attention_enabled

    run = runner(model, docs, start=start, exact_on=exact_on, matmul_attention=matmul_attention)
    cuda = torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    with torch.no_grad(), tf32_matmuls(tf32), served_attention_enabled(model):
        _sync(device)
        begin = clock()
        for d in range(len(docs)):
            run._reference(d)
        _sync(device)
        reference = (clock() - begin) / len(docs)
        rows = []
        for i in picks:
            if rows and time.perf_counter() > deadline:
                break
            _sync(device)
            begin = clock()
            run.measure(batches[i], _bar())
            _sync(device)
            rows.append({"index": i, "jobs": [str(j) for j in batches[i]], "rows": len(batches[i]),
                         "first_cell": min(run.first_cell(j) for j in batches[i]),
                         "units": cost_units(run, batches[i], start=start),
                         "seconds_per_doc": (clock() - begin) / len(docs)})
    per_unit = sum(r["seconds_per_doc"] for r in rows) / sum(r["units"] for r in rows)
    for r in rows:
        r["fit_seconds_per_doc"] = per_unit * r["units"]
    total_units = sum(cost_units(run, b, start=start) for b in batches)
    evaluations = sum(len(b) for b in batches)
    full = n_docs * (per_unit * total_units + reference)
    mean = n_docs * (sum(r["seconds_per_doc"] for r in rows) / len(rows) * len(batches) + reference)
    fraction = sum(r["units"] for r in rows) * len(docs) / (total_units * n_docs)
    measured = len(rows) == len(batches) and len(docs) == n_docs
    return {
        "start": start, "tf32": tf32, "exact_on": exact_on, "matmul_attention": matmul_attention,
        "reference_seconds_per_doc": reference, "sampled": rows,
        "seconds_per_unit_per_doc": per_unit, "units_per_doc": total_units,
        "full_profile_minutes": full / 60, "full_profile_minutes_mean_batch": mean / 60,
        "minutes_per_evaluation": full / 60 / evaluations,
        "how": "measured" if measured else "extrapolated", "measured_fraction_of_batch_work": fraction,
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        "reference_gib_per_doc": _reference_bytes(run, len(docs)) / 2**30,
    }


def _reference_bytes(run, n_docs: int) -> int:
    """Bytes the runner keeps per document (exact logits, share sources, checkpoints), averaged over documents."""
    total = 0
    for logits, sources, checkpoints in run._refs.values():
        total += logits.numel() * logits.element_size()
        total += sum(t.numel() * t.element_size() for kv in sources.values() for t in kv)
        total += sum(t.numel() * t.element_size() for t in checkpoints.values())
    return total // max(n_docs, 1)


def tf32_on_jobs(model, docs, jobs) -> dict:
    """Damage of ``jobs`` in fp32 and TF32 on the same documents: the difference against the fp32 damage's standard
    error over documents (with 2+ documents), and the exact model's own KL between its TF32 and fp32 logits."""
    from loopkv.planning.profiler import kl_per_position, tf32_matmuls
    from loopkv.planning.simulate import served_attention_enabled

    out, refs = {}, {}
    for name, tf32, mm in (("fp32", False, False), ("tf32", True, False), ("tf32-mm", True, True)):
        run = runner(model, docs, start="resume", matmul_attention=mm)
        with torch.no_grad(), tf32_matmuls(tf32), served_attention_enabled(model):
            out[name] = dict(zip(map(str, jobs), run.measure(jobs, _bar()), strict=True))
            refs[name] = [run._reference(d)[0] for d in range(len(docs))]
    result = {"documents": len(docs), "doc_len": int(docs[0].numel()),
              "note": "random weights: near-uniform outputs, so these KLs say little about a trained model's"}
    for name in ("tf32", "tf32-mm"):
        rows = []
        for key, (damage, per_doc) in out["fp32"].items():
            other = out[name][key][0]
            se = float(torch.tensor(per_doc).std()) / math.sqrt(len(per_doc)) if len(per_doc) > 1 else None
            rows.append({"job": key, "fp32": damage, name: other,
                         "relative_difference": abs(other - damage) / damage if damage else None,
                         "standard_error": se, "difference_over_se": abs(other - damage) / se if se else None})
        finite = [r["difference_over_se"] for r in rows if r["difference_over_se"] is not None]
        floor = [float(kl_per_position(a, b[None])[0].mean()) for a, b in zip(refs["fp32"], refs[name], strict=True)]
        result[name] = {"jobs": rows, "within_noise_floor": sum(1 for r in finite if r < 1.0) if finite else None,
                        "compared": len(finite), "exact_model_kl_vs_fp32": sum(floor) / len(floor)}
    result |= {k: result["tf32"][k] for k in ("jobs", "within_noise_floor", "compared")}  # the plain TF32 arm
    return result


def tf32_on_profile(model, docs) -> dict:
    """A whole profile of ``model`` in fp32 and in TF32: per damage, the difference against its standard error
    over documents (its noise floor)."""
    from loopkv.planning.profiler import profile

    a = profile(model, docs, progress=False)
    b = profile(model, docs, progress=False, tf32=True)
    return {"documents": len(docs), "doc_len": int(docs[0].numel()), **noise_floor(a, b)}


def noise_floor(a: Profile, b: Profile) -> dict:
    """Profile ``b`` against ``a`` (fp32): per damage, the difference over ``a``'s standard error over documents."""
    ratios = []
    for key, value in a.damage.items():
        per_doc = a.per_document.get(key, ())
        se = float(torch.tensor(per_doc).std()) / math.sqrt(len(per_doc)) if len(per_doc) > 1 else math.nan
        diff = abs(b.damage[key] - value)
        ratios.append({"key": f"{key[1]} at cell {key[0]}", "fp32": value, "tf32": b.damage[key],
                       "difference_over_se": diff / se if se > 0 else None})
    finite = [r["difference_over_se"] for r in ratios if r["difference_over_se"] is not None]
    return {"damages": len(ratios), "within_noise_floor": sum(1 for r in finite if r < 1.0), "compared": len(finite),
            "max_difference_over_se": max(finite, default=None),
            "kl_share_fp32": a.kl_share, "kl_share_tf32": b.kl_share, "per_damage": ratios,
            "seconds_fp32": a.provenance["profile_seconds"], "seconds_tf32": b.provenance["profile_seconds"]}


def _small_check(args, model, device) -> dict | None:
    """The TF32 check on loopkv's trained small model (with --smoke: on the tiny random model)."""
    if args.small_docs < 1:
        return None
    if args.smoke:
        gen = torch.Generator().manual_seed(SEED + 1)
        docs = [torch.randint(0, model.config.vocab_size, (args.small_len,), generator=gen)
                for _ in range(args.small_docs)]
        return {"model": "tiny random (smoke)", **tf32_on_profile(model, docs)}
    from loopkv.models.small import load_small
    from loopkv.planning.profiler import calibration_documents

    small = load_small(dtype=torch.float32, device=device)
    docs = calibration_documents(n=args.small_docs, length=args.small_len, seed=SEED)
    return {"model": "loopkv small (trained)", **tf32_on_profile(small, docs)}


# ---------------------------------------------------------------------------------------------- --compare-plans
@contextlib.contextmanager
def matmul_tf32(enabled: bool):
    """TF32 for CUDA matmuls and cuDNN set to ``enabled`` inside the block (on or off, whatever it was before)."""
    before = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = enabled
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def plan_budgets(ladder: Sequence[float]) -> dict[str, dict]:
    """The solves compared: the presets R and M, then every ladder damage budget (KL_share) without a storage budget
    and with M's."""
    from loopkv.planning.knapsack import PRESETS

    out = {"R": {"preset": "r"}, "M": {"preset": "m"}}
    for x in ladder:
        out[f"{x:g} KL_share"] = {"max_damage": x, "damage_unit": "kl_share"}
        out[f"{x:g} KL_share, stored <= {PRESETS['m']['storage_fraction']:g}"] = {
            "max_damage": x, "damage_unit": "kl_share", "storage_fraction": PRESETS["m"]["storage_fraction"]}
    return out


def solve_budget(profile: Profile, budget: dict, *, tau: float):
    """The plan ``budget`` gives on ``profile``, or the solver's message when no plan fits it."""
    from loopkv.planning.knapsack import solve, solve_preset

    try:
        if "preset" in budget:
            return solve_preset(profile, budget["preset"], tau=tau)
        return solve(profile, tau=tau, **budget)
    except ValueError as err:
        return str(err)


def damage_budget(budget: dict) -> float:
    """A budget's damage limit in KL_share."""
    from loopkv.planning.knapsack import PRESETS

    return (PRESETS[budget["preset"]] if "preset" in budget else budget)["max_damage"]


def _plan_row(plan, fp32: Profile) -> dict:
    from loopkv.planning.knapsack import predicted_damage

    if isinstance(plan, str):
        return {"infeasible": plan}
    return {"cells": [list(plan.options[t * plan.layers : (t + 1) * plan.layers]) for t in range(plan.loops)],
            "stored_kib": plan.predicted["stored_kib"], "read_kib": plan.predicted["read_kib"],
            "predicted_kl_share": plan.predicted["damage_kl_share"],
            "damage_by_fp32_profile_kl_share": predicted_damage(fp32, plan) / fp32.kl_share}


def measure_plan(model, plan, docs, *, positions: int):
    """``plan``'s KL through the real cache on ``docs`` (``measure_kl``), with TF32 off: its row, and the result."""
    from loopkv.planning.evaluate import measure_kl

    _sync(model.device)
    begin = time.perf_counter()
    with torch.no_grad(), matmul_tf32(False):
        r = measure_kl(model, plan, docs, max_positions=positions, progress=False)
    _sync(model.device)
    return {"kl": r.kl, "standard_error": standard_error(r.per_document), "per_document": list(r.per_document),
            "agreement": r.agreement, "positions": r.positions, "seconds": time.perf_counter() - begin}, r


def compare_plans(model, fp32: Profile, tf32: Profile, eval_docs, *, ladder: Sequence[float], tau: float,
                  positions: int, deadline: float = math.inf, on_row=None) -> list[dict]:
    """Per budget (:func:`plan_budgets`): the plans from the fp32 and the TF32 profile, compared cell by cell, and
    their measured KL where the module docstring says (the presets always, differing ladder plans until
    ``deadline``). ``on_row`` is called after each budget's row (the caller writes its JSON)."""
    measured: dict = {}  # one measurement (its row, its KLResult) per distinct plan

    def kl(plan):
        key = (plan.options, plan.taus)
        if key not in measured:
            measured[key] = measure_plan(model, plan, eval_docs, positions=positions)
        return measured[key]

    rows = []
    for name, budget in plan_budgets(ladder).items():
        a, b = solve_budget(fp32, budget, tau=tau), solve_budget(tf32, budget, tau=tau)
        row = {"budget": name, "solve": budget, "fp32": _plan_row(a, fp32), "tf32": _plan_row(b, fp32)}
        if isinstance(a, str) or isinstance(b, str):
            row |= {"cells_differ": None, "feasible": {"fp32": not isinstance(a, str), "tf32": not isinstance(b, str)},
                    "kl": {"how": "not measured: no plan fits this budget on at least one profile"}}
        else:
            diff = [{"cell": list(cell), "fp32": x, "tf32": y} for cell, x, y in differing_cells(a, b)]
            row |= {"cells_differ": len(diff), "differences": diff,
                    "tf32_plan_within_fp32_budget":
                        row["tf32"]["damage_by_fp32_profile_kl_share"] <= damage_budget(budget) * (1 + 1e-9)}
            preset = "preset" in budget
            if not diff:
                m = kl(a)[0] if preset else None
                row["kl"] = {"how": "equal plans: trivially within the eval's noise" + ("" if preset else
                             " (not measured)"), "fp32_plan": m, "tf32_plan": m, "within_eval_noise": True}
            elif not preset and time.perf_counter() > deadline:
                row["kl"] = {"how": "skipped: past --budget-s", "within_eval_noise": None}
            else:
                (ma, ra), (mb, rb) = kl(a), kl(b)
                row["kl"] = {"how": "measured", "fp32_plan": ma, "tf32_plan": mb, **kl_verdict(ra, rb)}
        rows.append(row)
        if on_row is not None:
            on_row(rows)
    return rows


def plans_summary(rows: list[dict], cells: int) -> dict:
    """How many budgets give different plans, how many cells differ, and how many measured pairs are within noise."""
    both = [r for r in rows if r["cells_differ"] is not None]
    differ = [r for r in both if r["cells_differ"]]
    measured = [r for r in differ if r["kl"]["how"] == "measured"]
    within = sum(1 for r in measured if r["kl"]["within_eval_noise"])
    ratios = [r["kl"]["difference_over_se"] for r in measured if r["kl"]["difference_over_se"] is not None]
    summary = {
        "budgets": len(rows), "feasible_on_both": len(both),
        "feasible_on_one_only": sum(1 for r in rows if r["cells_differ"] is None and any(r["feasible"].values())),
        "plans_differ": len(differ), "cells_per_plan": cells,
        "cells_differ_per_budget": {r["budget"]: r["cells_differ"] for r in both},
        "max_cells_differ": max((r["cells_differ"] for r in both), default=None),
        "tf32_plans_over_fp32_budget": sum(1 for r in both if not r["tf32_plan_within_fp32_budget"]),
        "differing_measured": len(measured), "differing_within_eval_noise": within,
        "differing_skipped": len(differ) - len(measured), "max_difference_over_se": max(ratios, default=None),
    }
    summary["verdict"] = (
        f"{len(differ)} of {len(both)} budgets give different plans from the TF32 profile (at most "
        f"{summary['max_cells_differ']} of {cells} cells); " + (
            f"of the {len(measured)} measured, {within} are within the eval's noise of the fp32-profiled plan"
            if measured else "no differing pair was measured") +
        (f" ({len(differ) - len(measured)} skipped)" if len(differ) > len(measured) else "") +
        "; equal plans are trivially within it")
    return summary


def compare_main(args, argv) -> dict:
    """``--compare-plans``: the small model (with --smoke, a tiny random one) profiled both ways, plans compared."""
    from loopkv.cli import DEFAULT_TAU
    from loopkv.planning.profiler import calibration_documents, documents_hash, profile

    begin = time.perf_counter()
    deadline = begin + args.budget_s
    device = torch.device(args.device)
    if args.smoke:
        model = build(ouro_config(True), device)
        gen = torch.Generator().manual_seed(SEED + 1)
        docs = [torch.randint(0, model.config.vocab_size, (args.small_len,), generator=gen)
                for _ in range(args.small_docs)]
        gen = torch.Generator().manual_seed(args.eval_seed + 1)
        eval_docs = [torch.randint(0, model.config.vocab_size, (args.eval_len,), generator=gen)
                     for _ in range(args.eval_docs)]
        name = "tiny random (smoke)"
    else:
        from loopkv.models.small import load_small

        model = load_small(dtype=torch.float32, device=device).eval()
        docs = calibration_documents(n=args.small_docs, length=args.small_len, seed=SEED)
        eval_docs = calibration_documents(n=args.eval_docs, length=args.eval_len, seed=args.eval_seed)
        name = "loopkv small (trained)"
    if any(e.numel() == d.numel() and bool((e == d).all()) for e in eval_docs for d in docs):
        raise ValueError("a held-out document equals a profile document; pick another --eval-seed")
    out = args.out or (RESULTS / "profile_tf32_plans.json")
    cells = model.config.total_ut_steps * model.config.num_hidden_layers
    result = {
        **run_info(__file__, argv, device),
        "model": name,
        "tf32_acts": device.type == "cuda",
        "note": "TF32 only acts on CUDA; on a CPU both profiles are equal and the run checks the plumbing",
        "profile_documents": {"n": len(docs), "doc_len": args.small_len, "seed": SEED,
                              "hash": documents_hash(docs)},
        "eval_documents": {"n": len(eval_docs), "doc_len": args.eval_len, "seed": args.eval_seed,
                           "positions_per_document": args.eval_positions, "hash": documents_hash(eval_docs),
                           "how": "loopkv.planning.evaluate.measure_kl: real LoopKVCache, fp32 model, TF32 off"},
        "tau": DEFAULT_TAU, "ladder_kl_share": list(args.ladder), "budget_s": args.budget_s,
    }
    with matmul_tf32(False):
        a = profile(model, docs, progress=False)
    b = profile(model, docs, progress=False, tf32=True)
    result["profiles"] = {
        "fp32": {"seconds": a.provenance["profile_seconds"], "kl_share": a.kl_share, "hash": a.content_hash()},
        "tf32": {"seconds": b.provenance["profile_seconds"], "kl_share": b.kl_share, "hash": b.content_hash()},
        "same_damages": a.damage == b.damage and a.kl_share == b.kl_share, "noise_floor": noise_floor(a, b)}
    write_json(out, result)

    def written(rows):
        result["plans"] = rows
        write_json(out, result)

    rows = compare_plans(model, a, b, eval_docs, ladder=args.ladder, tau=DEFAULT_TAU,
                         positions=args.eval_positions, deadline=deadline, on_row=written)
    result["plans"] = rows
    result["summary"] = plans_summary(rows, cells)
    result["seconds"] = time.perf_counter() - begin  # the whole arm: loading, both profiles, solves, measurements
    write_json(out, result)
    _print_plans(result)
    return result


def _print_plans(result: dict) -> None:
    floor = result["profiles"]["noise_floor"]
    print(f"TF32 vs fp32 profile ({result['model']}, {result['device']}): {floor['within_noise_floor']} of "
          f"{floor['compared']} damages within their noise floor")
    print(f"{'budget':<28} {'cells differ':>12} {'KL fp32 plan':>13} {'KL tf32 plan':>13} {'|diff|/se':>10}  how")
    for r in result["plans"]:
        k = r["kl"]
        fa, fb = k.get("fp32_plan"), k.get("tf32_plan")
        ratio = k.get("difference_over_se")
        print(f"{r['budget']:<28} {'-' if r['cells_differ'] is None else r['cells_differ']:>12} "
              f"{fa['kl'] if fa else float('nan'):>13.4g} {fb['kl'] if fb else float('nan'):>13.4g} "
              f"{float('nan') if ratio is None else ratio:>10.2f}  {k['how']}")
    print(result["summary"]["verdict"])


def main(argv: Sequence[str] | None = None) -> dict:
    args = _parse(argv)
    if args.compare_plans:
        return compare_main(args, argv)
    deadline = time.perf_counter() + args.budget_s
    device = torch.device(args.device)
    n_docs = max(args.measure_docs, args.tf32_docs)
    if args.model == "small" and not args.smoke:
        from loopkv.models.small import load_small
        from loopkv.planning.profiler import calibration_documents

        model = load_small(dtype=torch.float32, device=device).eval()
        config = model.config
        docs = calibration_documents(n=n_docs, length=args.doc_len, seed=SEED)
        shape = "loopkv small (trained), calibration documents"
    else:
        config = ouro_config(args.smoke)
        model = build(config, device)
        gen = torch.Generator().manual_seed(SEED)
        docs = [torch.randint(0, config.vocab_size, (args.doc_len,), generator=gen) for _ in range(n_docs)]
        shape = "tiny (smoke)" if args.smoke else "Ouro-1.4B (random weights)"
    batches = profile_batches(config, args.batch_cells)
    picks = sample(batches, args.sample_batches)
    from loopkv.planning.simulate import served_attention_enabled

    with torch.no_grad(), served_attention_enabled(model):  # warm up kernels and allocator on a short document
        runner(model, [docs[0][:400]], start="resume").measure(batches[0][:1], _bar())
    result = {
        **run_info(__file__, argv, device),
        "model": {"shape": shape,
                  "config": {k: getattr(config, k) for k in ("total_ut_steps", "num_hidden_layers", "hidden_size",
                                                             "num_attention_heads", "head_dim", "vocab_size")}},
        "profile": {"documents": args.docs, "doc_len": args.doc_len, "batch_cells": args.batch_cells,
                    "evaluations": sum(len(b) for b in batches), "batches": len(batches), "share_passes": 2},
        "measured": {"documents": args.measure_docs, "doc_len": args.doc_len, "batches": picks,
                     "clock": args.clock},
        "memory_note": "summary.projected_peak_gib: per arm, its peak plus, where the exact passes stay on the GPU, "
                       "those of the documents not measured (the profiler keeps every document's)",
        "arms": {},
        "tf32_check": {},
        "extrapolation": "each arm's 'how' says whether its full-profile time is measured (every batch on every "
                         "document) or extrapolated (module docstring): linearly in documents, over batches by the "
                         "cost model fitted on the sampled batches ('fit_seconds_per_doc' beside each measured time)",
    }
    out = args.out or (RESULTS / "profile.json")
    everything = [j for b in batches for j in b]
    kinds = [next(j for j in everything if j != "kl_share" and j[1] == o) for o in ("int4", "int2", "share")]
    tf32_jobs = (kinds + ["kl_share"])[: args.tf32_jobs]
    checks = {"ouro_shape": lambda: tf32_on_jobs(model, docs[: max(args.tf32_docs, 1)], tf32_jobs),
              "small_model": lambda: _small_check(args, model, device)}
    if args.tf32_jobs == 0:  # asked for none
        checks.pop("ouro_shape")
    names = args.arms.split(",")
    for step in [names[0], *checks, *names[1:]]:  # the TF32 check right after the first arm: it decides TF32
        if step in checks:
            over = time.perf_counter() > deadline
            result["tf32_check"][step] = {"skipped": f"past --budget-s {args.budget_s:g}"} if over else checks[step]()
        else:
            start, tf32, exact_on, matmul_attention = ARMS[step]
            arm = time_arm(model, docs[: args.measure_docs], batches, picks, start=start, tf32=tf32, device=device,
                           n_docs=args.docs, exact_on=exact_on, matmul_attention=matmul_attention,
                           deadline=deadline, clock=CLOCKS[args.clock])
            result["arms"][step] = arm
            print(f"{step}: {arm['full_profile_minutes']:.1f} min per profile ({arm['how']}, from "
                  f"{len(arm['sampled'])} batches), {arm['minutes_per_evaluation'] * 60:.1f} s per evaluation",
                  flush=True)
        write_json(out, result)
    result["summary"] = _summary(result)
    write_json(out, result)
    _print_table(result)
    return result


def _summary(result: dict) -> dict:
    """Minutes per profile per arm (each arm's 'how' says measured or extrapolated), the fastest arm, the TF32 checks
    (damages within their noise floor, of those compared) and, per arm, the issue's targets (60 and 20 minutes)."""
    minutes = {name: arm["full_profile_minutes"] for name, arm in result["arms"].items()}
    best = min(minutes, key=minutes.get) if minutes else None
    extra_docs = result["profile"]["documents"] - result["measured"]["documents"]
    peaks = {name: a["peak_memory_gib"] + (extra_docs * a["reference_gib_per_doc"] if a["exact_on"] is None else 0.0)
             for name, a in result["arms"].items() if a["peak_memory_gib"] is not None}
    return {"full_profile_minutes": minutes, "how": {n: a["how"] for n, a in result["arms"].items()},
            "fastest_arm": best, "evaluations_per_profile": result["profile"]["evaluations"],
            "minutes_per_evaluation": {n: a["minutes_per_evaluation"] for n, a in result["arms"].items()},
            "projected_peak_gib": peaks or None,
            "tf32_within_noise_floor": {
                **{name: [c.get("within_noise_floor"), c.get("compared")]
                   for name, c in result["tf32_check"].items() if c and "skipped" not in c},
                **{f"{name} (tf32-mm)": [c["tf32-mm"]["within_noise_floor"], c["tf32-mm"]["compared"]]
                   for name, c in result["tf32_check"].items() if c and "tf32-mm" in c}},
            "within_60_min": {name: m <= 60 for name, m in minutes.items()},
            "within_20_min": {name: m <= 20 for name, m in minutes.items()}}


def _print_table(result: dict) -> None:
    print(f"profile: {result['profile']['evaluations']} evaluations, {result['profile']['documents']} x "
          f"{result['profile']['doc_len']} tokens ({result['model']['shape']}, {result['device']})")
    print(f"{'arm':<12} {'min/profile':>12} {'(mean-batch)':>12} {'s/evaluation':>13} {'ref s/doc':>10}  how")
    for name, arm in result["arms"].items():
        print(f"{name:<12} {arm['full_profile_minutes']:>12.1f} {arm['full_profile_minutes_mean_batch']:>12.1f} "
              f"{arm['minutes_per_evaluation'] * 60:>13.2f} {arm['reference_seconds_per_doc']:>10.2f}  {arm['how']}")
    for name, check in result["tf32_check"].items():
        if check and "skipped" not in check:
            print(f"TF32 vs fp32 ({name}): {check['within_noise_floor']} of {check['compared']} damages within "
                  "their noise floor (standard error over documents)")
            if "tf32-mm" in check:
                mm = check["tf32-mm"]
                print(f"TF32 with matmul attention vs fp32 ({name}): {mm['within_noise_floor']} of {mm['compared']}")


if __name__ == "__main__":
    main()
