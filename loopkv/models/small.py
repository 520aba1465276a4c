"""The small Ouro-architecture model loopkv trains and ships (docs/small-model.md).

``load_small()`` loads the committed checkpoint in ``loopkv/models/small/`` offline; ``encode`` and
``decode`` are its byte tokenizer (ids 0..255 are bytes, then BOS/EOS/PAD; see loopkv.models.data).

    >>> from loopkv.models.small import load_small, encode, decode
    >>> model = load_small()
    >>> ids = encode("def add(a, b):\\n    return")[None]           # [1, n], BOS first
    >>> out = model.generate(ids, max_new_tokens=8, do_sample=False)
    >>> decode(out[0, ids.shape[1]:])                               # bytes
"""

from __future__ import annotations

import pathlib

import torch

from loopkv.models.data import BOS, EOS, PAD, VOCAB_SIZE, decode_bytes, encode_bytes

__all__ = ["BOS", "EOS", "PAD", "SMALL_DIR", "VOCAB_SIZE", "decode", "encode", "load_small"]

SMALL_DIR = pathlib.Path(__file__).resolve().parent / "small"


def encode(text: str | bytes, *, bos: bool = True) -> torch.Tensor:
    """Byte tokens of ``text`` (str is UTF-8 encoded): int64 ``[n]``, ``BOS`` first when ``bos``."""
    return torch.from_numpy(encode_bytes(text, bos=bos))


def decode(ids: torch.Tensor) -> bytes:
    """The bytes of ``ids`` (any shape, flattened); BOS, EOS, PAD and unused ids are dropped."""
    return decode_bytes(ids)


def load_small(
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    attn_implementation: str = "sdpa",
):
    """The shipped small model (``OuroForCausalLM``, eval mode) from ``SMALL_DIR``, without network access.

    ``dtype``: parameter dtype (the checkpoint is stored in 16 bits; fp32 is the exact reference).
    The model was trained on sequences of up to 4096 tokens (docs/small-model.md).
    """
    from loopkv.models.ouro import OuroForCausalLM

    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating torch.dtype such as torch.float32, got {dtype!r}")
    if not (SMALL_DIR / "config.json").is_file() or not (SMALL_DIR / "model.safetensors").is_file():
        raise FileNotFoundError(
            f"the small model's checkpoint is missing from {SMALL_DIR} (config.json + model.safetensors); "
            "reinstall loopkv, or train one (python tools/train_small.py in a checkout) and copy its small/ folder"
        )
    model = OuroForCausalLM.from_pretrained(
        str(SMALL_DIR), dtype=dtype, local_files_only=True, attn_implementation=attn_implementation
    )
    return model.to(device).eval()
