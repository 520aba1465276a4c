"""KL of a plan through the real :class:`~loopkv.LoopKVCache` decode path, and the additivity report.

:func:`measure_kl` runs, per document, an exact full forward (the reference logits) and then the real
cache: a prefill of the first ``prefill_len`` tokens (default 320 = sink + window + a page, so that
history pages form during decode) and teacher-forced decode of the rest, one token per step, exactly as
``generate`` would feed them. The KL ``KL(p_exact || p_served)`` is computed per position in fp32 and
averaged over positions ``i >= max(prefill_len, 320)`` (pooled over documents), together with the
next-token agreement (argmax equal).

:func:`additivity_report` compares, for a set of plans (the solver's and random ones,
:func:`random_plans`), the prediction of the profile (the sum of the plan's single-cell damages,
:func:`loopkv.planning.knapsack.predicted_damage`) with the measured KL, as the paper's Appendix D:
Pearson correlation, correlation on a log scale, rank correlation, and the range of measured/predicted.
Next to the raw sum it shows the two-family additivity correction (:mod:`loopkv.planning.correction`):
factors fitted on some plans (the named ones, by default) and scored on the others (the random ones).
"""

from __future__ import annotations

import contextlib
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

from loopkv.planning import correction as _correction
from loopkv.planning.knapsack import predicted_damage
from loopkv.planning.looped import cache_keyword, model_layout, random_initial_state
from loopkv.planning.plan import Plan
from loopkv.planning.profiler import as_documents, kl_per_position
from loopkv.planning.simulate import FIRST_HISTORY, check_model


@dataclass(frozen=True)
class KLResult:
    """What :func:`measure_kl` measured for one plan.

    kl: mean KL(p_exact || p_served) in nats per token over the counted positions of all documents.
    agreement: fraction of counted positions where the served argmax equals the exact argmax.
    positions: how many positions were counted; first_position: the first counted position.
    per_document, agreement_per_document: the same, per document.
    """

    kl: float
    agreement: float
    positions: int
    first_position: int
    prefill_len: int
    per_document: tuple[float, ...] = ()
    agreement_per_document: tuple[float, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {
            "kl": self.kl, "agreement": self.agreement, "positions": self.positions,
            "first_position": self.first_position, "prefill_len": self.prefill_len,
            "per_document": list(self.per_document), "agreement_per_document": list(self.agreement_per_document),
        }


def _check(model, plan, prefill_len: int | None, max_positions: int | None) -> tuple[int, int]:
    check_model(model)
    plan.validate_for(model.config)
    if random_initial_state(model):
        raise ValueError(
            "this model's recurrent state starts at random in every forward (state_init="
            f"{model.config.state_init!r}), so the served run and the exact run would start from different states; "
            "measure the KL of a plan with config.state_init='zero' (its profile's damages are measured from one "
            "fixed draw: loopkv.planning.looped)")
    prefill = FIRST_HISTORY if prefill_len is None else prefill_len
    if not isinstance(prefill, int) or prefill < 1:
        raise ValueError(f"prefill_len must be a positive int (default {FIRST_HISTORY}), got {prefill_len!r}")
    if max_positions is not None and (not isinstance(max_positions, int) or max_positions < 1):
        raise ValueError(f"max_positions must be a positive int or None, got {max_positions!r}")
    return prefill, max(prefill, FIRST_HISTORY)


@torch.no_grad()
def served_logits(model, plan, document: Tensor, *, prefill_len: int | None = None,
                  max_positions: int | None = None) -> Tensor:
    """Logits of positions ``max(prefill_len, 320) ..`` of ``document`` (int [N]) through a real
    ``LoopKVCache(plan)``: prefill, then teacher-forced decode. Returns [P, V] (model dtype), P = the
    counted positions (at most ``max_positions``)."""
    from loopkv.cache.loop_cache import LoopKVCache

    prefill, first = _check(model, plan, prefill_len, max_positions)
    ids = document.reshape(1, -1).to(model.device)
    n = ids.shape[1] if max_positions is None else min(ids.shape[1], first + max_positions)
    if n <= first:
        raise ValueError(f"the document has {ids.shape[1]} tokens; it needs more than {first} (positions "
                         f">= {first} are counted)")
    cache = LoopKVCache(plan, config=model.config, max_batch_size=1, max_cache_len=n, dtype=model.dtype,
                        device=model.device)
    prefill = min(prefill, n)
    keyword = cache_keyword(model)
    with _cache_attention(model, cache):
        out = model(input_ids=ids[:, :prefill], use_cache=True, **{keyword: cache})
        logits = [out.logits[0, first:prefill]] if prefill > first else []
        for i in range(prefill, n):
            out = model(input_ids=ids[:, i : i + 1], use_cache=True, **{keyword: cache})
            if i >= first:
                logits.append(out.logits[0, -1:])
    return torch.cat(logits)


@contextlib.contextmanager
def _cache_attention(model, cache):
    """transformers' own models (Dory) attend with their config's implementation: switch it to the cache's while
    the cache is read (loopkv's Ouro and Huginn ask the cache themselves)."""
    if model_layout(model).family != "dory":
        yield
        return
    before = model.config._attn_implementation
    model.set_attn_implementation(cache.attention_implementation)
    try:
        yield
    finally:
        model.set_attn_implementation(before)


@torch.no_grad()
def exact_logits(model, document: Tensor, *, first: int, n: int) -> Tensor:
    """Logits of positions ``first .. n-1`` of an exact full forward (the model's own dense cache)."""
    ids = document.reshape(1, -1)[:, :n].to(model.device)
    return model(input_ids=ids, use_cache=False, logits_to_keep=n - first).logits[0]


@torch.no_grad()
def measure_kl(model, plan, documents: Any, *, prefill_len: int | None = None, max_positions: int | None = None,
               progress: bool = True) -> KLResult:
    """The KL of ``plan`` through the real cache (module docstring). ``documents`` as for
    :func:`loopkv.planning.profile`; ``max_positions`` caps the counted positions per document."""
    prefill, first = _check(model, plan, prefill_len, max_positions)
    docs = as_documents(documents, min_len=first + 1)
    from tqdm import tqdm

    kls, agrees, counts = [], [], []
    for doc in tqdm(docs, desc="loopkv eval", unit="doc", disable=not progress, dynamic_ncols=True):
        served = served_logits(model, plan, doc, prefill_len=prefill, max_positions=max_positions)
        ref = exact_logits(model, doc, first=first, n=first + served.shape[0])
        kl = kl_per_position(ref, served[None])[0]  # [P], float64
        kls.append(float(kl.sum()))
        agrees.append(int((served.argmax(-1) == ref.argmax(-1)).sum()))
        counts.append(kl.shape[0])
    total = sum(counts)
    return KLResult(
        kl=sum(kls) / total,
        agreement=sum(agrees) / total,
        positions=total,
        first_position=first,
        prefill_len=prefill,
        per_document=tuple(k / c for k, c in zip(kls, counts, strict=True)),
        agreement_per_document=tuple(a / c for a, c in zip(agrees, counts, strict=True)),
    )


# ------------------------------------------------------------------------------------------ additivity
def random_plans(profile, n: int, *, seed: int = 0, options: Sequence[str] | None = None,
                 share_loops: Sequence[int] | None = None, final_option: str = "int4",
                 tau: float = math.inf) -> list:
    """``n`` random plans on ``profile``'s shape: each non-final cell draws an option from ``options``
    (default: the options the profile measured; ``share`` only in ``share_loops``, default the last two
    non-final loops), the final loop is ``final_option``. Seeded and independent of the measurements (the
    paper fixes them first)."""
    if not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be an int >= 0, got {n!r}")
    options = tuple(profile.options) if options is None else tuple(options)
    if not options:
        raise ValueError("random_plans needs options to draw from; the profile measured none")
    T, L = profile.loops, profile.layers
    allowed_share = set(range(max(0, T - 3), T - 1)) if share_loops is None else set(share_loops)
    rng = random.Random(seed)
    plans = []
    for k in range(n):
        cells = []
        for t in range(T - 1):
            menu = [o for o in options if o != "share" or t in allowed_share]
            cells += [rng.choice(menu) for _ in range(L)]
        cells += [final_option] * L
        plans.append(Plan(loops=T, layers=L, options=tuple(cells), tau=tau, kv_heads=profile.kv_heads,
                          head_dim=profile.head_dim, family=profile.family,
                          provenance={"made_by": f"random_plans(seed={seed}) #{k}"}))
    return plans


@dataclass(frozen=True)
class AdditivityReport:
    """Predicted (sum of single-cell damages) vs measured KL for a set of plans (paper Appendix D).

    predicted, measured: per plan, nats/token; names: per plan; kl_share: the profile's unit.
    pearson: correlation of predicted and measured; log_pearson: the same of their logarithms;
    spearman: rank correlation; ratio_min / ratio_max: the range of measured / predicted;
    log_slope: the slope of log(measured) on log(predicted). NaN where fewer than 2 plans allow it.
    corrected: per plan, the prediction with the additivity correction (``correction``, its factors as a
    dict); families: per plan "own" or "shared"; fitted: which plans the correction was fitted on;
    errors: on the plans it was *not* fitted on (all plans when it was fitted on all or given), the mean
    absolute relative error and the worst factor of the raw sum and of the corrected prediction.
    """

    names: tuple[str, ...]
    predicted: tuple[float, ...]
    measured: tuple[float, ...]
    kl_share: float | None
    pearson: float
    log_pearson: float
    spearman: float
    log_slope: float
    ratio_min: float
    ratio_max: float
    results: tuple[KLResult, ...] = field(default=(), repr=False)
    corrected: tuple[float, ...] = ()
    correction: dict[str, Any] | None = None
    families: tuple[str, ...] = ()
    fitted: tuple[bool, ...] = ()
    errors: dict[str, Any] = field(default_factory=dict)

    def format(self) -> str:
        unit = self.kl_share or 1.0
        name = "KL_share" if self.kl_share else "nats"
        width = max([len(n) for n in self.names] + [4])
        corrected = self.corrected or (math.nan,) * len(self.names)
        lines = [f"{'plan':<{width}}  family  predicted: sum  corrected ({name})  measured ({name})  "
                 "measured/sum  measured/corrected"]
        for i, (n_, p, m) in enumerate(zip(self.names, self.predicted, self.measured, strict=True)):
            c = corrected[i]
            fam = (self.families[i] if self.families else "") + ("*" if self.fitted and self.fitted[i] else "")
            lines.append(f"{n_:<{width}}  {fam:<6}  {p / unit:>14.4g}  {c / unit:>18.4g}  {m / unit:>15.4g}  "
                         f"{_ratio(m, p):>12.3f}  {_ratio(m, c):>18.3f}")
        lines.append(
            f"{len(self.names)} plans: pearson {self.pearson:.3f}, log-scale pearson {self.log_pearson:.3f} "
            f"(slope {self.log_slope:.2f}), rank {self.spearman:.3f}, measured/predicted "
            f"{self.ratio_min:.2f}-{self.ratio_max:.2f}x"
        )
        if self.correction is not None:
            lines.append(f"correction: {self.correction['text']}" + ("; * = fitted on" if any(self.fitted) else ""))
            raw, cor = self.errors.get("raw", {}), self.errors.get("corrected", {})
            if raw.get("plans"):
                lines.append(f"on {self.errors['scored']} ({raw['plans']} plans): mean |error| {raw['mae']:.1%} for "
                             f"the sum, {cor['mae']:.1%} corrected; worst miss x{raw['worst_factor']:.2f} and "
                             f"x{cor['worst_factor']:.2f}")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {
            "names": list(self.names), "predicted": list(self.predicted), "measured": list(self.measured),
            "kl_share": self.kl_share, "pearson": self.pearson, "log_pearson": self.log_pearson,
            "spearman": self.spearman, "log_slope": self.log_slope, "ratio_min": self.ratio_min,
            "ratio_max": self.ratio_max, "results": [r.to_dict() for r in self.results],
            "corrected": list(self.corrected), "correction": self.correction, "families": list(self.families),
            "fitted": list(self.fitted), "errors": self.errors,
        }


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else math.nan


def _corr(x: np.ndarray, y: np.ndarray) -> float:
    if len(x) < 2 or np.std(x) == 0 or np.std(y) == 0:
        return math.nan
    return float(np.corrcoef(x, y)[0, 1])


def _ranks(x: np.ndarray) -> np.ndarray:
    order = np.argsort(x, kind="stable")
    ranks = np.empty(len(x))
    ranks[order] = np.arange(len(x))
    for v in np.unique(x):  # ties share their mean rank
        ranks[x == v] = ranks[x == v].mean()
    return ranks


def summarize(names: Sequence[str], predicted: Sequence[float], measured: Sequence[float], *,
              kl_share: float | None = None, results: Sequence[KLResult] = (), plans: Sequence[Any] | None = None,
              correction: Any = None, fit_on: Sequence[int] | None = None) -> AdditivityReport:
    """The statistics of :class:`AdditivityReport` from paired predictions and measurements.

    With ``plans``, also the additivity correction: ``correction`` (a
    :class:`~loopkv.planning.correction.Correction`) applied as given, or, when None, fitted on the plans
    whose indices are in ``fit_on`` (default: all) with the paper's factors for a family none of them is in.
    The errors are scored on the other plans (on all when none is left)."""
    p, m = np.asarray(predicted, dtype=np.float64), np.asarray(measured, dtype=np.float64)
    if p.shape != m.shape or len(names) != len(p):
        raise ValueError("names, predicted and measured must have one entry per plan")
    pos = (p > 0) & (m > 0)
    lp, lm = np.log(p[pos]), np.log(m[pos])
    slope = float(np.polyfit(lp, lm, 1)[0]) if pos.sum() >= 2 and np.std(lp) > 0 else math.nan
    ratios = m[p > 0] / p[p > 0]
    return AdditivityReport(
        names=tuple(names), predicted=tuple(map(float, p)), measured=tuple(map(float, m)), kl_share=kl_share,
        pearson=_corr(p, m), log_pearson=_corr(lp, lm), spearman=_corr(_ranks(p), _ranks(m)), log_slope=slope,
        ratio_min=float(ratios.min()) if len(ratios) else math.nan,
        ratio_max=float(ratios.max()) if len(ratios) else math.nan,
        results=tuple(results),
        **(_corrected(plans, p, m, correction, fit_on) if plans is not None else {}),
    )


def _corrected(plans, p: np.ndarray, m: np.ndarray, correction, fit_on) -> dict[str, Any]:
    """The AdditivityReport fields of the additivity correction (see :func:`summarize`)."""
    if len(plans) != len(p):
        raise ValueError("plans must have one entry per prediction")
    fitted = [False] * len(plans)
    if correction is None:
        chosen = range(len(plans)) if fit_on is None else fit_on
        fitted = [i in set(chosen) for i in range(len(plans))]
        pick = [i for i in range(len(plans)) if fitted[i]]
        correction = _correction.fit([plans[i] for i in pick], p[pick], m[pick],
                                     source=f"fitted on {len(pick)} of these plans")
    corrected = [correction.predict(plan, float(x)) for plan, x in zip(plans, p, strict=True)]
    scored = [i for i in range(len(plans)) if not fitted[i]] or list(range(len(plans)))
    return {
        "corrected": tuple(corrected),
        "correction": {**correction.to_dict(), "text": correction.describe()},
        "families": tuple(_correction.family(plan) for plan in plans),
        "fitted": tuple(fitted),
        "errors": {
            "scored": "the plans it was not fitted on" if len(scored) < len(plans) else "every plan",
            "raw": _correction.errors([p[i] for i in scored], [m[i] for i in scored]),
            "corrected": _correction.errors([corrected[i] for i in scored], [m[i] for i in scored]),
        },
    }


def additivity_report(model, profile, plans: Sequence[Any], documents: Any, *, names: Sequence[str] | None = None,
                      prefill_len: int | None = None, max_positions: int | None = None,
                      progress: bool = True, correction: Any = None,
                      fit_on: Sequence[int] | None = None) -> AdditivityReport:
    """Measure every plan with :func:`measure_kl` and compare with the profile's prediction, raw and with
    the additivity correction (``correction`` as given, or fitted on the plans ``fit_on``: see
    :func:`summarize`)."""
    profile.validate_for(model.config)
    if names is None:
        names = [str(p.provenance.get("preset") or p.provenance.get("made_by") or f"plan {i}")
                 for i, p in enumerate(plans)]
    if len(names) != len(plans):
        raise ValueError(f"names has {len(names)} entries for {len(plans)} plans")
    predicted = [predicted_damage(profile, plan) for plan in plans]
    results = [measure_kl(model, plan, documents, prefill_len=prefill_len, max_positions=max_positions,
                          progress=progress) for plan in plans]
    return summarize(names, predicted, [r.kl for r in results], kl_share=profile.kl_share, results=results,
                     plans=plans, correction=correction, fit_on=fit_on)
