"""The per-cell profiler: single-cell damages through the simulated served cache (paper §3.1).

For every non-final cell ``c`` and option ``o`` the damage is ``KL(p_exact || p_{c<-o})`` with every
other cell exact, in nats per token, in the model's activations (fp32 is required), averaged over the
positions ``i >= max(prefill_len, 320)`` of the documents (pooled over documents: every position
weighs the same). The final loop's cells are profiled the same way at ``final_options`` (INT4 and INT2),
and ``kl_share`` (the unit of damage) is loop T-2 reading loop T-1's exact history, every layer at once,
everything else exact (paper §2.3).

Each measurement is one teacher-forced forward per document in which the perturbed cell attends as
the served cache does (:mod:`loopkv.planning.simulate`: sink and window exact, a page quantized once
it has left the window, a ``share`` cell reading the final loop's quantized pages). ``batch_cells``
measurements share one forward, one batch row each. A row is exact up to its perturbed cell, so the
exact pass of each document (run once, for the reference logits) keeps the hidden state entering the first
cell of every loop, and a batch resumes from there: one exact row up to the first perturbed cell, each row
joining at its own (:mod:`loopkv.planning.resume`). Jobs are ordered by their first perturbed cell, so a
batch's rows start close together. Everything is deterministic: the jobs are cut into batches
from the full, fixed job list, so a resumed run recomputes exactly the batches an uninterrupted one
would (with the same ``batch_cells``) and gets the same numbers.

Any looped model :mod:`loopkv.families` knows is profiled over its planned cells
(:func:`loopkv.planning.looped.model_layout`): Ouro's ``T x L`` cells; Dory's recurrent full-attention layers per
loop (its input/output and sliding-window layers are fixed slots, attended exactly and never perturbed); Huginn's
core layers per step for ``r = mean_recurrence`` steps, its default, from one fixed initial state
(:func:`loopkv.planning.looped.repeatable_state`). ``provenance["layout"]`` records the family, the loop count and
the fixed slots. Resuming inside the loop from checkpoints is Ouro's; other families' rows run from the first layer
(the same numbers, more compute).

Round-off can make a damage that is really ~0 come out slightly negative; it is clamped to 0, and the
clamped entries are listed in ``provenance["clamped"]`` (and warned about).
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import math
import os
import time
import warnings
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import Tensor

from loopkv.cells import Cell
from loopkv.format import QUANTIZED, check_head_dim
from loopkv.planning.bytes import ModelShape
from loopkv.planning.looped import describe, model_layout, repeatable_state
from loopkv.planning.profile_data import FINAL_PROFILE_OPTIONS, PROFILE_OPTIONS, Profile
from loopkv.planning.resume import Entry, checkpoint_cells, entry_for
from loopkv.planning.simulate import (
    FIRST_HISTORY,
    SimState,
    final_indices,
    final_sources,
    forward,
    served_attention_enabled,
    served_for,
)

KL_SHARE = "kl_share"  # the job that measures the unit
DEFAULT_BATCH_CELLS = 8
# Config fields of Dory's and Huginn's loop structure that the model fingerprint covers
_LOOP_FIELDS = ("n_input_layers", "n_output_layers", "n_recurrent_layers", "n_recurrent_loops",
                "recurrent_kv_cache_mode", "n_layers_in_prelude", "n_layers_in_recurrent_block", "n_layers_in_coda",
                "mean_recurrence", "state_init")
# Settings that change the numbers; a partial file made with other settings is not resumed.
_SETTING_KEYS = ("tau", "share_source", "share_passes", "prefill_len", "first_position", "document_lengths", "dtype",
                 "tf32")


# ------------------------------------------------------------------------------------------ documents
def as_documents(documents: Any, *, min_len: int) -> list[Tensor]:
    """Token id documents as a list of int64 [N] tensors (from a [N] or [n, N] tensor or a sequence of
    1-D tensors / lists), each at least ``min_len`` tokens; ValueError otherwise."""
    if isinstance(documents, Tensor):
        if documents.dim() not in (1, 2):
            raise ValueError(
                f"documents as a tensor must be [N] or [n, N] token ids, got shape {tuple(documents.shape)}"
            )
        docs = [documents] if documents.dim() == 1 else list(documents)
    elif isinstance(documents, Iterable) and not isinstance(documents, (str, bytes)):
        docs = [torch.as_tensor(d) for d in documents]
    else:
        raise ValueError(f"documents must be token id tensors or lists, got {type(documents).__name__}")
    if not docs:
        raise ValueError("documents is empty; pass at least one long document (e.g. calibration_documents())")
    out = []
    for i, d in enumerate(docs):
        if d.dim() != 1 or d.dtype.is_floating_point or d.dtype == torch.bool:
            raise ValueError(
                f"documents[{i}] must be a 1-D tensor of integer token ids, got {d.dtype} {tuple(d.shape)}"
            )
        if d.numel() < min_len:
            raise ValueError(
                f"documents[{i}] has {d.numel()} tokens, fewer than {min_len}: damage is measured where history "
                f"pages exist (positions >= {FIRST_HISTORY}); use longer documents (about 1024+ tokens)"
            )
        out.append(d.long().cpu())
    return out


def documents_hash(documents: Sequence[Tensor]) -> str:
    """sha256 (hex) of the documents' token ids, in order."""
    sha = hashlib.sha256()
    for d in documents:
        ids = d.long().cpu().contiguous()
        sha.update(len(ids).to_bytes(8, "little"))
        sha.update(ids.numpy().tobytes())
    return sha.hexdigest()


def calibration_documents(*, n: int = 4, length: int = 1024, seed: int = 0) -> list[Tensor]:
    """Seeded calibration documents for the byte-level small model (``loopkv.models.data``): held-out
    stdlib text windows alternating with synthetic long-range documents (key-value retrieval,
    variable tracking). ``n`` documents of exactly ``length`` tokens, int64 [length] each."""
    from loopkv.models import data

    if not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be a positive int, got {n!r}")
    if not isinstance(length, int) or length <= FIRST_HISTORY:
        raise ValueError(f"length must be an int > {FIRST_HISTORY} so that history pages exist, got {length!r}")
    corpus = data.load_corpus()
    n_text = (n + 1) // 2
    docs = list(data.heldout_windows(corpus, n=n_text, seq_len=length, seed=seed))
    for j in range(n - n_text):
        task = data.retrieval_task if j % 2 == 0 else data.variable_tracking_task
        prompt, answer = task(length, seed * 1000 + j, corpus=corpus)
        docs.append(torch.from_numpy(data.encode_bytes(prompt + answer, bos=True)))
    return docs


# ---------------------------------------------------------------------------------------- provenance
def model_fingerprint(model) -> str:
    """sha256 (hex) of the model's looped shape and every state-dict tensor (name, dtype, shape, bytes)."""
    config = model.config
    sha = hashlib.sha256()
    fields = ("model_type", "total_ut_steps", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "head_dim", "hidden_size", "rms_norm_eps", "rope_parameters", "layer_types", "sliding_window")
    sha.update(repr([(f, getattr(config, f, None)) for f in fields]).encode())
    # the loop structure of families other than Ouro (absent from Ouro's configs: its fingerprints are unchanged)
    extra = [(f, v) for f in _LOOP_FIELDS if (v := getattr(config, f, None)) is not None]
    if extra:
        sha.update(repr(extra).encode())
    for name, tensor in sorted(model.state_dict().items()):
        t = tensor.detach().cpu().contiguous()
        sha.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        sha.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return sha.hexdigest()


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda ({torch.cuda.get_device_name(device)})"
    return str(device)


def environment(model) -> dict[str, Any]:
    """loopkv/torch/transformers versions, device and date (UTC)."""
    import transformers

    from loopkv import __version__

    return {
        "loopkv_version": __version__,
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "device": device_name(model.device),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


# ------------------------------------------------------------------------------------------------ KL
def kl_per_position(ref_logits: Tensor, logits: Tensor, *, chunk: int = 256) -> Tensor:
    """``KL(p || q)`` per position: ref_logits [P, V] (p, the exact model), logits [R, P, V] (q) ->
    float64 [R, P]. The logits are the model's (fp32); the softmax and the sum run in float64 so that
    the KL's own round-off stays far below any damage (identical logits give exactly 0)."""
    R, P, _ = logits.shape
    out = torch.empty(R, P, dtype=torch.float64, device=logits.device)
    for i in range(0, P, chunk):
        logp = torch.log_softmax(ref_logits[i : i + chunk].double(), dim=-1)  # [c, V]
        p = logp.exp()
        for r in range(R):
            logq = torch.log_softmax(logits[r, i : i + chunk].double(), dim=-1)
            out[r, i : i + chunk] = (p * (logp - logq)).sum(dim=-1)
    return out


# ------------------------------------------------------------------------------------------- profile
def _jobs(base: Profile) -> list[tuple[Cell, str] | str]:
    """Every measurement in a fixed order: cell-major, option-minor, the ``share`` measurements and the
    unit last (so that they batch together: only they need ``share_passes``), the unit placed by its first
    cell (loop T-2, layer 0)."""
    everything = Profile.partial(loops=base.loops, layers=base.layers, kv_heads=base.kv_heads,
                                 head_dim=base.head_dim, options=base.options, final_options=base.final_options)
    pairs = everything.missing()
    shares = [j for j in pairs if j[1] == "share"]
    unit_at = sum(1 for cell, _ in shares if cell.loop < base.loops - 2)
    return [*[j for j in pairs if j[1] != "share"], *shares[:unit_at], KL_SHARE, *shares[unit_at:]]


def _done(profile: Profile, job) -> bool:
    if job == KL_SHARE:
        return profile.kl_share is not None
    cell, option = job
    return (profile.layout.flat_index(cell), option) in profile.damage


@torch.no_grad()
def profile(
    model,
    documents: Any,
    *,
    options: Sequence[str] = PROFILE_OPTIONS,
    final_options: Sequence[str] = FINAL_PROFILE_OPTIONS,
    tau: float = math.inf,
    share_source: str = "int4",
    share_passes: int = 2,
    prefill_len: int = FIRST_HISTORY,
    out: str | os.PathLike | None = None,
    resume: bool = True,
    batch_cells: int = DEFAULT_BATCH_CELLS,
    progress: bool = True,
    tf32: bool = False,
    exact_on: str | torch.device | None = None,
) -> Profile:
    """Profile every cell of ``model`` (see the module docstring) and return the :class:`Profile`.

    documents: token ids, a [N] / [n, N] tensor or a sequence of 1-D tensors, each longer than
        ``max(prefill_len, 320)`` (about 1024+ tokens is typical; e.g. :func:`calibration_documents`).
    options: what non-final cells are profiled at, from ("int4", "int2", "share");
    final_options: what the final loop's cells are profiled at, from ("int4", "int2"); a plan's damage
        counts the final loop's option only where it was profiled.
    tau: V precision threshold for INT4 reads (``inf``: off). share_source: what a ``share`` cell reads,
        the final loop at "int4" (the planner's default), "int2" or "bf16".
    share_passes: 1 takes a shared cell's source pages from the exact model (exact for documents shorter
        than 608 tokens, an approximation beyond); each further pass takes them from the previous pass's
        own perturbed final loop, converging to the served cache (:mod:`loopkv.planning.simulate`).
    prefill_len: the positions before it attend exactly (as a served prefill), the KL is averaged over
        positions ``>= max(prefill_len, 320)``.
    out: a JSON path; the partial profile is saved there after every batch, and with ``resume`` a
        partial file from the same setup is continued (a file from another model, other documents or
        other settings is refused with a ValueError).
    batch_cells: measurements per forward (batch rows); more is faster and takes more memory.
    tf32: run the model's matmuls in TF32 on CUDA (``torch.backends.cuda.matmul.allow_tf32``); off by default.
        It changes the numbers (recorded in ``provenance["settings"]``); ``benchmarks/bench_profile.py``
        measures how much against the fp32 profile and its noise floor.
    exact_on: where each document's exact pass (reference logits, share sources, checkpoints) is kept between
        batches: the model's device (None, the default) or e.g. "cpu" (pinned when the model is on CUDA; moved
        to the model's device for each use, the numbers unchanged). At Ouro-1.4B's size it is about 4.6 GiB per
        8K document, so 16 such documents on one GPU want "cpu".
    """
    layout = model_layout(model)
    loops, layers = layout.loops, layout.layers
    _check_arguments(model, tau=tau, share_source=share_source, share_passes=share_passes, batch_cells=batch_cells,
                     prefill_len=prefill_len)
    first = max(prefill_len, FIRST_HISTORY)
    docs = as_documents(documents, min_len=first + 1)
    shape = ModelShape.from_config(model.config)
    kv_heads, head_dim = shape.kv_heads, shape.head_dim
    if any(o in (*QUANTIZED, "share") for o in (*options, *final_options)):
        check_head_dim(head_dim)
    settings = {
        "tau": "inf" if math.isinf(tau) else float(tau),
        "share_source": share_source,
        "share_passes": share_passes,
        "prefill_len": prefill_len,
        "first_position": first,
        "document_lengths": [int(d.numel()) for d in docs],
        "dtype": str(model.dtype),
        **({"tf32": True} if tf32 else {}),  # absent when off, so that earlier partial files still resume
    }
    provenance = {
        "model_fingerprint": model_fingerprint(model),
        "documents_hash": documents_hash(docs),
        **environment(model),
        "n_documents": len(docs),
        "positions": sum(int(d.numel()) - first for d in docs),
        "settings": settings,
        "method": "dense simulation of the served cache, one cell perturbed per row (loopkv.planning.simulate)",
        "layout": describe(model, layout),
    }
    base = Profile.partial(loops=loops, layers=layers, kv_heads=kv_heads, head_dim=head_dim, options=options,
                           final_options=final_options, provenance=provenance, family=layout.family)
    result = _resume(base, out, settings) if (out is not None and resume and os.path.exists(out)) else base
    jobs = _jobs(base)
    batches = [jobs[i : i + batch_cells] for i in range(0, len(jobs), batch_cells)]
    pending = [[j for j in b if not _done(result, j)] for b in batches]
    runner = _Runner(model, docs, loops=loops, layers=layers, tau=tau, share_source=share_source,
                     share_passes=share_passes, prefill_len=prefill_len, first=first, exact_on=exact_on,
                     layout=None if layout.family == "ouro" else layout,
                     start="resume" if layout.family == "ouro" else "rows")
    with tf32_matmuls(tf32), repeatable_state(model):
        return _measure(runner, result, [b for b in pending if b], out=out, progress=progress)


@contextlib.contextmanager
def tf32_matmuls(enabled: bool):
    """TF32 for CUDA matmuls and cuDNN inside the block when ``enabled``; the previous settings after."""
    before = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    if enabled:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def _check_arguments(model, *, tau, share_source, share_passes, batch_cells, prefill_len) -> None:
    if model.dtype != torch.float32:
        raise ValueError(
            f"profile in fp32 activations (the model is {model.dtype}): bf16 round-off alone is about half of "
            "KL_share (paper §2.3, Appendix E); load the model with dtype=torch.float32 or call model.float()"
        )
    if share_source not in ("int4", "int2", "bf16"):
        raise ValueError(f"share_source must be 'int4', 'int2' or 'bf16', got {share_source!r}")
    if not isinstance(tau, (int, float)) or math.isnan(tau) or tau < 0:
        raise ValueError(f"tau must be a number >= 0 (math.inf: V precision off), got {tau!r}")
    if not isinstance(share_passes, int) or share_passes < 1:
        raise ValueError(f"share_passes must be a positive int, got {share_passes!r}")
    if not isinstance(batch_cells, int) or batch_cells < 1:
        raise ValueError(f"batch_cells must be a positive int, got {batch_cells!r}")
    if not isinstance(prefill_len, int) or prefill_len < 1:
        raise ValueError(f"prefill_len must be a positive int, got {prefill_len!r}")


def _measure(runner: _Runner, result: Profile, pending: list, *, out, progress: bool) -> Profile:
    """Run the pending batches, adding each measurement to ``result`` and saving it to ``out`` after every batch."""
    bar = _progress(sum(map(len, pending)), enabled=progress)
    clamped = list(result.provenance.get("clamped", []))
    elapsed = float(result.provenance.get("profile_seconds", 0.0))
    try:
        with served_attention_enabled(runner.model):
            for batch in pending:
                start = time.perf_counter()
                values = runner.measure(batch, bar)
                elapsed += time.perf_counter() - start
                for job, (pooled, per_doc) in zip(batch, values, strict=True):
                    result = _record(result, job, pooled, per_doc, clamped)
                prov = {**result.provenance, "clamped": clamped, "profile_seconds": round(elapsed, 3)}
                result = _replace_provenance(result, prov)
                if out is not None:
                    result.to_json(out)
    finally:
        bar.close()
    return result


def _record(result: Profile, job, pooled: float, per_doc: list[float], clamped: list[str]) -> Profile:
    """``result`` with one measurement added; a slightly negative value (round-off) is clamped to 0 and named."""
    name = KL_SHARE if job == KL_SHARE else f"{job[1]} at {tuple(job[0])}"
    if min(pooled, *per_doc) < 0:
        clamped.append(name)
        warnings.warn(f"profile: the damage of {name} came out {min(pooled, *per_doc):.3g} < 0 "
                      "(round-off of a damage that is ~0); clamped to 0", stacklevel=4)
    pooled, per_doc = max(pooled, 0.0), [max(v, 0.0) for v in per_doc]
    if job != KL_SHARE:
        return result.with_damage(job[0], job[1], pooled, per_document=per_doc)
    if pooled == 0.0:
        raise ValueError("kl_share measured 0: loop T-2 reading loop T-1's history changes nothing; use longer "
                         "documents (history must exist)")
    return result.with_kl_share(pooled, per_document=per_doc)


def _replace_provenance(profile: Profile, provenance: dict) -> Profile:
    import dataclasses

    return dataclasses.replace(profile, provenance=provenance)


def _resume(base: Profile, out, settings: dict) -> Profile:
    saved = Profile.from_json(out)
    diffs = base.setup_differences(saved)
    theirs = saved.provenance.get("settings") or {}
    diffs += [f"settings[{k!r}]: {settings.get(k)!r} vs {theirs.get(k)!r}" for k in _SETTING_KEYS
              if settings.get(k) != theirs.get(k)]
    if diffs:
        raise ValueError(
            f"refusing to resume {os.fspath(out)}: it was profiled with another setup ({'; '.join(diffs)}); "
            "pass another out= path, delete the file, or resume=False to start over"
        )
    resumed = [*saved.provenance.get("resumed", []), base.provenance["date"]]
    return _replace_provenance(saved, {**saved.provenance, "resumed": resumed})


def _progress(total: int, *, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc="loopkv profile", unit="cell", disable=not enabled or total == 0,
                dynamic_ncols=True)


class _Runner:
    """Measures batches of jobs over every document; caches each document's exact pass.

    start: how a batch's rows start. "resume" (the default): from the exact pass's hidden state at the last
    checkpoint (one per ``checkpoint_every`` cells, default one per loop) before the first row's cell, each row
    joining at its own first perturbed cell (:mod:`loopkv.planning.resume`); "prefix": the cells before the
    batch's first perturbed cell on one row, then every row from there; "rows": every row from the first cell.
    All three compute the same numbers (up to round-off); ``benchmarks/bench_profile.py`` times them.
    matmul_attention: the exact attention through matmuls rather than SDPA (TF32 when TF32 is on; the benchmark's
    ``tf32-mm`` arm).
    layout: the model's :class:`~loopkv.families.ModelLayout` (rows name its cache indices); None: Ouro's, cell
    ``(t, l)`` at index ``t*L + l``. Only Ouro's rows can start at "resume" or "prefix" (they enter Ouro's loop)."""

    STARTS = ("resume", "prefix", "rows")

    def __init__(self, model, docs, *, loops, layers, tau, share_source, share_passes, prefill_len, first,
                 start: str = "resume", checkpoint_every: int | None = None, exact_on=None,
                 matmul_attention: bool = False, layout=None) -> None:
        if start not in self.STARTS:
            raise ValueError(f"start must be one of {self.STARTS}, got {start!r}")
        if layout is not None and layout.family != "ouro" and start != "rows":
            raise ValueError(f"a {layout.family} model's rows run from its first layer: start='rows', not {start!r}")
        try:
            self.exact_on = None if exact_on is None else torch.device(exact_on)
        except (RuntimeError, TypeError) as err:
            raise ValueError(f"exact_on must be a torch device such as 'cpu' (or None), got {exact_on!r}") from err
        self.model, self.docs, self.start, self.matmul_attention = model, docs, start, matmul_attention
        self.loops, self.layers, self.layout = loops, layers, layout
        self.tau, self.share_source, self.share_passes = tau, share_source, share_passes
        self.final = frozenset(final_indices(loops, layers, layout))
        self.prefill_len, self.first = prefill_len, first
        keep = checkpoint_cells(loops, layers, every=checkpoint_every) if start == "resume" else ()
        self.checkpoints = tuple(c for c in keep if c > 0)  # cell 0's input is the embedding: nothing to keep
        self._refs: dict[int, tuple[Tensor, dict, dict]] = {}

    def _reference(self, d: int):
        """(exact logits [P, V], exact final-loop K/V per layer, {checkpoint cell: entering hidden [1, N, H]})
        of document ``d``."""
        if d not in self._refs:
            ids = self.docs[d].to(self.model.device)[None]
            state = SimState(rows=[{}], prefill_len=self.prefill_len, layers=self.layers, sources={},
                             capture=self.final, matmul_attention=self.matmul_attention, layout=self.layout)
            logits = forward(self.model, ids, state, logits_from=self.first, keep_hidden=self.checkpoints)
            sources = final_sources(state.captured, loops=self.loops, layers=self.layers, layout=self.layout)
            ref = (logits[0], sources, dict(state.hidden))
            pin = self.exact_on is not None and self.exact_on.type == "cpu" and self.model.device.type == "cuda"
            self._refs[d] = ref if self.exact_on is None else _moved(ref, self.exact_on, pin=pin)
        ref = self._refs[d]
        return ref if self.exact_on is None else _moved(ref, self.model.device)

    def first_cell(self, job) -> int:
        """The first cell (flat index ``t*L + l``) a job perturbs: every cell before it is exact in its row."""
        L, T = self.layers, self.loops
        cells = [Cell(T - 2, layer) for layer in range(L)] if job == KL_SHARE else [job[0]]
        return min(c.loop * L + c.layer for c in cells)  # cells run loop by loop, layer by layer

    def _index(self, cell: Cell) -> int:
        return cell.loop * self.layers + cell.layer if self.layout is None else self.layout.flat_index(cell)

    def _spec(self, job) -> dict:
        """The job's row: ``{cache index: Served}``."""
        L, T = self.layers, self.loops
        if job == KL_SHARE:
            served = served_for("share", source_option="bf16")
            return {self._index(Cell(T - 2, layer)): served for layer in range(L)}
        cell, option = job
        return {self._index(cell): served_for(option, source_option=self.share_source, tau=self.tau)}

    def _entry(self, starts: list[int], checkpoints: dict):
        if self.start == "rows":
            return None
        if self.start == "prefix":
            return Entry(starts=(starts[0],) * len(starts))
        return entry_for(starts, checkpoints)

    def measure(self, batch, bar) -> list[tuple[float, list[float]]]:
        """Per job: (KL pooled over all counted positions, [mean KL per document])."""
        order = sorted(range(len(batch)), key=lambda i: self.first_cell(batch[i]))  # rows in the order they join
        specs = [self._spec(batch[i]) for i in order]
        starts = [self.first_cell(batch[i]) for i in order]
        sums = [0.0] * len(batch)
        per_doc: list[list[float]] = [[] for _ in batch]
        total = 0
        shares = any(s.share for spec in specs for s in spec.values())
        passes = self.share_passes if shares else 1
        for d, doc in enumerate(self.docs):
            ref, sources, checkpoints = self._reference(d)
            ids = doc.to(self.model.device)[None]
            entry = self._entry(starts, checkpoints)
            if entry is None:
                ids = ids.expand(len(batch), -1)
            for k in range(passes):
                capture = self.final if k + 1 < passes else frozenset()
                state = SimState(rows=specs, prefill_len=self.prefill_len, layers=self.layers, sources=sources,
                                 capture=capture, matmul_attention=self.matmul_attention, layout=self.layout)
                logits = forward(self.model, ids, state, logits_from=self.first, entry=entry)
                if capture:  # the next pass reads each row's own perturbed final loop
                    sources = final_sources(state.captured, loops=self.loops, layers=self.layers,
                                            layout=self.layout)
            kl = kl_per_position(ref, logits)  # [R, P], rows in join order
            total += kl.shape[1]
            for r, i in enumerate(order):
                sums[i] += float(kl[r].sum())
                per_doc[i].append(float(kl[r].mean()))
            bar.update(len(batch) / len(self.docs))
        return [(s / total, p) for s, p in zip(sums, per_doc, strict=True)]


def _moved(ref, device: torch.device, *, pin: bool = False):
    """An exact pass (logits, {layer: (k, v)}, {cell: hidden}) on ``device`` (pinned host memory with ``pin``)."""
    def move(t: Tensor) -> Tensor:
        if pin:
            return torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t)
        return t.to(device, non_blocking=device.type == "cuda")

    logits, sources, checkpoints = ref
    return (move(logits), {layer: (move(k), move(v)) for layer, (k, v) in sources.items()},
            {cell: move(h) for cell, h in checkpoints.items()})
