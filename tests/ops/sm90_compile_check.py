"""Compile the fused cell attention for sm_90 exactly as the launcher would launch it on an H100/H200, without a GPU.

Run by ``test_sm90_compile.py`` in a fresh process (the test session runs Triton in the interpreter, and that is
chosen when ``@triton.jit`` decorates). The launcher is called on CPU tensors with the kernel replaced by a
recorder; the recorded arguments are then compiled by ``triton.compile`` for ``cuda:90`` with what the launcher
does only on a GPU put back (the ``maxnreg`` cap, the L2 prefetch, no bf16 upcast). Prints one JSON line:
registers, stack bytes and what the PTX contains. ``dtype`` (optional, default ``"bfloat16"``): the inputs';
``cc_opts`` (optional): a reader variant's options instead of the launcher's default; ``append`` (optional,
true): the fused ``append_attention`` launch; ``token`` (optional, true): ``token_attention``'s launch;
``timeline`` (optional, true): the build that writes each program's timeline (``%globaltimer``, ``%smid``).

    python tests/ops/sm90_compile_check.py '{"bits": 4, "tau": 14.0, "batch": 8, "heads": 8, "group": 1,
                                             "head_dim": 96}'
"""

from __future__ import annotations

import json
import math
import os
import re
import sys

os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from loopkv.ops import triton_attention as ta  # noqa: E402
from loopkv.ops import triton_config  # noqa: E402
from loopkv.ops.triton_register import _dummy_pool  # noqa: E402

TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int32: "i32",
         torch.int64: "i64", torch.uint8: "u8"}


class Recorder:
    """Stands in for the ``@triton.jit`` kernel: ``kernel[grid](*args, **kwargs)`` records the call."""

    def __init__(self):
        self.calls = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((args, kwargs))


def main(case: dict) -> dict:
    bits, tau, B, H, G, D = (case[k] for k in ("bits", "tau", "batch", "heads", "group", "head_dim"))
    tau = math.inf if tau is None else float(tau)
    dtype = getattr(torch, case.get("dtype", "bfloat16"))
    sink = [torch.zeros(B, H, 32, D, dtype=dtype) for _ in range(2)]
    ring = [torch.zeros(B, H, 288, D, dtype=dtype) for _ in range(2)]
    lengths = torch.zeros(B, dtype=torch.int32)
    table = torch.zeros(B, 16, dtype=torch.int32)
    pool = _dummy_pool(bits, H, D, dtype, torch.device("cpu"))
    q = torch.zeros(B, H * G, D, dtype=dtype)
    kernel, rec = ta._cell_attn_kernel, Recorder()
    ta._cell_attn_kernel = rec
    opts = case.get("cc_opts")  # a variant's options (default: the launcher's)
    kw = {"cc_opts": tuple(opts)} if opts is not None else {}
    try:
        if case.get("append"):  # the fused append_attention launch, own pool at the read bits
            tok = torch.zeros(B, H, 1, D, dtype=dtype)
            ta.append_attention(q, tok, tok, *sink, *ring, lengths, table, *pool, bits, bits, tau, D**-0.5, **kw)
        elif case.get("token"):  # token_attention_: the reader that also writes the step's token
            tok = torch.zeros(B, H, 1, D, dtype=dtype)
            ta.token_attention(q, tok, tok, *sink, *ring, lengths, table, *pool, bits, tau, D**-0.5, **kw)
        else:
            ta.cell_attention(q, *sink, *ring, lengths, table, *pool, bits, tau, D**-0.5, **kw)
    finally:
        ta._cell_attn_kernel = kernel
    (args, kwargs), = rec.calls
    exact = dtype == torch.float32
    impl = ta.choose_far_impl(bits, G, None, cc_default=ta.CC_DEFAULT, exact=exact)
    cfg = triton_config._config(bits, impl, B * H, G, exact)
    # what the launcher does on a GPU only
    if impl == "cc":
        kwargs["OPT"] = ta.cc_opt_bits(cfg["cc_opts"] if opts is None else opts)
        if kwargs["OPT"] & ta.CC_OPTS["k16"]:
            kwargs["OPT"] |= ta.OPT_ASM16  # "k16"'s pairs in inline PTX, as on CUDA
    kwargs["UPCAST"] = False
    if case.get("timeline"):  # the diagnostics build (cell_attention(timeline=...), CUDA only)
        kwargs["TIMELINE"] = True
    options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages", "maxnreg", "enable_fp_fusion") if k in kwargs}
    if cfg.get("maxnreg"):
        options["maxnreg"] = cfg["maxnreg"]
    if case.get("maxnreg"):  # a cap other than the launcher's (probe_page_loop.py --maxnreg)
        options["maxnreg"] = int(case["maxnreg"])
    names = [n for n in kernel.arg_names if n not in kwargs]
    sig, constexprs, attrs = {}, {}, {}
    for name, value in zip(names, args, strict=True):
        if isinstance(value, torch.Tensor):
            sig[name] = "*" + TYPES[value.dtype]
            aligned = value.data_ptr() % 16 == 0
        elif isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{name}: unexpected argument {value!r}")
        else:
            sig[name] = "i32" if isinstance(value, int) else "fp32"
            aligned = isinstance(value, int) and value % 16 == 0
        if aligned:  # what Triton's launcher specializes on a GPU (pointers and integers divisible by 16)
            attrs[(kernel.arg_names.index(name),)] = [["tt.divisibility", 16]]
    for name, value in kwargs.items():
        sig[name] = "constexpr"
        constexprs[name] = value
    compiled = triton.compile(ASTSource(kernel, sig, constexprs=constexprs, attrs=attrs),
                              target=GPUTarget("cuda", 90, 32), options=options)
    if case.get("cubin"):  # keep the binary (e.g. for cuobjdump -sass)
        with open(case["cubin"], "wb") as f:
            f.write(compiled.asm["cubin"])
    ptx = compiled.asm["ptx"]
    ftz = [ln.strip() for ln in ptx.splitlines() if ".ftz" in ln]
    registers, stack = _resources(compiled)
    return {"impl": impl, "opt": kwargs.get("OPT"), "options": options, "registers": registers, "stack": stack,
            "globaltimer": len(re.findall(r"%globaltimer", ptx)), "smid": len(re.findall(r"%smid", ptx)),
            "prefetch_l2": len(re.findall(r"prefetch\.global\.L2", ptx)),
            "fma": len(re.findall(r"\bfma\.rn\.f32", ptx)), "ftz_not_ex2": [ln for ln in ftz if "ex2" not in ln][:5]}


def _resources(compiled) -> tuple[int | None, int | None]:
    """Registers and stack bytes per thread from the cubin (Triton's own cuobjdump), None where it is not
    shipped."""
    import subprocess
    import tempfile

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(tool):
        return None, None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        res = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
    reg, stack = re.search(r"REG:(\d+)", res), re.search(r"STACK:(\d+)", res)
    return (int(reg.group(1)) if reg else None), (int(stack.group(1)) if stack else None)


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]))))
