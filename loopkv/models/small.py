"""The small Ouro-architecture model loopkv trains and ships (docs/small-model.md).

``load_small()`` loads the committed checkpoint in ``loopkv/models/small/`` offline; ``encode`` and
``decode`` are its byte tokenizer (ids 0..255 are bytes, then BOS/EOS/PAD; see loopkv.models.data).
The same tokenizer ships in transformers' format beside the weights (``tokenizer.json``,
``tokenizer_config.json``; :func:`load_tokenizer`, or ``AutoTokenizer.from_pretrained(SMALL_DIR)``), so that
``pipeline("text-generation", model=str(SMALL_DIR))`` loads it after ``loopkv.models.register_ouro()``.

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

__all__ = [
    "BOS",
    "EOS",
    "PAD",
    "SMALL_DIR",
    "SPECIAL_TOKENS",
    "VOCAB_SIZE",
    "build_tokenizer",
    "decode",
    "encode",
    "load_small",
    "load_tokenizer",
]

SMALL_DIR = pathlib.Path(__file__).resolve().parent / "small"
# the tokenizer's strings for the ids above the bytes; encode never produces the ids above PAD (unused, named so that
# the tokenizer's vocabulary is the model's VOCAB_SIZE ids)
SPECIAL_TOKENS = {"<bos>": BOS, "<eos>": EOS, "<pad>": PAD} | {f"<unused_{i}>": i for i in range(PAD + 1, VOCAB_SIZE)}


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


def _byte_chars() -> list[str]:
    """The printable character that stands for each byte in a byte-level ``tokenizers`` vocabulary (GPT-2's
    table, the one ``pre_tokenizers.ByteLevel`` maps bytes to): printable Latin-1 bytes stand for themselves,
    the others for ``chr(256 + k)`` in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for byte in range(256):
        if byte in keep:
            chars[byte] = chr(byte)
        else:
            chars[byte] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def build_tokenizer():
    """The small model's byte tokenizer as a transformers tokenizer (the ``tokenizers`` library's model classes):
    id ``b`` is byte ``b``, BOS is put first, text is never split on special-token strings, so its ids are
    :func:`encode`'s; decoding skips the special and unused ids with ``skip_special_tokens=True``, as
    :func:`decode` does. Left padding (LoopKVCache needs it), 4096 tokens (the training length).

    The files in ``SMALL_DIR`` are ``build_tokenizer().save_pretrained(SMALL_DIR)``.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {char: byte for byte, char in enumerate(_byte_chars())}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))  # no merges: one token per byte
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(list(SPECIAL_TOKENS))  # ids BOS.. in order, as SPECIAL_TOKENS lists them
    backend.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", BOS)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", padding_side="left",
        model_max_length=4096, split_special_tokens=True, clean_up_tokenization_spaces=False,
    )


def load_tokenizer():
    """The shipped tokenizer of the small model from ``SMALL_DIR`` (``AutoTokenizer``, offline). Registers Ouro with
    transformers' Auto classes first (``register_ouro``), so that AutoTokenizer reads ``config.json`` as an Ouro one."""
    from transformers import AutoTokenizer

    from loopkv.models.ouro import register_ouro

    if not (SMALL_DIR / "tokenizer.json").is_file():
        raise FileNotFoundError(f"the small model's tokenizer is missing from {SMALL_DIR} (tokenizer.json); reinstall "
                                "loopkv, or write it: build_tokenizer().save_pretrained(SMALL_DIR)")
    register_ouro()
    return AutoTokenizer.from_pretrained(str(SMALL_DIR), local_files_only=True)
