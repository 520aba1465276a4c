"""Where a looped Ouro model attends: each cell's attention recomputed in fp32 from its inputs.

:func:`cell_scores` and :func:`cell_attention_weights` rebuild one attention call's scores and softmax from the
attention module's input (a forward pre-hook sees it); :func:`attention_mass` hooks every cell and reports,
per loop, the attention mass on the first 1 / 4 / 32 positions (the sink) and on the last 256 (the window),
next to what uniform attention would give. The model card (docs/small-model.md) and the quality benchmark
report these numbers.
"""

from __future__ import annotations

from typing import Any

import torch

from loopkv.format import SINK, WINDOW
from loopkv.models.ouro import apply_rope

SINK_TOKENS = (1, 4, SINK)  # attention mass reported on the first 1, 4 and 32 positions
LOCAL_WINDOW = WINDOW  # attention mass reported on the most recent 256 positions


def cell_scores(module: torch.nn.Module, hidden: torch.Tensor, position_embeddings: tuple, *,
                queries: int) -> torch.Tensor:
    """``scaling * q . k`` of one Ouro attention call for its last ``queries`` positions, fp32, unmasked.

    ``hidden [B, S, H]`` is the attention module's input, ``position_embeddings`` its ``(cos, sin)``;
    returns ``[B, Hq, queries, S]`` (query head ``h`` against KV head ``h // groups``).
    """
    b, s, _ = hidden.shape
    cos, sin = (x.float() for x in position_embeddings)
    q = module.q_proj(hidden).view(b, s, -1, module.head_dim).transpose(1, 2).float()
    k = module.k_proj(hidden).view(b, s, -1, module.head_dim).transpose(1, 2).float()
    q, k = apply_rope(q[:, :, s - queries :], cos[:, s - queries :], sin[:, s - queries :]), apply_rope(k, cos, sin)
    k = k.repeat_interleave(module.num_key_value_groups, dim=1)
    return q @ k.transpose(2, 3) * module.scaling


def cell_attention_weights(module: torch.nn.Module, hidden: torch.Tensor, position_embeddings: tuple, *,
                           queries: int) -> torch.Tensor:
    """softmax of :func:`cell_scores` under the causal mask: ``[B, Hq, queries, S]``, fp32, zero beyond each
    query's position."""
    s = hidden.shape[1]
    scores = cell_scores(module, hidden, position_embeddings, queries=queries)
    qpos = torch.arange(s - queries, s, device=hidden.device)
    causal = torch.arange(s, device=hidden.device)[None, :] <= qpos[:, None]  # [Q, S]
    return scores.masked_fill(~causal, float("-inf")).softmax(-1)


@torch.no_grad()
def attention_mass(model, ids: torch.Tensor, *, queries: int = 128, device: torch.device | None = None
                   ) -> dict[str, Any]:
    """Where the last ``queries`` positions of ``ids [B, S]`` attend, per cell, averaged over heads and rows
    (``ids`` moves to ``device``, default the model's).

    Returns ``per_loop`` (per key, the mean over the loop's layers), ``per_cell`` (keyed by the flat cell
    index ``t * L + l``) and ``uniform_attention`` (what attention spread evenly over the causal prefix gives),
    with the keys ``first_1``, ``first_4``, ``first_32`` and ``last_256``.
    """
    cfg = model.config
    n_layers, loops = cfg.num_hidden_layers, cfg.total_ut_steps
    device = next(model.parameters()).device if device is None else torch.device(device)
    seq = ids.shape[1]
    if not 0 < queries <= seq:
        raise ValueError(f"queries must be in [1, {seq}] (the sequence length), got {queries}")
    cells: dict[int, dict[str, float]] = {}
    qpos = torch.arange(seq - queries, seq, device=device)
    local = torch.arange(seq, device=device)[None, :] > qpos[:, None] - LOCAL_WINDOW  # [Q, S]

    def hook(module, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        w = cell_attention_weights(module, hidden, kwargs["position_embeddings"], queries=queries)
        stats = {f"first_{n}": float(w[..., :n].sum(-1).mean()) for n in SINK_TOKENS}
        stats[f"last_{LOCAL_WINDOW}"] = float((w * local).sum(-1).mean())
        cells[int(kwargs["cell_index"])] = stats

    handles = [layer.self_attn.register_forward_pre_hook(hook, with_kwargs=True) for layer in model.model.layers]
    try:
        model(input_ids=ids.to(device), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    keys = sorted(next(iter(cells.values())))
    per_loop = {k: [sum(cells[t * n_layers + j][k] for j in range(n_layers)) / n_layers for t in range(loops)]
                for k in keys}
    pos = torch.arange(seq - queries, seq, dtype=torch.float64) + 1
    uniform = {f"first_{n}": float((torch.clamp(n / pos, max=1.0)).mean()) for n in SINK_TOKENS}
    uniform[f"last_{LOCAL_WINDOW}"] = float((torch.clamp(pos, max=LOCAL_WINDOW) / pos).mean())
    return {
        "per_loop": per_loop,
        "uniform_attention": uniform,
        "per_cell": {str(c): cells[c] for c in sorted(cells)},
        "sequence_length": seq,
        "query_positions": [seq - queries, seq],
    }
