"""The fused cell attention (and the chunk reader) compiles for sm_90 (H100/H200) as the launcher configures it there,
without a GPU.

The interpreter cannot run what only the GPU build has: the L2 prefetch and the fp16-pair arithmetic (inline PTX),
the register cap (``maxnreg``), ``ptxas``. This compiles those launches with Triton's own ``ptxas``
(``tests/ops/sm90_compile_check.py``, in a fresh process because this session runs Triton in the interpreter) and
checks what the design relies on: the prefetch is there (one instruction per region: K words, V hi, V lo unless V
precision or INT2, four scale regions), the cap holds, fused multiply-adds are on, and no fp32 operation flushes
subnormals (the code fields are read as subnormals, docs/kernels.md); only ``ex2.approx`` may.
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


def compile_sm90(**case) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    run = subprocess.run([sys.executable, str(ROOT / "tests/ops/sm90_compile_check.py"), json.dumps(case)],
                         capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(("bits", "tau", "batch", "heads", "head_dim", "token", "regions", "i32"), [
    (4, 14.0, 8, 8, 96, False, 6, False),  # V precision: the lo plane is left to its masked load; head_dim 96
    (4, None, 1, 16, 128, False, 7, False),  # the Ouro cell at batch 1 (INT4 is capped at every batch)
    (2, None, 8, 8, 128, True, 6, True),  # INT2 at B x H = 64: capped, 32-bit offsets; the decode step's launch
])
def test_cuda_core_reader_compiles_for_sm90(bits, tau, batch, heads, head_dim, token, regions, i32):
    got = compile_sm90(bits=bits, tau=tau, batch=batch, heads=heads, group=1, head_dim=head_dim, token=token)
    assert got["cc"]
    assert got["l2"]
    assert got["asm"]
    assert got["i32"] == i32
    assert got["prefetch_l2"] == regions
    assert got["options"]["maxnreg"] == 128
    assert got["registers"] is None or got["registers"] <= 128
    assert got["options"]["enable_fp_fusion"] is True
    assert got["fma"] > 0
    assert got["ftz_not_ex2"] == []


def test_tensor_core_reader_compiles_for_sm90():
    """Four query heads per KV head at head_dim 256: the tensor-core reader, no prefetch, no cap."""
    got = compile_sm90(bits=4, tau=None, batch=2, heads=4, group=4, head_dim=256)
    assert not got["cc"]
    assert got["prefetch_l2"] == 0
    assert "maxnreg" not in got["options"]
    assert got["ftz_not_ex2"] == []


@pytest.mark.parametrize(("bits", "group", "head_dim", "cc", "warps", "cap", "max_stack"), [
    (4, 1, 256, True, 2, 128, 256),  # two warps under the cap: 64 B of stack (one warp: 1.4 KB)
    (2, 2, 256, True, 2, None, 64),  # two warps uncapped: none (one warp: 256 B)
    (4, 8, 128, False, 2, None, 512),  # eight query heads: 152 B (one warp: 1.2 KB)
    (4, 8, 256, False, 8, None, 512),  # eight at 256, V precision: 152 B (one warp: 12 KB); one stage (Triton 3.6)
])
def test_wide_and_large_group_rows_compile_for_sm90(bits, group, head_dim, cc, warps, cap, max_stack):
    """The table's rows above head_dim 128 and past four query heads per KV head keep the stack small (Triton 3.9's
    numbers in the comments; the bounds separate them from the one-warp launches); the CUDA-core reader keeps its
    prefetch and its cap at two warps. V precision where the page loop has the most to hold."""
    got = compile_sm90(bits=bits, tau=14.0 if bits == 4 else None, batch=32, heads=4, group=group, head_dim=head_dim)
    assert got["cc"] == cc
    assert got["options"]["num_warps"] == warps
    assert got["options"].get("maxnreg") == cap
    assert got["stack"] is None or got["stack"] <= max_stack, got["stack"]
    assert (got["prefetch_l2"] > 0) == cc
    assert got["ftz_not_ex2"] == []


def test_fp32_inputs_take_the_four_warp_tensor_core_reader_without_spilling():
    """fp32 inputs (``ieee`` products): with one warp the programs spilled 8-9 KB per thread at head_dim 128 (static,
    Triton 3.6); four warps and one stage keep it (nearly) off the stack: 16-24 B with Triton 3.6, up to 472 B with
    3.9. The bound separates that from the one-warp spill."""
    got = compile_sm90(bits=4, tau=14.0, batch=2, heads=4, group=1, head_dim=128, dtype="float32")
    assert not got["cc"]
    assert got["options"]["num_warps"] == 4
    assert got["options"]["num_stages"] == 1
    assert got["stack"] is None or got["stack"] <= 1024, got["stack"]
    assert got["ftz_not_ex2"] == []


@pytest.mark.parametrize(("bits", "regions"), [(4, 7), (2, 6)])  # INT2: no lo plane
def test_the_table_gives_dorys_cell_the_query_head_row_reader_under_its_cap(bits, regions):
    """From B x KV heads = 32 (here 32 x 4) Dory's INT4 and INT2 cells run the query-head-row reader at four warps
    under a 128-register cap (the measured launch): 104 B of stack with Triton 3.6, every region prefetched."""
    got = compile_sm90(bits=bits, tau=None, batch=32, heads=4, group=4, head_dim=256)
    assert not got["cc"]
    assert got["options"]["num_warps"] == 4
    assert got["options"].get("maxnreg") == 128
    assert got["registers"] is None or got["registers"] <= 128
    assert got["stack"] is None or got["stack"] <= 256, got["stack"]
    assert got["prefetch_l2"] == regions
    assert got["ftz_not_ex2"] == []


@pytest.mark.parametrize(("bits", "tau", "cap", "max_stack", "regions"), [
    (4, None, None, 64, 7),  # Dory's cell, INT4: no stack (Triton 3.6: 252 registers, 3.9: 198)
    (4, 14.0, 168, 128, 6),  # V precision capped at 168 (three programs per SM): 16 B of stack with 3.6, 40 B with 3.9
    (2, None, None, 64, 6),  # INT2 (no lo plane): no stack
])
def test_query_head_row_reader_compiles_for_sm90(bits, tau, cap, max_stack, regions):
    """The query-head-row tensor-core reader (``far_gqa``, the benchmark's ``gqa_*`` launches) at Dory's cell: the L2
    prefetch of every region it reads (the lo plane left to its masked load under V precision), no denormal flush
    outside ``ex2.approx`` (its codes are subnormal fp16 operands), and a small stack."""
    launch = {"reader": "gqa", "num_warps": 4, "num_stages": 1, "near_block": 64, "maxnreg": cap}
    got = compile_sm90(bits=bits, tau=tau, batch=32, heads=4, group=4, head_dim=256, launch=launch)
    assert not got["cc"]
    assert got["l2"]
    assert got["prefetch_l2"] == regions
    assert got["options"].get("maxnreg") == cap
    assert got["stack"] is None or got["stack"] <= max_stack, got["stack"]
    assert got["ftz_not_ex2"] == []


@pytest.mark.parametrize(("held", "new", "nsplit"), [
    (2000, 512, 3),  # 8 blocks x 16 heads: 3 history splits for two programs per SM (132), the partials merged
    (2000, 2048, 1),  # 32 blocks x 16 heads: one pass, out stored by the reader
])
def test_chunk_reader_compiles_for_sm90(held, new, nsplit):
    """``chunk_attention``'s kernel at Ouro's cell (16 KV heads x 128, one query head each, bf16), INT4 with V
    precision, 512 and 2,048 tokens after 2,000: 64-token blocks on eight warps, fused multiply-adds, no stack (four
    warps spilled 16 B per thread)."""
    got = compile_sm90(kernel="chunk", bits=4, tau=14.0, heads=16, group=1, head_dim=128, held=held, new=new)
    assert got["nsplit"] == nsplit
    assert got["BM"] == 64
    assert got["options"]["num_warps"] == 8
    assert got["options"]["enable_fp_fusion"] is True
    assert got["fma"] > 0
    assert got["stack"] in (None, 0)


def test_chunk_merge_compiles_for_sm90():
    """The merge of the chunk reader's splits (Ouro's cell, 256 tokens after 12,800: 5 splits): no stack, no
    denormal flush outside ``ex2.approx``."""
    got = compile_sm90(kernel="chunk_merge", bits=4, tau=14.0, heads=16, group=1, head_dim=128, held=12800, new=256)
    assert got["nsplit"] == 5
    assert got["options"]["enable_fp_fusion"] is True
    assert got["stack"] in (None, 0)
    assert got["ftz_not_ex2"] == []
