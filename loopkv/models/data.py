"""Data of the small model loopkv ships: byte tokens, stdlib text and synthetic long-context tasks.

Nothing is downloaded. The text is the Python standard library of the running interpreter
(``sysconfig.get_paths()["stdlib"]``, every ``*.py`` outside ``site-packages``/``dist-packages``, sorted
by path), split into train and held-out *files* by a hash of the relative path, so held-out text is
unseen files. Everything is deterministic given a seed and the interpreter (a different Python
version has a different stdlib, hence slightly different documents).

Tokens are bytes: ids 0..255 are the byte values, then ``BOS``, ``EOS`` and ``PAD``; the vocabulary is
rounded up to ``VOCAB_SIZE = 320`` (a multiple of 64) and the ids above ``PAD`` are never used.

Synthetic documents force attention far back:

* key-value retrieval: records ``\\nkey 48213: 7391\\n`` scattered between stdlib filler, then
  queries that repeat a record's prefix, ``\\nkey 48213: `` + answer ``7391``; :func:`retrieval_task`
  is the prompt/answer pair the quality benchmarks score by exact match of the greedy answer. The key
  sits right before the value in record and query alike, so a copy (induction) circuit that matches the
  last few bytes solves it, and shorter matches already narrow the candidates (a smooth path to learn);
* variable tracking (RULER-style chains): ``\\nVAR QZK = 48213\\n`` ... ``\\nVAR ABC = QZK\\n`` ...,
  then ``\\n? ABC -> 48213``; :func:`variable_tracking_task` is its prompt/answer pair.

The demo, the profiler's calibration documents and the quality benchmark use these; the training mix
(``BatchSampler``) lives with the training script, ``tools/train_small.py``.
"""

from __future__ import annotations

import functools
import hashlib
import pathlib
import sysconfig
from dataclasses import dataclass

import numpy as np
import torch

BOS = 256
EOS = 257
PAD = 258
VOCAB_SIZE = 320  # 256 bytes + 3 specials, rounded up to a multiple of 64

HELDOUT_PERCENT = 5  # share of stdlib files (by path hash) kept out of training
EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})

KEY_LOW, KEY_HIGH = 10_000, 100_000  # keys: 5 digits
VALUE_LOW, VALUE_HIGH = 1_000, 10_000  # values: 4 digits, so a value never contains a whole key
VAR_VALUE_LOW, VAR_VALUE_HIGH = 10_000, 100_000  # variable-tracking root values: 5 digits
RECORD_SPACING = 80  # benchmark retrieval documents: one record per 80 bytes (~28% records, rest filler)
CHAIN_SPACING = 256  # benchmark variable-tracking documents: one chain per 256 bytes
MIN_SYNTHETIC_LEN = 64  # shortest synthetic document (tokens, BOS included)


# ----------------------------------------------------------------------------- tokens


def encode_bytes(data: bytes | str, *, bos: bool = True) -> np.ndarray:
    """Byte tokens of ``data`` (str is UTF-8 encoded): int64 ``[n]``, ``BOS`` first when ``bos``."""
    if isinstance(data, str):
        data = data.encode("utf-8")
    if not isinstance(data, bytes | bytearray):
        raise ValueError(f"data must be bytes or str, got {type(data).__name__}")
    ids = np.frombuffer(bytes(data), dtype=np.uint8).astype(np.int64)
    return np.concatenate([np.array([BOS], dtype=np.int64), ids]) if bos else ids


def decode_bytes(ids) -> bytes:
    """Bytes of the byte tokens in ``ids`` (any int sequence or tensor); special ids are dropped."""
    arr = np.asarray(ids.tolist() if isinstance(ids, torch.Tensor) else ids, dtype=np.int64).reshape(-1)
    return arr[(arr >= 0) & (arr < 256)].astype(np.uint8).tobytes()


# ----------------------------------------------------------------------------- corpus


def is_heldout(relpath: str) -> bool:
    """Whether the stdlib file at ``relpath`` (posix, relative to the stdlib root) is held out."""
    digest = hashlib.sha256(relpath.encode("utf-8")).digest()
    return int.from_bytes(digest[:4], "little") % 100 < HELDOUT_PERCENT


class Split:
    """One side of the corpus.

    Fields:
        paths: tuple[str] -- relative posix paths of the documents, sorted.
        tokens: uint16 ``[N]`` -- ``BOS doc EOS`` for every document, concatenated (text windows).
        filler: uint8 ``[M]`` -- the documents joined by newlines (distractor text for synthetic tasks).
        digest: str -- sha256 of the paths and contents, for provenance.
    """

    def __init__(self, paths: tuple[str, ...], docs: tuple[bytes, ...]):
        if not docs:
            raise ValueError("a corpus split needs at least one document")
        self.paths = paths
        sha = hashlib.sha256()
        parts = []
        for path, doc in zip(paths, docs, strict=True):
            sha.update(path.encode() + b"\0" + hashlib.sha256(doc).digest())
            parts.append(np.array([BOS], dtype=np.uint16))
            parts.append(np.frombuffer(doc, dtype=np.uint8).astype(np.uint16))
            parts.append(np.array([EOS], dtype=np.uint16))
        self.tokens = np.concatenate(parts)
        self.filler = np.frombuffer(b"\n".join(docs), dtype=np.uint8)
        self.digest = sha.hexdigest()

    @property
    def n_bytes(self) -> int:
        return int(self.filler.size - (len(self.paths) - 1))

    def filler_bytes(self, rng: np.random.Generator, n: int) -> bytes:
        """``n`` consecutive filler bytes from a random offset (wrapping around the pool)."""
        if n <= 0:
            return b""
        start = int(rng.integers(0, self.filler.size))
        idx = (start + np.arange(n)) % self.filler.size if start + n > self.filler.size else None
        chunk = self.filler[idx] if idx is not None else self.filler[start : start + n]
        return chunk.tobytes()

    def text_window(self, rng: np.random.Generator, n: int, *, bos: bool = True) -> np.ndarray:
        """A random window of the document stream: int64 ``[n]``; with ``bos``, ``BOS`` + ``n - 1`` tokens.

        Starting every row with ``BOS`` (as every synthetic document and benchmark prompt does) gives the
        model one consistent first token, where an attention sink can form.
        """
        body = n - 1 if bos else n
        if body > self.tokens.size or body < 0:
            raise ValueError(f"seq_len={n} exceeds the split's {self.tokens.size} tokens; use a smaller one")
        start = int(rng.integers(0, self.tokens.size - body + 1))
        window = self.tokens[start : start + body].astype(np.int64)
        return np.concatenate([np.array([BOS], dtype=np.int64), window]) if bos else window


@dataclass(frozen=True)
class Corpus:
    root: str
    train: Split
    heldout: Split


def stdlib_root() -> pathlib.Path:
    return pathlib.Path(sysconfig.get_paths()["stdlib"])


@functools.lru_cache(maxsize=4)
def load_corpus(root: str | None = None) -> Corpus:
    """The stdlib corpus under ``root`` (default: the running interpreter's stdlib), cached."""
    base = pathlib.Path(root) if root is not None else stdlib_root()
    if not base.is_dir():
        raise ValueError(f"root={str(base)!r} is not a directory; pass a folder of *.py files")
    files = []
    for path in base.rglob("*.py"):
        rel = path.relative_to(base)
        if EXCLUDED_DIRS.isdisjoint(rel.parts) and path.is_file():
            files.append((rel.as_posix(), path))
    files.sort()
    train, held = [], []
    for rel, path in files:
        doc = path.read_bytes()
        if doc:
            (held if is_heldout(rel) else train).append((rel, doc))
    if not train or not held:
        raise ValueError(f"root={str(base)!r} holds too few *.py files for a train/held-out split")
    return Corpus(
        root=str(base),
        train=Split(tuple(p for p, _ in train), tuple(d for _, d in train)),
        heldout=Split(tuple(p for p, _ in held), tuple(d for _, d in held)),
    )


# ----------------------------------------------------------------------------- synthetic documents


def interleave(rng: np.random.Generator, split: Split, pieces: list[bytes], filler_budget: int) -> bytes:
    """``pieces`` in order with ``filler_budget`` filler bytes cut at random into len(pieces)+1 gaps."""
    cuts = np.sort(rng.integers(0, filler_budget + 1, size=len(pieces)))
    gaps = np.diff(np.concatenate([[0], cuts, [filler_budget]]))
    out = [split.filler_bytes(rng, int(gaps[0]))]
    for piece, gap in zip(pieces, gaps[1:], strict=True):
        out.append(piece)
        out.append(split.filler_bytes(rng, int(gap)))
    return b"".join(out)


def check_fits(name: str, n_bytes: int, fixed: int) -> None:
    if fixed > n_bytes:
        raise ValueError(
            f"n_tokens too small for the {name} task: its records and queries take {fixed} bytes but "
            f"only {n_bytes} fit; use a larger n_tokens or fewer records/queries"
        )


def retrieval_document(
    rng: np.random.Generator,
    split: Split,
    *,
    n_bytes: int,
    n_queries: int,
    n_records: int,
    placement: str = "end",
) -> tuple[bytes, list[tuple[bytes, bytes]]]:
    """A key-value retrieval document of exactly ``n_bytes`` bytes.

    Returns ``(body, queries)``: ``body`` holds ``n_records`` records ``\\nkey K: V\\n`` scattered through
    filler; with ``placement="end"``, ``queries`` is a list of ``(b"\\nkey K: ", b"V")`` for ``n_queries``
    distinct records, meant to follow the body, and ``len(body) + sum(len(q) + len(a)) == n_bytes``.
    With ``placement="anywhere"`` each query line ``\\nkey K: V\\n`` sits in the body at a random point
    after its record, ``queries`` is empty and ``len(body) == n_bytes``: queries at every position keep a
    model from tying "answer now" to the end of its training rows.
    """
    if not 1 <= n_queries <= n_records:
        raise ValueError(f"n_queries must be in [1, n_records={n_records}], got {n_queries}")
    if placement not in ("end", "anywhere"):
        raise ValueError(f"placement must be 'end' or 'anywhere', got {placement!r}")
    keys = rng.choice(KEY_HIGH - KEY_LOW, size=n_records, replace=False) + KEY_LOW
    values = rng.choice(VALUE_HIGH - VALUE_LOW, size=n_records, replace=False) + VALUE_LOW
    records = [b"\nkey %d: %d\n" % (k, v) for k, v in zip(keys, values, strict=True)]
    asked = rng.choice(n_records, size=n_queries, replace=False)
    queries = [(b"\nkey %d: " % keys[i], b"%d" % values[i]) for i in asked]
    if placement == "anywhere":
        pieces = list(records)
        for i, (q, a) in zip(asked, queries, strict=True):
            after = pieces.index(records[i]) + 1
            pieces.insert(int(rng.integers(after, len(pieces) + 1)), q + a + b"\n")
        check_fits("retrieval", n_bytes, sum(map(len, pieces)))
        return interleave(rng, split, pieces, n_bytes - sum(map(len, pieces))), []
    fixed = sum(map(len, records)) + sum(len(q) + len(a) for q, a in queries)
    check_fits("retrieval", n_bytes, fixed)
    return interleave(rng, split, records, n_bytes - fixed), queries


def _var_name(code: int) -> bytes:
    return bytes(65 + (code // 26**i) % 26 for i in (2, 1, 0))


def variable_tracking_document(
    rng: np.random.Generator, split: Split, *, n_bytes: int, n_queries: int, n_chains: int, hops: int
) -> tuple[bytes, list[tuple[bytes, bytes]]]:
    """A variable-tracking document of exactly ``n_bytes`` bytes.

    Each of ``n_chains`` chains is ``\\nVAR A = 48213\\n`` followed (later, in order, with other chains'
    statements and filler between) by ``hops`` statements ``\\nVAR B = A\\n``, ``\\nVAR C = B\\n``, ...
    Returns ``(body, queries)`` with queries ``(b"\\n? C -> ", b"48213")`` about the last variable of
    ``n_queries`` distinct chains.
    """
    if not 1 <= n_queries <= n_chains:
        raise ValueError(f"n_queries must be in [1, n_chains={n_chains}], got {n_queries}")
    if hops < 1:
        raise ValueError(f"hops must be >= 1, got {hops}")
    names = rng.choice(26**3, size=n_chains * (hops + 1), replace=False).reshape(n_chains, hops + 1)
    roots = rng.choice(VAR_VALUE_HIGH - VAR_VALUE_LOW, size=n_chains, replace=False) + VAR_VALUE_LOW
    order = rng.permutation(np.repeat(np.arange(n_chains), hops + 1))
    emitted = np.zeros(n_chains, dtype=np.int64)
    statements = []
    for c in order:
        j = emitted[c]
        rhs = b"%d" % roots[c] if j == 0 else _var_name(names[c, j - 1])
        statements.append(b"\nVAR " + _var_name(names[c, j]) + b" = " + rhs + b"\n")
        emitted[c] += 1
    asked = rng.choice(n_chains, size=n_queries, replace=False)
    queries = [(b"\n? " + _var_name(names[c, hops]) + b" -> ", b"%d" % roots[c]) for c in asked]
    fixed = sum(map(len, statements)) + sum(len(q) + len(a) for q, a in queries)
    check_fits("variable-tracking", n_bytes, fixed)
    return interleave(rng, split, statements, n_bytes - fixed), queries


def _check_n_tokens(n_tokens: int) -> None:
    if not isinstance(n_tokens, int) or n_tokens < MIN_SYNTHETIC_LEN:
        raise ValueError(f"n_tokens must be an int >= {MIN_SYNTHETIC_LEN}, got {n_tokens!r}")


def retrieval_task(n_tokens: int, seed: int, *, corpus: Corpus | None = None) -> tuple[bytes, bytes]:
    """A key-value retrieval prompt and its answer, for exact-match scoring of greedy decoding.

    ``BOS + prompt + answer`` is exactly ``n_tokens`` tokens: the prompt holds ``n_tokens // 80``
    records between held-out stdlib filler and ends with one query ``\\nkey K: ``; the answer is the
    4-digit value ``V``. The key occurs exactly twice in the prompt (record and query) and the answer
    exactly once (its record), so the task has one right answer. Deterministic in ``(n_tokens, seed)``
    and the interpreter's stdlib.
    """
    _check_n_tokens(n_tokens)
    split = (corpus or load_corpus()).heldout
    rng = np.random.default_rng([0x4B56, n_tokens, seed])
    n_records = max(2, n_tokens // RECORD_SPACING)
    while True:
        body, [(query, answer)] = retrieval_document(rng, split, n_bytes=n_tokens - 1, n_queries=1, n_records=n_records)
        prompt = body + query
        key = query[5:-2]
        if prompt.count(key) == 2 and prompt.count(answer) == 1:
            return prompt, answer


def variable_tracking_task(
    n_tokens: int, seed: int, *, hops: int = 2, corpus: Corpus | None = None
) -> tuple[bytes, bytes]:
    """A variable-tracking prompt (``n_tokens // 256`` chains of ``hops`` hops) and its 5-digit answer.

    ``BOS + prompt + answer`` is exactly ``n_tokens`` tokens; the answer occurs once in the prompt.
    """
    _check_n_tokens(n_tokens)
    split = (corpus or load_corpus()).heldout
    rng = np.random.default_rng([0x5654, n_tokens, seed, hops])
    n_chains = max(2, n_tokens // CHAIN_SPACING)
    while True:
        body, [(query, answer)] = variable_tracking_document(
            rng, split, n_bytes=n_tokens - 1, n_queries=1, n_chains=n_chains, hops=hops
        )
        prompt = body + query
        if prompt.count(answer) == 1:
            return prompt, answer


# ----------------------------------------------------------------------------- held-out text


def heldout_windows(corpus: Corpus, *, n: int, seq_len: int, seed: int = 0) -> torch.Tensor:
    """``n`` fixed held-out text rows, ``BOS`` + ``seq_len - 1`` stream tokens: int64 ``[n, seq_len]``."""
    rng = np.random.default_rng([0x484F, seed])
    return torch.from_numpy(np.stack([corpus.heldout.text_window(rng, seq_len) for _ in range(n)]))
