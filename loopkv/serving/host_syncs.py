"""Counting the calls that would make the host wait for a GPU, by caller, step by step of a continuous-batching engine
with LoopKV storage: for checking that a decode step reads nothing back from the device (docs/design.md, "Serving").

The calls counted: ``Tensor.tolist``, ``Tensor.item``, ``bool``/``int`` of a tensor, and tensors built from host data
with a device argument (``torch.tensor(..., device=)``, a blocking host-to-device copy on a GPU). They are counted on
the CPU too, where none of them waits, so the check runs without a GPU. A count's key is ``"caller:call"``, the caller
being the package of the first frame outside this module and torch's own Python: ``transformers``, ``loopkv``,
``loopkv.ops`` (the reference ops: on a GPU the Triton kernels run instead) or ``other``.

    with record_steps() as steps:
        model.generate_batch(prompts, ...)  # inside engine_cache(plan, ...)
    for step, seconds, syncs in between(steps): ...
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import sys
import time
from collections.abc import Callable, Iterator

import torch

SYNC_METHODS = ("tolist", "item", "__bool__", "__int__")  # the Tensor methods counted
NEW_ON_DEVICE = "tensor(device=)"  # the name of a counted torch.tensor(host data, device=...)


def _caller() -> str:
    """The package of the first frame outside this module and torch's own Python (module docstring)."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if name != __file__ and "/torch/" not in name:
            break
        frame = frame.f_back
    name = frame.f_code.co_filename if frame is not None else ""
    if "/loopkv/ops/" in name:
        return "loopkv.ops"
    return "transformers" if "/transformers/" in name else "loopkv" if "/loopkv/" in name else "other"


@contextlib.contextmanager
def count_host_syncs(counts: collections.Counter) -> Iterator[collections.Counter]:
    """Inside, every counted call (module docstring) adds one to ``counts[(caller, call)]``; ``torch.Tensor``'s
    methods and ``torch.tensor`` are restored on exit."""
    originals = {n: getattr(torch.Tensor, n) for n in SYNC_METHODS}
    tensor = torch.tensor

    def wrap(name):
        def counted(self, *a, **k):
            counts[(_caller(), name)] += 1
            return originals[name](self, *a, **k)
        return counted

    def counted_tensor(data, *a, **k):
        if k.get("device") is not None and not isinstance(data, torch.Tensor):
            counts[(_caller(), NEW_ON_DEVICE)] += 1
        return tensor(data, *a, **k)

    for name in originals:
        setattr(torch.Tensor, name, wrap(name))
    torch.tensor = counted_tensor
    try:
        yield counts
    finally:
        for name, fn in originals.items():
            setattr(torch.Tensor, name, fn)
        torch.tensor = tensor


@dataclasses.dataclass(frozen=True)
class Step:
    """One forward of an engine cache, as :func:`record_steps` saw it begin."""

    start_s: float  # time.perf_counter() when the forward began
    tokens: int  # the packed batch's tokens (one per decoding row, plus every prompt token of the step)
    syncs: collections.Counter  # (caller, call) -> calls counted from the start of the recording to this forward


@contextlib.contextmanager
def record_steps(*, on_step: Callable[[Step], None] | None = None) -> Iterator[list[Step]]:
    """Inside, host syncs are counted (:func:`count_host_syncs`) and every forward of an
    :class:`~loopkv.serving.engine_cache.EngineCache` appends a :class:`Step` to the list yielded (``on_step``, if
    given, is called with it first, on the engine's thread)."""
    from loopkv.serving.engine_cache import EngineCache

    steps: list[Step] = []
    counts: collections.Counter = collections.Counter()
    run_step = EngineCache.run_step

    def recorded(self, logits_of, *, input_ids, **k):
        step = Step(start_s=time.perf_counter(), tokens=input_ids.shape[1], syncs=counts.copy())
        if on_step is not None:
            on_step(step)
        steps.append(step)
        return run_step(self, logits_of, input_ids=input_ids, **k)

    EngineCache.run_step = recorded
    try:
        with count_host_syncs(counts):
            yield steps
    finally:
        EngineCache.run_step = run_step


def between(steps: list[Step]) -> list[tuple[Step, float, collections.Counter]]:
    """Every recorded step but the last, with its seconds and the syncs counted in it: from its forward's start to
    the next's (its own forward, then the engine's sampling and scheduling of the next step)."""
    return [(a, b.start_s - a.start_s, b.syncs - a.syncs) for a, b in zip(steps, steps[1:], strict=False)]


def mean_per_step(syncs: list[collections.Counter]) -> dict[str, float]:
    """``"caller:call"`` -> calls per step, the mean over ``syncs`` (one counter per step; empty: {})."""
    total = collections.Counter()
    for counts in syncs:
        total.update(counts)
    return {f"{who}:{what}": n / len(syncs) for (who, what), n in sorted(total.items())}
