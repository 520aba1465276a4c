"""The decode benchmark's CPU-checkable parts: the paper's plan composition, the synthetic fill, the step,
the hot-fraction measurement against an independent count, and the table/plot script on committed results."""

import importlib.util
import json
import math
import os
import pathlib
import sys

import pytest
import torch

from loopkv.ops import codec

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _load(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def bench():
    return _load("bench_decode")


def test_paper_plans_have_the_papers_bytes_on_ouro_1p4b(bench):
    cfg = bench.ouro_1p4b_config()
    plans = bench.paper_plans(cfg.total_ut_steps, cfg.num_hidden_layers)
    got = {a: plans[a].bytes_per_token(cfg) for a in plans}
    assert (got["kivi4"].stored_kib, got["kivi4"].read_kib) == (240.0, 240.0)
    assert (got["loopkv-r"].stored_kib, got["loopkv-r"].read_kib) == (215.0, 215.0)  # paper Table 8
    assert (got["loopkv-m"].stored_kib, got["loopkv-m"].read_kib) == (155.0, 220.0)
    m = plans["loopkv-m"]
    assert m.options.count("share") == 26
    assert m.options.count("int2") == 20
    assert sum(o == "share" for o in m.grid()[2]) == 20  # 20 of the shared cells in loop 3 (0-based 2)
    r = plans["loopkv-r"]
    edge = set(range(6)) | set(range(18, 24))
    assert r.options.count("int2") == 25
    assert "share" not in r.options
    assert all(i in edge for row in r.grid() for i, o in enumerate(row) if o == "int2")
    assert math.isinf(plans["kivi4"].tau)
    assert plans["loopkv-m"].tau == 14.0


@pytest.fixture(scope="module")
def tiny(bench):
    """(config, model, plans) of the benchmark's CPU-sized Ouro, with the "loopkv" attention registered."""
    cfg = bench.smoke_config()
    torch.manual_seed(0)
    model = bench.OuroForCausalLM(cfg).eval()
    bench.register()
    return cfg, model, bench.paper_plans(cfg.total_ut_steps, cfg.num_hidden_layers)


@pytest.mark.parametrize("arm", ["bf16", "loopkv-m"])
def test_fill_and_one_step_equal_a_direct_forward(bench, tiny, arm):
    """The captured step (mask from the position, greedy token and position written back) decodes what a
    direct forward on an identically filled cache gives."""
    cfg, model, plans = tiny
    model.set_attn_implementation("sdpa" if arm == "bf16" else "loopkv")
    caches = []
    for _ in range(2):
        cache = bench.build_cache(arm, plans, cfg, batch=2, capacity=420, dtype=torch.float32, device="cpu")
        torch.manual_seed(3)
        bench.fill(cache, 400, k_scale=1.0)
        caches.append(cache)
    lengths = [int(layer.cumulative_length) if arm == "bf16" else int(layer.storage.lengths.max())
               for layer in caches[0].layers]
    assert lengths == [400] * len(caches[0].layers)
    tok, pos = torch.tensor([[7], [11]]), torch.full((2, 1), 400)
    mask = (torch.arange(420)[None, :] <= pos)[:, None, None, :] if arm == "bf16" else None
    with torch.no_grad():
        want = model(input_ids=tok, position_ids=pos, attention_mask=mask, past_key_values=caches[1]).logits
    bench.make_step(model, caches[0], tok, pos, dense=arm == "bf16", capacity=420)()
    assert pos.tolist() == [[401], [401]]
    assert torch.equal(tok, want[:, -1].argmax(-1, keepdim=True))


def test_hot_share_matches_a_token_by_token_count(bench, tiny):
    """The benchmark's hot share against a brute-force float64 count over every page, head and token."""
    cfg, model, plans = tiny
    model.set_attn_implementation("loopkv")
    torch.manual_seed(1)
    cache = bench.build_cache("kivi4v", plans, cfg, batch=1, capacity=460, dtype=torch.float32, device="cpu")
    bench.fill(cache, 450, k_scale=8.0)  # spread keys: about a third of the tokens hot, so the rule matters
    seen = bench.capture_queries(model, cache, torch.tensor([[5]]), torch.tensor([[450]]), cells=3)
    assert len(seen) == 3
    got = bench.hot_share(cache, seen)
    hot = total = 0
    for idx, q, scale in seen:
        st = cache.layers[idx].storage
        npg = (int(st.lengths[0]) - 288) // 32  # n_pages, written out
        for p in range(npg):
            pages = codec.PageCodes(*(t[int(st.page_table[0, p])] for t in st.pool()))
            k = codec.decode_k(pages, 4).double()  # [H, PAGE, D]
            for h in range(k.shape[0]):
                qh = q[0, h].double()
                s = (k[h] @ qh) * scale
                m_ref = max(float((st.sink_k[0, h].double() @ qh).max()) * scale, float(s.max()))
                hot += int((s >= m_ref - 14.0 * math.log(2.0)).sum())
                total += s.numel()
    assert total > 0
    assert 0.05 < hot / total < 0.95
    assert got == pytest.approx(hot / total, abs=1e-6)
    assert bench.hot_fraction(model, cache, torch.tensor([[5]]), torch.tensor([[451]])) is not None


def test_plot_decode_table_from_the_committed_results():
    plot = _load("plot_decode")
    result = json.loads((ROOT / "benchmarks/results/decode_2026-11-29.json").read_text())
    table = plot.table(result)
    rows = [line for line in table.splitlines() if line.startswith("| loopkv-m | 16384")]
    assert len(rows) == 1
    s = next(s for s in result["summary"] if s["arm"] == "loopkv-m" and s["ctx"] == 16384)
    assert f"{s['peak_tok_s']:.1f}" in rows[0]
    assert str(s["peak_batch"]) in rows[0]


def test_plot_merges_runs_and_refuses_a_point_given_twice():
    plot = _load("plot_decode")
    res = ROOT / "benchmarks/results"
    a = json.loads((res / "decode_2026-11-30_session4_16k.json").read_text())
    b = json.loads((res / "decode_2026-11-30_session4_8k.json").read_text())
    merged = plot.merge([a, b])
    assert len(merged["rows"]) == len(a["rows"]) + len(b["rows"])
    assert {(s["ctx"], s["arm"]) for s in merged["summary"]} == (
        {(s["ctx"], s["arm"]) for s in a["summary"]} | {(s["ctx"], s["arm"]) for s in b["summary"]})
    table = plot.table(merged)
    assert "| loopkv-m | 8192 |" in table
    assert "| loopkv-m | 16384 |" in table
    with pytest.raises(SystemExit, match="two JSONs"):
        plot.merge([a, a])


def test_compile_mode_resets_and_counts_graphs(bench):
    """``--capture compile`` compiles one step code object many times (arms, batches); each (context, arm)
    starts from a reset with a raised recompile limit (at the default 8 the 9th compile below fails), and each
    point records how many graphs were compiled since."""

    def make(n):
        x = torch.ones(n)

        def step():
            return (x * 2).sum()

        return step

    bench.prepare_compile(recompile_limit=64)
    cfg = torch._dynamo.config
    assert getattr(cfg, "recompile_limit", getattr(cfg, "cache_size_limit", None)) == 64
    assert bench.compiled_graphs() == 0
    for n in range(1, 11):  # ten shapes: more than Dynamo's default limit of 8 recompiles
        assert torch.compile(make(n), backend="eager", fullgraph=True, dynamic=False)() == 2 * n
    assert bench.compiled_graphs() == 10
    bench.prepare_compile()
    assert bench.compiled_graphs() == 0


def test_kernel_times_sums_gpu_kernels_by_role(bench):
    """The quantizer's share of a step: GPU kernel events summed per role, CPU events ignored."""
    from types import SimpleNamespace

    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU

    def ev(name, start, us, dev=cuda):
        return SimpleNamespace(name=name, device_type=dev,
                               time_range=SimpleNamespace(start=start, end=start + us, elapsed_us=lambda: us))

    events = [ev("_append_kernel", 0.0, 3.0), ev("_cell_attn_kernel", 3.0, 40.0), ev("_write_pages_kernel", 43.0, 7.0),
              ev("void at::native::elementwise_kernel<...>", 50.0, 50.0), ev("_append_kernel", 0.0, 999.0, cpu)]
    got = bench.kernel_times(events)
    assert got["gpu_kernels"] == 4
    assert got["gpu_us"] == 100.0
    assert (got["quantizer_us"], got["quantizer_share"]) == (10.0, 0.1)
    assert (got["attention_us"], got["attention_share"]) == (40.0, 0.4)
    assert got["idle_us"] == 0.0  # back to back
    assert bench.kernel_times([])["quantizer_share"] is None


def test_kernel_times_charges_idle_gaps_to_the_next_kernel(bench):
    """Idle time between consecutive GPU kernels (sorted by start), charged to the role of the kernel after it."""
    from types import SimpleNamespace

    cuda = torch.autograd.DeviceType.CUDA

    def ev(name, start, end):
        return SimpleNamespace(name=name, device_type=cuda,
                               time_range=SimpleNamespace(start=start, end=end, elapsed_us=lambda: end - start))

    events = [ev("_cell_attn_kernel", 30.0, 70.0), ev("rms_norm", 0.0, 10.0), ev("_append_kernel", 12.0, 15.0),
              ev("rope", 71.0, 80.0), ev("_append_kernel", 79.0, 82.0)]  # the last overlaps: no negative gap
    got = bench.kernel_times(events)
    assert got["gpu_us"] == 10.0 + 3.0 + 40.0 + 9.0 + 3.0
    assert got["idle_before_quantizer_us"] == 2.0  # 10 -> 12 (79 < 80: no gap)
    assert got["idle_before_attention_us"] == 15.0  # 15 -> 30
    assert got["idle_before_other_us"] == 1.0  # 70 -> 71
    assert got["idle_us"] == 18.0


def test_batches_for_default_sweep_and_explicit_order(bench):
    """Default: 1, the sweep below the peak, the common batch and the peak, ascending and without repeats;
    ``--batches``: the order given ('peak' is the arm's peak), sizes above the peak dropped."""
    assert bench.batches_for(36, [8, 32, 64], 8) == [1, 8, 32, 36]
    assert bench.batches_for(7, [8, 32], 8) == [1, 7]
    assert bench.batches_for(36, [8], 8, "peak,1") == [36, 1]
    assert bench.batches_for(7, [8], 8, "peak,8,1,7") == [7, 1]
    with pytest.raises(SystemExit, match="--batches"):
        bench.main(["--batches", "peak,max", "--contexts", "64"])


def fake_event(log, elapsed, *, wait_s=0.0):
    """A ``torch.cuda.Event`` stand-in: events named a, b, a, b, ... log their calls; ``elapsed_time`` (always a to
    b) returns the next of ``elapsed``; ``synchronize`` sleeps ``wait_s`` (a GPU the host waits for)."""
    import itertools
    import time

    names, times = itertools.cycle("ab"), iter(elapsed)

    class Event:
        def __init__(self, enable_timing):
            assert enable_timing
            self.name = next(names)

        def record(self):
            log.append(f"{self.name}.record")

        def synchronize(self):
            log.append(f"{self.name}.synchronize")
            time.sleep(wait_s)

        def elapsed_time(self, other):
            assert (self.name, other.name) == ("a", "b")
            return next(times)

    return Event


def test_back_to_back_timing_queues_every_replay_between_two_events(bench):
    """``time_back_to_back``: both events bracket all replays and nothing waits in between (the host queues the
    next step while the GPU runs the last); the result is the bracketed time divided by the steps."""
    log = []
    got = bench.time_back_to_back(lambda: log.append("replay"), 32, event=fake_event(log, [96.0]))
    assert got == 3.0
    assert log == ["a.record"] + ["replay"] * 32 + ["b.record", "b.synchronize"]


def test_per_step_timing_waits_for_every_step_and_times_the_host_submission(bench):
    """``time_steps``: each step is bracketed by its own two events and waited for; the host time is the
    ``replay()`` call alone (the submission an idle GPU waits for), not the wait."""
    import time

    log = []

    def replay():
        log.append("replay")
        time.sleep(0.005)

    event = fake_event(log, [4.0, 6.0, 5.0, 9.0], wait_s=0.02)  # the wait must not count as host submission time
    mean, median, host = bench.time_steps(replay, 4, event=event)
    assert (mean, median) == (6.0, 6.0)  # sorted [4, 5, 6, 9]: the element at index 2
    assert 5.0 <= host < 15.0, host  # about 5 ms per replay call, far below the 20 ms waits
    assert log == ["a.record", "replay", "b.record", "b.synchronize"] * 4


def test_profile_modes_pick_points(bench):
    """``--profile``: every point, only batch 1 and the arm's peak, or none; an unknown mode is an error."""
    points = [1, 8, 32, 36]
    assert [bench.profiled(b, 36, "all") for b in points] == [True] * 4
    assert [bench.profiled(b, 36, "ends") for b in points] == [True, False, False, True]
    assert [bench.profiled(b, 36, "none") for b in points] == [False] * 4
    with pytest.raises(ValueError, match="--profile"):
        bench.profiled(1, 36, "peak")


def test_a_point_runs_in_its_own_process_with_this_runs_settings(bench):
    """Each point runs in a child process (a profiled point slows later graph launches in its process, session 7):
    the child's command line parses back to the same settings, with its one point, and a failing child is an
    error that carries its output."""
    p = bench.build_parser()
    args = p.parse_args(["--capture", "compile", "--steps", "64", "--k-scale", "2.5", "--far-impl", "dot",
                         "--dynamic"])
    argv = bench.point_argv(args, 16384, "loopkv-m", 36, profile=False, launches=True, out="/tmp/row.json")
    assert argv[1].endswith("bench_decode.py")
    child = p.parse_args(argv[2:])
    assert (child.point, child.point_profile, child.point_launches, child.out) == ("16384,loopkv-m,36", 0, 1,
                                                                                  "/tmp/row.json")
    for key in ("capture", "steps", "k_scale", "far_impl", "dynamic"):
        assert getattr(child, key) == getattr(args, key), key
    assert not p.parse_args([]).shared_process
    with_weights = p.parse_args(bench.point_argv(args, 8192, "bf16", 1, profile=True, launches=False, out="x",
                                                 weights="/tmp/w.pt")[2:])
    assert (with_weights.weights, child.weights) == ("/tmp/w.pt", None)
    args.capture = "no-such-mode"  # the child's parser rejects it: the parent reports the child's message
    with pytest.raises(RuntimeError, match="invalid choice"):
        bench.run_point_in_child(args, 8192, "bf16", 1, profile=False, launches=False)


@pytest.mark.parametrize("script", sorted(p.name for p in (ROOT / "benchmarks").glob("*.py")))
def test_every_benchmark_script_imports_and_parses_its_arguments(script):
    """``--help`` of each script under benchmarks/ in a fresh process: its imports resolve from the tree (the GPU
    machine runs them with PYTHONPATH=.) and its argument parser builds, so a device call does not fail there."""
    import os
    import subprocess

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), "--help"], capture_output=True,
                         text=True, env=env, cwd=ROOT, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "usage:" in res.stdout


def test_a_child_loads_the_parents_parameters_exactly(bench, tmp_path):
    """The parent initializes the model once (seeded, on CPU) and saves its parameters; a child builds the model
    on its device and loads them: every parameter and buffer equals the parent's."""
    cfg = bench.smoke_config()
    torch.manual_seed(0)
    parent = bench.OuroForCausalLM(cfg).to(torch.bfloat16).eval()
    torch.save(parent.state_dict(), tmp_path / "w.pt")
    torch.manual_seed(1)  # the child's own init differs; loading must overwrite all of it
    child = bench.load_model(cfg, str(tmp_path / "w.pt"), device="cpu", dtype=torch.bfloat16)
    want, got = dict(parent.named_parameters()), dict(child.named_parameters())
    assert want.keys() == got.keys()
    assert all(torch.equal(want[k], got[k]) for k in want)
    want_b, got_b = dict(parent.named_buffers()), dict(child.named_buffers())
    assert want_b.keys() == got_b.keys()
    assert all(torch.equal(want_b[k], got_b[k]) for k in want_b)
    assert not child.training
    assert next(child.parameters()).dtype == torch.bfloat16


def test_plot_draws_the_committed_session9_sweep(tmp_path):
    plot = _load("plot_decode")
    result = json.loads((ROOT / "benchmarks/results/decode_2026-11-30_session9_graph_16k_sweep.json").read_text())
    png = tmp_path / "sweep.png"
    plot.plot(result, str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_code_flip_comparison_counts_against_a_brute_force_count():
    probe = _load("probe_code_flips")
    gen = torch.Generator().manual_seed(0)
    steps, rows, vocab, prompt = 12, 2, 7, probe.PROMPT
    want_logits = torch.randn(steps, rows, vocab, generator=gen)
    got_logits = want_logits + 1e-6 * torch.randn(steps, rows, vocab, generator=gen)  # rounding: below 1e-4
    got_logits[5, 1, 3] += 3e-4  # a flip at step 5 ...
    got_logits[9, 0, :] += 2e-4  # ... and drift afterwards
    seq = torch.randint(0, vocab, (rows, prompt + steps), generator=gen)
    other = seq.clone()
    other[1, prompt + 7] += 1  # tokens first differ at decode step 7
    row = probe.compare((other, got_logits), (seq, want_logits))
    assert row["first_step_beyond_1e-4"] == 5
    assert row["fraction_beyond_1e-4"] == pytest.approx((1 + vocab) / (steps * rows * vocab))
    assert row["max_abs"] == pytest.approx(3e-4, rel=1e-2)
    assert row["first_token_difference_step"] == 7
    assert not row["tokens_equal"]
    assert not row["bit_equal"]
    same = probe.compare((seq, want_logits), (seq, want_logits.clone()))
    assert same["bit_equal"]
    assert same["tokens_equal"]
    assert same["first_step_beyond_1e-4"] is None


def test_summary_and_table_of_the_session10_compiled_run_leave_unrun_ratios_blank(bench, capsys):
    """Session 10's compiled 16K run had no KIVI-4 arm and no batch 1: its table printed "0.00" in those columns,
    which reads as a measured ratio. The summary recomputed from the committed rows gives the tok/s ratio to BF16
    (checked against the rows by hand here) and leaves the others out; the table prints "-" for them."""
    result = json.loads((ROOT / "benchmarks/results/decode_2026-11-30_session10_compile_16k_notau.json").read_text())
    summary = bench.summarize(result["rows"], [16384])
    tok = {r["arm"]: r["batch"] * 1000.0 / r["step_ms"] for r in result["rows"]}
    by_arm = {s["arm"]: s for s in summary}
    assert set(by_arm) == {"bf16", "loopkv-m", "loopkv-m-notau"}
    for arm, s in by_arm.items():
        assert s["x_bf16"] == pytest.approx(tok[arm] / tok["bf16"], abs=2e-3)
        assert "x_kivi4" not in s
        assert "batch1_vs_bf16" not in s
        assert s["batch1_step_ms"] is None
    bench.print_table(summary, result["rows"])
    lines = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines()[1:]}
    assert lines["loopkv-m"][4] == f"{by_arm['loopkv-m']['x_bf16']:.2f}"
    assert lines["loopkv-m"][5:8] == ["-", "-", "-"]
    assert "0.00" not in " ".join(" ".join(v) for v in lines.values())


@pytest.mark.slow
def test_a_compiled_loopkv_step_hits_inductors_caches_in_a_second_process(tmp_path):
    """A server that restarts should not pay the compile again (120-150 s per compiled point on the H200 host):
    loopkv's custom ops must not make inductor bypass its FX-graph or AOTAutograd caches. Two fresh processes
    compile the same 4-cell step of ``probe_compile_cache`` with one shared, initially empty cache directory; the
    second must hit both caches and miss neither. (Measured on the GPU in session 10: 149.8 s -> 27.7 s at 96
    cells; ``compile_cache_2026-11-30_session10_cuda.json``.)"""
    import os
    import subprocess

    out = tmp_path / "probe.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks/probe_compile_cache.py"), "--layers", "1",
                          "--arms", "loopkv-m", "--out", str(out)], capture_output=True, text=True, env=env, cwd=ROOT,
                         timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    first, second = json.loads(out.read_text())["rows"]
    assert (first["run"], second["run"]) == ("first process", "second process")
    assert first["fxgraph_cache_miss"] >= 1
    assert first["fxgraph_cache_hit"] == 0
    assert second["fxgraph_cache_hit"] >= 1, second
    assert second["fxgraph_cache_miss"] == 0, second
    assert second["fxgraph_cache_bypass"] == 0, second
    assert second.get("autograd_cache_hit", 0) >= 1, second


def test_fp16x2_probe_counts_the_readers_two_instructions_per_field_and_fewer_for_pairs(tmp_path):
    """``probe_fp16x2_fields``: its fp32 kernel must show what the reader's page loop shows (one ``LOP3`` and one
    ``FFMA`` per field; ncu, session 10), which checks the difference method; the fp16x2 kernel must then need
    fewer than half as many multiply-adds (``HFMA2`` holds two fields) and fewer masks (static, sm_90)."""
    import os
    import subprocess

    # a fresh process without TRITON_INTERPRET: @triton.jit picks the interpreter when it decorates, and this test
    # session may have imported Triton under it (as test_sm90_compile does)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("TRITON_INTERPRET", None)
    code = ("import sys; sys.path.insert(0, 'benchmarks'); import probe_fp16x2_fields as p; "
            "p.main(['--out', sys.argv[1]])")
    out = tmp_path / "fp16x2.json"
    res = subprocess.run([sys.executable, "-c", code, str(out)], capture_output=True, text=True, env=env, cwd=ROOT,
                         timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    fp32, h2 = rows["fp32"], rows["fp16x2"]
    n = fp32["fields_per_lane_per_position"]
    assert fp32["lop3_per_position"] == n
    assert fp32["multiply_adds_per_position"] == n
    assert h2["multiply_adds_per_position"] <= n // 2
    assert h2["lop3_per_position"] <= n // 2
    assert h2["field_instructions_per_field"] < 0.5 * fp32["field_instructions_per_field"]


def test_fp16_accumulation_probe_fp32_matches_float64_and_flushed_fp16_stays_small(tmp_path):
    """``probe_fp16_accumulation``: its fp32 emulation of the reader's page loop must agree with the float64 softmax
    on the same codes (an independent formula) to fp32 rounding; the fp16 variants must show the pattern that
    decides the design (kernel-notes, session 10): unflushed fp16 accumulators degrade with the pages of a split;
    flushed every 8 pages, with fields read at bits 4-8, they stay near 2e-3, far below INT2's own error; with
    fields at bits 0-8 a long split of peaky attention loses precision (the subnormals' range)."""
    probe = _load("probe_fp16_accumulation")
    out = tmp_path / "acc.json"
    probe.main(["--pages", "16,128", "--peak", "1,3", "--trials", "4", "--out", str(out)])
    rows = {(r["pages"], r["peak"]): r for r in json.loads(out.read_text())["rows"]}
    for r in rows.values():
        assert r["fp32_max"] < 2e-5
        assert r["v16_k16_flush8_high_median"] < 5e-3
        assert r["int2_median"] > 50 * r["v16_k16_flush8_high_median"]
    assert rows[(128, 1.0)]["v16_median"] > 3 * rows[(128, 1.0)]["v16_k16_flush8_high_median"]
    assert rows[(128, 3.0)]["v16_k16_flush8_median"] > 2 * rows[(128, 3.0)]["v16_k16_flush8_high_median"]


def test_page_loop_probe_finds_the_readers_loop_and_the_token_programs_leave_it_unchanged(tmp_path):
    """``probe_page_loop`` (static, sm_90): INT2's page loop at B = 32 x 16 heads x 128 is the same instruction count
    with and without ``token_attention_``'s token write (its near program stores the token; docs/design-decisions.md
    §12), has no spill under the register cap, and is the reader's loop (hundreds of instructions, with the fused
    multiply-adds of the fields), not some small copy loop."""
    import os
    import subprocess

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("TRITON_INTERPRET", None)  # a fresh process, as above
    out = tmp_path / "loop.json"
    res = subprocess.run([sys.executable, "benchmarks/probe_page_loop.py", "--bits", "2", "--batch", "32",
                          "--variants", "plain,token", "--out", str(out)], capture_output=True, text=True, env=env,
                         cwd=ROOT, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    plain, token = rows["plain"], rows["token"]
    assert plain["loop_instructions"] == token["loop_instructions"]
    assert 500 < plain["loop_instructions"] < 2000
    assert plain["opcodes"].get("FFMA", 0) >= 128  # 64 crumb fields of K and V per lane at least
    assert plain["spill_loads"] == token["spill_loads"] == 0
    assert plain["registers"] is None or plain["registers"] <= 128


def test_page_loop_probe_k16_pairs_the_key_fields(tmp_path):
    """``probe_page_loop --cc-opts ...,k16`` (static, sm_90; docs/kernel-notes.md, session 12): INT2's page loop with
    K's fields in packed fp16 pairs (the default since session 13) has one ``HFMA2`` per pair of K fields (8 words x
    8 pairs per lane), about 128 fewer ``FFMA`` (V's stay), no spill under the cap, and fewer instructions than the
    reader without it (session 12's default)."""
    import os
    import subprocess

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("TRITON_INTERPRET", None)
    rows = {}
    for name, opts in (("k32", "qk,vg,f24,i32,l2,pt"), ("k16", None)):
        out = tmp_path / f"{name}.json"
        cmd = [sys.executable, "benchmarks/probe_page_loop.py", "--bits", "2", "--batch", "32", "--variants", "plain",
               "--out", str(out)] + (["--cc-opts", opts] if opts else [])
        res = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
        assert res.returncode == 0, res.stderr[-3000:]
        rows[name] = json.loads(out.read_text())["rows"]["plain"]
    base, k16 = rows["k32"], rows["k16"]
    assert base["opcodes"].get("HFMA2", 0) == 0
    assert k16["opcodes"].get("HFMA2", 0) >= 64
    assert base["opcodes"]["FFMA"] - k16["opcodes"]["FFMA"] >= 100
    assert k16["spill_loads"] == 0
    assert k16["loop_instructions"] < base["loop_instructions"]


def test_k32_arms_drop_k16_for_their_point_only(bench):
    """The ``-k32`` arms run the library default without "k16" (K's field work in fp32, the reader up to session 12),
    for that point only: restored afterwards, also when the point fails; other arms run the default unchanged."""
    from loopkv.ops import triton_config

    before = dict(triton_config.CC_DEFAULT_OPTS_BY_BITS)
    assert all("k16" in opts for opts in before.values())  # session 13: on by default
    with bench.reader_options("loopkv-m"):
        assert triton_config.CC_DEFAULT_OPTS_BY_BITS == before
    for arm in bench.K32_ARMS:
        with bench.reader_options(arm):
            for bits, opts in before.items():
                assert triton_config.CC_DEFAULT_OPTS_BY_BITS[bits] == tuple(o for o in opts if o != "k16")
        assert triton_config.CC_DEFAULT_OPTS_BY_BITS == before
    with pytest.raises(RuntimeError, match="point failed"), bench.reader_options("kivi4-k32"):
        raise RuntimeError("point failed")
    assert triton_config.CC_DEFAULT_OPTS_BY_BITS == before
    plans = bench.paper_plans(4, 24)
    assert plans["loopkv-m-k32"].grid() == plans["loopkv-m"].grid()
    assert plans["kivi4-k32"].grid() == plans["kivi4"].grid()


def test_s16_arms_take_session_16s_split_count_for_their_point_only(bench):
    """The ``-s16`` arms run their base plan with session 16's split count (WAVES 124, no minimum chunk) and
    the reader's variants unchanged; the defaults are back afterwards."""
    from loopkv.ops import triton_config

    opts, waves, coef = dict(triton_config.CC_DEFAULT_OPTS_BY_BITS), triton_config.WAVES, triton_config.CHUNK_COEF
    assert (waves, coef) != (124, 0.0)
    for arm in bench.S16_SPLIT_ARMS:
        with bench.reader_options(arm):
            assert (triton_config.WAVES, triton_config.CHUNK_COEF) == (124, 0.0)
            assert triton_config.CC_DEFAULT_OPTS_BY_BITS == opts
        assert (triton_config.WAVES, triton_config.CHUNK_COEF) == (waves, coef)
    plans = bench.paper_plans(4, 24)
    assert plans["loopkv-m-s16"].grid() == plans["loopkv-m"].grid()
    assert plans["kivi4-s16"].grid() == plans["kivi4"].grid()


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs Triton's interpreter (set on CPU)")
def test_k16_error_probe_puts_the_fp16_rounding_far_below_the_codes_error(tmp_path):
    """``probe_k16_error``: on the same keys and values, "k16"'s fp16 rounding of the key scores stays more than 20x
    below the codes' own error against the unquantized pages (INT4 and INT2; measured 76-244x in session 12) and
    above fp32 rounding (so the fp16 path really ran), while the fp32 reader stays at fp32 rounding."""
    pytest.importorskip("triton")
    probe = _load("probe_k16_error")
    out = tmp_path / "k16.json"
    probe.main(["--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert {(r["bits"], r["q_std"]) for r in rows} == {(4, 1.0), (4, 2.0), (2, 1.0), (2, 2.0)}
    for r in rows:
        assert r["fp32_reader_vs_codes"] < 1e-5
        assert 1e-5 < r["k16_vs_codes"] < 6e-3
        assert r["codes_vs_unquantized"] > 20 * r["k16_vs_codes"]


def test_served_quality_probe_smoke_writes_every_arm_and_reader(tmp_path):
    """``probe_served_quality --smoke`` (CPU): the small model served in bf16 through LoopKVCache, teacher-forced,
    per arm and reader. On CPU the cache runs the reference ops, which have no reader variants, so every reader
    gives the base's logits there; the served BF16 cache is not exact (bf16 model against fp32) but close."""
    probe = _load("probe_served_quality")
    out = tmp_path / "served.json"
    probe.main(["--smoke", "--arms", "BF16 (exact),LoopKV-M", "--out", str(out)])
    result = json.loads(out.read_text())
    assert result["complete"]
    assert result["decode_steps"] == 8
    rows = {(r["arm"], r["reader"]): r for r in result["rows"]}
    readers = ("k32", "k16", "dot", "k16 vs k32", "dot vs k32")
    assert set(rows) == {(a, r) for a in ("BF16 (exact)", "LoopKV-M") for r in readers}
    for arm in ("BF16 (exact)", "LoopKV-M"):
        for other in ("k16 vs k32", "dot vs k32"):
            assert rows[arm, other]["kl"] == 0
            assert rows[arm, other]["max_abs_logit_diff"] == 0
        assert 0 < rows[arm, "k16"]["kl_vs_exact"] < 1e-2
    with pytest.raises(SystemExit, match="unknown"):
        probe.main(["--smoke", "--arms", "KIVI-5", "--out", str(out)])
    with pytest.raises(SystemExit):  # argparse: one reader is no comparison
        probe.main(["--smoke", "--readers", "k16", "--out", str(out)])
    # --reference: the same served path through the reference ops alone, at any size; with the smoke's sizes it
    # reproduces the smoke's rows (on CPU every reader there ran the reference ops)
    ref = tmp_path / "reference.json"
    probe.main(["--reference", "--docs", "1", "--len", "328", "--prefill", "320", "--arms", "BF16 (exact),LoopKV-M",
                "--out", str(ref)])
    ref_result = json.loads(ref.read_text())
    assert ref_result["complete"]
    assert ref_result["readers"] == ["reference"]
    ref_rows = {(r["arm"], r["reader"]): r for r in ref_result["rows"]}
    assert set(ref_rows) == {("BF16 (exact)", "reference"), ("LoopKV-M", "reference")}
    for arm in ("BF16 (exact)", "LoopKV-M"):
        assert ref_rows[arm, "reference"]["kl_vs_exact"] == rows[arm, "k32"]["kl_vs_exact"]
        assert ref_rows[arm, "reference"]["agreement_vs_exact"] == rows[arm, "k32"]["agreement_vs_exact"]
    with pytest.raises(SystemExit):  # argparse: --reference is its own mode
        probe.main(["--reference", "--smoke", "--out", str(ref)])
    # --simulate: the demo's dense simulation beside the served cache; in fp32 the two are the same computation
    # (reference quantization; at 328 tokens two share passes reach the served fixed point)
    sim = tmp_path / "simulated.json"
    probe.main(["--reference", "--dtype", "float32", "--simulate", "--docs", "1", "--len", "328", "--prefill", "320",
                "--arms", "KIVI-4,LoopKV-M", "--out", str(sim)])
    sim_rows = {(r["arm"], r["reader"]): r for r in json.loads(sim.read_text())["rows"]}
    for arm in ("KIVI-4", "LoopKV-M"):
        assert sim_rows[arm, "simulated vs reference"]["kl"] < 1e-9
        assert sim_rows[arm, "simulated vs reference"]["max_abs_logit_diff"] < 1e-3
        assert sim_rows[arm, "reference"]["kl_vs_exact"] > 1e-7  # quantized: not the exact model
