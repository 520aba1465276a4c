"""loopkv's cells as vLLM schedules them (``loopkv/vllm/cells.py``), against ``LoopKVCache`` (no vLLM needed).

A simulated vLLM engine (a block allocator handing out shuffled block ids, 32 tokens per block, packed batches of
prompts, chunks and decode tokens, requests pausing, finishing and being replaced) drives one INT4 cell through
``plan_step`` + ``forward_cell``; every request also has its own ``LoopKVCache`` fed the same q/k/v through the
transformers-facing path (prompt: prefill + exact attention; decode; later chunk: the continuation). The outputs must
agree step by step: the served semantics are the same by design, while the storage differs (slots of exact buffers,
pages in vLLM's blocks laid out field after field, the slot's page table from the block table, pages quantized at
the decode token that completes them)."""

import math
import os
import random

import pytest
import torch

from loopkv.cache.attention import loopkv_attention
from loopkv.cache.loop_cache import LoopKVCache
from loopkv.format import PAGE, POOL_FIELDS, RING, SINK, n_pages, page_bytes, pool_field_shapes, stored_pages
from loopkv.models.ouro import OuroConfig
from loopkv.planning.plan import Plan
from loopkv.vllm.cells import (
    CellExact,
    SlotMap,
    StepState,
    cell_region,
    forward_cell,
    idle_length,
    plan_step,
    pool_views,
)
from loopkv.vllm.layout import block_bytes, kv_layout, pool_refs

H, HQ, D = 2, 4, 32
CONFIG = OuroConfig(num_hidden_layers=1, total_ut_steps=1, hidden_size=HQ * D, num_attention_heads=HQ,
                    num_key_value_heads=H, head_dim=D, intermediate_size=64, vocab_size=64)
SCALE = D**-0.5
MAX_LEN = 1024


def test_pool_views_tile_the_blocks():
    blocks = 5
    kv = torch.zeros(blocks, page_bytes(4, H, D), dtype=torch.uint8)
    views = pool_views(kv, 4, H, D)
    shapes = pool_field_shapes(4, blocks, H, D)
    ends = []
    for name, view in zip(POOL_FIELDS, views, strict=True):
        if shapes[name] == (0,):
            assert view.numel() == 0
            continue
        assert tuple(view.shape) == shapes[name]
        assert view.is_contiguous()
        start = view.data_ptr() - kv.data_ptr()
        ends.append((start, start + view.numel() * view.element_size()))
    assert ends[0][0] == 0
    assert ends[-1][1] == kv.numel()
    assert all(a[1] == b[0] for a, b in zip(ends, ends[1:], strict=False))  # back to back, no overlap
    with pytest.raises(ValueError, match="page of 2 heads x 32 has"):
        pool_views(torch.zeros(blocks, 7, dtype=torch.uint8), 4, H, D)


def test_slot_map():
    m = SlotMap(2)
    assert m.assign([5, 9], [0, 0], [10, 3]) == [0, 1]
    assert m.assign([9], [3], [4]) == [1]  # request 5 not scheduled: keeps its slot
    assert m.assign([5, 9], [10, 4], [11, 5]) == [0, 1]
    assert m.assign([7, 9], [0, 5], [2, 6]) == [0, 1]  # a new request takes the slot request 9 does not use
    with pytest.raises(RuntimeError, match="continues at position 11.*are gone"):
        m.assign([5], [11], [12])
    with pytest.raises(RuntimeError, match="hold 6 tokens"):
        m.assign([9], [8], [9])
    with pytest.raises(RuntimeError, match="share a first block.*prefix caching off"):
        m.assign([7, 7], [2, 2], [3, 3])
    with pytest.raises(RuntimeError, match="more requests in one step than loopkv's 2 exact slots"):
        SlotMap(2).assign([1, 2, 3], [0, 0, 0], [1, 1, 1])


class Engine:
    """A toy vLLM: block ids handed out shuffled (0 is the null block), a block table per step."""

    def __init__(self, num_blocks: int, seed: int = 0):
        self.free = list(range(1, num_blocks))
        random.Random(seed).shuffle(self.free)
        self.blocks: dict[str, list[int]] = {}
        self.held: dict[str, int] = {}

    def schedule(self, entry: list[tuple[str, int]]):
        """``entry``: (request, new tokens) in batch order -> (query_start_loc, seq_lens, first block ids, block
        table [reqs, blocks + 3], each request's (first token, end token, tokens held before))."""
        qsl, seq_lens, first, ranges = [0], [], [], {}
        for name, n in entry:
            held = self.held.setdefault(name, 0)
            blocks = self.blocks.setdefault(name, [])
            while len(blocks) * PAGE < held + n:
                blocks.append(self.free.pop())
            ranges[name] = (qsl[-1], qsl[-1] + n, held)
            qsl.append(qsl[-1] + n)
            seq_lens.append(held + n)
            first.append(blocks[0])
            self.held[name] = held + n
        width = max(len(self.blocks[name]) for name, _ in entry)
        table = torch.zeros(len(entry), width + 3, dtype=torch.int32)  # vLLM's table is wider than needed
        for i, (name, _) in enumerate(entry):
            table[i, :len(self.blocks[name])] = torch.tensor(self.blocks[name])
        return qsl, seq_lens, first, table, ranges

    def finish(self, name: str):
        self.free.extend(self.blocks.pop(name))
        del self.held[name]


# (request, tokens) per step: prompts past a page boundary, decodes across the quantize lengths 319 and 351, a
# chunked prompt (chunk on an empty slot, then a continuation on a used one), a paused request, a finished request
# whose slot and blocks go to a new one
SCENARIO = ([[("a", 300), ("b", 40)]] + [[("a", 1), ("b", 1)]] * 25  # a: 300 -> 325 (page 0 quantized at 319)
            + [[("c", 100), ("a", 1), ("b", 1)]]  # a chunked prompt's first chunk, mixed with decodes
            + [[("a", 1), ("c", 400)]]  # b paused; c's second chunk is a continuation
            + [[("b", 1), ("c", 1), ("a", 1)]] * 30  # a crosses 351; c decodes from 500
            + ["finish b"] + [[("d", 33), ("a", 1), ("c", 1)]]  # d takes b's slot (and its blocks)
            + [[("d", 1), ("c", 1)]] * 3)
SLOTS, NUM_BLOCKS, MAX_TOKENS = 3, 200, 512


def _reference(plan, config=CONFIG):
    return LoopKVCache(plan, config=config, max_batch_size=1, max_cache_len=MAX_LEN, dtype=torch.float32,
                       device="cpu")


def _ref_forward(cache, cell, q, k, v):
    """One request's tokens through LoopKVCache's transformers path: q [S, Hq, D], k, v [S, H, D] -> [S, Hq, D]."""
    handle, _ = cache.update(k.transpose(0, 1)[None], v.transpose(0, 1)[None], cell)
    out, _ = loopkv_attention(None, q.transpose(0, 1)[None], handle, handle, None, scaling=SCALE)
    return out[0]


def run_scenario(plan, forward, scenario=SCENARIO, held=None, config=CONFIG) -> tuple[Engine, dict]:
    """Drive ``forward(qsl, seq_lens, first_blocks, block_table, q, k, v, out)`` (every cell's step over the packed
    batch, cell after cell in flat order as vLLM's Ouro runs them: q, k, v, out [cells, tokens + 2, heads, D], two
    padding tokens past the step's) through ``scenario`` and check every request's outputs against its own
    LoopKVCache, fed the same cells in the same order; returns the engine and the references."""
    engine = Engine(NUM_BLOCKS)
    refs: dict[str, LoopKVCache] = {}
    gen = torch.Generator().manual_seed(0)
    cells = plan.loops * plan.layers
    for entry in scenario:
        if isinstance(entry, str):
            name = entry.split()[1]
            engine.finish(name)
            del refs[name]
            continue
        qsl, seq_lens, first, table, ranges = engine.schedule(entry)
        T = qsl[-1]
        q = torch.randn(cells, T + 2, HQ, D, generator=gen)  # vLLM may pass padded tokens past num_actual_tokens
        k = torch.randn(cells, T + 2, H, D, generator=gen)
        v = torch.randn(cells, T + 2, H, D, generator=gen)
        out = torch.full((cells, T + 2, HQ, D), float("nan"))
        forward(qsl, seq_lens, first, table, q, k, v, out)
        for name, (begin, end, before) in ranges.items():
            if before == 0:
                refs[name] = _reference(plan, config)
            for c in range(cells):
                want = _ref_forward(refs[name], c, q[c, begin:end], k[c, begin:end], v[c, begin:end])
                torch.testing.assert_close(out[c, begin:end], want, atol=2e-5, rtol=1e-5,
                                           msg=lambda m, n=name, h=before, c=c: f"request {n} at {h}, cell {c}: {m}")
        assert torch.isnan(out[:, T:]).all()  # padding untouched
    assert engine.held == (held or {"a": 358, "c": 534, "d": 36})
    return engine, refs


def check_storage(engine, refs, slot_map, cell, pool, index=0):
    """Cell ``index``'s storage holds what request a's LoopKVCache holds: sink, live window slots, pages in its
    blocks."""
    a_slot = slot_map._of[engine.blocks["a"][0]]
    st = refs["a"].storage(index)
    n = engine.held["a"]
    assert slot_map.held[a_slot] == int(st.lengths[0]) == n
    live = (torch.arange(SINK + PAGE * n_pages(n), n) - SINK) % RING  # ring slots of the window
    for mine, ref in ((cell.win_k, st.win_k), (cell.win_v, st.win_v)):
        assert torch.equal(mine[a_slot][:, live], ref[0][:, live])
    assert torch.equal(cell.sink_k[a_slot], st.sink_k[0])
    assert torch.equal(cell.sink_v[a_slot], st.sink_v[0])
    for p in range(stored_pages(n)):  # pages quantized at 319 (and 351)
        block = engine.blocks["a"][p + 1]
        for field, mine, ref in zip(POOL_FIELDS, pool, st.pool(), strict=True):
            if mine.numel():
                assert torch.equal(mine[block], ref[int(st.page_table[0, p])]), (p, field)


@pytest.mark.parametrize("tau", [math.inf, 2.0])
def test_scheduled_steps_equal_loopkv_cache(tau):
    plan = Plan.from_config(CONFIG, option="int4", tau=tau)
    state = StepState(SLOTS, math.ceil(MAX_LEN / PAGE) - 1, MAX_TOKENS, device="cpu")
    cell = CellExact.allocate(SLOTS, H, D, dtype=torch.float32)
    pool = pool_views(torch.zeros(NUM_BLOCKS, page_bytes(4, H, D), dtype=torch.uint8), 4, H, D)

    def forward(qsl, seq_lens, first, table, q, k, v, out):
        step = plan_step(state, query_start_loc=qsl, seq_lens=seq_lens, first_blocks=first, block_table=table)
        T = step.num_tokens
        forward_cell(cell, pool, step, q[0, :T], k[0, :T], v[0, :T], out[0, :T], bits=4, tau=tau, scale=SCALE)

    engine, refs = run_scenario(plan, forward)
    check_storage(engine, refs, state.slot_map, cell, pool)


# 3 loops x 2 layers: every option in one plan. LoopKV-R's kind (int4, int2 and bf16 cells, no shares) and LoopKV-M's
# (shares too: a share cell's source is the final loop's cell at its layer, a bf16 one and an int4 one here)
CONFIG3 = OuroConfig(num_hidden_layers=2, total_ut_steps=3, hidden_size=HQ * D, num_attention_heads=HQ,
                     num_key_value_heads=H, head_dim=D, intermediate_size=64, vocab_size=64)
MIXED = [["int2", "int4"], ["bf16", "int2"], ["int4", "bf16"]]
SHARED = [["share", "int2"], ["int4", "share"], ["bf16", "int4"]]
# SCENARIO shortened for 6 cells: a crosses 319, c's chunks 100 + 250 (a share cell continues by at most WINDOW
# tokens in one forward; 100 -> 350 crosses page 0's quantize length, a page the share cell of layer 0 reads before its
# bf16 source has written it) and c's decodes cross 351, d takes b's slot
MIXED_SCENARIO = ([[("a", 310), ("b", 40)]] + [[("a", 1), ("b", 1)]] * 10 + [[("c", 100), ("a", 1), ("b", 1)]]
                  + [[("a", 1), ("c", 250)]] + [[("b", 1), ("c", 1), ("a", 1)]] * 4
                  + ["finish b"] + [[("d", 33), ("a", 1), ("c", 1)]] + [[("d", 1), ("c", 1)]] * 2)


class PlanCells:
    """Every cell of a plan as the backend serves it: one KV tensor of ``NUM_BLOCKS`` blocks of the plan's bytes, each
    cell's pool its region (a share cell: its source's), one ``CellExact`` per cell, one step plan for all."""

    def __init__(self, plan, config=CONFIG3):
        self.layout = kv_layout(plan, config, dtype_bytes=4)  # float32 exact cells
        self.refs = pool_refs(self.layout)
        self.kv = torch.zeros(NUM_BLOCKS, block_bytes(self.layout), dtype=torch.uint8)
        self.exact = {c.layer_name: CellExact.allocate(SLOTS, H, D, dtype=torch.float32) for c in self.layout}
        self.state = StepState(SLOTS, math.ceil(MAX_LEN / PAGE) - 1, MAX_TOKENS, device="cpu")
        self.taus = [plan.tau_of(c.cell) for c in self.layout]
        self.steps = []

    def pool(self, name):
        ref = self.refs[name]
        return pool_views(cell_region(self.kv, ref.offset, ref.size), ref.bits, H, D, dtype=torch.float32)

    def forward(self, qsl, seq_lens, first, table, q, k, v, out, num_tokens=None):
        step = plan_step(self.state, query_start_loc=qsl, seq_lens=seq_lens, first_blocks=first, block_table=table,
                         num_tokens=num_tokens)
        self.steps.append(step)
        T = step.num_tokens
        for i, c in enumerate(self.layout):
            ref = self.refs[c.layer_name]
            source = None if ref.owner == c.layer_name else self.exact[ref.owner]
            forward_cell(self.exact[c.layer_name], self.pool(c.layer_name), step, q[i, :T], k[i, :T], v[i, :T],
                         out[i, :T], bits=ref.bits, tau=self.taus[i], scale=SCALE, name=c.layer_name, source=source)


@pytest.mark.parametrize("grid", [pytest.param(MIXED, marks=pytest.mark.slow), SHARED],
                         ids=["int4-int2-bf16", "with-shares"])  # SHARED stores every option too
def test_mixed_plan_steps_equal_loopkv_cache(grid):
    plan = Plan.from_grid(grid, kv_heads=H, head_dim=D, tau=[2.0, math.inf, 3.0])
    cells = PlanCells(plan)
    ends = [0] + [end for _, end in sorted({(r.offset, r.offset + r.size) for r in cells.refs.values()})]
    starts = sorted({r.offset for r in cells.refs.values()}) + [cells.kv.shape[1]]
    assert starts == ends  # the storing cells' pools tile the plan's block, back to back
    engine, refs = run_scenario(plan, cells.forward, MIXED_SCENARIO, {"a": 327, "c": 357, "d": 35}, CONFIG3)
    for i, c in enumerate(cells.layout):
        if c.stores:
            check_storage(engine, refs, cells.state.slot_map, cells.exact[c.layer_name], cells.pool(c.layer_name), i)


def test_a_share_cell_refuses_a_chunk_past_its_window():
    plan = Plan.from_grid(SHARED, kv_heads=H, head_dim=D)
    cells = PlanCells(plan)
    scenario = [[("a", 40)], [("a", 300)]]
    # 40 + 300: the share cell's queries past 319 would read page 0, which its source writes after it (279 fit)
    with pytest.raises(ValueError, match="layers.0.* share cell.* holds 40 tokens may add at most 279.*scheduled 300"):
        run_scenario(plan, cells.forward, scenario, {"a": 340}, CONFIG3)


def test_dummy_rows_get_no_slot_and_zeros():
    # vLLM's dummy runs: block table rows of zeros (the null block), and padded requests without tokens
    state = StepState(2, 4, 8, device="cpu")
    cell = CellExact.allocate(2, H, D, dtype=torch.float32)
    pool = pool_views(torch.zeros(8, page_bytes(4, H, D), dtype=torch.uint8), 4, H, D)
    table = torch.tensor([[0, 0, 0], [0, 0, 0], [5, 6, 0], [0, 0, 0]], dtype=torch.int32)
    step = plan_step(state, query_start_loc=[0, 3, 4, 6, 6], seq_lens=[3, 1, 2, 0], first_blocks=[0, 0, 5, 0],
                     block_table=table)
    assert step.dummy == ((0, 3), (3, 4))
    assert step.decode is None
    assert [r.slot for r in step.prompts] == [0]
    assert state.slot_map.held == [2, 0]
    assert state.page_table[0].tolist() == [6, 0, 0, 0]
    q, k, v = torch.randn(6, HQ, D), torch.randn(6, H, D), torch.randn(6, H, D)
    out = torch.full((6, HQ, D), float("nan"))
    forward_cell(cell, pool, step, q, k, v, out, bits=4, tau=math.inf, scale=SCALE)
    assert not out[:4].any()
    assert torch.isfinite(out[4:]).all()
    assert torch.equal(cell.sink_k[0, :, :2], k[4:].transpose(0, 1))
    assert not cell.sink_k[1].any()


CAPTURE_SIZES = (1, 2, 4, 8)
# single-token steps across page 0's quantize length (a: 316 -> 319), a one-token prompt (e) among decodes, paused
# requests (b, then a at 324 tokens: read at its idle length), a mixed step (d's prompt), the slot of a finished
# request reused
PADDED_SCENARIO = ([[("a", 316), ("b", 40)]] + [[("a", 1), ("b", 1)]] * 5 + [[("e", 1), ("a", 1), ("b", 1)]]
                   + [[("e", 1), ("a", 1)]] + ["finish b"] + [[("d", 33), ("a", 1)]] + [[("d", 1), ("e", 1)]]
                   + [[("d", 1), ("e", 1), ("a", 1)]])


def test_idle_length_is_the_shortest_with_the_next_positions_slot():
    def slot(p):  # where LoopKVCache keeps position p while it is exact: its sink or ring slot
        return ("sink", p) if p < SINK else ("ring", (p - SINK) % RING)

    for held in range(0, 1500):
        shortest = next(p for p in range(held + 1) if slot(p) == slot(held))
        assert idle_length(held) == shortest < SINK + RING


def padded(cells: PlanCells):
    """``cells.forward`` as vLLM runs a step of single tokens in a CUDA graph: padded to the next capture size with
    requests of no tokens (query_start_loc repeats the last value, seq_len 0, block table row 0) and tokens that belong
    to no request (their q, k, v random); steps with prompts unpadded."""
    gen = torch.Generator().manual_seed(1)

    def forward(qsl, seq_lens, first, table, q, k, v, out):
        reqs, T = len(seq_lens), qsl[-1]
        if T != reqs:
            return cells.forward(qsl, seq_lens, first, table, q, k, v, out)
        n = min(c for c in CAPTURE_SIZES if c >= reqs)
        pad = n - reqs

        def grow(x):
            return torch.cat([x[:, :T], torch.randn(x.shape[0], pad, *x.shape[2:], generator=gen)], dim=1)

        table = torch.cat([table, torch.zeros(pad, table.shape[1], dtype=table.dtype)])
        wide = torch.full((out.shape[0], n, *out.shape[2:]), float("nan"))
        cells.forward(qsl + [T] * pad, seq_lens + [0] * pad, first + [0] * pad, table, grow(q), grow(k), grow(v), wide,
                      num_tokens=n)
        assert not wide[:, T:].any()  # a padded token is answered with zeros
        out[:, :T] = wide[:, :T]

    return forward


def test_a_padded_decode_step_equals_the_unpadded_one():
    # vLLM pads a uniform decode batch to a CUDA graph's size: the padded steps give the real tokens the outputs of
    # the unpadded steps and leave the same cache state, and both equal LoopKVCache (run_scenario); the decode read's
    # inputs are the same tensors (addresses) in every step
    plan = Plan.from_grid(SHARED, kv_heads=H, head_dim=D, tau=[2.0, math.inf, 3.0])
    held = {"a": 325, "d": 35, "e": 4}
    outs = {}
    cells = {}
    for mode in ("unpadded", "padded"):
        cells[mode] = PlanCells(plan)
        forward = padded(cells[mode]) if mode == "padded" else cells[mode].forward
        seen = []

        def record(*args, _forward=forward, _seen=seen):
            _forward(*args)
            _seen.append(args[-1][:, :args[0][-1]].clone())  # the step's tokens' outputs

        run_scenario(plan, record, PADDED_SCENARIO, held, CONFIG3)
        outs[mode] = seen
    for a, b in zip(outs["unpadded"], outs["padded"], strict=True):
        assert torch.equal(a, b)
    one, two = cells["unpadded"], cells["padded"]
    assert torch.equal(one.kv, two.kv)
    for name in one.exact:
        for field in ("sink_k", "sink_v", "win_k", "win_v"):
            assert torch.equal(getattr(one.exact[name], field), getattr(two.exact[name], field)), (name, field)
    assert one.state.slot_map.held == two.state.slot_map.held
    assert torch.equal(one.state.page_table, two.state.page_table)
    decodes = [s.decode for s in two.steps if s.decode is not None]
    assert len(decodes) == 10
    assert {s.num_tokens for s in two.steps if not s.prompts} == {2, 4}
    for field in ("token", "decoding", "row", "decodes", "lengths", "held", "scratch", "index"):
        assert len({getattr(d, field).data_ptr() for d in decodes}) == 1, field


@pytest.mark.interpret
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1 (no CUDA)")
@pytest.mark.parametrize("bits", [4, 2])
def test_the_triton_launchers_take_the_decode_reads_views(monkeypatch, bits):
    # on CUDA, token_attention_ and advance_ are loopkv's Triton launchers; one given tensors it does not take runs
    # the PyTorch reference, which reads the device on the host (no CUDA graph). Under Triton's interpreter, the
    # launchers take forward_cell's views of a vLLM cell (the decode read over every slot, advance_ on one cell's
    # stacks) without falling back, and leave the references' state and outputs: 2 requests decoding across page 0's
    # quantize length (319), head_dim 64 (the launchers' smallest)
    from loopkv.ops import step_ops, triton_attention, triton_quant
    from tests.tolerances import ATTN_FP32_ATOL, ATTN_FP32_RTOL

    heads, q_heads, dim, slots = 1, 2, 64, 2
    gen = torch.Generator().manual_seed(0)
    table = torch.tensor([[3, 4, 5, 0], [6, 7, 0, 0]], dtype=torch.int32)
    prompt = [(torch.randn(n, q_heads, dim, generator=gen), torch.randn(n, heads, dim, generator=gen),
               torch.randn(n, heads, dim, generator=gen)) for n in (316, 40)]
    decodes = [(torch.randn(2, q_heads, dim, generator=gen), torch.randn(2, heads, dim, generator=gen),
                torch.randn(2, heads, dim, generator=gen)) for _ in range(5)]

    def serve():
        state = StepState(slots, 4, 8, device="cpu")
        cell = CellExact.allocate(slots, heads, dim, dtype=torch.float32)
        kv = torch.zeros(8, page_bytes(bits, heads, dim), dtype=torch.uint8)
        pool = pool_views(kv, bits, heads, dim, dtype=torch.float32)
        outs = []
        for i, (q, k, v) in enumerate(prompt):  # one prompt a step (references: not the point)
            step = plan_step(state, query_start_loc=[0, len(q)], seq_lens=[len(q)], first_blocks=[int(table[i, 0])],
                             block_table=table[i:i + 1])
            forward_cell(cell, pool, step, q, k, v, torch.empty_like(q), bits=bits, tau=math.inf, scale=dim**-0.5)
        for j, (q, k, v) in enumerate(decodes):
            step = plan_step(state, query_start_loc=[0, 1, 2], seq_lens=[317 + j, 41 + j], first_blocks=[3, 6],
                             block_table=table)
            with torch.no_grad():
                real = (torch.ops.loopkv.token_attention_, torch.ops.loopkv.advance_)
                if launchers:
                    monkeypatch.setattr(torch.ops.loopkv, "token_attention_", counted(triton_attention.token_attention))
                    monkeypatch.setattr(torch.ops.loopkv, "advance_", counted(triton_quant.advance))
                outs.append(forward_cell(cell, pool, step, q, k, v, torch.empty_like(q), bits=bits, tau=math.inf,
                                         scale=dim**-0.5))
                monkeypatch.setattr(torch.ops.loopkv, "token_attention_", real[0])
                monkeypatch.setattr(torch.ops.loopkv, "advance_", real[1])
        return cell, kv, outs

    calls = []

    def counted(launcher):
        def run(*args):
            calls.append(launcher.__name__)
            return launcher(*args)

        return run

    launchers = False
    want = serve()

    def refused(*args, **kwargs):
        raise AssertionError("a Triton launcher fell back to its PyTorch reference")

    launchers = True
    with monkeypatch.context() as m:
        m.setattr(step_ops, "advance_stacks_reference", refused)
        m.setattr(step_ops, "token_attention_reference", refused)
        got = serve()
    assert calls == ["token_attention", "advance"] * len(decodes)
    for a, b in zip(want[2], got[2], strict=True):
        torch.testing.assert_close(b, a, atol=ATTN_FP32_ATOL, rtol=ATTN_FP32_RTOL)
    for field in ("sink_k", "sink_v", "win_k", "win_v"):
        assert torch.equal(getattr(got[0], field), getattr(want[0], field)), field
    assert torch.equal(got[1], want[1])  # the same pool bytes
    k_pages = pool_views(got[1], bits, heads, dim, dtype=torch.float32)[0]
    assert k_pages[4].any()  # page 0 of request 0, quantized at 319 into its block 4
    assert not k_pages[5].any()


@pytest.mark.gpu
def test_a_decode_step_replays_as_one_cuda_graph():
    # what vLLM's full decode graphs do with a cell, without vLLM: the decode step (padded to 4 tokens) is captured
    # once from a dummy batch (block-table rows of zeros, as model runner V2 captures), after one eager run of it; each
    # later step only rewrites StepState's buffers through plan_step and replays. Outputs and cache state equal an
    # eager twin's (the same steps, forward_cell run eagerly) bit for bit, across page 0's quantize length
    from loopkv.ops.triton_register import register_triton_kernels

    assert register_triton_kernels()
    device, dtype, heads, q_heads, dim, slots, width = "cuda", torch.bfloat16, 2, 4, 128, 4, 4
    gen = torch.Generator().manual_seed(0)
    table = torch.tensor([[3, 4, 5, 0], [6, 7, 0, 0]], dtype=torch.int32, device=device)
    padded_table = torch.cat([table, torch.zeros(2, 4, dtype=torch.int32, device=device)])

    def qkv(n):
        return tuple(torch.randn(n, h, dim, generator=gen).to(device, dtype) for h in (q_heads, heads, heads))

    prompts = [qkv(316), qkv(40)]
    decodes = [qkv(width) for _ in range(6)]  # 2 real tokens, 2 padding
    dummy = dict(query_start_loc=list(range(width + 1)), seq_lens=[1] * width, first_blocks=[0] * width,
                 block_table=torch.zeros(width, 4, dtype=torch.int32, device=device), num_tokens=width)

    def serving():
        state = StepState(slots, 4, 512, device=device)
        cell = CellExact.allocate(slots, heads, dim, dtype=dtype, device=device)
        kv = torch.zeros(8, page_bytes(4, heads, dim), dtype=torch.uint8, device=device)
        return state, cell, kv, pool_views(kv, 4, heads, dim, dtype=dtype)

    def run(served, step, q, k, v, out):
        state, cell, kv, pool = served
        return forward_cell(cell, pool, step, q, k, v, out, bits=4, tau=math.inf, scale=dim**-0.5)

    eager, graphed = serving(), serving()
    static = [torch.zeros_like(x) for x in decodes[0]]
    static_out = torch.zeros(width, q_heads, dim, dtype=dtype, device=device)
    for i, (q, k, v) in enumerate(prompts):
        for served in (eager, graphed):
            step = plan_step(served[0], query_start_loc=[0, len(q)], seq_lens=[len(q)],
                             first_blocks=[int(table[i, 0])], block_table=table[i:i + 1])
            run(served, step, q, k, v, torch.empty_like(q))
    # the capture, from a dummy batch: one eager run on a side stream (Triton compiles, counters are allocated), then
    # the graph; the eager twin runs the same dummy step (it writes zeros where every slot's next token goes)
    run(eager, plan_step(eager[0], **dummy), *static, torch.empty_like(static_out))
    captured = plan_step(graphed[0], **dummy)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run(graphed, captured, *static, static_out)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run(graphed, captured, *static, static_out)
    for j, (q, k, v) in enumerate(decodes):
        real = dict(query_start_loc=[0, 1, 2, 2, 2], seq_lens=[317 + j, 41 + j, 0, 0], first_blocks=[3, 6, 0, 0],
                    block_table=padded_table, num_tokens=width)
        want = run(eager, plan_step(eager[0], **real), q, k, v, torch.empty_like(static_out))
        plan_step(graphed[0], **real)  # the builder's work before a replay: the same buffers, rewritten
        for dst, src in zip(static, (q, k, v), strict=True):
            dst.copy_(src)
        graph.replay()
        assert torch.equal(static_out[:2], want[:2]), j
        assert not static_out[2:].any()
    torch.cuda.synchronize()
    for field in ("sink_k", "sink_v", "win_k", "win_v"):
        assert torch.equal(getattr(graphed[1], field), getattr(eager[1], field)), field
    assert torch.equal(graphed[2], eager[2])
    k_pages = graphed[3][0]
    assert k_pages[4].any()  # page 0 of request 0, quantized at 319 into its block 4 inside the graph
