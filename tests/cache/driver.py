"""Drive a LoopKVCache cell by cell without a model, and recompute attention in float64 from what it stores.

The float64 recomputation is independent of ``cell_attention_reference``: it rebuilds each row's
effective K and V token by token from the stored sink, ring and pool (bit unpacking from the codec is
the only shared piece, and the codec has its own exact tests), restates the cold-token rule (paper §3.3)
independently in float64, and takes one softmax.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch
from transformers.cache_utils import DynamicCache

from loopkv.cache.attention import loopkv_attention
from loopkv.format import PAGE, RING, SINK, n_pages
from loopkv.ops import codec


def tiny_config(*, loops=2, layers=2, heads=4, kv_heads=2, head_dim=32, dtype=torch.float32):
    return SimpleNamespace(total_ut_steps=loops, num_hidden_layers=layers, num_attention_heads=heads,
                           num_key_value_heads=kv_heads, head_dim=head_dim, hidden_size=heads * head_dim,
                           dtype=dtype)


def tiny_ouro(*, loops=2, layers=2, head_dim=32, device="cpu"):
    """A tiny random Ouro (vocab 97, hidden 64, 4 query heads over 2 KV heads), fp32, eval mode, seed 0."""
    from loopkv.models.ouro import OuroConfig, OuroForCausalLM

    torch.manual_seed(0)
    cfg = OuroConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim, total_ut_steps=loops,
                     max_position_embeddings=4096, rope_theta=10000.0)
    return OuroForCausalLM(cfg).to(device).eval()


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


def write_token(cache, cell_index, k, v):
    """Write one token per row (k, v [B, H, 1, D]) into a cell the way decode does (its read writes it; the
    answer to a zero query is dropped)."""
    q = torch.zeros(k.shape[0], cache.q_heads, 1, k.shape[3], dtype=k.dtype)
    decode(cache, cell_index, q, k, v, 1.0)


def effective_kv(cache, cell_index, row):
    """float64 (K [H, n, D], V_full [H, n, D], V_cold [H, n, D] or None, V scale [H, n, D/G], is_hist [n])."""
    st = cache.storage(cell_index)
    n = int(st.lengths[row])
    npg = n_pages(n)
    H, D = cache.kv_heads, cache.head_dim
    bits = st.read_bits
    ns = min(n, SINK)
    ws = SINK + PAGE * npg
    slots = (torch.arange(ws, n) - SINK) % RING if n > ws else torch.arange(0)
    Ks, Vs_ = [st.sink_k[row, :, :ns].double()], [st.sink_v[row, :, :ns].double()]
    Kw, Vw = st.win_k[row, :, slots].double(), st.win_v[row, :, slots].double()
    vscale = torch.zeros(H, n, D // codec.GROUP, dtype=torch.float64)
    Vc = None
    if npg:
        phys = st.page_table[row, :npg].long()
        if bits == 16:
            Kh, Vh = st.k_pages[phys].double(), st.v_hi[phys].double()  # [npg, H, PAGE, D]
            Vch = None
        else:
            kc = codec.unpack(st.k_pages[phys], bits).double()
            Kh = kc * st.k_scale[phys].double()[:, :, None] + st.k_zero[phys].double()[:, :, None]
            vsc = st.v_scale[phys].double()  # [npg, H, PAGE, D/G]
            vs = vsc.repeat_interleave(codec.GROUP, -1)
            vz = st.v_zero[phys].double().repeat_interleave(codec.GROUP, -1)
            hi = codec.unpack(st.v_hi[phys], 2).double()
            if bits == 4:
                lo = codec.unpack(st.v_lo[phys], 2).double()
                Vh, Vch = (4 * hi + lo) * vs + vz, (4 * hi + 1.5) * vs + vz
            else:
                Vh, Vch = hi * vs + vz, None
            vscale[:, SINK:ws] = vsc.permute(1, 0, 2, 3).reshape(H, npg * PAGE, -1)

        def flat(t):
            return t.permute(1, 0, 2, 3).reshape(H, npg * PAGE, D)

        Ks.append(flat(Kh))
        Vs_.append(flat(Vh))
        if Vch is not None:
            Vc = torch.cat([Vs_[0], flat(Vch), Vw], dim=1)
    K = torch.cat(Ks + [Kw], dim=1)
    V = torch.cat(Vs_ + [Vw], dim=1)
    if bits == 4 and Vc is None:
        Vc = V.clone()
    hist = torch.zeros(n, dtype=torch.bool)
    hist[SINK:ws] = True
    return K, V, (Vc if bits == 4 else None), vscale, hist


def cold_tokens(s, hist, tau):
    """The cold rule (paper §3.3) in float64. s [H, g, n] scores; -> bool [H, n] (cold for every query head)."""
    H, _, n = s.shape
    cold = torch.zeros(H, n, dtype=torch.bool)
    if not math.isfinite(tau) or not hist.any():
        return cold
    sink_max = s[..., : min(n, SINK)].amax(-1)  # [H, g]
    ws = int(torch.nonzero(hist).max()) + 1
    npg = (ws - SINK) // PAGE
    pages = s[..., SINK:ws].unflatten(-1, (npg, PAGE))  # [H, g, npg, PAGE]
    m_ref = torch.maximum(sink_max[..., None], pages.amax(-1))  # [H, g, npg]
    cold_q = pages < (m_ref - tau * math.log(2))[..., None]
    cold[:, SINK:ws] = cold_q.all(dim=1).flatten(1)
    return cold


def attention64(cache, cell_index, q, scale, tau):
    """The float64 read (paper §3.3-3.4) for every row; q [B, Hq, D] -> [B, Hq, D] float64, plus the weights."""
    B, Hq, D = q.shape
    H = cache.kv_heads
    g = Hq // H
    outs, weights = [], []
    for b in range(B):
        K, V, Vc, _, hist = effective_kv(cache, cell_index, b)
        qq = q[b].double().view(H, g, D)
        s = torch.einsum("hgd,hnd->hgn", qq, K) * scale  # [H, g, n]
        if Vc is not None:
            V = torch.where(cold_tokens(s, hist, tau)[..., None], Vc, V)
        a = torch.softmax(s, dim=-1)
        outs.append(torch.einsum("hgn,hnd->hgd", a, V).reshape(Hq, D))
        weights.append(a)
    return torch.stack(outs), weights


class CodecHistoryCache(DynamicCache):
    """transformers' dense cache, except that at the indices of ``bits`` a decode token reads its history pages as
    the codec's round trip (K per channel over the page, V per token in groups of 32 channels): the reference of a
    quantized plan through ``generate`` (batch 1; prefill attends exactly). Written from the storage layout in
    docs/design.md, not from loopkv's cache: page ``p`` holds positions ``32 + 32p .. 32 + 32p + 31`` and a token
    whose row then holds ``n`` tokens reads pages ``p < (n - 288) // 32``.

    ``bits``: cache index -> the bits of its pages; ``sources``: a ``share`` index -> the index whose pages it reads
    (its own sink and window); ``config``: the model config, for a model whose dense cache needs it (Dory's sliding
    layers)."""

    def __init__(self, bits: dict[int, int], sources: dict[int, int] | None = None, config=None) -> None:
        super().__init__(**({} if config is None else {"config": config}))
        self.bits, self.sources = bits, sources or {}

    def update(self, key, value, layer_idx, *args, **kwargs):
        k, v = super().update(key, value, layer_idx, *args, **kwargs)  # [1, H, n, D]
        pages = max(0, (k.shape[2] - 288) // 32)  # the layout's numbers, stated here (not loopkv.format's)
        if layer_idx not in self.bits or key.shape[2] != 1 or not pages:
            return k, v
        source = self.sources.get(layer_idx, layer_idx)
        k_src, v_src = self.layers[source].keys, self.layers[source].values
        k, v = k.clone(), v.clone()
        for p in range(pages):
            at = slice(32 + 32 * p, 32 + 32 * (p + 1))
            k[:, :, at] = codec.dequantize_k(*codec.quantize_k(k_src[:, :, at], self.bits[source]))
            v[:, :, at] = codec.dequantize_v(*codec.quantize_v(v_src[:, :, at], self.bits[source]))
        return k, v
