"""KIVI-style codec, pure-PyTorch reference (paper §3.1 and Appendix C; docs/design.md).

Per cell, per 32-token page, per KV head:

* K is quantized **per channel** over the page's 32 tokens; V **per token** in groups of 32 channels.
* For a group ``x``: ``zero = min(x)``, ``scale = max(max(x) - zero, EPS) / (2**b - 1)``, both stored as
  fp16; codes come from the *stored* values: ``code = clamp(round((x - zero) / scale), 0, 2**b - 1)``
  and ``x_hat = code * scale + zero``. ``round`` is round-half-to-even (``torch.round``).
* INT4 K codes are packed two per byte along channels (channel ``2j`` in the low nibble). INT4 V codes
  are split into two 2-bit planes ``hi = code >> 2`` and ``lo = code & 3``, each packed four per byte
  along channels (channel ``4j + i`` at bits ``2i``). INT2 K and V codes are packed four per byte.
  A cold INT4 value decodes from its high plane only, as ``4 * hi + 1.5`` (its bucket's midpoint).

Everything here is the reference the Triton kernels are tested against and the CPU implementation.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from loopkv.format import COLD_MIDPOINT, GROUP, PAGE, check_head_dim  # noqa: F401  (check_head_dim: the codec's rule)

EPS = 2.0**-10  # smallest quantization range: a constant group decodes finitely (fp16-normal scale)
FP16_MAX = 65504.0


def _check_bits(bits: int) -> None:
    if bits not in (2, 4):
        raise ValueError(f"bits must be 2 or 4, got {bits}")


def _qparams(xmin: Tensor, xmax: Tensor, bits: int) -> tuple[Tensor, Tensor]:
    """fp16 (scale, zero) from fp32 group minima and maxima."""
    levels = 2**bits - 1
    zero = xmin.clamp(-FP16_MAX, FP16_MAX).to(torch.float16)
    scale = ((xmax - xmin).clamp_min(EPS) / levels).clamp_max(FP16_MAX).to(torch.float16)
    return scale, zero


def _codes(x: Tensor, scale: Tensor, zero: Tensor, bits: int) -> Tensor:
    q = torch.round((x - zero.float()) / scale.float())
    return q.clamp_(0, 2**bits - 1).to(torch.uint8)


def quantize_k(k: Tensor, bits: int) -> tuple[Tensor, Tensor, Tensor]:
    """Per-channel quantization of K over the token axis.

    k: float [..., PAGE, D] -> codes uint8 [..., PAGE, D] (unpacked), scale and zero fp16 [..., D]
    """
    _check_bits(bits)
    x = k.float()
    scale, zero = _qparams(x.amin(dim=-2), x.amax(dim=-2), bits)
    return _codes(x, scale.unsqueeze(-2), zero.unsqueeze(-2), bits), scale, zero


def dequantize_k(codes: Tensor, scale: Tensor, zero: Tensor) -> Tensor:
    """codes uint8 [..., T, D], scale/zero fp16 [..., D] -> float32 [..., T, D]"""
    return codes.float() * scale.float().unsqueeze(-2) + zero.float().unsqueeze(-2)


def quantize_v(v: Tensor, bits: int) -> tuple[Tensor, Tensor, Tensor]:
    """Per-token quantization of V in groups of GROUP channels.

    v: float [..., T, D]  ->  codes uint8 [..., T, D], scale fp16 [..., T, D // GROUP], zero likewise
    """
    _check_bits(bits)
    check_head_dim(v.shape[-1])
    x = v.float().unflatten(-1, (-1, GROUP))  # [..., T, D/G, G]
    scale, zero = _qparams(x.amin(dim=-1), x.amax(dim=-1), bits)
    codes = _codes(x, scale.unsqueeze(-1), zero.unsqueeze(-1), bits)
    return codes.flatten(-2), scale, zero


def dequantize_v(codes: Tensor, scale: Tensor, zero: Tensor) -> Tensor:
    """codes [..., T, D] (float codes allowed, e.g. 4*hi + 1.5), scale/zero fp16 [..., T, D/G] -> fp32"""
    c = codes.float().unflatten(-1, (-1, GROUP))
    return (c * scale.float().unsqueeze(-1) + zero.float().unsqueeze(-1)).flatten(-2)


def pack(codes: Tensor, bits: int) -> Tensor:
    """Pack ``8 // bits`` codes per byte along the last axis; element ``i`` of a byte at bit ``bits * i``.

    codes uint8 [..., n] with values < 2**bits and n divisible by 8 // bits  ->  uint8 [..., n * bits // 8]
    """
    if bits not in (2, 4):
        raise ValueError(f"bits must be 2 or 4, got {bits}")
    per = 8 // bits
    if codes.shape[-1] % per:
        raise ValueError(f"last axis {codes.shape[-1]} is not a multiple of {per} codes per byte")
    c = codes.to(torch.uint8).unflatten(-1, (-1, per))
    out = torch.zeros(c.shape[:-1], dtype=torch.uint8, device=codes.device)
    for i in range(per):
        out |= c[..., i] << (bits * i)
    return out


def unpack(packed: Tensor, bits: int) -> Tensor:
    """Inverse of :func:`pack`: uint8 [..., m] -> codes uint8 [..., m * 8 // bits]"""
    if bits not in (2, 4):
        raise ValueError(f"bits must be 2 or 4, got {bits}")
    per = 8 // bits
    mask = 2**bits - 1
    parts = [(packed >> (bits * i)) & mask for i in range(per)]
    return torch.stack(parts, dim=-1).flatten(-2)


def split_planes(codes4: Tensor) -> tuple[Tensor, Tensor]:
    """INT4 codes -> (hi, lo) 2-bit planes, ``code = 4 * hi + lo``."""
    return codes4 >> 2, codes4 & 3


class PageCodes(NamedTuple):
    """The stored form of pages of one option (``loopkv.format``); leading dims ``[...]`` are free.

    k_codes: uint8 [..., PAGE, D * bits // 8]  (INT4 nibbles or INT2 crumbs, channel-packed, token-major)
    k_scale, k_zero: fp16 [..., D]            (per channel over the page's 32 tokens)
    v_hi: uint8 [..., PAGE, D // 4]           (INT4: high 2-bit plane; INT2: the codes)
    v_lo: uint8 [..., PAGE, D // 4]           (INT4: low 2-bit plane; INT2: an empty tensor)
    v_scale, v_zero: fp16 [..., PAGE, D // GROUP]
    """

    k_codes: Tensor
    k_scale: Tensor
    k_zero: Tensor
    v_hi: Tensor
    v_lo: Tensor
    v_scale: Tensor
    v_zero: Tensor


def encode_pages(k: Tensor, v: Tensor, bits: int) -> PageCodes:
    """Quantize whole pages. k, v: float [..., PAGE, D]."""
    if k.shape[-2] != PAGE or v.shape[-2] != PAGE:
        raise ValueError(f"pages hold {PAGE} tokens, got k {tuple(k.shape)} and v {tuple(v.shape)}")
    check_head_dim(k.shape[-1])
    kc, ks, kz = quantize_k(k, bits)
    vc, vs, vz = quantize_v(v, bits)
    if bits == 4:
        hi, lo = split_planes(vc)
        v_hi, v_lo = pack(hi, 2), pack(lo, 2)
    else:
        v_hi, v_lo = pack(vc, 2), vc.new_zeros(vc.shape[:-1] + (0,))
    return PageCodes(pack(kc, bits), ks, kz, v_hi, v_lo, vs, vz)


def decode_k(pages: PageCodes, bits: int) -> Tensor:
    """float32 [..., PAGE, D] from stored K codes."""
    return dequantize_k(unpack(pages.k_codes, bits), pages.k_scale, pages.k_zero)


def decode_v(pages: PageCodes, bits: int, cold: Tensor | None = None) -> Tensor:
    """float32 [..., PAGE, D] from stored V codes.

    cold: optional bool [..., PAGE] (broadcastable); for INT4, a cold token decodes as ``4 * hi + 1.5``.
    """
    if bits == 2:
        return dequantize_v(unpack(pages.v_hi, 2), pages.v_scale, pages.v_zero)
    hi = unpack(pages.v_hi, 2).float()
    full = 4 * hi + unpack(pages.v_lo, 2).float()
    if cold is not None:
        full = torch.where(cold.unsqueeze(-1), 4 * hi + COLD_MIDPOINT, full)
    return dequantize_v(full, pages.v_scale, pages.v_zero)
