"""The small model's byte tokenizer as shipped in transformers' format (``loopkv/models/small/tokenizer*.json``):
its ids are ``loopkv.models.small.encode``'s and its decoding is ``decode``'s."""

from __future__ import annotations

import pytest
import torch

from loopkv.models import data
from loopkv.models.small import SMALL_DIR, SPECIAL_TOKENS, build_tokenizer, decode, encode, load_tokenizer

# every character of one and two UTF-8 bytes, characters of three and four bytes (every lead byte valid UTF-8 has),
# whitespace and control characters, and the special tokens' strings, which are text like any other
TEXT = ("".join(chr(c) for c in range(1, 0x800))
        + "".join(chr(c) for c in range(0x800, 0x10000, 0x1FF) if not 0xD800 <= c < 0xE000)  # no surrogates
        + "".join(chr(c) for c in range(0x10000, 0x110000, 0x3FFF)) + "\x00 \t\r\n  x <bos><eos><pad><unused_300>")


@pytest.fixture(scope="module", params=["shipped", "built"])
def tokenizer(request):
    return load_tokenizer() if request.param == "shipped" else build_tokenizer()


def test_the_tokenizer_files_ship_with_the_small_model():
    assert (SMALL_DIR / "tokenizer.json").is_file()
    assert (SMALL_DIR / "tokenizer_config.json").is_file()


def test_ids_are_the_byte_tokens_of_encode(tokenizer):
    assert not TEXT.encode("utf-8").isascii()
    ids = tokenizer(TEXT)["input_ids"]
    assert ids == encode(TEXT).tolist()
    assert ids[0] == data.BOS
    assert data.EOS not in ids  # "<eos>" in the text is five bytes, not EOS
    assert tokenizer(TEXT, add_special_tokens=False)["input_ids"] == encode(TEXT, bos=False).tolist()


def test_decoding_drops_what_decode_drops(tokenizer):
    ids = encode(TEXT).tolist() + [data.EOS, data.PAD, 300, data.VOCAB_SIZE - 1]
    assert tokenizer.decode(ids, skip_special_tokens=True) == decode(torch.tensor(ids)).decode("utf-8") == TEXT
    assert tokenizer.decode([data.BOS, 104, 105, data.EOS]) == "<bos>hi<eos>"


def test_the_vocabulary_is_the_models(tokenizer):
    assert len(tokenizer) == data.VOCAB_SIZE
    tokens = tokenizer.convert_ids_to_tokens(list(range(256)))
    assert len(set(tokens)) == 256  # one distinct symbol per byte
    assert all(len(t) == 1 for t in tokens)
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (data.BOS, data.EOS, data.PAD)
    assert tokenizer.convert_tokens_to_ids(list(SPECIAL_TOKENS)) == list(range(data.BOS, data.VOCAB_SIZE))
    assert tokenizer.model_max_length == 4096


def test_batches_are_left_padded(tokenizer):
    batch = tokenizer(["ab", "abcd"], padding=True, return_tensors="pt")
    assert batch["input_ids"].tolist() == [[data.PAD, data.PAD, data.BOS, 97, 98], [data.BOS, 97, 98, 99, 100]]
    assert batch["attention_mask"].tolist() == [[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]]
