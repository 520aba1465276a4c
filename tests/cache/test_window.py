"""A sliding layer's ring (loopkv/cache/window.py) against brute force: every token of a row kept densely, each query
attending in float64 to the positions ``i - W < j <= i`` (transformers' sliding_window_overlay), rows of different
lengths; and the decode step under ``torch.compile(fullgraph=True)`` equal to eager."""

from __future__ import annotations

import pytest
import torch

from loopkv.cache import window
from tests.tolerances import ATTN_FP32_ATOL, ATTN_FP32_RTOL

H, HQ, D = 2, 4, 32


def _window_attention64(q, keys, values, positions, query_position, w):
    """float64 attention of q [Hq, D] over keys/values [H, n, D] at ``positions`` within the window."""
    seen = [j for j, p in enumerate(positions) if query_position - w < p <= query_position]
    k, v = keys[:, seen].double(), values[:, seen].double()
    k, v = k.repeat_interleave(HQ // H, 0), v.repeat_interleave(HQ // H, 0)
    s = torch.einsum("hd,hnd->hn", q.double(), k) * D**-0.5
    return torch.einsum("hn,hnd->hd", torch.softmax(s, -1), v)


@pytest.mark.parametrize(("w", "max_len", "prompt", "steps", "turn"), [
    (8, 60, (3, 17), 20, 11),  # rows far past the window, a later turn longer than it
    (8, 5, (1, 3), 2, 0),  # a cache shorter than the window: its ring never wraps
    (1, 30, (3, 17), 5, 4),  # a window of one token: each query sees itself alone
])
def test_prompt_decode_and_a_later_turn_read_the_window(w, max_len, prompt, steps, turn):
    """Left-padded rows of different lengths, decoded token by token, then a later turn: every read is the float64
    window attention over every token the row ever held, and the lengths count every token."""
    torch.manual_seed(0)
    rows, S = len(prompt), max(prompt)
    st = window.allocate_window(batch=rows, heads=H, head_dim=D, slots=min(w, max_len), dtype=torch.float32,
                                device="cpu")
    k, v = torch.randn(rows, H, S, D), torch.randn(rows, H, S, D)
    window.prefill(st, k, v, torch.tensor([S - n for n in prompt]), list(range(rows)))
    keys = [k[b, :, S - n:] for b, n in enumerate(prompt)]
    values = [v[b, :, S - n:] for b, n in enumerate(prompt)]
    held = list(prompt)
    for _ in range(steps):
        q, kn, vn = torch.randn(rows, HQ, D), torch.randn(rows, H, 1, D), torch.randn(rows, H, 1, D)
        out = window.decode_(st, q, kn, vn, scale=D**-0.5)
        for b in range(rows):
            keys[b], values[b] = torch.cat([keys[b], kn[b]], 1), torch.cat([values[b], vn[b]], 1)
            want = _window_attention64(q[b], keys[b], values[b], range(held[b] + 1), held[b], w)
            torch.testing.assert_close(out[b].double(), want, atol=ATTN_FP32_ATOL, rtol=ATTN_FP32_RTOL)
            held[b] += 1
    assert st.lengths.tolist() == held
    if not turn:
        return
    q, kn, vn = torch.randn(rows, HQ, turn, D), torch.randn(rows, H, turn, D), torch.randn(rows, H, turn, D)
    out = window.extend(st, q, kn, vn, scale=D**-0.5, window=w, held=list(held))  # [B, turn, Hq, D]
    for b in range(rows):
        keys[b], values[b] = torch.cat([keys[b], kn[b]], 1), torch.cat([values[b], vn[b]], 1)
        for i in range(turn):
            want = _window_attention64(q[b, :, i], keys[b], values[b], range(held[b] + turn), held[b] + i, w)
            torch.testing.assert_close(out[b, i].double(), want, atol=ATTN_FP32_ATOL, rtol=ATTN_FP32_RTOL)
    assert st.lengths.tolist() == [h + turn for h in held]
    q, kn, vn = torch.randn(rows, HQ, D), torch.randn(rows, H, 1, D), torch.randn(rows, H, 1, D)
    out = window.decode_(st, q, kn, vn, scale=D**-0.5)  # the ring the turn left
    for b in range(rows):
        keys[b], values[b] = torch.cat([keys[b], kn[b]], 1), torch.cat([values[b], vn[b]], 1)
        n = held[b] + turn
        want = _window_attention64(q[b], keys[b], values[b], range(n + 1), n, w)
        torch.testing.assert_close(out[b].double(), want, atol=ATTN_FP32_ATOL, rtol=ATTN_FP32_RTOL)


def test_a_compiled_decode_step_equals_eager():
    torch.manual_seed(1)
    st, ref = (window.allocate_window(batch=2, heads=H, head_dim=D, slots=8, dtype=torch.float32, device="cpu")
               for _ in range(2))
    for t in (st.win_k, st.win_v, st.lengths):
        torch._dynamo.mark_static_address(t)
    step = torch.compile(lambda q, k, v: window.decode_(st, q, k, v, scale=0.2), fullgraph=True)
    for _ in range(12):  # past the ring's 8 slots
        q, k, v = torch.randn(2, HQ, D), torch.randn(2, H, 1, D), torch.randn(2, H, 1, D)
        assert torch.equal(step(q, k, v), window.decode_(ref, q, k, v, scale=0.2))
    assert torch.equal(st.win_k, ref.win_k)
    assert torch.equal(st.lengths, ref.lengths)
