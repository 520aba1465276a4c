"""Decode-only engine steps as CUDA graphs (docs/design.md, "Serving").

transformers' engine captures its own graphs keyed by padded token counts, which cannot tell a step's prompts from
its decode tokens (``transformers_cb.engine_config`` turns them off). loopkv captures its own instead, inside the
model's forward (:meth:`~loopkv.serving.engine_cache.EngineCache.run_step`), for the one kind of step whose shapes
are fixed: every scheduled request decodes one token. Such a step's host work is done before the graph runs (the
segments, the pages reserved, the decoding rows written into :class:`~loopkv.cache.slots.DecodeSteps`' fixed
tensors); what runs on the device is the model's forward over ``bucket(T)`` packed tokens, the ``T`` decoding
tokens first and zeros after (a padding token decodes no row: its output is never read), with every cell's
``token_attention_`` over all the cache's rows, as in an eager step.

A bucket's graph is captured the first time a step of that bucket runs: the step runs eagerly first (its output is
the step's), then the same forward is captured without running (capture records kernels, it does not execute
them), and later steps of the bucket replay it. Every bucket's graph shares one memory pool. The engine cache runs
every bucket (:func:`buckets`) once before its first request, with a step in which no row decodes
(:meth:`~loopkv.serving.engine_cache.EngineCache.warm_up`), so no request's step waits for a capture.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor


def bucket(tokens: int) -> int:
    """The packed length a decode-only step of ``tokens`` decoding rows runs at: a power of two up to 8, then the next
    multiple of 8 (few graphs, little padding)."""
    if tokens <= 8:
        return 1 << (tokens - 1).bit_length()
    return -(-tokens // 8) * 8


def buckets(max_rows: int) -> list[int]:
    """Every bucket a decode-only step of at most ``max_rows`` decoding rows runs at, ascending."""
    return sorted({bucket(t) for t in range(1, max_rows + 1)})


class DecodeGraphs:
    """One engine's decode-only steps: static inputs of ``bucket(max_rows)`` tokens, a CUDA graph per bucket.

    ``capture=False`` runs the same padded forward on the same static inputs eagerly (every step), which is what a
    graph replays; it is the path the CPU tests take."""

    def __init__(self, *, max_rows: int, device, capture: bool):
        if capture and torch.device(device).type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, not {device}: pass capture=False")
        width = bucket(max_rows)
        self.capture = capture
        self.input_ids = torch.zeros(1, width, dtype=torch.long, device=device)
        self.position_ids = torch.zeros(1, width, dtype=torch.long, device=device)
        self.keep = torch.arange(width, device=device)  # every padded token's logits (the first T are the step's)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._logits: dict[int, Tensor] = {}
        self._pool = torch.cuda.graph_pool_handle() if capture else None

    @property
    def captured(self) -> list[int]:
        """The buckets that have a graph."""
        return sorted(self._graphs)

    def pool_bytes(self) -> int:
        """Device memory the graphs' pool holds (every captured bucket's intermediates and outputs); 0 without
        capture."""
        if self._pool is None:
            return 0
        pool = tuple(self._pool)
        return sum(s["total_size"] for s in torch.cuda.memory_snapshot() if tuple(s["segment_pool_id"]) == pool)

    def run(self, forward: Callable[..., Tensor], input_ids: Tensor, position_ids: Tensor) -> Tensor:
        """The step's logits ``[1, T, V]``: ``forward(input_ids=, position_ids=, logits_to_keep=)`` (the model's
        logits) over the step's ``T`` tokens padded to ``bucket(T)``, replayed from the bucket's graph if it has one."""
        tokens = input_ids.shape[1]
        width = bucket(tokens)
        self.input_ids[:, :tokens].copy_(input_ids)
        self.input_ids[:, tokens:width].zero_()
        self.position_ids[:, :tokens].copy_(position_ids)
        self.position_ids[:, tokens:width].zero_()
        args = dict(input_ids=self.input_ids[:, :width], position_ids=self.position_ids[:, :width],
                    logits_to_keep=self.keep[:width])
        graph = self._graphs.get(width)
        if graph is not None:
            graph.replay()
            return self._logits[width][:, :tokens]
        logits = forward(**args)  # the step itself (and, when capturing, the warm-up)
        if self.capture:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                self._logits[width] = forward(**args)
            self._graphs[width] = graph
        return logits[:, :tokens]
