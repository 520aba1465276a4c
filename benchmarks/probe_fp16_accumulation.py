"""Would fp16 arithmetic in the INT2 reader's field work be accurate enough? An emulation on CPU, against float64.

``probe_fp16x2_fields.py`` counted the instructions: fp16x2 pairs (one ``LOP3`` and one ``HFMA2`` per two fields)
would cut INT2's field work from 2.00 to 0.88 instructions per field. The price is rounding to fp16 (11 significant
bits, exponents -14 .. 15). This probe emulates one history program of the reader (``loopkv/ops/triton_far.py``,
one (row, KV head) and one split of ``pages`` INT2 pages) with torch's float16 arithmetic, which rounds every
operation to fp16 as ``HFMA2`` would (products of two fp16 values are exact in fp32, so ``acc + w * f`` computed
in fp32 and rounded once is the fused operation), and compares its partial output with float64 math on the same
codes:

* ``fp32``: the reader as it is (fp32 fields, fp32 per-slot accumulators);
* ``v16``: V's field work in fp16, as a kernel would do it: each field the exact fp16 subnormal of its bits, one
  fp16 weight per token (``p * v_scale``, scaled by a power of two to at most 2**15 from the running exponent of
  the V scales, with an exact rescale when it grows, like the softmax's lazy one), per-slot accumulators (32 token
  slots x channels, one product per page, as the reader keeps them) in fp16, each field position scaled back at
  the end. The zero-point term stays fp32 (one per 32-channel group, not per field). ``flush``: the fp16
  accumulators are added into fp32 ones every 8 pages;
* ``k16``: K's field work in fp16 too: the per-channel factor ``q * k_scale`` times the position's power of two in
  fp16, each half word's 8 products summed in an fp16 chain (``HFMA2``), then widened to fp32;
* ``high``: every field read at bits 4-8 of its half (one more shift per word) instead of 0-8, so the subnormals
  lose 4 binades less of fp16's range.

Data: K with per-channel spread (log-normal channel scales, as real keys have outlier channels), V with per-token
spread, queries scaled so the attention is ``--peak`` nats peaky. Quantized by loopkv's codec. Reported per
variant: the relative L2 error of the partial output against float64 on the same codes, next to INT2's own error
(float64 on the codes against float64 on the unquantized K and V), over ``--trials`` random programs.

    python benchmarks/probe_fp16_accumulation.py [--pages 5,16,64,128] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import math

import torch

from loopkv.ops import codec

D = 128
PAGE = codec.PAGE
BITS = 2


def make_program(pages: int, peak: float, gen: torch.Generator) -> dict:
    """One program's data: q [D], unquantized K/V [pages, PAGE, D] (float64), and their INT2 codes and scales."""
    n = pages * PAGE
    chan = torch.exp(torch.randn(D, generator=gen, dtype=torch.float64))  # outlier channels of K
    k = torch.randn(n, D, generator=gen, dtype=torch.float64) * chan
    tok = torch.exp(0.5 * torch.randn(n, 1, generator=gen, dtype=torch.float64))  # tokens of larger V
    v = torch.randn(n, D, generator=gen, dtype=torch.float64) * tok
    q = torch.randn(D, generator=gen, dtype=torch.float64)
    q *= peak / (k @ q).std()  # scores with standard deviation `peak` (natural units)
    kc, ks, kz = codec.quantize_k(k.view(pages, PAGE, D), BITS)  # per page and channel
    vc, vs, vz = codec.quantize_v(v.view(pages, PAGE, D), BITS)  # per token and 32-channel group
    return {"q": q, "k": k, "v": v, "kc": kc, "ks": ks, "kz": kz, "vc": vc, "vs": vs, "vz": vz}


def reference(prog: dict, dequantized: bool = True) -> torch.Tensor:
    """float64 softmax(q k^T) v over the program's tokens, on the codes (or on the unquantized K and V)."""
    if dequantized:
        k = codec.dequantize_k(prog["kc"], prog["ks"], prog["kz"]).double().flatten(0, 1)
        v = codec.dequantize_v(prog["vc"], prog["vs"], prog["vz"]).double().flatten(0, 1)
    else:
        k, v = prog["k"], prog["v"]
    s = k @ prog["q"]
    p = torch.exp(s - s.max())
    return (p @ v) / p.sum()


def _pow2_exponent(x: torch.Tensor) -> int:
    """Smallest e with max |x| <= 2**e."""
    return int(math.ceil(math.log2(max(float(x.abs().max()), 2.0**-60))))


def _field_bits(high: bool) -> torch.Tensor:
    """[D]: the bit at which channel ``16 w + 8 e + j`` is read in its fp16 half (as a subnormal). Low: crumb ``j``
    in place at bit ``2 j`` for ``j < 5``, the others from the half shifted right by 6 (bits 4, 6, 8); one shift per
    word. High: only bits 4-8, crumbs 0 and 1 from the half shifted left by 4; two shifts per word, 4 binades less
    of the fp16 range lost to the subnormal's scale ``2**(bit - 24)``."""
    j = torch.arange(D) % 8
    if high:
        return torch.tensor([4, 6, 4, 6, 8, 4, 6, 8])[j]
    return torch.where(j < 5, 2 * j, 2 * j - 6)


def emulate(prog: dict, *, v16: bool, k16: bool, flush: int = 0, high: bool = False) -> torch.Tensor:
    """The reader's page loop on the program's codes: fp32 everywhere, or fp16 field work for V (and K).

    A field at bit ``b`` of a half is the fp16 subnormal ``field * 2**(b - 24)`` (exact). V: one fp16 weight per
    token and group, ``p * v_scale * 2**(15 - e_v)`` (at most 2**15; ``e_v`` the running exponent of the V scales,
    exact power-of-two rescale when it grows), one fp16 accumulator per slot and channel, each field position
    scaled back by ``2**(24 - b)`` at the end; ``flush`` > 0 adds them into fp32 every ``flush`` pages. K: the
    per-channel factor ``q * k_scale * 2**(24 - b - E)`` in fp16 (at most 2**15: ``E`` from the page's largest),
    so every product has the same scale; a half word's 8 products summed in an fp16 chain, then widened."""
    pages = prog["kc"].shape[0]
    q = prog["q"].float()
    bits = _field_bits(high)
    sub = 2.0 ** (bits - 24).float()  # the subnormal's scale per channel
    acc32 = torch.zeros(PAGE, D)  # where flushed fp16 sums go
    m_i = -math.inf
    l_t = torch.zeros(PAGE)  # per token slot sums, fp32
    acc = torch.zeros(PAGE, D, dtype=torch.float16 if v16 else torch.float32)  # per token slot, per channel
    zacc = torch.zeros(PAGE, D // codec.GROUP)  # zero-point term, fp32, per slot and group
    e_v = None  # running exponent of v_scale (v16)
    for pg in range(pages):
        kc, ks, kz = prog["kc"][pg].float(), prog["ks"][pg].float(), prog["kz"][pg].float()
        qk = q * ks  # [D]
        if k16:
            big = _pow2_exponent(qk / sub)  # E: the largest factor qk * 2**(24 - b) is 2**(E') <= 2**15 after scaling
            qk16 = (qk / sub * 2.0 ** (15 - big)).half().float()  # per channel, once per page
            f16 = (kc * sub).half().float()  # exact subnormals
            prod = (f16 * qk16).view(PAGE, 16, 8)  # exact in fp32; HFMA2 rounds product + sum once
            part16 = prod[..., 0].half()
            for j in range(1, 8):  # the HFMA2 chain over a half word's 8 fields
                part16 = (part16.float() + prod[..., j]).half()
            s = part16.float().sum(1) * 2.0 ** (big - 15) + q @ kz
        else:
            s = kc @ qk + q @ kz
        m_new = max(m_i, float(s.max()))
        if m_new > m_i:  # lazy rescale when the running maximum grows
            alpha = math.exp(m_i - m_new) if m_i > -math.inf else 0.0
            l_t *= alpha
            zacc *= alpha
            acc = (acc.float() * alpha).to(acc.dtype)
            acc32 *= alpha
            m_i = m_new
        p = torch.exp(s - m_i)  # [PAGE]
        l_t += p
        vc, vs, vz = prog["vc"][pg].float(), prog["vs"][pg].float(), prog["vz"][pg].float()
        zacc += p[:, None] * vz
        w = p[:, None] * vs  # [PAGE, D / GROUP]
        w = w.repeat_interleave(codec.GROUP, 1)  # per channel
        if v16:
            e = _pow2_exponent(prog["vs"][pg].float())
            if e_v is None:
                e_v = e
            elif e > e_v:  # rescale the accumulators by an exact power of two
                acc = (acc.float() * 2.0 ** (e_v - e)).half()
                acc32 *= 2.0 ** (e_v - e)
                e_v = e
            w16 = (w * 2.0 ** (15 - e_v)).half()
            f16 = (vc * sub).half()  # exact subnormals
            acc = (acc.float() + w16.float() * f16.float()).half()  # HFMA2: exact product, one rounding
            if flush and (pg + 1) % flush == 0:
                acc32 += acc.float()
                acc = torch.zeros_like(acc)
        else:
            acc = acc + w * vc
    if v16:
        o = (acc.float() + acc32).sum(0) / sub * 2.0 ** (e_v - 15)
    else:
        o = acc.sum(0)
    o = o + zacc.sum(0).repeat_interleave(codec.GROUP)
    return (o / l_t.sum()).double()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pages", default="5,16,64,128", help="pages per split (the reader's range: 5 at batch 1 x "
                   "8K, 16 at B = 32 x 16K, up to 128 at large batches and 32K)")
    p.add_argument("--peak", default="1,3", help="standard deviations of the scores (natural units)")
    p.add_argument("--trials", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    gen = torch.Generator().manual_seed(args.seed)
    rows = []
    print(f"{'pages':>5s} {'peak':>4s} {'INT2 vs exact':>13s} {'fp32':>10s} {'v16':>10s} {'v16+k16 f8':>10s} "
          f"{'same, bits 4-8':>14s}   "
          "(median relative L2 error of the partial output; max in the JSON)")
    for pages in [int(x) for x in args.pages.split(",")]:
        for peak in [float(x) for x in args.peak.split(",")]:
            errs = {"int2": [], "fp32": [], "v16": [], "v16_k16_flush8": [], "v16_k16_flush8_high": []}
            for _ in range(args.trials):
                prog = make_program(pages, peak, gen)
                ref = reference(prog)
                norm = float(ref.norm())
                errs["int2"].append(float((ref - reference(prog, dequantized=False)).norm()) / norm)
                for name, kw in (("fp32", {}), ("v16", {"v16": True}),
                                 ("v16_k16_flush8", {"v16": True, "k16": True, "flush": 8}),
                                 ("v16_k16_flush8_high", {"v16": True, "k16": True, "flush": 8, "high": True})):
                    out = emulate(prog, v16=kw.get("v16", False), k16=kw.get("k16", False), flush=kw.get("flush", 0),
                                  high=kw.get("high", False))
                    errs[name].append(float((out - ref).norm()) / norm)
            row = {"pages": pages, "peak": peak, "trials": args.trials}
            for name, e in errs.items():
                row[f"{name}_median"] = float(torch.tensor(e).median())
                row[f"{name}_max"] = max(e)
            rows.append(row)
            print(f"{pages:5d} {peak:4.1f} {row['int2_median']:13.2e} {row['fp32_median']:10.2e} "
                  f"{row['v16_median']:10.2e} {row['v16_k16_flush8_median']:10.2e} "
                  f"{row['v16_k16_flush8_high_median']:14.2e}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"probe": "probe_fp16_accumulation", "date": datetime.datetime.now(datetime.timezone.utc)
                       .isoformat(), "torch": torch.__version__, "args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
