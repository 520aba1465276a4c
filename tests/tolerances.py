"""Tolerance tiers, named once (STYLE.md habit 3).

* bit and integer ops: exact (``torch.equal``), no constant here.
* dequantization: a bound derived from the stored scale (see tests/ops/test_codec.py).
* attention vs a float64 recomputation of the same stored state:
"""

# fp32 attention over the same stored codes, vs float64 math: fp32 accumulation over <= a few
# thousand terms stays far below this.
ATTN_FP32_ATOL = 2e-5
ATTN_FP32_RTOL = 1e-4
# bf16 inputs/outputs (one rounding of the output to bf16: 2**-8 relative).
ATTN_BF16_ATOL = 1e-2
ATTN_BF16_RTOL = 1e-2
# whole-model logits, fp32, cache path vs recomputation without cache (different summation orders).
LOGITS_FP32_ATOL = 1e-4
LOGITS_FP32_RTOL = 1e-4
