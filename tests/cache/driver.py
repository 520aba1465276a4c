"""Drive a LoopKVCache cell by cell without a model, and recompute attention in float64 from what it stores.

The float64 recomputation is independent of ``cell_attention_reference``: it rebuilds each row's
effective K and V token by token from the stored sink, ring and pool (bit unpacking from the codec is
the only shared piece, and the codec has its own exact tests), applies DESIGN.md §7's cold rule in
float64, and takes one softmax.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch

from loopkv.cache.attention import loopkv_attention
from loopkv.ops import codec
from loopkv.ops.codec import PAGE, SINK
from loopkv.ops.layout import RING, n_pages


def tiny_config(*, loops=2, layers=2, heads=4, kv_heads=2, head_dim=32, dtype=torch.float32):
    return SimpleNamespace(total_ut_steps=loops, num_hidden_layers=layers, num_attention_heads=heads,
                           num_key_value_heads=kv_heads, head_dim=head_dim, hidden_size=heads * head_dim,
                           dtype=dtype)


def left_pad(seqs: list[torch.Tensor], length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[H, n_b, D] per row -> [B, H, length, D] left-padded with garbage, and a 2D mask."""
    H, _, D = seqs[0].shape
    out = torch.randn(len(seqs), H, length, D, dtype=seqs[0].dtype) * 100  # pads: loud garbage
    mask = torch.zeros(len(seqs), length, dtype=torch.long)
    for b, s in enumerate(seqs):
        n = s.shape[1]
        out[b, :, length - n:] = s
        mask[b, length - n:] = 1
    return out, mask


def prefill(cache, cell_index, q, k, v, mask2d, scale):
    """q [B, Hq, S, D], k/v [B, H, S, D]; returns [B, S, Hq, D]."""
    hk, hv = cache.update(k, v, cell_index)
    mask4 = mask2d[:, None, None, :].bool().expand(-1, 1, k.shape[2], -1)
    out, _ = loopkv_attention(None, q, hk, hv, mask4, scaling=scale)
    return out


def decode(cache, cell_index, q, k, v, scale):
    """q [B, Hq, 1, D], k/v [B, H, 1, D]; returns [B, Hq, D]."""
    hk, hv = cache.update(k, v, cell_index)
    out, _ = loopkv_attention(None, q, hk, hv, None, scaling=scale)
    return out[:, 0]


def effective_kv(cache, cell_index, row):
    """float64 (K [H, n, D], V_full [H, n, D], V_cold [H, n, D] or None, V scale [H, n, D/G], is_hist [n])."""
    st = cache.storage(cell_index)
    n = int(st.lengths[row])
    npg = n_pages(n)
    H, D = cache.kv_heads, cache.head_dim
    K = torch.zeros(H, n, D, dtype=torch.float64)
    V = torch.zeros_like(K)
    Vc = torch.zeros_like(K)
    Vs = torch.zeros(H, n, D // codec.GROUP, dtype=torch.float64)
    hist = torch.zeros(n, dtype=torch.bool)
    bits = st.read_bits
    for pos in range(n):
        if pos < SINK:
            K[:, pos], V[:, pos] = st.sink_k[row, :, pos].double(), st.sink_v[row, :, pos].double()
        elif pos >= SINK + PAGE * npg:
            slot = (pos - SINK) % RING
            K[:, pos], V[:, pos] = st.win_k[row, :, slot].double(), st.win_v[row, :, slot].double()
        else:
            hist[pos] = True
            p, t = divmod(pos - SINK, PAGE)
            phys = int(st.page_table[row, p])
            if bits == 16:
                K[:, pos], V[:, pos] = st.k_pages[phys, :, t].double(), st.v_hi[phys, :, t].double()
                continue
            kc = codec.unpack(st.k_pages[phys, :, t], bits).double()  # [H, D]
            K[:, pos] = kc * st.k_scale[phys].double() + st.k_zero[phys].double()
            vs = st.v_scale[phys, :, t].double().repeat_interleave(codec.GROUP, -1)  # [H, D]
            vz = st.v_zero[phys, :, t].double().repeat_interleave(codec.GROUP, -1)
            Vs[:, pos] = st.v_scale[phys, :, t].double()
            hi = codec.unpack(st.v_hi[phys, :, t], 2).double()
            if bits == 4:
                lo = codec.unpack(st.v_lo[phys, :, t], 2).double()
                V[:, pos] = (4 * hi + lo) * vs + vz
                Vc[:, pos] = (4 * hi + 1.5) * vs + vz
            else:
                V[:, pos] = hi * vs + vz
    return K, V, (Vc if bits == 4 else None), Vs, hist


def attention64(cache, cell_index, q, scale, tau):
    """float64 DESIGN.md §7 for every row; q [B, Hq, D] -> [B, Hq, D] float64, plus the weights."""
    B, Hq, D = q.shape
    H = cache.kv_heads
    g = Hq // H
    outs, weights = [], []
    for b in range(B):
        K, V, Vc, _, hist = effective_kv(cache, cell_index, b)
        qq = q[b].double().view(H, g, D)
        s = torch.einsum("hgd,hnd->hgn", qq, K) * scale  # [H, g, n]
        if Vc is not None and math.isfinite(tau):
            sink_max = s[..., : min(K.shape[1], SINK)].amax(-1)  # [H, g]
            cold = torch.zeros(H, K.shape[1], dtype=torch.bool)
            for pos in torch.nonzero(hist).flatten().tolist():
                p = (pos - SINK) // PAGE
                lo, hi_ = SINK + PAGE * p, SINK + PAGE * (p + 1)
                m_ref = torch.maximum(sink_max, s[..., lo:hi_].amax(-1))  # [H, g]
                cold[:, pos] = (s[..., pos] < m_ref - tau * math.log(2)).all(dim=-1)
            V = torch.where(cold[..., None], Vc, V)
        a = torch.softmax(s, dim=-1)
        outs.append(torch.einsum("hgn,hnd->hgd", a, V).reshape(Hq, D))
        weights.append(a)
    return torch.stack(outs), weights
