"""Where vLLM's loopkv plan comes from, and whether it fits the served model (docs/vllm.md, "The setting").

One setting, two spellings: the environment variable ``LOOPKV_PLAN=/path/plan.json`` (seen by every vLLM process,
the plugin's entry point included), or ``additional_config={"loopkv_plan": "/path/plan.json"}`` (``vllm serve
--additional-config '{"loopkv_plan": "/path/plan.json"}'``; the value may also be a plan's JSON object, what
``Plan.to_dict()`` gives). Setting both is refused rather than one silently winning. No plan: vLLM serves Ouro as
it would without loopkv.

Everything here takes plain objects (a ``transformers`` config, a mapping, an environment) and imports no vLLM,
so it is tested on a CPU without vLLM.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from typing import Any

from loopkv.planning.plan import Plan

logger = logging.getLogger(__name__)

PLAN_ENV = "LOOPKV_PLAN"
PLAN_KEY = "loopkv_plan"
# vLLM's --kv-cache-dtype values that keep exact cells in the model's dtype (anything else, fp8, quantizes them)
EXACT_KV_CACHE_DTYPES = ("auto", "bfloat16", "float16")


def load_plan(additional_config: Mapping[str, Any] | None = None, *,
              environ: Mapping[str, str] | None = None) -> Plan | None:
    """The plan named by ``additional_config["loopkv_plan"]`` or ``$LOOPKV_PLAN``, or ``None`` when neither is set.

    additional_config: vLLM's ``VllmConfig.additional_config`` (a dict; other keys are left alone). Its
        ``loopkv_plan`` is a path to a plan JSON file or the plan's JSON object.
    environ: the environment to read (``os.environ`` by default).
    """
    environ = os.environ if environ is None else environ
    from_env = environ.get(PLAN_ENV) or None
    from_config = None
    if additional_config is not None:
        if not isinstance(additional_config, Mapping):
            raise ValueError(
                f"vLLM's additional_config is a {type(additional_config).__name__}; loopkv reads a dict "
                f"with the key {PLAN_KEY!r} (--additional-config '{{\"{PLAN_KEY}\": \"/path/plan.json\"}}')")
        from_config = additional_config.get(PLAN_KEY)
    if from_env is not None and from_config is not None:
        raise ValueError(
            f"the loopkv plan is set twice: ${PLAN_ENV}={from_env!r} and additional_config[{PLAN_KEY!r}]; "
            f"set one of them (unset {PLAN_ENV} or drop the key)")
    if from_config is not None:
        return _read(from_config, f"additional_config[{PLAN_KEY!r}]")
    if from_env is not None:
        return _read(from_env, f"${PLAN_ENV}")
    return None


def _read(value: Any, where: str) -> Plan:
    if isinstance(value, Mapping):
        try:
            return Plan.from_dict(value)
        except ValueError as err:
            raise ValueError(f"{where} is not a loopkv plan: {err}") from err
    if not isinstance(value, (str, os.PathLike)):
        raise ValueError(f"{where} must be a path to a plan JSON file or a plan's JSON object, got "
                         f"{type(value).__name__}")
    path = os.fspath(value)
    if not os.path.isfile(path):
        raise ValueError(f"{where} names {path!r}, which is not a file; write a plan with "
                         "`loopkv plan profile.json --out plan.json` or Plan.to_json, and give its path")
    try:
        return Plan.from_json(path)
    except (ValueError, json.JSONDecodeError) as err:
        raise ValueError(f"{where} = {path!r} is not a loopkv plan file: {err}") from err


def vllm_ouro_head_dim(hf_config: Any) -> int:
    """The head_dim vLLM's Ouro uses: ``hidden_size // num_attention_heads`` (vllm/model_executor/models/ouro.py,
    ``OuroAttention.__init__``), whatever ``config.head_dim`` says."""
    return int(hf_config.hidden_size) // int(hf_config.num_attention_heads)


def validate_for_vllm(plan: Plan, hf_config: Any, *, tensor_parallel_size: int = 1,
                      kv_cache_dtype: str = "auto") -> None:
    """Raise ``ValueError`` naming every way ``plan`` does not fit the Ouro model vLLM serves from ``hf_config``.

    Checks the plan against the config (family, loops = ``total_ut_steps``, layers = ``num_hidden_layers``, KV heads,
    head_dim: :meth:`Plan.validate_for`), that vLLM's Ouro computes the same head_dim as the config states, that the
    KV heads split over ``tensor_parallel_size`` ranks as vLLM splits them, and that ``kv_cache_dtype`` keeps the
    exact cells exact.
    """
    if not isinstance(plan, Plan):
        raise ValueError(f"plan must be a loopkv Plan, got {type(plan).__name__}")
    if getattr(hf_config, "total_ut_steps", None) is None:
        raise ValueError(
            f"the served model's config ({type(hf_config).__name__}, model_type "
            f"{getattr(hf_config, 'model_type', None)!r}) has no total_ut_steps: loopkv's vLLM plugin serves Ouro "
            "(vllm/model_executor/models/ouro.py). Unset the loopkv plan for this model")
    plan.validate_for(hf_config)
    problems = []
    stated = getattr(hf_config, "head_dim", None)
    computed = vllm_ouro_head_dim(hf_config)
    if stated is not None and int(stated) != computed:
        problems.append(
            f"config.head_dim={stated} but vLLM's Ouro uses hidden_size // num_attention_heads = {computed}; "
            "vLLM would serve a different model than the plan was made for (fix the config)")
    tp = tensor_parallel_size
    kv_heads = int(getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads)
    if not isinstance(tp, int) or tp < 1:
        problems.append(f"tensor_parallel_size must be a positive int, got {tp!r}")
    elif kv_heads % tp and tp % kv_heads:
        problems.append(f"{kv_heads} KV heads split over tensor_parallel_size={tp} neither evenly nor by "
                        "replication; choose a tensor-parallel size that divides or is a multiple of it")
    if kv_cache_dtype not in EXACT_KV_CACHE_DTYPES:
        problems.append(f"--kv-cache-dtype {kv_cache_dtype} quantizes the cells the plan keeps exact; leave it "
                        f"at one of {EXACT_KV_CACHE_DTYPES} (the plan chooses each cell's storage)")
    if problems:
        raise ValueError("the loopkv plan cannot be served by vLLM: " + "; ".join(problems))


def check_engine(plan: Plan, *, block_size: int | None, prefix_caching: bool, speculative: bool,
                 chunked_prefill: bool = False, long_prefill_token_threshold: int = 0,
                 kv_sharing_fast_prefill: bool = False) -> None:
    """Refuse, at start-up, vLLM engine settings a plan with loopkv-stored cells cannot run under (none for an
    all-bf16 plan): ``--block-size 32`` (one vLLM block is one loopkv page), prefix caching off (a cached block of a
    quantized cell holds codes whose exact window is gone), no speculative decoding, no ``kv_sharing_fast_prefill``
    (loopkv's cells share one KV tensor through vLLM's KV sharing, docs/vllm.md). A plan with ``share`` cells also
    needs every chunk of a prompt after its first to be at most ``WINDOW`` tokens (a share cell reads pages its source,
    a later loop, writes in the same forward): chunked prefill off, or ``--long-prefill-token-threshold`` at most
    ``WINDOW``."""
    from loopkv.format import PAGE, WINDOW

    if set(plan.options) == {"bf16"}:
        return
    problems = []
    if block_size != PAGE:
        problems.append(f"--block-size is {block_size}: pass --block-size {PAGE} (block_size={PAGE}), one vLLM block "
                        "per loopkv page")
    if prefix_caching:
        problems.append("prefix caching is on: pass --no-enable-prefix-caching (enable_prefix_caching=False); a "
                        "cached block of a quantized cell has lost the exact window its tokens were read with")
    if speculative:
        problems.append("speculative decoding is configured: loopkv's backend decodes one token per request and step")
    if kv_sharing_fast_prefill:
        problems.append("kv_sharing_fast_prefill is on: loopkv's cells share one KV tensor and each computes its "
                        "prefill; leave it off")
    if "share" in plan.options and chunked_prefill and not 0 < long_prefill_token_threshold <= WINDOW:
        problems.append(
            "chunked prefill is on: a share cell continues a prompt by at most "
            f"{WINDOW} tokens per step; pass --no-enable-chunked-prefill (enable_chunked_prefill=False, with "
            "--max-num-batched-tokens at least --max-model-len) or --long-prefill-token-threshold "
            f"{WINDOW}")
    if problems:
        raise ValueError("loopkv's vLLM plugin cannot serve this plan with these engine settings: "
                         + "; ".join(problems))
    if chunked_prefill:
        logger.warning(
            "chunked prefill is on: a prompt's chunks after its first are read by loopkv's continuation "
            "(loopkv.cache.continuation), exact but reading the row's pages once per chunk token as a decode step "
            "does, far slower than a whole prompt on a GPU; for long prompts pass --no-enable-chunked-prefill with "
            "--max-num-batched-tokens at least --max-model-len (docs/vllm.md)")
