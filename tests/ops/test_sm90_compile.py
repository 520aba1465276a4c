"""The fused cell attention compiles for sm_90 (H100/H200) as the launcher configures it there, without a GPU.

The interpreter cannot run what only the GPU build has: the L2 prefetch (inline PTX), the register cap
(``maxnreg``), ``ptxas``. Session 5 found a head_dim-96 bug in the prefetch only on the H200; this compiles those
paths in CI with Triton's own ``ptxas`` (``tests/ops/sm90_compile_check.py``, in a fresh process because this
session runs Triton in the interpreter) and checks what the design relies on: the prefetch is there (one
instruction per region: K words, V hi, V lo unless V precision or INT2, four scale regions), the cap holds, fused
multiply-adds are on, and no fp32 operation flushes subnormals (the code fields are read as fp32 subnormals,
docs/kernel-notes.md); only ``ex2.approx`` may.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")  # Linux only (pyproject)

ROOT = Path(__file__).resolve().parents[2]
PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
pytestmark = pytest.mark.skipif(not PTXAS.exists(), reason="this Triton build ships no NVIDIA ptxas")

OPT_I32, OPT_L2 = 8, 64  # triton_far.CC_OPTS


def compile_sm90(**case) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    run = subprocess.run([sys.executable, str(ROOT / "tests/ops/sm90_compile_check.py"), json.dumps(case)],
                         capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(("bits", "tau", "batch", "heads", "group", "head_dim", "regions", "i32"), [
    (4, 14.0, 8, 8, 1, 96, 6, False),  # V precision: the lo plane is left to its masked load; head_dim 96
    (4, None, 1, 16, 1, 128, 7, False),  # the Ouro cell at batch 1 (INT4 is capped at every batch)
    (2, None, 8, 8, 1, 128, 6, True),  # INT2 at B x H = 64: capped, 32-bit offsets
])
def test_cuda_core_reader_compiles_for_sm90(bits, tau, batch, heads, group, head_dim, regions, i32):
    got = compile_sm90(bits=bits, tau=tau, batch=batch, heads=heads, group=group, head_dim=head_dim)
    assert got["impl"] == "cc"
    assert got["opt"] & OPT_L2
    assert bool(got["opt"] & OPT_I32) == i32
    assert got["prefetch_l2"] == regions
    assert got["options"]["maxnreg"] == 128
    assert got["registers"] is None or got["registers"] <= 128
    assert got["options"]["enable_fp_fusion"] is True
    assert got["fma"] > 0
    assert got["ftz_not_ex2"] == []


def test_tensor_core_reader_compiles_for_sm90():
    """Four query heads per KV head at head_dim 256: the tensor-core reader, no prefetch, no cap."""
    got = compile_sm90(bits=4, tau=None, batch=2, heads=4, group=4, head_dim=256)
    assert got["impl"] == "dot"
    assert got["prefetch_l2"] == 0
    assert "maxnreg" not in got["options"]
    assert got["ftz_not_ex2"] == []


def test_fp32_inputs_take_the_four_warp_tensor_core_reader_without_spilling():
    """fp32 inputs (``ieee`` products): with one warp the programs spilled (static, Triton 3.6: an 8-9 KB stack per
    thread at head_dim 128 for either reader, docs/kernel-notes.md, Session 6); the launcher now runs them on the
    tensor-core reader with four warps, which keeps head_dim 128 (nearly) off the stack: 16-24 B with Triton 3.6 (the
    H200's), 16-472 B with 3.9 depending on unrelated code in the kernel (the append programs added in session 6
    moved it). The bound separates that from the one-warp spill, 8-10 KB."""
    got = compile_sm90(bits=4, tau=14.0, batch=2, heads=4, group=1, head_dim=128, dtype="float32")
    assert got["impl"] == "dot"
    assert got["options"]["num_warps"] == 4
    assert got["options"]["num_stages"] == 1
    assert got["stack"] is None or got["stack"] <= 1024, got["stack"]
    assert got["ftz_not_ex2"] == []


@pytest.mark.parametrize("bits", [4, 2])
def test_page_ahead_variant_compiles_under_the_cap(bits):
    """``cc_opts`` "sc" (the next page's index and scales carried one iteration ahead; not yet measured on the GPU)
    compiles for sm_90 under the launcher's register cap with the L2 prefetch of the codes only (3 regions for INT4,
    2 for INT2: the scales are loaded ahead, not prefetched)."""
    opts = ["qk", "vg", "f24", "l2", "sc"] + (["i32"] if bits == 2 else [])
    got = compile_sm90(bits=bits, tau=None, batch=8, heads=8, group=1, head_dim=128, cc_opts=opts)
    assert got["impl"] == "cc"
    assert got["options"]["maxnreg"] == 128
    assert got["registers"] is None or got["registers"] <= 128
    assert got["prefetch_l2"] == (3 if bits == 4 else 2)
    assert got["ftz_not_ex2"] == []



@pytest.mark.parametrize("bits", [4, 2])
def test_fused_append_attention_compiles_for_sm90(bits):
    """``append_attention_``'s one launch (reader + append programs + page encoder) compiles for sm_90 under the
    reader's register cap; no GPU has run it yet (session 6)."""
    got = compile_sm90(bits=bits, tau=14.0 if bits == 4 else None, batch=8, heads=8, group=1, head_dim=128,
                       append=True)
    assert got["impl"] == "cc"
    assert got["options"]["maxnreg"] == 128
    assert got["registers"] is None or got["registers"] <= 128
    assert got["ftz_not_ex2"] == []


def test_timeline_build_compiles_for_sm90_under_the_cap():
    """``cell_attention(timeline=...)`` (benchmarks/probe_timeline.py) reads ``%globaltimer`` twice and ``%smid``
    once per program, in inline PTX the interpreter cannot run; the default build reads neither."""
    case = dict(bits=4, tau=None, batch=32, heads=16, group=1, head_dim=128)
    got = compile_sm90(timeline=True, **case)
    assert (got["globaltimer"], got["smid"]) == (2, 1)
    assert got["registers"] is None or got["registers"] <= 128
    plain = compile_sm90(**case)
    assert (plain["globaltimer"], plain["smid"]) == (0, 0)
