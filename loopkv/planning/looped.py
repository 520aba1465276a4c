"""The looped model the profiler and the plan simulation run: its layout and what keeps its forwards comparable.

The simulation (:mod:`loopkv.planning.simulate`) works in a model's *cache indices* (the ``layer_idx`` it passes to
``Cache.update``) and plans in its *cells* (loop, planned layer); :func:`model_layout` gives the
:class:`~loopkv.families.ModelLayout` that maps one to the other, for every family :mod:`loopkv.families` knows:

* Ouro: every layer looped, cell ``(t, l)`` at index ``t * L + l``.
* Dory (transformers' ``DoryForCausalLM``, cache mode ``per_loop``): the recurrent full-attention layers per loop
  are the cells; the input and output layers and every sliding-window layer are fixed slots, attended exactly
  (a sliding layer over its window). ``last_loop`` mode is refused: its earlier loops read the last loop's cache
  without writing their own.
* Huginn: the core block's layers per step are the cells, for ``r = config.mean_recurrence`` steps (the model's
  default ``num_steps``); prelude and coda layers are fixed slots. A plan made from such a profile has ``T = r``
  loops and serves calls of ``num_steps <= T`` (:func:`loopkv.models.huginn.check_steps`).

Huginn starts its recurrent state at random (``state_init="like-init"``). Damages compare forwards that must start
from the same state, so :func:`repeatable_state` fixes it while the profiler runs: one draw from a generator seeded
with :data:`STATE_SEED`, the same for every batch row and every forward of a document (``provenance["layout"]``
records it).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from typing import Any

import torch

from loopkv.families import ModelLayout, known_family, layout_of

STATE_SEED = 0  # the seed of a random initial recurrent state while profiling (Huginn's like-init)


def model_layout(model: Any) -> ModelLayout:
    """The :class:`~loopkv.families.ModelLayout` of ``model`` at its default loop count, or a ValueError naming
    what the simulation needs."""
    config = getattr(model, "config", None)
    if config is None or not known_family(config):
        raise ValueError(
            "model must be a looped model loopkv knows: loopkv.models.ouro.OuroForCausalLM (total_ut_steps), "
            "transformers' DoryForCausalLM (transformers >= 5.24) or loopkv.models.huginn.HuginnForCausalLM; "
            f"got {type(model).__name__}")
    layout = layout_of(config)
    if layout.family == "ouro" and "sliding_attention" in (getattr(config, "layer_types", None) or ()):
        raise ValueError("Ouro-style models with sliding-window layers are not supported by the served simulation: "
                         "Ouro's layout plans every layer (Dory's keeps sliding layers as fixed slots)")
    if layout.reads_without_update:
        raise ValueError(
            f"this {layout.family} model's cache mode ({getattr(config, 'recurrent_kv_cache_mode', None)!r}) lets "
            f"loops read another loop's cache without writing their own ({len(layout.reads_without_update)} cells): "
            "the profiler measures each loop's own cache; load it with recurrent_kv_cache_mode='per_loop'")
    return layout


def loops_field(layout: ModelLayout) -> str:
    """The config field that sets the layout's loop count (Huginn: ``mean_recurrence``, the default ``r``)."""
    from loopkv.planning.plan import SHAPE_NAMES

    return SHAPE_NAMES.get(layout.family, ("loops",))[0]


def describe(model: Any, layout: ModelLayout) -> dict[str, Any]:
    """``provenance["layout"]``: the family, the loop count and where it comes from, the planned cells and the
    fixed slots by kind, and how a random initial state was fixed."""
    fixed: dict[str, int] = {}
    for slot in layout.fixed():
        fixed[slot.kind] = fixed.get(slot.kind, 0) + 1
    out = {"family": layout.family, "loops": layout.loops, "loops_from": f"config.{loops_field(layout)}",
           "planned_layers": layout.layers, "fixed_slots": fixed}
    if random_initial_state(model):
        out["initial_state"] = (f"{model.config.state_init}, one draw from torch.Generator seeded {STATE_SEED}, "
                                "the same for every row and forward of a document")
    return out


def random_initial_state(model: Any) -> bool:
    """Whether ``model``'s recurrent state starts at random in every forward (Huginn's ``like-init``)."""
    return callable(getattr(model, "initial_state", None)) and getattr(model.config, "state_init", None) != "zero"


@contextlib.contextmanager
def repeatable_state(model: Any, seed: int = STATE_SEED) -> Iterator[None]:
    """Inside the block, a model with a random initial recurrent state (``model.initial_state``, Huginn's) starts
    every forward from one draw of a generator seeded ``seed`` for one row, the same for all rows."""
    if not random_initial_state(model):
        yield
        return
    original = model.initial_state

    def initial_state(embeds: torch.Tensor, *, init_scale: float = 1.0, generator=None) -> torch.Tensor:
        fixed = torch.Generator(device=embeds.device).manual_seed(seed)
        return original(embeds[:1], init_scale=init_scale, generator=fixed).expand_as(embeds)

    model.initial_state = initial_state
    try:
        yield
    finally:
        del model.initial_state


def cache_keyword(model: Any) -> str:
    """The name ``model``'s forward takes its cache by: ``past_key_values``, or ``cache`` (transformers' own models
    from 5.2x on)."""
    params = inspect.signature(model.forward).parameters
    return "past_key_values" if "past_key_values" in params or "cache" not in params else "cache"
