"""Calibration documents sampled from the model itself (paper §3.1: "16 of the model's own long generations").

:func:`generate_documents` samples ``n`` documents of ``length`` tokens each, starting from a prompt (the
model's BOS token by default), by ancestral sampling at ``temperature`` from the exact model (its dense
cache, the model's own dtype). It is

* **seeded**: batch ``k`` (documents ``k*batch .. k*batch + batch - 1``) samples with its own
  ``torch.Generator`` seeded from ``(seed, k)``, on the CPU from float64 probabilities, so a document does
  not depend on the batches before it;
* **resumable**: with ``out``, the finished documents are saved after every batch, as a plain int64
  ``[n, length]`` tensor (``torch.save``; any ``--documents`` option reads it) with the settings beside it
  in ``<out minus .pt>.json``, and a rerun continues after the last saved batch; a file made with other
  settings (model, prompts, length, seed, batch, temperature, suppressed tokens) is refused, and asking for
  more documents than a file holds extends it. Batches of one are bit-reproducible; larger batches are
  reproducible with the same batch (their rows share matmuls);
* **fixed length**: the end-of-sequence and padding tokens are never sampled (their logits are masked),
  so every document has exactly ``length`` tokens.

``loopkv profile MODEL --generate N --length L --out P.json`` saves them beside the profile, as
``P.generated.pt`` and ``P.generated.json`` (:func:`generated_path`).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

GENERATED_TYPE = "loopkv.GeneratedDocuments"
GENERATED_VERSION = 1
_SETTING_KEYS = ("model_fingerprint", "prompts_hash", "length", "seed", "batch", "temperature", "suppressed")


def generated_path(profile_out: str | os.PathLike) -> str:
    """Where ``loopkv profile --generate`` keeps the documents of profile ``profile_out``: beside it,
    ``<name>.generated.pt`` (``profile.json`` -> ``profile.generated.pt``)."""
    root, _ = os.path.splitext(os.fspath(profile_out))
    return root + ".generated.pt"


def _prompts(model, prompts: Sequence[Any] | None) -> list[Tensor]:
    if prompts is None:
        bos = getattr(model.config, "bos_token_id", None)
        if bos is None:
            raise ValueError("the model's config has no bos_token_id to start generations from; pass prompts")
        return [torch.tensor([int(bos)])]
    out = [torch.as_tensor(p).long().reshape(-1) for p in prompts]
    if not out or any(p.numel() == 0 for p in out):
        raise ValueError("prompts must be a non-empty list of non-empty token-id sequences")
    return out


def _suppressed(model) -> list[int]:
    ids = []
    for name in ("eos_token_id", "pad_token_id"):
        value = getattr(model.config, name, None)
        ids += [int(v) for v in (value if isinstance(value, (list, tuple)) else [value]) if v is not None]
    return sorted(set(ids))


def _check(n: Any, length: Any, batch: Any, temperature: Any, prompts: list[Tensor]) -> None:
    for name, value in (("n", n), ("length", length), ("batch", batch)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature > 0:
        raise ValueError(f"temperature must be a number > 0, got {temperature!r}")
    longest = max(p.numel() for p in prompts)
    if longest >= length:
        raise ValueError(f"length={length} must exceed the prompt ({longest} tokens)")
    if batch > 1 and len({p.numel() for p in prompts}) > 1:
        raise ValueError("prompts of different lengths need batch=1 (rows of a batch start together)")


@torch.no_grad()
def _sample_batch(model, prompt: Tensor, *, length: int, generator: torch.Generator, temperature: float,
                  suppressed: Sequence[int]) -> Tensor:
    """Documents [B, length] continuing ``prompt`` [B, p] by ancestral sampling with the dense cache."""
    from loopkv.models.ouro_config import dense_cache

    cache = dense_cache(model.config)
    ids = prompt.to(model.device)
    tokens = [prompt]
    step_input = ids
    for _ in range(length - prompt.shape[1]):
        logits = model(input_ids=step_input, past_key_values=cache, use_cache=True, logits_to_keep=1).logits
        scores = logits[:, -1].double().cpu() / temperature  # [B, V]
        scores[:, list(suppressed)] = -torch.inf
        nxt = torch.multinomial(torch.softmax(scores, dim=-1), 1, generator=generator)  # [B, 1]
        tokens.append(nxt)
        step_input = nxt.to(model.device)
    return torch.cat(tokens, dim=1)


def generate_documents(
    model,
    *,
    n: int,
    length: int,
    seed: int = 0,
    prompts: Sequence[Any] | None = None,
    batch: int = 1,
    temperature: float = 1.0,
    out: str | os.PathLike | None = None,
    progress: bool = True,
) -> list[Tensor]:
    """``n`` documents of ``length`` token ids (int64 [length] each) sampled from ``model`` (module docstring).

    prompts: token-id sequences; document ``i`` starts with ``prompts[i % len(prompts)]`` (default: BOS).
    batch: documents sampled together (faster on a GPU; a batch's KV cache is the dense fp32 one: for
        Ouro-1.4B about 1.6 MB per token and row in fp32).
    out: a ``.pt`` file; finished batches are saved there and a rerun resumes from it.
    """
    from loopkv.planning.profiler import model_fingerprint

    prompt_list = _prompts(model, prompts)
    _check(n, length, batch, temperature, prompt_list)
    sha = hashlib.sha256()
    for p in prompt_list:
        sha.update(len(p).to_bytes(8, "little") + p.numpy().tobytes())
    settings = {"model_fingerprint": model_fingerprint(model), "prompts_hash": sha.hexdigest(), "length": length,
                "seed": seed, "batch": batch, "temperature": float(temperature), "suppressed": _suppressed(model)}
    docs = _load(out, settings) if out is not None and os.path.exists(out) else []
    from tqdm import tqdm

    bar = tqdm(total=n, initial=min(len(docs), n), desc="loopkv generate", unit="doc", disable=not progress)
    while len(docs) < n:
        k = len(docs) // batch
        rows = range(k * batch, (k + 1) * batch)
        prompt = torch.stack([prompt_list[i % len(prompt_list)] for i in rows])
        generator = torch.Generator().manual_seed(hash_seed(seed, k))
        new = _sample_batch(model, prompt, length=length, generator=generator, temperature=temperature,
                            suppressed=settings["suppressed"])
        docs += list(new)
        if out is not None:
            _save(out, settings, docs)
        bar.update(min(batch, n - bar.n))
    bar.close()
    return [d.clone() for d in docs[:n]]


def hash_seed(seed: int, batch_index: int) -> int:
    """The generator seed of batch ``batch_index`` (a 63-bit hash of both)."""
    digest = hashlib.sha256(f"{seed}/{batch_index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def settings_path(path: str | os.PathLike) -> str:
    """The JSON beside a generated-documents file that holds its settings and document count."""
    root, _ = os.path.splitext(os.fspath(path))
    return root + ".json"


def _save(path, settings: dict, docs: list[Tensor]) -> None:
    """The tensor first, then the sidecar that counts it: a stop between the two leaves a sidecar that
    counts fewer documents than the tensor holds, and those it counts are unchanged."""
    path = os.fspath(path)
    torch.save(torch.stack(docs), f"{path}.tmp")
    os.replace(f"{path}.tmp", path)
    meta = {"_type": GENERATED_TYPE, "_version": GENERATED_VERSION, "documents": len(docs), "settings": settings}
    with open(f"{path}.json.tmp", "w", encoding="utf-8") as f:
        json.dump(meta, f, indent=1)
    os.replace(f"{path}.json.tmp", settings_path(path))


def _load(path, settings: dict) -> list[Tensor]:
    path = os.fspath(path)
    try:
        with open(settings_path(path), encoding="utf-8") as f:
            meta = json.load(f)
    except (OSError, ValueError):
        meta = None
    kind = (meta.get("_type"), meta.get("_version")) if isinstance(meta, dict) else None
    if kind != (GENERATED_TYPE, GENERATED_VERSION):
        raise ValueError(f"{path} has no loopkv generated-documents settings beside it ({settings_path(path)}); "
                         "delete it or pass another path")
    theirs = meta.get("settings") or {}
    diffs = [f"{k}: {settings[k]!r} vs {theirs.get(k)!r}" for k in _SETTING_KEYS if settings[k] != theirs.get(k)]
    if diffs:
        raise ValueError(f"refusing to continue {os.fspath(path)}: it was generated with other settings "
                         f"({'; '.join(diffs)}); delete it (loopkv profile --overwrite does) or change the settings")
    return list(torch.load(path, map_location="cpu", weights_only=True)[: int(meta["documents"])])
