"""Static size of the cell-attention reader's page loop on sm_90, as the launcher would launch it (no GPU).

Compiles the launch through ``tests/ops/sm90_compile_check.py`` (Triton's own ``ptxas``, the launcher's register cap
and options), disassembles it with Triton's ``cuobjdump`` and takes the longest backward branch as the page loop
(the reader's history loop is the kernel's largest loop). Prints, per case: registers, stack bytes, the loop's
instruction count and its spill loads (``LDL``). Used in session 11 to check that ``token_attention_``'s launch
(``APPEND = 2``) leaves the page loop as it was (docs/design-decisions.md §12).

    python benchmarks/probe_page_loop.py --bits 2 --batch 32 --variants plain,token

Run it in a fresh process without ``TRITON_INTERPRET`` (the interpreter is chosen when ``@triton.jit`` decorates).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = {"plain": {}, "token": {"token": True}, "append": {"append": True}}


def page_loop(case: dict) -> dict:
    """Registers, stack, and the page loop's instruction count and opcodes of one ``sm90_compile_check`` case."""
    import triton

    sys.path[:0] = [str(ROOT / "tests" / "ops"), str(ROOT)]
    import sm90_compile_check as chk

    with tempfile.TemporaryDirectory() as d:
        res = chk.main(dict(case, cubin=os.path.join(d, "k.cubin")))
        tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
        sass = subprocess.run([tool, "-sass", os.path.join(d, "k.cubin")], capture_output=True, text=True,
                              check=True).stdout
    ins = []
    for line in sass.splitlines():
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if m:
            ins.append((int(m.group(1), 16), m.group(2).strip()))
    loop = None
    for addr, text in ins:
        m = re.search(r"BRA.*?0x([0-9a-f]+)", text)
        if m and int(m.group(1), 16) < addr and (loop is None or addr - int(m.group(1), 16) > loop[1] - loop[0]):
            loop = (int(m.group(1), 16), addr)
    body = [t for a, t in ins if loop and loop[0] <= a <= loop[1]]
    ops = collections.Counter((t.split()[1] if t.startswith("@") else t.split()[0]).split(".")[0] for t in body)
    return {"registers": res["registers"], "stack": res["stack"], "loop_instructions": len(body),
            "spill_loads": ops.get("LDL", 0), "opcodes": dict(ops.most_common())}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--tau", type=float, default=None, help="V precision (INT4); default none")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--variants", default="plain,token", help=f"comma-separated: {', '.join(VARIANTS)}")
    p.add_argument("--cc-opts", default=None,
                   help="comma-separated cc_opts of the CUDA-core reader instead of the launcher's default "
                        "(e.g. qk,vg,f24,l2,pt,k16)")
    p.add_argument("--maxnreg", type=int, default=None,
                   help="register cap for ptxas instead of the launcher's (e.g. 112: 18 one-warp programs per SM)")
    p.add_argument("--out", default=None, help="JSON path")
    args = p.parse_args(argv)
    rows = {}
    for name in args.variants.split(","):
        case = {"bits": args.bits, "tau": args.tau, "batch": args.batch, "heads": args.heads, "group": 1,
                "head_dim": args.head_dim, **VARIANTS[name]}
        if args.cc_opts is not None:
            case["cc_opts"] = [o for o in args.cc_opts.split(",") if o]
        if args.maxnreg is not None:
            case["maxnreg"] = args.maxnreg
        rows[name] = page_loop(case)
        r = rows[name]
        print(f"{name:7s} registers {r['registers']} stack {r['stack']} page loop {r['loop_instructions']} "
              f"instructions, {r['spill_loads']} spill loads", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"probe": "probe_page_loop", "args": vars(args), "rows": rows}, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
