"""Huginn's adaptive exit: each row stops its recurrence once its state has converged, within one call.

The rule is the released model's ``latent-diff`` criterion, restated: after core step ``t`` (0-based, ``t >=
min_steps``) a row whose state ``s`` moved by ``mean over its positions of |s_t - s_{t-1}| / |s_t| < threshold``
(``s_{-1}``: the initial state) exits; its logits come from ``s_t``, the state after ``t + 1`` steps.

What it leaves in a cache: the released code's ``latest-m4`` lookup reads, for a token that exited after ``e`` steps,
its K/V of step ``e - 1`` wherever a later token's step ``t >= e`` attends to it (the latest step it ran, at the same
core layer). loopkv writes that value in place: an exited row keeps its state, and at every later step of the call
its core layer ``j`` stores the row's K/V of its last step at ``j``. Every cell then holds every token (a
``LoopKVCache`` needs no change: its cells advance together, pages are quantized as always, a ``share`` cell's
source holds the copy too), and a later token reads exactly what ``latest-m4`` gives it. Rows exit on their own, so
a batch's rows equal each row alone; once every row has exited, the remaining steps only write (each core layer's
attention on the frozen state, no MLP).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn


@dataclass(frozen=True)
class ExitRule:
    """Exit a row after step ``t >= min_steps`` when its state's relative change is below ``threshold``."""

    threshold: float
    min_steps: int = 0

    @classmethod
    def of(cls, exit_threshold: float | None, min_steps: int = 0) -> ExitRule | None:
        """The rule of a call, or ``None`` without ``exit_threshold`` (every row runs every step); a ValueError names
        a bad value."""
        if exit_threshold is None:
            if min_steps:
                raise ValueError("min_steps applies to the adaptive exit: pass exit_threshold too (e.g. 0.03)")
            return None
        if isinstance(exit_threshold, bool) or not isinstance(exit_threshold, (int, float)) \
                or not math.isfinite(exit_threshold) or exit_threshold <= 0:
            raise ValueError(f"exit_threshold must be a positive number (the released latent-diff default is 0.03), "
                             f"got {exit_threshold!r}")
        if isinstance(min_steps, bool) or not isinstance(min_steps, int) or min_steps < 0:
            raise ValueError(f"min_steps must be an int >= 0 (steps run before a row may exit), got {min_steps!r}")
        return cls(float(exit_threshold), min_steps)

    def converged(self, step: int, new: Tensor, old: Tensor, real: Tensor | None) -> Tensor:
        """bool ``[B]``: rows whose state moved little in ``step``. new, old ``[B, S, E]``; real ``[B, S]`` bool (the
        row's own positions, not its left pads) or ``None`` (all)."""
        if step < self.min_steps:
            return torch.zeros(new.shape[0], dtype=torch.bool, device=new.device)
        n, o = new.float(), old.float()
        change = (n - o).norm(dim=-1) / n.norm(dim=-1)  # [B, S]
        if real is None:
            return change.mean(-1) < self.threshold
        real = real.to(change.device)
        mean = (change * real).sum(-1) / real.sum(-1).clamp(min=1)
        return mean < self.threshold


@dataclass(eq=False)
class Exits:
    """One call's exits: ``done`` bool ``[B]`` (rows that have exited) and, per core attention module, the K/V
    ``[B, H, S, D]`` of each row's last step there."""

    done: Tensor
    kv: dict[nn.Module, tuple[Tensor, Tensor]] = field(default_factory=dict)

    def kv_of(self, module: nn.Module, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """The K/V module ``module`` stores this step: an exited row's last ones, the others' new ``k``, ``v``."""
        if module in self.kv:
            rows = self.done[:, None, None, None]
            old_k, old_v = self.kv[module]
            k, v = torch.where(rows, old_k, k), torch.where(rows, old_v, v)
        self.kv[module] = (k, v)
        return k, v

    def step(self, rule: ExitRule, step: int, new: Tensor, old: Tensor, real: Tensor | None) -> Tensor:
        """The state after ``step``: ``new``, except that an exited row keeps ``old``; rows that converged exit."""
        state = torch.where(self.done[:, None, None], old, new)
        self.done = self.done | rule.converged(step, state, old, real)
        return state

    def all_done(self) -> bool:
        """Whether every row has exited (eager only: a host sync; a compiled call runs every step)."""
        return not torch.compiler.is_compiling() and bool(self.done.all())
