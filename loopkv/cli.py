"""The ``loopkv`` command line: profile a model, solve a plan, show files, measure a plan's KL, run the demo, serve.

::

    loopkv profile small --out profile.json                      # resumable: add --resume after a stop
    loopkv plan profile.json --preset m --out plan.json          # or --max-damage 1.5 --max-stored-kib 30
    loopkv show plan.json [--png plan.png]
    loopkv eval small --plan plan.json --profile profile.json    # KL through the real LoopKVCache
    loopkv demo
    loopkv serve small --plan plan.json --port 8000              # OpenAI-compatible /v1/completions

MODEL is a local checkpoint directory, a Hub id already in the local Hub cache (looked up offline, never
downloaded) or ``small`` (the small model loopkv ships). A checkpoint's ``config.json`` ``model_type`` picks the
class: ``ouro`` (loopkv's ``OuroForCausalLM``), ``dory`` (transformers' ``DoryForCausalLM``, transformers >= 5.24)
or ``huginn_raven`` (loopkv's ``HuginnForCausalLM``). Documents default to
seeded calibration documents for the byte-level small model (``loopkv.planning.profiler.calibration_documents``);
``--documents`` takes text files (tokenized with the model's tokenizer) or token-id files (``.pt`` / ``.npy``, [N]
or [n, N]).

``import loopkv.cli`` imports only argparse: everything heavy loads inside the command that needs it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Sequence

from loopkv import __version__
from loopkv.cli_errors import (
    UserError,
    check_input_file,
    check_model_dir,
    check_output_file,
    png_path,
    read_token_file,
    reading,
    resolve_device,
    run_command,
    token_rows,
)

DTYPES = ("float32", "bfloat16", "float16")
# The V-precision threshold `loopkv plan` records by default: the paper's (§3.3), the one the demo, the README
# and the benchmarks serve. The profile measures the codec without it (`profile --tau` defaults to inf): at
# tau = 14 a value is read from its high plane only when its weight is below 2^-14 of the row's largest, and
# on the small model KIVI-4 + V has the KL of KIVI-4 to three digits (benchmarks/results/quality.json).
DEFAULT_TAU = 14.0


# ---------------------------------------------------------------------------------------------- parser
def _float(text: str) -> float:
    return math.inf if text.lower() in ("inf", "infinity") else float(text)


def _options(text: str) -> tuple[str, ...]:
    return tuple(o.strip() for o in text.split(",") if o.strip())


def _add_model(p: argparse.ArgumentParser, *, dtype_choice: bool) -> None:
    p.add_argument("model", metavar="MODEL", help="a checkpoint directory, a Hub id in the local Hub cache "
                   "(never downloaded), or 'small' for loopkv's small model")
    p.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    if dtype_choice:
        p.add_argument("--dtype", default="float32", choices=DTYPES, help="activation dtype (default float32)")


def _add_documents(p: argparse.ArgumentParser) -> None:
    p.add_argument("--documents", nargs="+", metavar="FILE",
                   help="text files (one document each) or token-id files (.pt/.npy, [N] or [n, N]); "
                        "default: seeded calibration documents for the byte-level small model")
    p.add_argument("--n-documents", type=int, default=4, help="generated documents (default 4)")
    p.add_argument("--doc-len", type=int, default=None,
                   help="tokens per generated document (default 1024); also truncates --documents")
    p.add_argument("--seed", type=int, default=0, help="seed of the generated documents (default 0)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="loopkv", description="Loop-aware KV-cache compression for looped "
                                     "transformers: profile, plan, show, evaluate, serve.")
    parser.add_argument("--version", action="version", version=f"loopkv {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    from loopkv.planning import cli_support as planning_cli  # light: argparse helpers of the planner

    p = sub.add_parser("profile", help="measure every cell's single-cell damage (resumable)",
                       description="Profile every (loop, layer) cell of MODEL at every option: the fp32 KL "
                       "of applying the option to that cell alone, through a simulation of the served cache.")
    _add_model(p, dtype_choice=False)
    _add_documents(p)
    p.add_argument("--out", required=True, help="profile JSON; the partial profile is saved after every batch")
    p.add_argument("--resume", action="store_true", help="continue the partial profile in --out")
    p.add_argument("--overwrite", action="store_true", help="start over even if --out exists")
    p.add_argument("--options", type=_options, default=("int4", "int2", "share"),
                   help="comma-separated options for non-final cells (default int4,int2,share)")
    p.add_argument("--no-final", action="store_true", help="do not profile the final loop (same as no "
                   "--final-options; plans then count its INT4 as 0 and say so)")
    p.add_argument("--tau", type=_float, default=math.inf, help="V precision threshold (default inf: off)")
    p.add_argument("--share-source", default="int4", choices=("int4", "int2", "bf16"),
                   help="the final loop's option a shared cell reads (default int4)")
    p.add_argument("--share-passes", type=int, default=2,
                   help="passes that iterate a shared cell's source pages to the served fixed point (default 2)")
    p.add_argument("--batch-cells", type=int, default=8, help="measurements per forward (default 8)")
    p.add_argument("--exact-on", metavar="DEVICE", default=None,
                   help="where each document's exact pass is kept between batches (default: the model's device); "
                        "cpu frees GPU memory (about 4.6 GiB per 8K document at Ouro-1.4B's size), same numbers")
    planning_cli.add_profile_arguments(p)

    p = sub.add_parser("plan", help="solve a plan from a profile (exact knapsack)",
                       description="Solve the plan with the least read bytes per token under a damage and a "
                       "storage budget, from a profile. Prints the plan and its predicted figures.")
    p.add_argument("profile", metavar="PROFILE", help="profile JSON from 'loopkv profile'")
    p.add_argument("--preset", choices=("r", "m", "R", "M"),
                   help="r: read-optimized (damage <= 1.19 KL_share); m: memory-optimized (also storage "
                        "<= 0.65 of uniform INT4)")
    p.add_argument("--max-damage", type=_float,
                   help="damage budget in KL_share (--damage-unit abs: nats); required without --preset, "
                        "replaces the preset's with it")
    p.add_argument("--damage-unit", choices=("kl_share", "abs"), default=None,
                   help="unit of --max-damage (default kl_share)")
    p.add_argument("--max-stored-kib", type=_float, help="storage budget, KiB per history token")
    p.add_argument("--storage-fraction", type=_float, help="storage budget as a fraction of uniform INT4")
    p.add_argument("--tau", type=planning_cli.tau_arg, default=DEFAULT_TAU,
                   help=f"V precision threshold recorded in the plan (default {DEFAULT_TAU:g}, the paper's; "
                        "inf turns V precision off), or one per loop: 10,10,inf,inf")
    p.add_argument("--final-option", choices=("int4", "int2", "bf16"), default=None,
                   help="the final loop's option (default int4)")
    p.add_argument("--options", type=_options, default=None,
                   help="options for non-final cells (default int4,int2,share)")
    p.add_argument("--layerwise", action="store_true", help="one option per layer (the paper's ablation)")
    planning_cli.add_plan_arguments(p)
    p.add_argument("--out", required=True, help="plan JSON to write")

    p = sub.add_parser("show", help="print a plan or a profile (optionally a PNG heatmap)")
    p.add_argument("file", metavar="FILE", help="a plan or profile JSON")
    p.add_argument("--png", help="also write a heatmap PNG to this path ('.png' is added if missing; needs "
                   "matplotlib)")
    p.add_argument("--profile", help="a profile JSON, for a plan's predicted damage per loop")

    p = sub.add_parser("eval", help="measure plans' KL through the real LoopKVCache",
                       description="Per document: exact logits, then LoopKVCache(plan) prefill + teacher-forced "
                       "decode; the fp32 KL and next-token agreement over positions >= 320.")
    _add_model(p, dtype_choice=True)
    p.add_argument("--plan", action="append", required=True, help="plan JSON (repeatable)")
    _add_documents(p)
    p.add_argument("--prefill-len", type=int, default=None, help="tokens prefilled before decoding (default 320)")
    p.add_argument("--max-positions", type=int, default=None, help="decode at most this many counted positions")
    p.add_argument("--profile", help="profile JSON: also print predicted vs measured (additivity report)")
    p.add_argument("--random", type=int, default=0, help="with --profile: also measure N random plans")
    planning_cli.add_eval_arguments(p)
    p.add_argument("--json", help="write the results to this JSON file")

    p = sub.add_parser("serve", help="serve a plan over HTTP (OpenAI-compatible /v1/completions)",
                       description="Serve MODEL with LoopKV storage for PLAN on transformers' continuous-batching "
                       "engine: POST /v1/completions (prompt as text or token ids, max_tokens; greedy), GET "
                       "/v1/models, GET /health. Ctrl-C stops it.")
    _add_model(p, dtype_choice=True)
    p.add_argument("--plan", required=True, help="plan JSON (loopkv plan, or Plan.to_json)")
    pool = p.add_mutually_exclusive_group()
    pool.add_argument("--kv-budget-gib", type=float, help="KV memory for the slots' exact sink and window and the "
                      "shared page pool (default: pages for every slot at --max-len)")
    pool.add_argument("--pool-pages", type=int, help="history pages of 32 tokens shared by all requests")
    p.add_argument("--max-slots", type=int, default=8, help="requests decoded at once (default 8)")
    p.add_argument("--max-len", type=int, default=4096, help="tokens per request, prompt + output (default 4096)")
    p.add_argument("--max-batch-tokens", type=int, default=None, help="tokens per engine step (default: "
                   "--max-len + --max-slots, every prompt in one step; with --chunked-prefill, --max-slots + "
                   "min(loopkv.serving.transformers_cb.DEFAULT_CHUNK, --max-len))")
    p.add_argument("--chunked-prefill", action="store_true", help="prefill a prompt the step does not hold whole in "
                   "chunks, one request at a time, exactly (as one pass), through a scratch of --max-len tokens of "
                   "every cell kept beside the pool (out of --kv-budget-gib)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000; 0: any free port)")

    p = sub.add_parser("demo", help="run the loopkv demo (arguments are passed on)", add_help=False)
    p.add_argument("args", nargs=argparse.REMAINDER)
    return parser


# ------------------------------------------------------------------------------------------- helpers
def load_model(spec: str, *, device: str | None = None, dtype: str = "float32"):
    """``small``, a checkpoint directory, or a Hub id already in the local Hub cache (never downloaded) -> an
    eval-mode model on ``device``."""
    import torch

    torch_dtype = getattr(torch, dtype)
    device = resolve_device(device)
    if spec == "small":
        from loopkv.models.small import load_small

        return load_small(dtype=torch_dtype, device=device)
    from loopkv.models.checkpoints import CheckpointError, checkpoint_folder

    try:
        folder = checkpoint_folder(spec)
        check_model_dir(folder)
    except CheckpointError as err:
        raise UserError(str(err)) from err
    model_class = _model_class(folder)
    model = model_class.from_pretrained(folder, dtype=torch_dtype, local_files_only=True)
    return model.to(device).eval()


def _ouro_class():
    from loopkv.models.ouro import OuroForCausalLM, register_ouro

    register_ouro()  # AutoConfig and AutoTokenizer know model_type "ouro" (a text --documents file's tokenizer)
    return OuroForCausalLM


def _dory_class():
    from loopkv.families import check_transformers

    try:
        check_transformers("dory")
    except ValueError as err:
        raise UserError(f"MODEL is a Dory checkpoint: {err}") from err
    from transformers import DoryForCausalLM

    return DoryForCausalLM


def _huginn_class():
    from loopkv.models.huginn import HuginnForCausalLM, register_huginn

    register_huginn()
    return HuginnForCausalLM


# config.json's model_type -> the looped model class the command line loads it with (None: Ouro's older files)
MODEL_TYPES = {"ouro": _ouro_class, None: _ouro_class, "dory": _dory_class, "huginn_raven": _huginn_class}


def _model_class(folder: str):
    """The class that loads checkpoint ``folder``, from its config.json's ``model_type``; a UserError for another."""
    try:
        with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
            model_type = json.load(f).get("model_type")
    except (OSError, ValueError, AttributeError):
        return _ouro_class()  # unreadable or not a JSON object: from_pretrained names the problem
    if model_type not in MODEL_TYPES:
        known = ", ".join(repr(t) for t in MODEL_TYPES if t is not None)
        raise UserError(f"MODEL {folder} is a {model_type!r} checkpoint (config.json's model_type), a model the "
                        f"loopkv command line does not know; it loads {known} checkpoints. Profile another looped "
                        "model from Python: README.md, 'Using it with your looped model'")
    return MODEL_TYPES[model_type]()


def _tokenize(spec: str, text: bytes):
    import torch

    if spec == "small":
        from loopkv.models.small import encode

        return encode(text)
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(spec, local_files_only=True)
    except (OSError, ValueError) as err:
        raise ValueError(f"no tokenizer in {spec} ({err}); pass token-id files (.pt or .npy) as --documents") from err
    return torch.tensor(tokenizer(text.decode("utf-8", errors="replace"))["input_ids"], dtype=torch.long)


def load_documents(args, model) -> list:
    """The documents of a command: ``--documents`` files, or generated calibration documents."""
    if not args.documents:
        from loopkv.planning.profiler import calibration_documents

        docs = calibration_documents(n=args.n_documents, length=args.doc_len or 1024, seed=args.seed)
        top = max(int(d.max()) for d in docs)
        if top >= model.config.vocab_size:
            raise ValueError(f"the default documents are byte tokens (ids up to {top}) but this model's vocabulary "
                             f"has {model.config.vocab_size} ids; pass --documents")
        return docs
    docs = []
    for path in args.documents:
        check_input_file(path, "--documents")
        if path.endswith((".pt", ".npy")):
            data = read_token_file(path)
        else:
            with open(path, "rb") as f:
                data = _tokenize(args.model, f.read())
        rows = token_rows(data, path, vocab_size=model.config.vocab_size)
        docs += [r[: args.doc_len] if args.doc_len else r for r in rows]
    return docs


# ------------------------------------------------------------------------------------------ commands
def _exact_on(spec: str) -> str:
    """``profile --exact-on``: cpu, or a CUDA device this machine has."""
    try:
        return resolve_device(spec)
    except UserError as err:
        raise UserError(str(err).replace("--device", "--exact-on")) from err


def cmd_profile(args) -> int:
    from loopkv.planning.profiler import profile

    check_output_file(args.out, "--out", default_name="profile.json")
    if os.path.exists(args.out) and not (args.resume or args.overwrite):
        raise ValueError(f"{args.out} exists; pass --resume to continue it or --overwrite to start over")
    from loopkv.planning.cli_support import profile_documents

    exact_on = None if args.exact_on is None else _exact_on(args.exact_on)
    model = load_model(args.model, device=args.device)
    docs = profile_documents(args, model, load_documents)
    result = profile(model, docs, options=args.options, final_options=() if args.no_final else args.final_options,
                     tau=args.tau, share_source=args.share_source, share_passes=args.share_passes, out=args.out,
                     resume=args.resume, batch_cells=args.batch_cells, progress=not args.quiet, tf32=args.tf32,
                     exact_on=exact_on)
    from loopkv.planning.show import format_profile

    print(format_profile(result))
    seconds = result.provenance.get("profile_seconds")
    if seconds:
        print(f"{len(result.damage) + 1} measurements in {seconds:.1f} s this run and before "
              f"({(len(result.damage) + 1) / seconds:.2f} cell-option evaluations per second)")
    print(f"wrote {args.out}")
    return 0


def cmd_plan(args) -> int:
    from loopkv.planning.knapsack import solve, solve_layerwise, solve_preset
    from loopkv.planning.profile_data import Profile
    from loopkv.planning.show import format_plan

    check_output_file(args.out, "--out", default_name="plan.json")
    with reading(args.profile, "PROFILE", kind="profile"):
        prof = Profile.from_json(args.profile)
    kwargs = {k: v for k, v in {
        "max_damage": args.max_damage, "damage_unit": args.damage_unit, "max_stored_kib": args.max_stored_kib,
        "storage_fraction": args.storage_fraction, "tau": args.tau, "final_option": args.final_option,
        "options": args.options,
    }.items() if v is not None}
    from loopkv.planning.cli_support import plan_kwargs

    kwargs.update(plan_kwargs(args))  # objective, read budget, final options, fix/forbid rules
    import warnings

    from loopkv.planning.knapsack import UncountedDamageWarning

    warnings.simplefilter("ignore", UncountedDamageWarning)  # format_plan prints what is not counted
    if args.damage_unit is not None and args.max_damage is None:
        raise UserError("--damage-unit is the unit of --max-damage; pass --max-damage too")
    if args.max_damage is not None:  # KL_share by default, with --preset as without it
        kwargs.setdefault("damage_unit", "kl_share")
    if args.preset is not None:
        if args.layerwise:
            raise ValueError("--layerwise takes explicit budgets (--max-damage ...), not --preset")
        plan = solve_preset(prof, args.preset, **kwargs)
    else:
        if args.max_damage is None:
            raise ValueError("pass --preset r|m or a damage budget --max-damage (in KL_share by default)")
        kwargs.setdefault("damage_unit", "kl_share")
        plan = (solve_layerwise if args.layerwise else solve)(prof, **kwargs)
    plan.to_json(args.out)
    print(format_plan(plan, profile=prof))
    print(f"wrote {args.out}")
    return 0


def cmd_show(args) -> int:
    from loopkv.planning.profile_data import Profile
    from loopkv.planning.show import show_file

    png = png_path(args.png) if args.png else None
    if png is not None:
        check_output_file(png, "--png", default_name="plan.png")
    prof = None
    if args.profile:
        with reading(args.profile, "--profile", kind="profile"):
            prof = Profile.from_json(args.profile)
    try:
        with reading(args.file, "FILE", kind="plan or profile"):
            text = show_file(args.file, profile=prof, png=png)
    except ImportError as err:  # --png without matplotlib
        raise UserError(f"--png: {err}") from err
    print(text)
    if png is not None:
        print(f"wrote {png}")
    return 0


def cmd_eval(args) -> int:
    from loopkv.planning.evaluate import measure_kl, random_plans
    from loopkv.planning.plan import Plan
    from loopkv.planning.profile_data import Profile

    if args.random and not args.profile:
        raise ValueError("--random needs --profile (random plans are drawn on the profile's shape)")
    if args.json:
        check_output_file(args.json, "--json", default_name="eval.json")
    prof = None
    if args.profile:
        with reading(args.profile, "--profile", kind="profile"):
            prof = Profile.from_json(args.profile)
    plans = []
    for path in args.plan:
        with reading(path, "--plan", kind="plan"):
            plans.append(Plan.from_json(path))
    names = list(args.plan)
    if args.random:
        extra = random_plans(prof, args.random, seed=args.seed)
        plans += extra
        names += [f"random #{i}" for i in range(len(extra))]
    model = load_model(args.model, device=args.device, dtype=args.dtype)
    for plan in plans:
        plan.validate_for(model.config)
    if prof is not None:
        prof.validate_for(model.config)
    docs = load_documents(args, model)
    results = []
    for name, plan in zip(names, plans, strict=True):
        r = measure_kl(model, plan, docs, prefill_len=args.prefill_len, max_positions=args.max_positions,
                       progress=not args.quiet)
        results.append(r)
        unit = f" = {r.kl / prof.kl_share:.4g} KL_share" if prof is not None and prof.kl_share else ""
        print(f"{name}: KL {r.kl:.4g} nats/token{unit}, next-token agreement {r.agreement:.4f} "
              f"({r.positions} positions from {r.first_position})")
    out = {"plans": names, "results": [r.to_dict() for r in results], "model": args.model}
    if prof is not None:
        from loopkv.planning.cli_support import additivity

        report = additivity(names, plans, results, prof, args, n_named=len(args.plan))
        print(report.format())
        out["additivity"] = report.to_dict()
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=1)
        print(f"wrote {args.json}")
    return 0


def cmd_serve(args) -> int:
    from loopkv.planning.plan import Plan

    for flag, value, low in (("--max-slots", args.max_slots, 1), ("--max-len", args.max_len, 1),
                             ("--pool-pages", args.pool_pages, 1), ("--max-batch-tokens", args.max_batch_tokens, 1)):
        if value is not None and value < low:
            raise UserError(f"{flag} {value}: pass a positive integer")
    if args.kv_budget_gib is not None and not args.kv_budget_gib > 0:
        raise UserError(f"--kv-budget-gib {args.kv_budget_gib}: pass a positive number of GiB")
    if not 0 <= args.port <= 65535:
        raise UserError(f"--port {args.port}: pass a port from 0 to 65535 (0: any free port)")
    with reading(args.plan, "--plan", kind="plan"):
        plan = Plan.from_json(args.plan)
    from loopkv.serving import server as serving

    model = load_model(args.model, device=args.device, dtype=args.dtype)
    with reading(args.plan, "--plan", kind="plan"):
        plan.validate_for(model.config)
    try:
        srv = serving.from_arguments(model, plan, args.model, max_slots=args.max_slots, max_len=args.max_len,
                                     pool_pages=args.pool_pages, kv_budget_gib=args.kv_budget_gib,
                                     max_batch_tokens=args.max_batch_tokens, chunked_prefill=args.chunked_prefill,
                                     host=args.host, port=args.port)
    except (NotImplementedError, RuntimeError) as err:  # transformers' engine: unsupported version, cannot start
        raise UserError(str(err)) from err
    print(serving.banner(srv, args.plan), flush=True)
    serving.serve_until_stopped(srv)
    print("loopkv serve: stopped", file=sys.stderr)
    return 0


def cmd_demo(args) -> int:
    from loopkv import demo

    code = demo.main(list(args.args))
    return 0 if code is None else int(code)


COMMANDS = {"profile": cmd_profile, "plan": cmd_plan, "show": cmd_show, "eval": cmd_eval, "demo": cmd_demo,
            "serve": cmd_serve}


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``loopkv`` command line; returns the exit status (2 on a usage or input error)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["demo"]:  # the demo parses its own options (argparse.REMAINDER drops leading --options)
        return run_command("demo", cmd_demo, argparse.Namespace(command="demo", args=argv[1:]))
    args = build_parser().parse_args(argv)
    return run_command(args.command, COMMANDS[args.command], args)


if __name__ == "__main__":
    sys.exit(main())
