"""Compile the fused cell attention for sm_90 exactly as the launcher would launch it on an H100/H200, without a GPU.

Run by ``test_sm90_compile.py`` in a fresh process (the test session runs Triton in the interpreter, and that is
chosen when ``@triton.jit`` decorates). The launcher is called on CPU tensors with the kernel replaced by a
recorder, the device taken for an sm_90 GPU of 132 SMs (``triton_config._capability``, ``_num_sms``), so the recorded
launch is the GPU's (register cap, L2 prefetch, inline PTX, no bf16 upcast); it is compiled by ``triton.compile`` for
``cuda:90`` with the argument specializations Triton's launcher would make. Prints one JSON line: the launch's
options and flags, registers, stack bytes and what the PTX contains. ``dtype`` (optional, default ``"bfloat16"``):
the inputs'; ``token`` (optional, true): ``token_attention``'s launch; ``launch`` (optional): ``Launch`` fields that
replace the table's (a benchmark arm's launch, checked before a device run); ``kernel`` (optional): ``"chunk"`` compiles
``chunk_attention``'s kernel instead (``triton_chunk``; ``held`` and ``new``, default 2,000 and 512, size the chunk;
132 SMs choose its history splits), ``"chunk_merge"`` the merge of its splits (a launch with NSPLIT > 1).

    python tests/ops/sm90_compile_check.py '{"bits": 4, "tau": 14.0, "batch": 8, "heads": 8, "group": 1,
                                             "head_dim": 96}'
"""

from __future__ import annotations

import inspect
import json
import math
import os
import re
import subprocess
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from loopkv.ops import triton_attention as ta  # noqa: E402
from loopkv.ops import triton_chunk as tc  # noqa: E402
from loopkv.ops import triton_config  # noqa: E402
from loopkv.ops.chunk_attention import tail_length  # noqa: E402
from loopkv.ops.triton_register import _dummy_pool  # noqa: E402

TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int32: "i32",
         torch.int64: "i64", torch.uint8: "u8"}
OPTIONS = ("num_warps", "num_stages", "maxnreg", "enable_fp_fusion")


class Recorder:
    """Stands in for the ``@triton.jit`` kernel: ``kernel[grid](*args, **kwargs)`` records the call."""

    def __init__(self):
        self.calls = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((args, kwargs))


def record(case: dict) -> tuple[tuple, dict]:
    """The launcher's kernel call for ``case`` on an sm_90 GPU of 132 SMs."""
    bits, tau, B, H, G, D = (case[k] for k in ("bits", "tau", "batch", "heads", "group", "head_dim"))
    tau = math.inf if tau is None else float(tau)
    dtype = getattr(torch, case.get("dtype", "bfloat16"))
    exact = [torch.zeros(B, H, n, D, dtype=dtype) for n in (32, 32, 288, 288)]
    lengths = torch.zeros(B, dtype=torch.int32)
    table = torch.zeros(B, 16, dtype=torch.int32)
    pool = _dummy_pool(bits, H, D, dtype, torch.device("cpu"))
    q = torch.zeros(B, H * G, D, dtype=dtype)
    rec = Recorder()
    saved = ta._cell_attn_kernel, triton_config._capability, triton_config._num_sms, triton_config.launch_config
    ta._cell_attn_kernel, triton_config._capability, triton_config._num_sms = rec, lambda d: (9, 0), lambda d: 132
    if case.get("launch"):
        triton_config.launch_config = lambda *a: triton_config.Launch(**case["launch"])
    try:
        if case.get("token"):
            tok = torch.zeros(B, H, 1, D, dtype=dtype)
            ta.token_attention(q, tok, tok, *exact, lengths, table, *pool, bits, tau, D**-0.5)
        else:
            ta.cell_attention(q, *exact, lengths, table, *pool, bits, tau, D**-0.5)
    finally:
        (ta._cell_attn_kernel, triton_config._capability, triton_config._num_sms,
         triton_config.launch_config) = saved
    (call,) = rec.calls
    return call


def record_chunk(case: dict) -> tuple[tuple, dict]:
    """The chunk launcher's kernel call (``case["kernel"]`` ``"chunk_merge"``: its merge kernel's) for ``case`` on an
    sm_90 GPU of 132 SMs: one row of ``heads`` KV heads holding ``held`` tokens, ``new`` more."""
    bits, tau, H, G, D = (case[k] for k in ("bits", "tau", "heads", "group", "head_dim"))
    held, new = case.get("held", 2000), case.get("new", 512)
    dtype = getattr(torch, case.get("dtype", "bfloat16"))
    T = tail_length(held, new)
    exact = [torch.zeros(H, n, D, dtype=dtype) for n in (32, 32, T, T)]
    pool = _dummy_pool(bits, H, D, dtype, torch.device("cpu"))
    table = torch.zeros((held + new) // 32, dtype=torch.int32)
    q = torch.zeros(new, H * G, D, dtype=dtype)
    rec, merge = Recorder(), Recorder()
    saved = tc._chunk_attn_kernel, tc._chunk_merge_kernel, triton_config._capability, triton_config._num_sms
    tc._chunk_attn_kernel, tc._chunk_merge_kernel = rec, merge
    triton_config._capability, triton_config._num_sms = lambda d: (9, 0), lambda d: 132
    try:
        tc.chunk_attention(q, *exact, held, 288, table, *pool, bits, math.inf if tau is None else float(tau),
                           D**-0.5)
    finally:
        tc._chunk_attn_kernel, tc._chunk_merge_kernel, triton_config._capability, triton_config._num_sms = saved
    (call,) = merge.calls if case["kernel"] == "chunk_merge" else rec.calls
    return call


def _specialize(value) -> tuple[str, bool]:
    """(Triton type, divisible by 16) of a runtime argument, as Triton's launcher specializes it."""
    if isinstance(value, torch.Tensor):
        return "*" + TYPES[value.dtype], value.data_ptr() % 16 == 0
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"unexpected argument {value!r}")
    if isinstance(value, float):
        return "fp32", False
    return "i32", value % 16 == 0


def main(case: dict) -> dict:
    chunk = case.get("kernel") in ("chunk", "chunk_merge")
    args, kwargs = record_chunk(case) if chunk else record(case)
    kernel = {"chunk": tc._chunk_attn_kernel, "chunk_merge": tc._chunk_merge_kernel}.get(case.get("kernel"),
                                                                                        ta._cell_attn_kernel)
    options = {k: kwargs.pop(k) for k in OPTIONS if k in kwargs}
    bound = inspect.signature(kernel.fn).bind(*args, **kwargs).arguments
    sig, constexprs, attrs = {}, {}, {}
    for i, p in enumerate(kernel.params):
        value = bound[p.name]
        if p.is_constexpr or (isinstance(value, int) and not isinstance(value, bool) and value == 1):
            sig[p.name], constexprs[(i,)] = "constexpr", value  # Triton specializes integers equal to 1 as well
            continue
        sig[p.name], aligned = _specialize(value)
        if aligned:
            attrs[(i,)] = [["tt.divisibility", 16]]
    compiled = triton.compile(ASTSource(kernel, sig, constexprs=constexprs, attrs=attrs),
                              target=GPUTarget("cuda", 90, 32), options=options)
    ptx = compiled.asm["ptx"]
    registers, stack = _resources(compiled)
    ftz = [ln.strip() for ln in ptx.splitlines() if ".ftz" in ln]
    if chunk:
        return {"options": options, "registers": registers, "stack": stack, "BM": bound.get("BM"),
                "nsplit": bound["NSPLIT"], "fma": len(re.findall(r"\bfma\.rn\.f32", ptx)),
                "ftz_not_ex2": [ln for ln in ftz if "ex2" not in ln][:5]}
    return {"cc": bound["CC"], "l2": bound["L2"], "asm": bound["ASM"], "i32": bound["I32"], "options": options,
            "registers": registers, "stack": stack, "prefetch_l2": len(re.findall(r"prefetch\.global\.L2", ptx)),
            "fma": len(re.findall(r"\bfma\.rn\.f32", ptx)), "ftz_not_ex2": [ln for ln in ftz if "ex2" not in ln][:5]}


def _resources(compiled) -> tuple[int | None, int | None]:
    """Registers and stack bytes per thread from the cubin (Triton's own cuobjdump), None where it is not
    shipped."""
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
