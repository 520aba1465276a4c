"""How large cc_opts "k16"'s fp16 rounding is next to the codes' own error (CPU, Triton's interpreter).

The same random keys and values (per-channel key spread, as in ``tests/ops/test_triton_attention.make_cell``) are
stored once as BF16 pages and once as INT4 / INT2 codes. Against the float64 reference on the codes, the fp32
reader and the "k16" reader (K's field work in packed fp16 pairs, ``loopkv/ops/triton_far.py``); and the codes'
own error, the float64 reference on the codes against the one on the unquantized pages. Relative L2 norms of the
attention output of one cell (3 rows of 0-3 history pages, 2 KV heads x 128).

    TRITON_INTERPRET=1 PYTHONPATH=. python benchmarks/probe_k16_error.py \
        --out benchmarks/results/k16_error_<date>_cpu.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="JSON path")
    args = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") != "1":
        p.error("run under TRITON_INTERPRET=1 (the CPU has no GPU; the readers run in Triton's interpreter)")
    sys.path.insert(0, str(ROOT))
    from loopkv.ops import triton_attention as ta
    from tests.ops.test_triton_attention import make_cell, reference64

    lengths = [288 + 32 * 3 + 5, 288 + 32 * 2, 300]
    scale = 128**-0.5
    kw = {"splits": 2, "far_impl": "cc", "num_warps": 1, "sub_tokens": 8}
    rows = []
    for bits in (4, 2):
        for q_std in (1.0, 2.0):
            dense = make_cell(len(lengths), 2, 128, 4, 16, lengths, seed=11)
            codes = make_cell(len(lengths), 2, 128, 4, bits, lengths, seed=11)  # the same K and V, encoded
            q = q_std * torch.randn(len(lengths), 2, 128, generator=torch.Generator().manual_seed(3))
            want_dense = reference64(q, dense, 16, math.inf, scale)
            want = reference64(q, codes, bits, math.inf, scale)
            fp32 = ta.cell_attention(q, *codes, bits, math.inf, scale, cc_opts=("qk", "vg", "f24"), **kw)
            k16 = ta.cell_attention(q, *codes, bits, math.inf, scale, cc_opts=("qk", "vg", "f24", "k16"), **kw)

            def rel(a, b):
                return float((a.double() - b).norm() / b.norm())

            row = {"bits": bits, "q_std": q_std, "codes_vs_unquantized": rel(want, want_dense),
                   "fp32_reader_vs_codes": rel(fp32, want), "k16_vs_codes": rel(k16, want)}
            row["codes_error_over_k16_error"] = row["codes_vs_unquantized"] / row["k16_vs_codes"]
            rows.append(row)
            print(f"INT{bits} q std {q_std}: codes vs unquantized {row['codes_vs_unquantized']:.2e}, "
                  f"fp32 reader vs codes {row['fp32_reader_vs_codes']:.2e}, k16 vs codes {row['k16_vs_codes']:.2e} "
                  f"({row['codes_error_over_k16_error']:.0f}x below the codes' error)", flush=True)
    result = {"probe": "probe_k16_error", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
              "torch": torch.__version__, "rows": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
