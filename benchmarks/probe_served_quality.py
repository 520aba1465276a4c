"""Served-path quality of the CUDA-core reader's variants on the small model (GPU; session 13).

``loopkv demo`` and ``bench_quality.py`` measure a plan's quality by dense simulation (reference quantization and
fp32 attention), so they cannot see how a reader rounds. This probe serves the small model in bf16 (``--dtype``) through
``LoopKVCache`` (prefill, then teacher-forced decode one token per step: every cell read by the Triton kernel), once
per reader setting, and compares each step's logits with the exact fp32 model on the same held-out documents:

* KL(exact || served) and next-token agreement with the exact model, per arm and reader;
* KL, agreement and the largest logit difference between each reader's served logits and ``k32``'s.

Readers: ``k16`` is the default (K's code fields in fp16 pairs, ``triton_far._k_sub16``); ``k32`` drops it (fp32
field work, the default up to session 12), through ``triton_config.cc_options``; ``dot`` is the tensor-core reader
(fp16 operands), and with ``--interpret`` ``reference`` is the PyTorch reference ops (fp32 math on the stored
codes). The last two are controls: in a bf16 model any change of rounding moves the logits, so how far k16 is from
k32 means something only beside how far two other correct readers are from it.

Run: ``PYTHONPATH=. python benchmarks/probe_served_quality.py`` (CUDA; the steps run eagerly, about 40 ms each on
the H200, so the defaults' 448 steps per arm and reader take about 5 minutes for five arms and three readers;
session 13 cut a run of 6 x 1024 tokens with two readers in its fifth arm). On CPU the cache runs the PyTorch
reference ops, which have no reader variants: ``--smoke`` only checks the script end to end, and ``--reference``
serves every arm through them at full size (the ops' specification, fp32 math on the stored codes): the served
baseline a GPU run's readers are compared with (session 14). ``--simulate`` adds, per arm, the dense simulation that
``loopkv demo`` and ``bench_quality.py`` report, on the same documents and positions, so their numbers can be set
beside the served cache's (``--dtype float32`` to compare like with like). ``--interpret`` (CPU,
no GPU needed) registers the Triton kernels as the ops' CPU kernels under ``TRITON_INTERPRET=1``, so the readers
run as on the GPU (the interpreter computes "k16"'s fp16 pairs with the same roundings; docs/kernel-notes.md,
session 12), at tens of seconds per decode step: use a short run, e.g. ``--interpret --docs 1 --len 464
--prefill 448 --arms LoopKV-M``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import pathlib
import platform
import time
from collections.abc import Iterator, Sequence

import torch

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
READERS = ("k32", "k16", "dot")  # the first is the base the others are compared with; "reference": --interpret


@contextlib.contextmanager
def reader(name: str) -> Iterator[None]:
    """The cache's kernels read with ``name``: "k32" / "k16" (the CUDA-core reader without / with "k16") or "dot"
    (the tensor-core reader for every cell, ``triton_attention.CC_DEFAULT`` off)."""
    from loopkv.ops import triton_attention, triton_config

    if name not in READERS:
        raise ValueError(f"reader {name!r}: choose from {READERS}")
    with triton_config.cc_options(drop=("k16",) if name == "k32" else ()):
        saved = triton_attention.CC_DEFAULT
        triton_attention.CC_DEFAULT = name != "dot"
        try:
            yield
        finally:
            triton_attention.CC_DEFAULT = saved


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--docs", type=int, default=8, help="held-out documents (one batch)")
    p.add_argument("--len", type=int, default=768, help="tokens per document")
    p.add_argument("--prefill", type=int, default=320, help="prompt tokens; the rest are decoded one per step")
    p.add_argument("--arms", default="", help="comma-separated arm names (default: the demo's five)")
    p.add_argument("--readers", default=",".join(READERS),
                   help=f"comma-separated readers, the first the base of the comparisons (default {','.join(READERS)})")
    p.add_argument("--smoke", action="store_true", help="CPU, one short document: checks the script only")
    p.add_argument("--interpret", action="store_true",
                   help="CPU: the Triton kernels under TRITON_INTERPRET=1 as the ops' CPU kernels (slow)")
    p.add_argument("--reference", action="store_true",
                   help="CPU: serve through the PyTorch reference ops only (the ops' specification), at any size: "
                        "the served baseline for a GPU run's rows")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                   help="the served model's dtype (the exact reference is always fp32)")
    p.add_argument("--simulate", action="store_true",
                   help="also the demo's dense simulation of each plan (loopkv.demo, the numbers `loopkv demo` and "
                        "bench_quality report) on the same documents and positions, compared with the served cache")
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/served_quality_<date>.json)")
    args = p.parse_args(argv)
    if args.smoke:
        args.docs, args.len, args.prefill = 1, 328, 320
    if args.reference and (args.smoke or args.interpret):
        p.error("--reference runs the reference ops alone; it does not combine with --smoke or --interpret")
    args.readers = args.readers.split(",")
    unknown = sorted(set(args.readers) - set(READERS))
    if unknown or len(args.readers) < 2:
        p.error(f"--readers: two or more of {READERS}, got {args.readers}")
    if not 0 < args.prefill < args.len:
        p.error(f"--prefill must be between 1 and --len - 1, got {args.prefill} with --len {args.len}")
    return args


def served_logits(model, plan, ids: torch.Tensor, prefill: int) -> torch.Tensor:
    """Logits at positions ``prefill .. len-1`` of ``ids`` (B, len): prefill, then one token per decode step."""
    import loopkv

    cache = loopkv.LoopKVCache(plan, config=model.config, max_batch_size=ids.shape[0], max_cache_len=ids.shape[1],
                               dtype=model.dtype, device=model.device)
    out = []
    with torch.no_grad():
        model(input_ids=ids[:, :prefill], past_key_values=cache)
        for t in range(prefill, ids.shape[1]):
            out.append(model(input_ids=ids[:, t:t + 1], past_key_values=cache).logits[:, -1].float())
    return torch.stack(out, 1)


def simulated_logits(model, plan, ids: torch.Tensor, prefill: int) -> torch.Tensor:
    """What ``loopkv demo`` reports for ``plan``: its dense simulation (``loopkv.demo._simulate``: reference
    quantization, share sources iterated two passes toward the served fixed point), per document, at the positions
    ``served_logits`` returns."""
    from loopkv.demo import _simulate

    return torch.stack([_simulate(model, plan, doc, prefill_len=prefill, logits_from=prefill) for doc in ids])


def versions() -> dict:
    import importlib.metadata as md

    out = {"python": platform.python_version(), "torch": torch.__version__}
    for name in ("transformers", "triton"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = None
    return out


def use_interpreter() -> None:
    """``TRITON_INTERPRET=1``, which Triton reads when it loads (torch may load it early): call before any work."""
    import os
    import sys

    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("--interpret: Triton was imported before TRITON_INTERPRET=1 could be set; set it in the "
                         "environment instead")
    os.environ["TRITON_INTERPRET"] = "1"


def interpret_on_cpu() -> None:
    """The Triton launchers as the loopkv ops' CPU kernels, run by Triton's interpreter (``use_interpreter`` first)."""
    from loopkv.ops.triton_register import launchers

    for op, launcher in launchers():
        op.register_kernel("cpu")(launcher)


def main(argv: Sequence[str] | None = None) -> int:
    from loopkv.demo import PROFILE_FILE, _arms, kl_and_agreement
    from loopkv.models.data import heldout_windows, load_corpus
    from loopkv.models.small import SMALL_DIR, load_small
    from loopkv.planning import Plan
    from loopkv.planning.profile_data import Profile

    args = _parse(argv)
    device = "cpu" if args.smoke or args.interpret or not torch.cuda.is_available() else "cuda"
    if args.reference:
        device = "cpu"
    elif device == "cpu" and not (args.smoke or args.interpret):
        raise SystemExit("probe_served_quality needs CUDA, or on CPU --reference (the reference ops) or --interpret "
                         "(the kernels, slow); --smoke checks the script")
    if args.interpret:
        use_interpreter()
    t0 = time.perf_counter()
    exact_model = load_small(dtype=torch.float32, device=device)
    model = load_small(dtype=getattr(torch, args.dtype), device=device)
    cfg = model.config
    ids = torch.stack(list(heldout_windows(load_corpus(), n=args.docs, seq_len=args.len, seed=1))).to(device)
    with torch.no_grad():
        exact = exact_model(input_ids=ids).logits[:, args.prefill:].float()
    del exact_model
    arms = _arms(Profile.from_json(SMALL_DIR / PROFILE_FILE), cfg)
    arms[0].plan = Plan.uniform(loops=cfg.total_ut_steps, layers=cfg.num_hidden_layers, option="bf16")
    if args.arms:
        names = args.arms.split(",")
        unknown = sorted(set(names) - {a.name for a in arms})
        if unknown:
            raise SystemExit(f"--arms: unknown {unknown}; choose from {[a.name for a in arms]}")
        arms = [a for a in arms if a.name in names]
    variants = [] if args.reference else args.readers  # the reader settings switched per arm (CUDA, --interpret)
    out = pathlib.Path(args.out or RESULTS / f"served_quality_{datetime.date.today().isoformat()}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    result = {
        "benchmark": "probe_served_quality",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": (torch.cuda.get_device_name(0) if device == "cuda" else
                   f"cpu ({'Triton interpreter' if args.interpret else 'reference ops'})"),
        "readers": (["reference"] if args.reference or args.interpret else []) + variants,
        "versions": versions(), "args": vars(args), "decode_steps": args.len - args.prefill, "rows": rows,
        "complete": False,
    }
    got = {arm.name: {} for arm in arms}
    if args.interpret:  # the reference ops first: they are the CPU kernels until the interpreted ones replace them
        for arm in arms:
            got[arm.name]["reference"] = served_logits(model, arm.plan, ids, args.prefill)
        interpret_on_cpu()
    base = variants[0] if variants else "reference"
    for arm in arms:
        if args.reference:  # the reference ops, which are the CPU kernels: no reader variants to switch
            got[arm.name]["reference"] = served_logits(model, arm.plan, ids, args.prefill)
        for name in variants:
            with reader(name):
                got[arm.name][name] = served_logits(model, arm.plan, ids, args.prefill)
        if args.simulate:
            got[arm.name]["simulated"] = simulated_logits(model, arm.plan, ids, args.prefill)
        for name, logits in got[arm.name].items():
            kl, agree = kl_and_agreement(exact.double(), logits.double())  # in fp64
            rows.append({"arm": arm.name, "reader": name, "kl_vs_exact": kl, "agreement_vs_exact": agree})
        for name, logits in got[arm.name].items():
            if name != base:
                kl, agree = kl_and_agreement(got[arm.name][base].double(), logits.double())
                rows.append({"arm": arm.name, "reader": f"{name} vs {base}", "kl": kl, "agreement": agree,
                             "max_abs_logit_diff": (logits - got[arm.name][base]).abs().max().item()})
        result["seconds"] = time.perf_counter() - t0
        out.write_text(json.dumps(result, indent=1))  # after every arm: a run cut short keeps what it measured
        print(f"{arm.name} done at {time.perf_counter() - t0:.0f} s", flush=True)
    result["complete"] = True
    out.write_text(json.dumps(result, indent=1))
    print(f"\nsmall model in {args.dtype} served through LoopKVCache, {args.docs} document(s), "
          f"{args.len - args.prefill} teacher-forced decode steps after a {args.prefill}-token prefill, on {device}")
    print(f"{'arm':14s} {'reader':16s} {'KL vs exact':>12s} {'agree':>7s} {'KL base||it':>12s} {'agree':>7s} "
          f"{'max |dlogit|':>12s}")
    for r in rows:
        if " vs " in r["reader"]:
            print(f"{r['arm']:14s} {r['reader']:16s} {'':>12s} {'':>7s} {r['kl']:12.2e} {r['agreement']:7.2%} "
                  f"{r['max_abs_logit_diff']:12.2e}")
        else:
            print(f"{r['arm']:14s} {r['reader']:16s} {r['kl_vs_exact']:12.2e} {r['agreement_vs_exact']:7.2%}")
    print(f"wrote {out} in {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
