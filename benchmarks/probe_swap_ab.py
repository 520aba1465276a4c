"""Static probe (no GPU needed): a tensor-core page loop for one query per KV head, K side only.

Session 5 (docs/kernel-notes.md): would Triton turn INT4 codes into tensor-core operands cheaply if the codes
are the large operand (scores^T [32 tokens, 16] = K fields [32, 32] @ (q * k_scale) [32, 16], one dot per
nibble position, so no interleave) and each field becomes fp16 by the magic-number trick (1024 + 2**s * f,
one AND-OR)? The script compiles the loop for sm_90 with the installed Triton and its ptxas and writes the
SASS; count the loop with any SASS reader. With Triton 3.6: 167 registers and 956 instructions per page for
the K side alone (LOP3 256, PRMT 156, STS 72, HADD2 64, SEL 64, HMMA 32): the layout conversions to the MMA
operand cost more than the whole CUDA-core loop (907 per page for K and V). Not pursued.

    PYTHONPATH=/path/to/triton-3.6 python benchmarks/probe_swap_ab.py [MAXNREG] [NUM_WARPS]
"""
import os
import re
import subprocess

os.environ.pop("TRITON_INTERPRET", None)
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


@triton.jit
def _f16(x, S: tl.constexpr):
    # nibble at bit S of int16 x as fp16 1024 + 2**(S % 8) * f (S in 0, 4: in place; 8, 12: shifted down by 8)
    if S >= 8:
        x = x >> 8
    return ((x & (15 << (S % 8))) | 0x6400).to(tl.float16, bitcast=True)

@triton.jit
def probe(kw_ptr, ks_ptr, q_ptr, out_ptr, npages):
    t = tl.arange(0, 32)[:, None]
    w = tl.arange(0, 32)[None, :]
    n = tl.arange(0, 16)
    qj = ()
    for j in tl.static_range(4):
        qj = qj + (tl.load(q_ptr + tl.arange(0, 32) * 4 + j),)
    m = tl.full([16], -float("inf"), tl.float32)
    lsum = tl.zeros([16], tl.float32)
    for p in range(npages):
        words = tl.load(kw_ptr + p * 1024 + t * 32 + w)  # [32 tok, 32] int16: channel 4 w + j
        s = tl.zeros([32, 16], tl.float32)
        for j in tl.static_range(4):
            ks = tl.load(ks_ptr + p * 128 + tl.arange(0, 32) * 4 + j).to(tl.float32)
            qb = tl.where(n[None, :] == 0, (qj[j] * ks)[:, None], 0.0).to(tl.float16)  # [32, 16]
            s = tl.dot(_f16(words, 4 * j), qb, s)
        m_new = tl.maximum(m, tl.max(s, 0))
        alpha = tl.exp2(m - m_new)
        pr = tl.exp2(s - m_new[None, :])
        lsum = lsum * alpha + tl.sum(pr, 0)
        m = m_new
    tl.store(out_ptr + n, m + tl.log2(lsum))  # keeps the loop alive

def main(maxnreg=0, nw=1, out_dir="/tmp"):
    sig = {"kw_ptr": "*i16", "ks_ptr": "*fp16", "q_ptr": "*fp32", "out_ptr": "*fp32", "npages": "i32"}
    src = ASTSource(probe, sig, attrs={(i,): [["tt.divisibility", 16]] for i in range(4)})
    opts = {"num_warps": nw, "num_stages": 1}
    if maxnreg:
        opts["maxnreg"] = maxnreg
    ck = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)
    out = f"{out_dir}/swap_ab_w{nw}_r{maxnreg}"
    open(out + ".cubin", "wb").write(ck.asm["cubin"])
    open(out + ".ttgir", "w").write(ck.asm["ttgir"])
    bindir = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin")
    sass = subprocess.run([f"{bindir}/cuobjdump", "-sass", out + ".cubin"], capture_output=True, text=True).stdout
    open(out + ".sass", "w").write(sass)
    res = subprocess.run([f"{bindir}/cuobjdump", "-res-usage", out + ".cubin"], capture_output=True, text=True).stdout
    print(out, re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+)", res).groups())

if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("maxnreg", type=int, nargs="?", default=0, help="register cap for ptxas (0: none)")
    ap.add_argument("num_warps", type=int, nargs="?", default=1)
    ap.add_argument("--out-dir", default="/tmp", help="where the cubin, TTGIR and SASS go")
    a = ap.parse_args()
    main(a.maxnreg, a.num_warps, a.out_dir)
