"""Train loopkv's small Ouro-architecture model: ``python tools/train_small.py --out DIR ...``.

Run from a checkout with loopkv installed (``pip install -e .``). The model card, docs/small-model.md,
gives the commands that made the shipped checkpoint (``loopkv/models/small/``).

The model is Ouro (loopkv.models.ouro) at a small shape: byte vocabulary, T=4 loops over 6 layers,
MHA with head_dim 128 like Ouro. Data: stdlib text windows (loopkv.models.data) mixed with synthetic
key-value retrieval, variable-tracking and repeat documents (:class:`BatchSampler`). AdamW with linear
warm-up and a cosine decay, bf16 autocast on CUDA, a curriculum over sequence lengths. The schedule follows
*progress*, the larger of ``step / --steps`` and the elapsed share of ``--minutes`` (counted from the end of
the first step, which carries compilation; the wall-clock budget itself includes it), so a time budget ends
with a decayed learning rate whatever the device's speed.

Loss: cross-entropy of the final loop's logits plus ``--aux-loop-weight`` times the mean cross-entropy of
the earlier loops' (normed) states through the same LM head, so every loop is a predictor as in Ouro.

Outputs in ``--out``: ``small/config.json`` + ``small/model.safetensors`` (16-bit), ``train_log.csv``
(the loss curve), ``metrics.json`` (device, versions, date, steps, tokens, losses, retrieval accuracy,
attention-sink mass per loop, the evaluation history).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import datetime
import json
import math
import pathlib
import platform
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from loopkv.models import data
from loopkv.models.attention_stats import attention_mass
from loopkv.models.ouro import OuroConfig, OuroForCausalLM

SMALL_SHAPE = {
    "hidden_size": 256,
    "intermediate_size": 704,
    "num_hidden_layers": 6,
    "num_attention_heads": 2,
    "head_dim": 128,
    "total_ut_steps": 4,
}
SMOKE_SHAPE = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "head_dim": 32,
    "total_ut_steps": 2,
}
ROPE_THETA = 10_000.0  # a 4K-context model; Ouro-1.4B's 1e6 serves 64K
QUERY_PLACEMENTS = ("end", "anywhere")
REPEAT_ALPHABET = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz0123456789", dtype=np.uint8)


# ----------------------------------------------------------------------------- training data


def repeat_document(rng: np.random.Generator, split: data.Split, *, n_bytes: int, n_strings: int) -> bytes:
    """A copy-training document of exactly ``n_bytes`` bytes: ``n_strings`` random strings
    ``\\n<16..48 letters/digits>\\n`` in filler, each repeated once later (second copies in random order)."""
    if n_strings < 1:
        raise ValueError(f"n_strings must be >= 1, got {n_strings}")
    strings = [
        b"\n" + REPEAT_ALPHABET[rng.integers(0, REPEAT_ALPHABET.size, size=int(n))].tobytes() + b"\n"
        for n in rng.integers(16, 49, size=n_strings)
    ]
    pieces = strings + [strings[i] for i in rng.permutation(n_strings)]
    fixed = sum(map(len, pieces))
    data.check_fits("repeat", n_bytes, fixed)
    return data.interleave(rng, split, pieces, n_bytes - fixed)


class BatchSampler:
    """Seeded batches mixing stdlib text windows with synthetic retrieval, variable-tracking and repeat rows.

    Each row is ``seq_len`` tokens with no padding, ``BOS`` first: a text row continues with a window of
    the ``BOS doc EOS`` stream; a synthetic row with one document of ``seq_len - 1`` bytes (retrieval and
    tracking rows end with their query answers). Retrieval rows draw their record density (one per
    48..160 bytes) and 1..16 queries at random, placed at the row's end or anywhere after their records
    (``query_placement``); variable-tracking rows draw 1..3 hops; repeat rows hold one random string per
    200 bytes (at most 16). Same seed and same calls, same batches.
    """

    def __init__(
        self,
        split: data.Split,
        *,
        seed: int,
        retrieval_fraction: float = 0.375,
        tracking_fraction: float = 0.125,
        repeat_fraction: float = 0.0,
        query_placement: str = "end",
    ):
        fractions = (retrieval_fraction, tracking_fraction, repeat_fraction)
        if min(fractions) < 0 or sum(fractions) > 1:
            raise ValueError(
                "retrieval_fraction, tracking_fraction and repeat_fraction must be >= 0 and sum to <= 1, "
                f"got {fractions}"
            )
        if query_placement not in QUERY_PLACEMENTS:
            raise ValueError(f"query_placement must be one of {QUERY_PLACEMENTS}, got {query_placement!r}")
        self.split = split
        self.query_placement = query_placement
        self.rng = np.random.default_rng([0x5A4D, seed])
        self.p = np.array([1 - sum(fractions), *fractions])

    def row(self, seq_len: int) -> np.ndarray:
        """One row: int64 ``[seq_len]``."""
        kind = int(self.rng.choice(4, p=self.p)) if seq_len >= data.MIN_SYNTHETIC_LEN else 0
        if kind == 0:
            return self.split.text_window(self.rng, seq_len)
        n_bytes = seq_len - 1
        if kind == 1 or n_bytes < 2 * data.MIN_SYNTHETIC_LEN - 1:
            n_records = max(2, n_bytes // int(self.rng.integers(48, 161)))
            n_queries = int(self.rng.integers(1, min(16, n_records, max(1, n_bytes // 64)) + 1))
            body, queries = data.retrieval_document(
                self.rng, self.split, n_bytes=n_bytes, n_queries=n_queries, n_records=n_records,
                placement=self.query_placement,
            )
        elif kind == 2:
            hops = int(self.rng.integers(1, max(1, min(3, n_bytes // 128)) + 1))
            n_chains = max(2, n_bytes // (data.CHAIN_SPACING * hops // 2 + 64))
            n_queries = int(self.rng.integers(1, min(4, n_chains) + 1))
            body, queries = data.variable_tracking_document(
                self.rng, self.split, n_bytes=n_bytes, n_queries=n_queries, n_chains=n_chains, hops=hops
            )
        else:
            n_strings = max(1, min(16, n_bytes // 200))
            body, queries = repeat_document(self.rng, self.split, n_bytes=n_bytes, n_strings=n_strings), []
        doc = body + b"".join(q + a for q, a in queries)
        return data.encode_bytes(doc, bos=True)

    def __call__(self, *, batch_size: int, seq_len: int) -> torch.Tensor:
        """A batch of token ids: int64 ``[batch_size, seq_len]``."""
        if batch_size < 1 or seq_len < 2:
            raise ValueError(f"batch_size must be >= 1 and seq_len >= 2, got {batch_size} and {seq_len}")
        return torch.from_numpy(np.stack([self.row(seq_len) for _ in range(batch_size)]))


def copy_accuracy_documents(corpus: data.Corpus, *, n: int, seq_len: int, seed: int = 0) -> list[tuple[bytes, bytes]]:
    """``n`` (prompt, answer) pairs testing plain copying: held-out filler with random strings, the prompt
    ending with the first 8 bytes of a repeat of one of them, the answer its remaining bytes."""
    rng = np.random.default_rng([0x4350, seed, seq_len])
    out = []
    for _ in range(n):
        s = b"\n" + REPEAT_ALPHABET[rng.integers(0, REPEAT_ALPHABET.size, size=24)].tobytes()
        head, tail = s[:9], s[9:]
        filler = seq_len - 1 - len(s) - len(s)
        if filler < 0:
            raise ValueError(f"seq_len={seq_len} is too short for a copy test; use at least 64")
        cut = int(rng.integers(0, filler + 1))
        prompt = corpus.heldout.filler_bytes(rng, cut) + s + corpus.heldout.filler_bytes(rng, filler - cut) + head
        out.append((prompt, tail))
    return out


# ----------------------------------------------------------------------------- model and schedule


def small_config(
    *, shape: dict[str, int] | None = None, max_positions: int = 4096, rope_theta: float = ROPE_THETA
) -> OuroConfig:
    """The small model's config: Ouro fields, byte vocabulary, MHA (``num_key_value_heads == heads``)."""
    shape = dict(SMALL_SHAPE if shape is None else shape)
    return OuroConfig(
        vocab_size=data.VOCAB_SIZE,
        num_key_value_heads=shape["num_attention_heads"],
        max_position_embeddings=max_positions,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": float(rope_theta)},
        tie_word_embeddings=False,
        bos_token_id=data.BOS,
        eos_token_id=data.EOS,
        pad_token_id=data.PAD,
        **shape,
    )


def parse_curriculum(spec: str, *, max_len: int) -> list[tuple[float, int]]:
    """``"0:512,0.2:1024,0.8:4096"`` -> ``[(0.0, 512), (0.2, 1024), (0.8, 4096)]`` (start progress, length).

    An empty spec means one stage at ``max_len``.
    """
    if not spec:
        return [(0.0, max_len)]
    stages = []
    for item in spec.split(","):
        start, _, length = item.partition(":")
        stages.append((float(start), int(length)))
    starts = [s for s, _ in stages]
    if starts[0] != 0.0 or starts != sorted(starts) or any(not 0 <= s < 1 for s in starts):
        raise ValueError(f"curriculum={spec!r}: stage starts must begin at 0, increase and stay below 1")
    if any(n < 2 or n > max_len for _, n in stages):
        raise ValueError(f"curriculum={spec!r}: every length must be in [2, seq_len={max_len}]")
    return stages


def default_curriculum(max_len: int) -> str:
    """Short sequences first: max_len/8 for the first 20% of progress, /4 to 45%, /2 to 80%, then full."""
    lengths = [max(64, max_len // 8), max(64, max_len // 4), max(64, max_len // 2), max_len]
    return ",".join(f"{s}:{n}" for s, n in zip((0, 0.2, 0.45, 0.8), lengths, strict=True))


def stage_at(stages: list[tuple[float, int]], progress: float) -> int:
    """Sequence length at ``progress`` in [0, 1]."""
    return [n for s, n in stages if s <= progress][-1]


def lr_at(step: int, progress: float, *, lr: float, warmup_steps: int, min_ratio: float) -> float:
    """Linear warm-up over ``warmup_steps`` steps, then cosine by progress to ``lr * min_ratio``."""
    warm = min(1.0, (step + 1) / max(1, warmup_steps))
    cos = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return lr * warm * (min_ratio + (1 - min_ratio) * cos)


def make_optimizer(model: torch.nn.Module, *, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW(0.9, 0.95); weight decay on matrices only (not on norms, the gate bias or embeddings)."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (decay if p.dim() >= 2 and "embed_tokens" not in name else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    fused = all(p.is_cuda for p in model.parameters())
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8, fused=fused)


class LoopStates:
    """Captures the normed state after every loop (``model.model.norm``'s outputs): ``[B, S, H]`` each."""

    def __init__(self, model: OuroForCausalLM):
        self.states: list[torch.Tensor] = []
        self._handle = model.model.norm.register_forward_hook(lambda _m, _i, out: self.states.append(out))

    def pop(self) -> list[torch.Tensor]:
        states, self.states = self.states, []
        return states

    def remove(self) -> None:
        self._handle.remove()


def loop_losses(model: OuroForCausalLM, ids: torch.Tensor, probe: LoopStates) -> torch.Tensor:
    """Next-byte cross-entropy of every loop, fp32 ``[T]`` (the last entry is the model's own output).

    ``ids``: int64 ``[B, S]``; position ``i`` predicts ``ids[:, i + 1]``.
    """
    probe.pop()
    model.model(input_ids=ids, use_cache=False)
    states = probe.pop()
    targets = ids[:, 1:].reshape(-1)
    out = []
    for h in states:
        logits = model.lm_head(h[:, :-1])  # [B, S-1, V]
        out.append(F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets))
    return torch.stack(out)


def objective(losses: torch.Tensor, *, aux_weight: float) -> torch.Tensor:
    """Final loop's loss plus ``aux_weight`` times the mean of the earlier loops' losses."""
    if losses.numel() == 1 or aux_weight == 0:
        return losses[-1]
    return losses[-1] + aux_weight * losses[:-1].mean()


def autocast_for(device: torch.device):
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast("cpu", enabled=False)


# ----------------------------------------------------------------------------- evaluation


@torch.no_grad()
def heldout_loss(model: OuroForCausalLM, windows: torch.Tensor, *, device: torch.device, batch: int) -> float:
    """Mean next-byte cross-entropy (nats) of the final loop over held-out windows ``[N, S]``."""
    total, count = 0.0, 0
    for chunk in windows.split(batch):
        ids = chunk.to(device)
        with autocast_for(device):
            logits = model(input_ids=ids, use_cache=False).logits[:, :-1]
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="sum")
        total += float(loss)
        count += ids[:, 1:].numel()
    return total / count


@torch.no_grad()
def task_accuracy(
    model: OuroForCausalLM,
    tasks: Sequence[tuple[bytes, bytes]],
    *,
    device: torch.device,
    batch: int,
) -> float:
    """Exact match of greedy decoding of each answer after its prompt, as a fraction.

    Greedy decoding reproduces an answer iff at every answer position the argmax given the prompt and
    the answer's previous bytes is the answer's byte, so one teacher-forced pass decides it.
    """
    hits = 0
    for start in range(0, len(tasks), batch):
        part = tasks[start : start + batch]
        rows = [data.encode_bytes(p + a) for p, a in part]
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), data.PAD, dtype=torch.long)
        for i, r in enumerate(rows):  # all rows have the same length here; pad on the right if not
            ids[i, : len(r)] = torch.from_numpy(r)
        with autocast_for(device):
            logits = model(input_ids=ids.to(device), use_cache=False).logits
        pred = logits.argmax(-1).cpu()
        for i, (p, a) in enumerate(part):
            first = 1 + len(p)  # position of the answer's first byte
            got = pred[i, first - 1 : first - 1 + len(a)]
            hits += bool(torch.equal(got, ids[i, first : first + len(a)]))
    return hits / len(tasks)


def evaluate(
    model: OuroForCausalLM,
    corpus: data.Corpus,
    *,
    device: torch.device,
    text: torch.Tensor,
    retrieval_lengths: Sequence[int],
    n_tasks: int,
    batch_tokens: int,
    tracking_length: int | None = None,
) -> dict[str, Any]:
    """Held-out byte loss, retrieval exact match per length and (optionally) variable tracking."""
    was_training = model.training
    model.eval()
    seed0 = 1_000_000  # task seeds disjoint from anything the benchmarks are likely to pick first
    out: dict[str, Any] = {}
    loss = heldout_loss(model, text, device=device, batch=max(1, batch_tokens // text.shape[1]))
    out["heldout_loss_nats"] = loss
    out["heldout_bits_per_byte"] = loss / math.log(2)
    copy_len = min(retrieval_lengths)
    copies = copy_accuracy_documents(corpus, n=n_tasks, seq_len=copy_len, seed=seed0)
    out[f"copy_em_{copy_len}"] = task_accuracy(model, copies, device=device, batch=max(1, batch_tokens // copy_len))
    for n in retrieval_lengths:
        tasks = [data.retrieval_task(n, seed0 + i, corpus=corpus) for i in range(n_tasks)]
        out[f"retrieval_em_{n}"] = task_accuracy(model, tasks, device=device, batch=max(1, batch_tokens // n))
    if tracking_length:
        tasks = [data.variable_tracking_task(tracking_length, seed0 + i, corpus=corpus) for i in range(n_tasks)]
        out[f"tracking_em_{tracking_length}"] = task_accuracy(
            model, tasks, device=device, batch=max(1, batch_tokens // tracking_length)
        )
    model.train(was_training)
    return out


# ----------------------------------------------------------------------------- saving


def save_checkpoint(model: OuroForCausalLM, directory: pathlib.Path) -> str:
    """Save ``config.json`` + ``model.safetensors`` in fp16 (bf16 if a weight leaves fp16's range)."""
    state = model.state_dict()
    biggest = max(float(t.abs().max()) for t in state.values() if t.is_floating_point())
    dtype = torch.float16 if biggest < 60_000 else torch.bfloat16
    half = {k: v.detach().to("cpu", dtype) if v.is_floating_point() else v.cpu() for k, v in state.items()}
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory, state_dict=half)
    name = str(dtype).removeprefix("torch.")
    config_path = directory / "config.json"
    config = json.loads(config_path.read_text())
    config["dtype"] = name  # the stored dtype (save_pretrained writes the live model's, fp32)
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return name


# ----------------------------------------------------------------------------- the loop


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python tools/train_small.py", description=__doc__.split("\n")[0])
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--minutes", type=float, default=None, help="wall-clock budget of the training loop")
    p.add_argument("--steps", type=int, default=None, help="number of optimizer steps")
    p.add_argument("--seq-len", type=int, default=4096, help="longest (final) sequence length")
    p.add_argument("--batch-size", type=int, default=16, help="rows per step at --seq-len (tokens per step fixed)")
    p.add_argument("--curriculum", default=None, help="'start:len,...' over progress (default: len/8 -> len)")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--smoke", action="store_true", help="tiny CPU run that finishes in well under a minute")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--warmup-steps", type=int, default=150)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--aux-loop-weight", type=float, default=0.3)
    p.add_argument("--retrieval-fraction", type=float, default=0.375)
    p.add_argument("--tracking-fraction", type=float, default=0.125)
    p.add_argument("--repeat-fraction", type=float, default=0.2)
    p.add_argument(
        "--query-placement",
        choices=QUERY_PLACEMENTS,
        default="anywhere",
        help="retrieval queries at the end of each row, or anywhere after their records ('end' ties answering "
        "to the end of the training length)",
    )
    p.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="torch.compile each decoder layer (default: on for CUDA); falls back to eager on error",
    )
    p.add_argument("--eval-every", type=float, default=None, help="seconds between evaluations and saves (90)")
    p.add_argument("--eval-tasks", type=int, default=64, help="retrieval prompts per length in periodic evals")
    p.add_argument("--final-tasks", type=int, default=200, help="prompts per length in the final evaluation")
    p.add_argument("--log-every", type=int, default=10, help="steps between loss-curve rows")
    p.add_argument("--init", default=None, help="start from this checkpoint directory instead of random weights")
    p.add_argument("--corpus-root", default=None, help="folder of *.py files (default: the stdlib)")
    for name, value in SMALL_SHAPE.items():
        p.add_argument("--" + name.replace("_", "-"), type=int, default=None, help=f"model shape (default {value})")
    p.add_argument("--rope-theta", type=float, default=ROPE_THETA)
    p.add_argument(
        "--embed-init-std",
        type=float,
        default=0.02,
        help="std of the initial byte embeddings (fresh models only)",
    )
    return p


def _resolve(args: argparse.Namespace) -> argparse.Namespace:
    if args.smoke:
        args.device = args.device or "cpu"
        args.steps = args.steps or 20
        args.seq_len = min(args.seq_len, 256)
        args.batch_size = 8
        args.eval_every = 1e9 if args.eval_every is None else args.eval_every
        args.eval_tasks = 8
        args.final_tasks = 8
        args.warmup_steps = min(args.warmup_steps, 5)
        args.log_every = 5
        shape = dict(SMOKE_SHAPE)
    else:
        shape = dict(SMALL_SHAPE)
    for name in SMALL_SHAPE:
        if getattr(args, name) is not None:
            shape[name] = getattr(args, name)
    args.shape = shape
    args.eval_every = 90.0 if args.eval_every is None else args.eval_every
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.compile is None:
        args.compile = args.device.startswith("cuda")
    if args.steps is None and args.minutes is None:
        raise ValueError("give --steps, --minutes or both (the run stops at whichever comes first)")
    if args.seq_len < data.MIN_SYNTHETIC_LEN:
        raise ValueError(f"--seq-len must be >= {data.MIN_SYNTHETIC_LEN}, got {args.seq_len}")
    args.stages = parse_curriculum(
        default_curriculum(args.seq_len) if args.curriculum is None else args.curriculum, max_len=args.seq_len
    )
    return args


def _compile_layers(model: OuroForCausalLM) -> None:
    for layer in model.model.layers:
        layer.compile(dynamic=True)


def _uncompile_layers(model: OuroForCausalLM) -> None:
    import torch._dynamo

    for layer in model.model.layers:
        layer._compiled_call_impl = None
    torch._dynamo.reset()


def _eager_if(compiled: bool):
    """Run compiled layers eagerly (evaluation shapes and no-grad mode would only add recompiles)."""
    if compiled and hasattr(torch.compiler, "set_stance"):
        return torch.compiler.set_stance("force_eager")
    return contextlib.nullcontext()


def _versions() -> dict[str, str]:
    import numpy
    import transformers

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "numpy": numpy.__version__,
        "cuda": str(torch.version.cuda),
    }


def train(args: argparse.Namespace) -> dict[str, Any]:
    """Run the training described by the parsed ``args``; returns the metrics written to metrics.json."""
    args = _resolve(args)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    torch.set_float32_matmul_precision("high")  # fp32 matmuls outside autocast may use TF32 on CUDA

    t_setup = time.perf_counter()
    corpus = data.load_corpus(args.corpus_root)
    if args.init:
        model = OuroForCausalLM.from_pretrained(args.init, dtype=torch.float32)
    else:
        model = OuroForCausalLM(small_config(shape=args.shape, max_positions=args.seq_len, rope_theta=args.rope_theta))
        with torch.no_grad():
            model.model.embed_tokens.weight.normal_(0.0, args.embed_init_std)
    model.to(device).train()
    n_params = sum(p.numel() for p in model.parameters())
    opt = make_optimizer(model, lr=args.lr, weight_decay=args.weight_decay)
    sampler = BatchSampler(
        corpus.train,
        seed=args.seed,
        retrieval_fraction=args.retrieval_fraction,
        tracking_fraction=args.tracking_fraction,
        repeat_fraction=args.repeat_fraction,
        query_placement=args.query_placement,
    )
    probe = LoopStates(model)
    tokens_per_step = args.batch_size * args.seq_len
    eval_len = min(args.seq_len, 1024)
    eval_text = data.heldout_windows(corpus, n=16 if args.smoke else 64, seq_len=eval_len, seed=0)
    eval_lengths = sorted({min(args.seq_len, n) for n in (1024, 2048)}) if not args.smoke else [128, 256]
    compiled = False
    if args.compile:
        _compile_layers(model)
        compiled = True
    print(
        f"model: {n_params:,} parameters; device {device}; compile {compiled}; setup "
        f"{time.perf_counter() - t_setup:.1f}s; stages {args.stages}",
        flush=True,
    )

    log_path = out / "train_log.csv"
    log_file = log_path.open("w", newline="")
    log = csv.writer(log_file)
    log.writerow(["step", "tokens", "seq_len", "lr", "loss", "loss_per_loop", "elapsed_s"])
    history: list[dict[str, Any]] = []
    notes: list[str] = []
    budget_s = args.minutes * 60 if args.minutes is not None else None
    start = time.perf_counter()
    next_eval = args.eval_every
    step, tokens = 0, 0
    running = torch.zeros(model.config.total_ut_steps, device=device)
    running_n = 0
    last_losses: list[float] = []

    first_step_done: float | None = None  # the first step carries compilation; the schedule starts after it

    def progress_now() -> float:
        p = step / args.steps if args.steps else 0.0
        if budget_s:
            now = time.perf_counter()
            if now - start >= budget_s:
                return 1.0
            if first_step_done is not None:
                p = max(p, (now - first_step_done) / (budget_s - (first_step_done - start)))
        return p

    def snapshot(*, final: dict[str, Any] | None, train_s: float, saved_dtype: str | None) -> dict[str, Any]:
        tail = last_losses[-10:]
        return {
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
            "versions": _versions(),
            "args": {k: v for k, v in vars(args).items() if k not in ("stages",)},
            "curriculum": args.stages,
            "parameters": n_params,
            "saved_dtype": saved_dtype,
            "compiled": compiled,
            "complete": final is not None,
            "steps": step,
            "tokens_seen": tokens,
            "train_seconds": round(train_s, 1),
            "first_step_seconds": None if first_step_done is None else round(first_step_done - start, 1),
            "tokens_per_second": round(tokens / max(train_s, 1e-9)),
            "peak_gpu_memory_gib": (
                round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if device.type == "cuda" else None
            ),
            "final_train_loss_nats": sum(tail) / len(tail) if tail else None,
            "final": final,
            "history": history,
            "corpus": {
                "root": corpus.root,
                "train_files": len(corpus.train.paths),
                "heldout_files": len(corpus.heldout.paths),
                "train_tokens": int(corpus.train.tokens.size),
                "heldout_tokens": int(corpus.heldout.tokens.size),
                "train_sha256": corpus.train.digest,
                "heldout_sha256": corpus.heldout.digest,
            },
            "notes": notes,
        }

    def run_eval(tag: str) -> None:
        nonlocal next_eval
        t0 = time.perf_counter()
        with _eager_if(compiled):
            res = evaluate(
                model,
                corpus,
                device=device,
                text=eval_text,
                retrieval_lengths=eval_lengths,
                n_tasks=args.eval_tasks,
                batch_tokens=32 * 1024,
            )
        res.update(step=step, tokens=tokens, elapsed_s=round(time.perf_counter() - start, 1), tag=tag)
        history.append(res)
        saved = save_checkpoint(model, out / "small")
        partial = snapshot(final=None, train_s=time.perf_counter() - start, saved_dtype=saved)
        (out / "metrics.json").write_text(json.dumps(partial, indent=1) + "\n")
        print("eval", json.dumps(res), f"({time.perf_counter() - t0:.1f}s)", flush=True)
        next_eval = (time.perf_counter() - start) + args.eval_every

    while True:
        progress = progress_now()
        if progress >= 1.0:
            break
        seq_len = stage_at(args.stages, progress)
        rows = max(1, tokens_per_step // seq_len)
        lr = lr_at(step, progress, lr=args.lr, warmup_steps=args.warmup_steps, min_ratio=args.min_lr_ratio)
        for group in opt.param_groups:
            group["lr"] = lr
        ids = sampler(batch_size=rows, seq_len=seq_len)
        if device.type == "cuda":
            ids = ids.pin_memory().to(device, non_blocking=True)
        try:
            with autocast_for(device):
                losses = loop_losses(model, ids, probe)
                loss = objective(losses, aux_weight=args.aux_loop_weight)
            loss.backward()
        except Exception as err:  # a compile failure: fall back to eager once, redo the step
            if not compiled:
                raise
            notes.append(f"torch.compile failed at step {step} ({type(err).__name__}: {err}); continued eager")
            print(notes[-1], file=sys.stderr, flush=True)
            opt.zero_grad(set_to_none=True)
            _uncompile_layers(model)
            compiled = False
            continue
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        running += losses.detach()
        running_n += 1
        step += 1
        if first_step_done is None:
            first_step_done = time.perf_counter()
        tokens += rows * seq_len
        if step % args.log_every == 0:
            mean = (running / running_n).tolist()
            running.zero_()
            running_n = 0
            if not all(math.isfinite(x) for x in mean):
                raise FloatingPointError(f"non-finite loss {mean} at step {step}; lower --lr")
            last_losses.append(mean[-1])
            elapsed = time.perf_counter() - start
            log.writerow(
                [
                    step,
                    tokens,
                    seq_len,
                    f"{lr:.3e}",
                    f"{mean[-1]:.5f}",
                    " ".join(f"{x:.4f}" for x in mean),
                    f"{elapsed:.1f}",
                ]
            )
            log_file.flush()
            if step % (args.log_every * 10) == 0:
                print(
                    f"step {step} seq {seq_len} lr {lr:.2e} loss {mean[-1]:.4f} per-loop "
                    f"{[round(x, 3) for x in mean]} tokens {tokens:,} {tokens / elapsed:,.0f} tok/s",
                    flush=True,
                )
        if time.perf_counter() - start >= next_eval:
            run_eval("periodic")
    train_s = time.perf_counter() - start
    log_file.close()
    probe.remove()

    # final: save first (a later failure keeps the weights), then the full evaluation
    saved_dtype = save_checkpoint(model, out / "small")
    model.eval()
    if compiled:
        _uncompile_layers(model)  # evaluation shapes would only trigger recompiles
    t0 = time.perf_counter()
    final_lengths = sorted({min(args.seq_len, n) for n in (1024, 2048, 4096)}) if not args.smoke else [128, 256]
    final_text = data.heldout_windows(corpus, n=16 if args.smoke else 64, seq_len=min(args.seq_len, 2048), seed=1)
    final = evaluate(
        model,
        corpus,
        device=device,
        text=final_text,
        retrieval_lengths=final_lengths,
        n_tasks=args.final_tasks,
        batch_tokens=32 * 1024,
        tracking_length=final_lengths[-1],
    )
    sink_len = min(args.seq_len, 2048)
    with autocast_for(device):
        final["attention"] = attention_mass(
            model, data.heldout_windows(corpus, n=4, seq_len=sink_len, seed=2), queries=min(128, sink_len // 2)
        )
    final["eval_s"] = round(time.perf_counter() - t0, 1)
    metrics = snapshot(final=final, train_s=train_s, saved_dtype=saved_dtype)
    (out / "metrics.json").write_text(json.dumps(metrics, indent=1) + "\n")
    print("final", json.dumps({k: v for k, v in final.items() if k != "attention"}), flush=True)
    print("attention per loop", json.dumps(final["attention"]["per_loop"]), flush=True)
    return metrics


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        train(args)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
