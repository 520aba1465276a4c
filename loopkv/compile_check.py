"""``loopkv.check_compile(model, cache)``: does the decode step compile to one graph?

Users only see "skipping cudagraphs" or slow decoding and cannot tell why (pytorch #117281). This runs
a few decode steps of ``model`` on ``cache`` under ``torch.compile`` (without ``fullgraph``, so that a
problem is *reported* rather than raised) and returns what dynamo and inductor counted, with their
reasons: graph breaks, graphs compiled (recompiles), and CUDA-graph skips (``mode="reduce-overhead"``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

_WATCH = ("recompil", "graph break", "graph_break", "skipping cudagraphs", "cudagraph")


class _Collector(logging.Handler):
    def __init__(self) -> None:
        super().__init__(level=logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        if any(w in msg.lower() or w in record.name.lower() for w in _WATCH):
            self.messages.append(" | ".join(line.strip() for line in msg.strip().splitlines()[:4])[:400])


@dataclass
class CompileReport:
    """What compiling the decode step produced. ``ok`` when one graph, no break, no CUDA-graph skip."""

    steps: int
    graphs: int
    graph_breaks: dict = field(default_factory=dict)
    cudagraph_skips: int = 0
    messages: list = field(default_factory=list)

    @property
    def recompiles(self) -> int:
        return max(0, self.graphs - 1)

    @property
    def ok(self) -> bool:
        return self.graphs == 1 and not self.graph_breaks and self.cudagraph_skips == 0

    def __str__(self) -> str:
        lines = [f"decode steps: {self.steps}; graphs compiled: {self.graphs} (recompiles: {self.recompiles}); "
                 f"graph breaks: {sum(self.graph_breaks.values())}; CUDA-graph skips: {self.cudagraph_skips}"
                 f" -> {'OK: one graph' if self.ok else 'NOT one graph'}"]
        lines += [f"  graph break x{n}: {reason}" for reason, n in self.graph_breaks.items()]
        lines += [f"  log: {m}" for m in dict.fromkeys(self.messages)]
        return "\n".join(lines)


def check_compile(model, cache, *, steps: int = 8, prompt_len: int = 16, mode: str | None = None,
                  backend: str = "inductor") -> CompileReport:
    """Prefill ``prompt_len`` random tokens (eager), then compile and run ``steps`` decode steps.

    ``cache`` is reset before and after. ``mode="reduce-overhead"`` on CUDA also checks CUDA-graph capture.
    """
    from torch._dynamo.utils import counters

    if steps < 2:
        raise ValueError(f"steps must be >= 2 to see a recompile, got {steps}")
    max_len = getattr(cache, "max_cache_len", None)
    if isinstance(max_len, int) and prompt_len + steps > max_len:
        raise ValueError(f"prompt_len + steps = {prompt_len + steps} exceeds the cache's max_cache_len={max_len}")
    device = next(model.parameters()).device
    batch = getattr(cache, "max_batch_size", 1)
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (batch, prompt_len), generator=gen).to(device)
    if hasattr(cache, "warmup"):
        cache.warmup()
    cache.reset()

    def step(tok, pos):
        return model(input_ids=tok, position_ids=pos, past_key_values=cache).logits

    torch._dynamo.reset()
    counters.clear()
    collector = _Collector()
    # torch's log setup gives these loggers their own handlers and turns propagation off
    loggers = [logging.getLogger(n) for n in ("torch", "torch._dynamo", "torch._inductor")]
    torch._logging.set_logs(recompiles=True, graph_breaks=True, cudagraphs=True)  # resets torch's handlers
    for lg in loggers:
        lg.addHandler(collector)
    try:
        compiled = torch.compile(step, backend=backend, mode=mode)
        with torch.no_grad():
            model(input_ids=ids, past_key_values=cache)
            tok = torch.empty(batch, 1, dtype=ids.dtype, device=device).copy_(ids[:, -1:])  # argmax's strides
            for i in range(steps):
                pos = torch.full((batch, 1), prompt_len + i, device=device)
                tok = compiled(tok, pos)[:, -1].argmax(-1, keepdim=True)
    finally:
        for lg in loggers:
            lg.removeHandler(collector)
        torch._logging.set_logs()
        cache.reset()
    return CompileReport(
        steps=steps,
        graphs=int(counters["stats"]["unique_graphs"]),
        graph_breaks=dict(counters["graph_break"]),
        cudagraph_skips=int(counters["inductor"]["cudagraph_skips"]),
        messages=collector.messages,
    )
