"""Rows as request slots (loopkv/cache/slots.py): requests joining, decoding together, adding a prompt chunk,
finishing and being replaced, each equal to the same request run alone through its own LoopKVCache.

The reference for a request is a batch-1 cache driven through the public attention path (prefill, continuation,
decode) with the same K/V; the slot path shares one cache, a shared page pool and fixed-shape steps over every row.
"""

import pytest
import torch

import loopkv
from loopkv.cache import slots
from loopkv.cache.attention import loopkv_attention
from tests.cache.driver import decode, prefill, tiny_config
from tests.tolerances import ATTN_FP32_ATOL, ATTN_FP32_RTOL

H, HQ, SCALE = 2, 4, 0.3
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


class Request:
    """A request's K/V/queries per cell, generated up front; ``alone`` replays it through its own cache."""

    def __init__(self, cells, prompt, chunks, new, seed, device, head_dim):
        g = torch.Generator().manual_seed(seed)
        self.pieces = [prompt, *chunks] + [1] * new  # tokens added per engine step
        total = sum(self.pieces)
        self.q = (torch.randn(cells, HQ, total, head_dim, generator=g) * 2).to(device)
        self.k = torch.randn(cells, H, total, head_dim, generator=g).to(device)
        self.v = torch.randn(cells, H, total, head_dim, generator=g).to(device)
        self.device, self.head_dim = device, head_dim
        self.done = 0  # pieces fed
        self.outs = [[] for _ in range(cells)]

    def piece(self, cell):
        start = sum(self.pieces[:self.done])
        sl = slice(start, start + self.pieces[self.done])
        return self.q[cell, :, sl], self.k[cell, :, sl], self.v[cell, :, sl]

    def alone(self, plan, cells):
        cache = loopkv.LoopKVCache(plan, config=tiny_config(loops=plan.loops, layers=plan.layers,
                                                           head_dim=self.head_dim),
                                   max_batch_size=1, max_cache_len=800, device=self.device)
        outs = [[] for _ in range(cells)]
        start = 0
        for n in self.pieces:
            sl = slice(start, start + n)
            for cell in range(cells):
                q, k, v = self.q[cell:cell + 1, :, sl], self.k[cell:cell + 1, :, sl], self.v[cell:cell + 1, :, sl]
                if start == 0:
                    out = prefill(cache, cell, q, k, v, torch.ones(1, n, dtype=torch.long, device=q.device),
                                  SCALE)[0]
                elif n > 1:
                    hk, hv = cache.update(k, v, cell)
                    out = loopkv_attention(None, q, hk, hv, None, scaling=SCALE)[0][0]
                else:
                    out = decode(cache, cell, q, k, v, SCALE)
                outs[cell].append(out)
            start += n
        return [torch.cat(o) for o in outs]


def _prompt_attention(q, k, v):
    from loopkv.cache.attention import _prompt_attention as exact

    return exact(q[None], k[None], v[None], torch.zeros(1, dtype=torch.long, device=q.device), SCALE)[0]


def _step(cache, cells, active):
    """One engine step: ``active`` maps slot -> request; each request adds its next piece."""
    decoding = [s for s, r in active.items() if r.pieces[r.done] == 1 and r.done > 0]
    held = {s: sum(r.pieces[:r.done]) for s, r in active.items()}
    assert held == {s: int(cache.storage(0).lengths[s]) for s in active}  # what the engine's count would be
    cache.reserve({s: held[s] + r.pieces[r.done] for s, r in active.items()})
    packed = decoding[::-1]
    step = slots.DecodeSteps(rows=cache.max_batch_size, max_tokens=len(packed), cells=cells,
                             device=cache.device).fill([(s, i) for i, s in enumerate(packed)], tokens=len(packed))
    for cell in range(cells):
        for s, r in active.items():
            q, k, v = r.piece(cell)
            if r.done == 0:
                slots.prefill(cache, cell, s, k, v)
                r.outs[cell].append(_prompt_attention(q, k, v))
            elif s not in decoding:
                r.outs[cell].append(slots.extend(cache, cell, s, held[s], q, k, v, scale=SCALE))
        if decoding:  # packed as an engine packs them: one token per decoding slot, in reverse slot order
            q = torch.stack([active[s].piece(cell)[0][:, 0] for s in packed])
            k = torch.stack([active[s].piece(cell)[1][:, 0] for s in packed])
            v = torch.stack([active[s].piece(cell)[2][:, 0] for s in packed])
            out = slots.decode(cache, cell, step, q, k, v, scale=SCALE)
            for i, s in enumerate(packed):
                active[s].outs[cell].append(out[i:i + 1])
    if decoding:
        slots.end_step(cache, step)
    for r in active.values():
        r.done += 1


@pytest.mark.parametrize(("device", "head_dim"), [
    ("cpu", 32), pytest.param("cuda", 128, marks=[pytest.mark.gpu, CUDA]),  # CUDA: the Triton kernels
])
@pytest.mark.parametrize("per_loop", [["int4"], ["share", "int4"]])
def test_requests_sharing_a_pool_equal_each_request_alone(per_loop, device, head_dim):
    plan = loopkv.Plan.from_loops(loops=len(per_loop), layers=1, per_loop=per_loop, tau=14.0)
    cells = plan.loops
    cache = loopkv.LoopKVCache(plan, config=tiny_config(loops=plan.loops, layers=1, head_dim=head_dim),
                               max_batch_size=3, max_cache_len=800, device=device, pool_pages=20)
    dims = dict(device=device, head_dim=head_dim)
    a = Request(cells, 330, [], 40, seed=1, **dims)  # crosses a page boundary while decoding
    b = Request(cells, 40, [], 12, seed=2, **dims)  # short; finishes and leaves its slot
    c = Request(cells, 100, [200], 30, seed=3, **dims)  # a prompt in two chunks
    d = Request(cells, 300, [], 25, seed=4, **dims)  # joins in b's slot
    schedule = {0: {0: a}, 3: {1: b}, 5: {2: c}, 30: {1: d}}
    active, finished = {}, []
    for step in range(80):
        for s, r in list(active.items()):
            if r.done == len(r.pieces):
                finished.append(r)
                cache.release([s])
                del active[s]
        assert not set(schedule.get(step, {})) & set(active)  # a slot is free before it is given out
        active.update(schedule.get(step, {}))
        if not active:
            break
        _step(cache, cells, active)
    assert sorted(map(id, finished)) == sorted(map(id, [a, b, c, d]))
    for r in (a, b, c, d):
        want = r.alone(plan, cells)
        for cell in range(cells):
            torch.testing.assert_close(torch.cat(r.outs[cell]), want[cell], atol=ATTN_FP32_ATOL,
                                       rtol=ATTN_FP32_RTOL)
    assert cache.pages_in_use == 0  # every request's pages came back


@pytest.mark.parametrize(("device", "head_dim"), [
    ("cpu", 32), pytest.param("cuda", 128, marks=[pytest.mark.gpu, CUDA]),  # CUDA: recorded by the same torch ops
])
def test_a_decode_step_finds_each_rows_uncodable_token_per_cell(device, head_dim):
    """Rows 1 and 3 of 5 decode, packed in reverse; their K/V carry a NaN, an inf, a value beyond fp16 (70000,
    -65536) or only codable ones (65504 itself), in different cells. What the step
    records (``DecodeStep.largest``) names exactly the (row, cell) pairs a brute-force float64 check finds, among the
    cells that store INT4/INT2 pages (a bf16 or share cell's values are never encoded); row 0, which does not decode
    (its packed token 0 would be row 3's), is never named."""
    plan = loopkv.Plan.from_loops(loops=4, layers=1, per_loop=["share", "int2", "bf16", "int4"], tau=14.0)
    cells = plan.loops
    cache = loopkv.LoopKVCache(plan, config=tiny_config(loops=cells, layers=1, head_dim=head_dim),
                               max_batch_size=5, max_cache_len=800, device=device, pool_pages=20)
    step = slots.DecodeSteps(rows=5, max_tokens=2, cells=cells, device=device).fill([(3, 0), (1, 1)], tokens=2)
    g = torch.Generator().manual_seed(0)
    poison = {(0, 0, "k"): float("nan"), (1, 0, "v"): float("inf"), (1, 1, "k"): 70000.0, (3, 1, "v"): -65536.0,
              (3, 0, "v"): 65504.0, (2, 1, "k"): float("nan")}  # (cell, packed token, k|v): value
    expected = {}
    for cell in range(cells):
        q = torch.randn(2, HQ, head_dim, generator=g)
        kv = {"k": torch.randn(2, H, head_dim, generator=g), "v": torch.randn(2, H, head_dim, generator=g)}
        for (c, token, which), value in poison.items():
            if c == cell:
                kv[which][token, 1, 5] = value
        for token, row in ((0, 3), (1, 1)):
            values = torch.cat([x[token].double().flatten() for x in kv.values()])
            bad = bool((~torch.isfinite(values) | (values.abs() > 65504)).any())
            if bad and plan.options[cell] in ("int4", "int2"):
                expected.setdefault(row, []).append(cell)
        slots.decode(cache, cell, step, q.to(device), kv["k"].to(device), kv["v"].to(device), scale=SCALE)
    assert expected == {3: [1], 1: [1, 3]}  # the poison above, seen through the plan
    assert slots.uncodable_rows(step.largest.cpu(), [0, 1, 2, 3, 4]) == expected
    assert slots.uncodable_rows(step.largest.cpu(), [1]) == {1: [1, 3]}
