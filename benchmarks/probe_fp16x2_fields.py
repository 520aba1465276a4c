"""How many SASS instructions a 2-bit code field costs: the reader's fp32 way against fp16x2 pairs (static, no GPU).

The CUDA-core reader (``loopkv/ops/triton_far.py``) spends one ``LOP3`` (mask the field; read as an fp32 subnormal
it is ``2**(s - 149) * field``) and one ``FFMA`` on every code field. At INT2 that field work is 524 of the 776
instructions of the page loop, and the loop is close to issue-bound (ncu, session 10: 72% of issue slots;
``docs/kernel-notes.md``). This probe compiles two minimal kernels for ``cuda:90`` with Triton's own ``ptxas``,
each doing only the V-side field work of one page of INT2 words (``[tokens, words]`` int32, 16 crumbs per word,
``acc += weight * field``), and counts the opcodes of the compiled SASS:

* ``fp32``: the reader's way, per field ``(word & (3 << s))`` bitcast to fp32, times the fp32 weight;
* ``fp16x2``: the words loaded as int16 halves laid out ``[..., 2]`` (crumb ``j`` of half ``e`` is channel
  ``16 w + 8 e + j``), masked with the same int16 constant and bitcast to fp16 (a half's subnormal is exactly
  ``2**(s - 24) * field`` for bits below 10), times an fp16 weight. Triton (LLVM) packs the two halves into one
  register, so one ``LOP3`` masks two fields and one ``HFMA2`` multiplies and adds two.

It answers a static question only: the instruction count. Whether fp16 products and sums are accurate enough for
the reader (they round to 11 bits, and the weights must be scaled into fp16's range) is not answered here.

    python benchmarks/probe_fp16x2_fields.py [--out FILE.json]
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import subprocess
import tempfile

os.environ.pop("TRITON_INTERPRET", None)  # compile for sm_90, not the interpreter

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

TOKENS, WORDS = 32, 8  # one page, head_dim 128 at 2 bits: 8 int32 words of 16 crumbs per token
FIELDS_IN_PLACE = 5  # crumbs at bits 0-9 of a half: fp16 subnormals without a shift (fp32 reads 12 per word)


@triton.jit
def _fields_fp32(words, weight, out, n_pages, T: tl.constexpr, W: tl.constexpr, J: tl.constexpr):
    t = tl.arange(0, T)[:, None]
    w = tl.arange(0, W)[None, :]
    acc = ()
    for _j in tl.static_range(2 * J):
        acc = acc + (tl.zeros([T, W], tl.float32),)
    for pg in range(n_pages):  # a runtime loop, as the reader's page loop: its body is compiled once
        x = tl.load(words + pg * T * W + t * W + w)
        a = tl.load(weight + pg * T + t)  # [T, 1] fp32
        new = ()
        for j in tl.static_range(J):  # crumbs j (low half) and j + 8 (high half): 2 J fields per word
            new = new + (acc[j] + a * (x & (3 << (2 * j))).to(tl.float32, bitcast=True),)
        for j in tl.static_range(J):
            new = new + (acc[J + j] + a * (x & (3 << (2 * j + 16))).to(tl.float32, bitcast=True),)
        acc = new
    for j in tl.static_range(2 * J):
        tl.store(out + (t * W + w) * 16 + j, acc[j])


@triton.jit
def _fields_fp16x2(words16, weight, out, n_pages, T: tl.constexpr, W: tl.constexpr, J: tl.constexpr):
    t = tl.arange(0, T)[:, None, None]
    w = tl.arange(0, W)[None, :, None]
    e = tl.arange(0, 2)[None, None, :]
    acc = ()
    for _j in tl.static_range(J):
        acc = acc + (tl.zeros([T, W, 2], tl.float16),)
    for pg in range(n_pages):
        x = tl.load(words16 + pg * T * W * 2 + (t * W + w) * 2 + e)  # int16 halves of the int32 words
        a = tl.load(weight + pg * T + t + 0 * (w + e)).to(tl.float16)
        new = ()
        for j in tl.static_range(J):
            new = new + (acc[j] + a * (x & (3 << (2 * j))).to(tl.float16, bitcast=True),)
        acc = new
    for j in tl.static_range(J):
        tl.store(out + ((t * W + w) * 2 + e) * 8 + j, acc[j].to(tl.float32))


def sass_opcodes(fn, signature: dict, fields: int) -> collections.Counter:
    """Compile ``fn`` for sm_90 (one warp) with ``fields`` crumb positions per half word and count the opcodes of
    its SASS (Triton's own cuobjdump)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    src = ASTSource(fn=fn, signature={**signature, "n_pages": "i32", "T": "constexpr", "W": "constexpr",
                                      "J": "constexpr"},
                    constexprs={"T": TOKENS, "W": WORDS, "J": fields})
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 1})
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(compiled.asm["cubin"])
        sass = subprocess.run([tool, "-sass", path], capture_output=True, text=True, check=True).stdout
    ops = collections.Counter()
    for line in sass.splitlines():
        parts = line.split("*/", 1)
        if len(parts) == 2 and ";" in parts[1]:
            words = parts[1].split(";")[0].split()
            words = words[1:] if words and words[0].startswith("@") else words  # predicate
            if words:
                ops[words[0]] += 1
    return ops


def _field_ops(ops: collections.Counter) -> tuple[int, int]:
    """(masks, multiply-adds): ``LOP3`` and the fp32/fp16x2 multiply and add opcodes (not the ``.F32`` widening)."""
    math = sum(n for op, n in ops.items() if op.split(".")[0] in ("FFMA", "FMUL", "FADD", "HFMA2", "HMUL2", "HADD2")
               and not op.endswith(".F32"))
    return ops["LOP3.LUT"], math


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="JSON path")
    args = p.parse_args(argv)
    # one more crumb position per half word adds 2 fields per word: T * W * 2 / 32 per lane of the one warp. The
    # difference between J and J - 1 positions is the loop body's cost of those fields (prologue, epilogue and
    # addresses cancel, except the epilogue's per-accumulator work, which the opcode filter leaves out)
    per_lane = TOKENS * WORDS * 2 // 32
    rows = {}
    for name, fn, sig in (
        ("fp32", _fields_fp32, {"words": "*i32", "weight": "*fp32", "out": "*fp32"}),
        ("fp16x2", _fields_fp16x2, {"words16": "*i16", "weight": "*fp32", "out": "*fp32"}),
    ):
        full, less = (sass_opcodes(fn, sig, j) for j in (FIELDS_IN_PLACE, FIELDS_IN_PLACE - 1))
        (m1, a1), (m0, a0) = _field_ops(full), _field_ops(less)
        rows[name] = {"fields_per_lane_per_position": per_lane, "lop3_per_position": m1 - m0,
                      "multiply_adds_per_position": a1 - a0,
                      "field_instructions_per_field": round((m1 - m0 + a1 - a0) / per_lane, 3),
                      "opcodes": dict(full.most_common())}
        print(f"{name:7s} per crumb position ({per_lane} fields a lane): LOP3 {m1 - m0:3d}, multiply-adds "
              f"{a1 - a0:3d} -> {(m1 - m0 + a1 - a0) / per_lane:.2f} instructions per field", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"probe": "probe_fp16x2_fields", "date": datetime.datetime.now(datetime.timezone.utc)
                       .isoformat(), "target": "cuda:90 (ptxas of triton " + triton.__version__ + ")",
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
