"""Served-path quality of the CUDA-core reader's variants on the small model (GPU; session 13).

``loopkv demo`` and ``bench_quality.py`` measure a plan's quality by dense simulation (reference quantization and
fp32 attention), so they cannot see how a reader rounds. This probe serves the small model in bf16 through
``LoopKVCache`` (prefill, then teacher-forced decode one token per step: every cell read by the Triton kernel), once
per reader setting, and compares each step's logits with the exact fp32 model on the same held-out documents:

* KL(exact || served) and next-token agreement with the exact model, per arm and reader;
* KL and agreement between the two readers' served logits, and their largest logit difference.

Readers: ``k16`` is the default (K's code fields in fp16 pairs, ``triton_far._k_sub16``); ``k32`` drops it (fp32
field work, the default up to session 12), through ``triton_config.cc_options``.

Run: ``PYTHONPATH=. python benchmarks/probe_served_quality.py`` (CUDA; the steps run eagerly, about 40 ms each on
the H200, so the defaults' 448 steps per arm and reader take about 3.5 minutes for the five arms; session 13 cut a
run of 6 x 1024 tokens in its fifth arm). On CPU the cache runs the PyTorch reference ops, which have no reader
variants: ``--smoke`` only checks the script end to end.
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import platform
import time
from collections.abc import Sequence

import torch

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
READERS = {"k32": ("k16",), "k16": ()}  # reader name -> variants dropped from the default


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--docs", type=int, default=8, help="held-out documents (one batch)")
    p.add_argument("--len", type=int, default=768, help="tokens per document")
    p.add_argument("--prefill", type=int, default=320, help="prompt tokens; the rest are decoded one per step")
    p.add_argument("--arms", default="", help="comma-separated arm names (default: the demo's five)")
    p.add_argument("--smoke", action="store_true", help="CPU, one short document: checks the script only")
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/served_quality_<date>.json)")
    args = p.parse_args(argv)
    if args.smoke:
        args.docs, args.len, args.prefill = 1, 328, 320
    if not 0 < args.prefill < args.len:
        p.error(f"--prefill must be between 1 and --len - 1, got {args.prefill} with --len {args.len}")
    return args


def kl_and_agreement(ref: torch.Tensor, got: torch.Tensor) -> tuple[float, float]:
    """Mean KL(softmax(ref) || softmax(got)) in fp64 and argmax agreement, over all positions."""
    lp, lq = torch.log_softmax(ref.double(), -1), torch.log_softmax(got.double(), -1)
    kl = (lp.exp() * (lp - lq)).sum(-1).clamp_min(0).mean().item()
    return kl, (ref.argmax(-1) == got.argmax(-1)).double().mean().item()


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


def versions() -> dict:
    import importlib.metadata as md

    out = {"python": platform.python_version(), "torch": torch.__version__}
    for name in ("transformers", "triton"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = None
    return out


def main(argv: Sequence[str] | None = None) -> int:
    from loopkv.demo import PROFILE_FILE, _arms
    from loopkv.models.data import heldout_windows, load_corpus
    from loopkv.models.small import SMALL_DIR, load_small
    from loopkv.ops import triton_config
    from loopkv.planning import Plan
    from loopkv.planning.profile_data import Profile

    args = _parse(argv)
    device = "cpu" if args.smoke or not torch.cuda.is_available() else "cuda"
    if device == "cpu" and not args.smoke:
        raise SystemExit("probe_served_quality needs CUDA (on CPU the readers do not run); --smoke checks the script")
    t0 = time.perf_counter()
    exact_model = load_small(dtype=torch.float32, device=device)
    model = load_small(dtype=torch.bfloat16, device=device)
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
    out = pathlib.Path(args.out or RESULTS / f"served_quality_{datetime.date.today().isoformat()}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    result = {
        "benchmark": "probe_served_quality",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(0) if device == "cuda" else f"cpu ({platform.processor() or 'smoke'})",
        "versions": versions(), "args": vars(args), "decode_steps": args.len - args.prefill, "rows": rows,
        "complete": False,
    }
    for arm in arms:
        got = {}
        for reader, drop in READERS.items():
            with triton_config.cc_options(drop=drop):
                got[reader] = served_logits(model, arm.plan, ids, args.prefill)
            kl, agree = kl_and_agreement(exact, got[reader])
            rows.append({"arm": arm.name, "reader": reader, "kl_vs_exact": kl, "agreement_vs_exact": agree})
        kl, agree = kl_and_agreement(got["k32"], got["k16"])
        rows.append({"arm": arm.name, "reader": "k16 vs k32", "kl": kl, "agreement": agree,
                     "max_abs_logit_diff": (got["k16"] - got["k32"]).abs().max().item()})
        result["seconds"] = time.perf_counter() - t0
        out.write_text(json.dumps(result, indent=1))  # after every arm: a run cut short keeps what it measured
        print(f"{arm.name} done at {time.perf_counter() - t0:.0f} s", flush=True)
    result["complete"] = True
    out.write_text(json.dumps(result, indent=1))
    print(f"\nsmall model in bf16 served through LoopKVCache, {args.docs} document(s), {args.len - args.prefill} "
          f"teacher-forced decode steps after a {args.prefill}-token prefill, on {device}")
    print(f"{'arm':14s} {'reader':11s} {'KL vs exact':>12s} {'agree':>7s} {'KL k16||k32':>12s} {'agree':>7s} "
          f"{'max |dlogit|':>12s}")
    for r in rows:
        if r["reader"] == "k16 vs k32":
            print(f"{r['arm']:14s} {r['reader']:11s} {'':>12s} {'':>7s} {r['kl']:12.2e} {r['agreement']:7.2%} "
                  f"{r['max_abs_logit_diff']:12.2e}")
        else:
            print(f"{r['arm']:14s} {r['reader']:11s} {r['kl_vs_exact']:12.2e} {r['agreement_vs_exact']:7.2%}")
    print(f"wrote {out} in {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
