"""Tolerance tiers, named once (docs/design.md, "Conventions").

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
# The CUDA-core reader's "k16" (K's field work in packed fp16, loopkv/ops/triton_far.py): each query-scale factor
# and each product rounds to fp16 (2**-11 relative), and a lane's products of 16 channels per half (INT4: 4 words x 4
# pairs; INT2: 2 words x 8 pairs, at head_dim 128) are summed in fp16 before fp32. Under the interpreter, with fp32
# inputs (random keys with per-channel spread, queries of std 2): relative L2 error of the output 5.4-7.3e-4 in the
# test's cases and up to 1.9e-3 over other seeds (the fp32 reader: 2.5-3.3e-7), max abs up to 6.5e-3. The tier:
# about 3x the largest seen. "k16" is how 16-bit inputs are read, and the same tier holds there (the output's bf16
# rounding, 2**-9 relative, adds to k16's): on the H200 at B = 8 x 16K with bf16 inputs, INT2's output was 1.34e-2
# from the float64 reference at its worst element (2 of 16,384 outside ATTN_BF16), INT4's within ATTN_BF16.
ATTN_K16_REL_L2 = 6e-3
ATTN_K16_ATOL = 2e-2
