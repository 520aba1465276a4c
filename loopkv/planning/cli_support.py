"""The planning side of ``loopkv profile / plan / eval``: their planner arguments and what the handlers in
:mod:`loopkv.cli` delegate to. Imports nothing heavy at module level (``import loopkv.cli`` stays light)."""

from __future__ import annotations

import argparse
import math
import os
from typing import Any

from loopkv.planning.constraints import SYNTAX, parse_rule

FINAL_CHOICES = ("bf16", "int4", "int2")


# ------------------------------------------------------------------------------------------ argument types
def tau_arg(text: str) -> float | tuple[float, ...]:
    """``14``, ``inf``, or one value per loop: ``10,10,inf,inf``."""
    try:
        values = tuple(math.inf if v.strip().lower() in ("inf", "infinity") else float(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a threshold: give a number, 'inf', or one per loop such as 10,10,inf,inf") from None
    if any(math.isnan(v) or v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: thresholds must be >= 0 (inf: V precision off)")
    return values[0] if len(values) == 1 else values


def rule_arg(text: str) -> str:
    """A fix/forbid rule, checked now so that a typo is an argument error."""
    try:
        parse_rule(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return text


def final_options_arg(text: str) -> tuple[str, ...]:
    options = tuple(o.strip() for o in text.split(",") if o.strip())
    bad = [o for o in options if o not in FINAL_CHOICES]
    if bad or not options:
        raise argparse.ArgumentTypeError(f"final-loop options are from {','.join(FINAL_CHOICES)} (the final loop "
                                         f"cannot share), got {text!r}")
    return options


# ------------------------------------------------------------------------------------------ parsers
def add_profile_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--final-options", type=final_options_arg, default=("int4", "int2"),
                   help="comma-separated options the final loop's cells are profiled at (default int4,int2); "
                        "plans count the final loop's damage only where it was profiled")
    p.add_argument("--generate", type=int, metavar="N", default=None,
                   help="profile on N documents sampled from MODEL itself (the paper's calibration), saved beside "
                        "--out as NAME.generated.pt and resumed from it; --documents become the prompts "
                        "(default: the BOS token)")
    p.add_argument("--length", type=int, metavar="L", default=None,
                   help="tokens per generated document, prompt included (with --generate; e.g. 8192)")
    p.add_argument("--generate-batch", type=int, default=1,
                   help="documents sampled together (default 1; results depend on it)")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature of --generate (default 1)")
    p.add_argument("--tf32", action="store_true",
                   help="TF32 matmuls on CUDA (faster; changes the numbers: see benchmarks/bench_profile.py)")


def add_plan_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--objective", choices=("read", "stored"), default="read",
                   help="what to minimise: read bytes (default, the paper's planner) or stored bytes")
    p.add_argument("--max-read-kib", type=float, help="read budget, KiB per history token (with V precision at "
                   "--hot-fraction when tau is finite)")
    p.add_argument("--hot-fraction", type=float, default=None,
                   help="expected fraction of history tokens read in full under V precision (default 1: reads "
                        "counted as if every token were hot)")
    p.add_argument("--final-options", type=final_options_arg, default=None,
                   help="options the final loop's cells may take, chosen per layer (default int4)")
    p.add_argument("--fix", type=rule_arg, action="append", metavar="RULE",
                   help=f"restrict cells to options, repeatable: {SYNTAX}; several options as int4|bf16")
    p.add_argument("--forbid", type=rule_arg, action="append", metavar="RULE",
                   help="remove options from cells, repeatable, same syntax (e.g. '*:7=int2')")


def add_eval_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--correction", metavar="JSON",
                   help="with --profile: apply this additivity correction (an eval --json output, or a JSON with "
                        "'own' and 'shared' factors) instead of fitting one on the --plan plans")


# ------------------------------------------------------------------------------------------ handlers
def profile_documents(args: Any, model: Any, load_documents: Any) -> list:
    """The documents ``loopkv profile`` measures on: generated from the model (``--generate``) or loaded."""
    if args.generate is None:
        if args.length is not None:
            raise ValueError("--length is the length of --generate's documents; pass --generate N too")
        return load_documents(args, model)
    from loopkv.planning.generate import generate_documents, generated_path, settings_path

    if args.length is None:
        raise ValueError("--generate N needs --length L (tokens per document, e.g. 8192)")
    prompts = load_documents(args, model) if args.documents else None
    path = generated_path(args.out)
    if args.overwrite:
        for stale in (path, settings_path(path)):
            if os.path.exists(stale):
                os.remove(stale)
    docs = generate_documents(model, n=args.generate, length=args.length, seed=args.seed, prompts=prompts,
                              batch=args.generate_batch, temperature=args.temperature, out=path,
                              progress=not args.quiet)
    print(f"{len(docs)} generated documents of {args.length} tokens in {path}")
    return docs


def plan_kwargs(args: Any) -> dict[str, Any]:
    """The solver keywords of ``loopkv plan``'s planner arguments (those left at None are not passed)."""
    kwargs = {"objective": args.objective, "max_read_kib": args.max_read_kib, "final_options": args.final_options,
              "fix": args.fix, "forbid": args.forbid, "hot_fraction": args.hot_fraction}
    if args.final_options is not None and args.final_option is not None:
        raise ValueError("pass --final-option or --final-options, not both")
    return {k: v for k, v in kwargs.items() if v is not None}


def additivity(names: list, plans: list, results: list, profile: Any, args: Any, n_named: int):
    """The additivity report of ``loopkv eval --profile``: the raw sum and the two-family correction, fitted
    on the ``n_named`` named plans (scored on the random ones) or read from ``--correction``."""
    import json

    from loopkv.planning.correction import Correction
    from loopkv.planning.evaluate import summarize
    from loopkv.planning.knapsack import predicted_damage

    correction = None
    if args.correction:
        with open(args.correction, encoding="utf-8") as f:
            data = json.load(f)
        data = data.get("additivity", {}).get("correction", data) if isinstance(data, dict) else data
        correction = Correction.from_dict(data)
    return summarize(names, [predicted_damage(profile, p) for p in plans], [r.kl for r in results],
                     kl_share=profile.kl_share, results=results, plans=plans, correction=correction,
                     fit_on=range(n_named))
