"""Each benchmark's ``--smoke`` end to end: ``bench_cell_attention.py`` (CPU; the cell reader under Triton's
interpreter where there is no GPU), ``bench_quality.py``, ``bench_decode.py`` with ``plot_decode.py``,
``bench_profile.py``, ``bench_soak.py`` and ``bench_serving.py``."""

import contextlib
import datetime
import importlib
import io
import json
import math
import pathlib
import sys

import pytest

BENCHMARKS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"


def _load(name: str):
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    return importlib.import_module(name)


def _check_run_info(result: dict, script: str, out: pathlib.Path) -> None:
    assert result["benchmark"] == script
    assert result["command"] == f"python benchmarks/{script}.py --smoke --out {out}"
    assert result["device"]
    assert {"torch", "triton", "transformers", "loopkv"} <= set(result["versions"])
    datetime.datetime.fromisoformat(result["date"])


def test_bench_cell_attention_smoke(tmp_path, capsys):
    out = tmp_path / "cell_attention.json"
    _load("bench_cell_attention").main(["--smoke", "--out", str(out)])
    result = json.loads(out.read_text())
    _check_run_info(result, "bench_cell_attention", out)
    [row] = result["rows"]
    assert row["history_pages"] == 4
    assert row["cudnn_bf16"]["ms"] > 0
    assert list(row["modes"]) == ["int4", "int4_vpdata", "int4_vp", "int2"]
    for mode in row["modes"].values():
        assert mode["ms"] > 0
        assert mode["bytes"] > 0
        assert mode["x_cudnn"] == pytest.approx(row["cudnn_bf16"]["ms"] / mode["ms"])
        assert mode["max_abs_vs_reference"] < 2e-2  # the reader's bf16 output against the fp32 reference
    assert row["modes"]["int2"]["bytes"] < row["modes"]["int4"]["bytes"]
    assert row["modes"]["int4_vp"]["bytes"] < row["modes"]["int4_vpdata"]["bytes"]  # cold tokens' lo plane skipped
    assert 0.1 < row["hot_fraction"] < 0.4  # the data is built with ~1/6 of the history hot
    assert row["vp_gain"] > 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-2].split()[:3] == ["B", "ctx", "cudnn"]  # the table comes last
    assert lines[-1].split()[:2] == ["1", "423"]


def test_bench_quality_smoke(tmp_path, capsys):
    out = tmp_path / "quality.json"
    _load("bench_quality").main(["--smoke", "--out", str(out)])
    result = json.loads(out.read_text())
    _check_run_info(result, "bench_quality", out)
    arms = {a["arm"]: a for a in result["arms"]}
    assert list(arms) == ["BF16 (exact)", "KIVI-4 + V", "LoopKV-M"]
    assert arms["BF16 (exact)"]["stored_kib"] == 24.0
    assert arms["KIVI-4 + V"]["stored_kib"] == 7.5
    assert arms["LoopKV-M"]["stored_kib"] < arms["LoopKV-M"]["read_kib"] < arms["KIVI-4 + V"]["read_kib"]
    for name, arm in arms.items():
        assert len(arm["kl_per_doc"]) == len(arm["agree_per_doc"]) == 1
        assert all(math.isfinite(k) and k >= 0 for k in arm["kl_per_doc"])
        assert 0 <= arm["agree_per_doc"][0] <= 1
        [ret] = arm["retrieval"].values()
        assert ret["per_prompt"] in ([0.0], [1.0])
        if name != "BF16 (exact)":
            assert arm["kl"]["mean"] == pytest.approx(arm["kl_per_doc"][0])
            assert "diff_vs_bf16" in ret
    for values in (result["structure"]["sink_mass_first_32_per_loop"],
                   result["structure"]["hot_fraction_tau14_per_loop"]):
        assert len(values) == 4
        assert all(0 < v <= 1 for v in values)
    lines = capsys.readouterr().out.strip().splitlines()
    assert [line.split()[0] for line in lines[-len(arms):]] == [name.split()[0] for name in arms]  # table last


ARMS = ("bf16", "kivi4", "kivi4v", "loopkv-r", "loopkv-m")


@pytest.fixture(scope="module")
def decode_smoke(tmp_path_factory):
    """(JSON path, parsed JSON, stdout) of one ``bench_decode.py --smoke`` run."""
    path = tmp_path_factory.mktemp("bench") / "decode.json"
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        _load("bench_decode").main(["--smoke", "--out", str(path)])
    return path, json.loads(path.read_text()), stdout.getvalue()


def test_bench_decode_smoke(decode_smoke):
    path, result, stdout = decode_smoke
    assert result["benchmark"] == "bench_decode"
    assert result["command"] == f"python benchmarks/bench_decode.py --smoke --out {path}"
    assert result["device"].startswith("cpu")
    assert {"torch", "triton", "transformers", "loopkv"} <= set(result["versions"])
    datetime.datetime.fromisoformat(result["date"])
    assert result["complete"]
    assert not result["errors"]
    assert result["plans_kib_per_token_stored_read"]["loopkv-m"][0] < result["plans_kib_per_token_stored_read"][
        "kivi4"][0]
    for arm in ARMS:
        fit = result["fits"][f"{arm}@448"]
        assert fit["max_batch"] == min(result["kv_budget_bytes"] // fit["bytes_per_row"], 8)
        rows = [r for r in result["rows"] if r["arm"] == arm]
        assert sorted(r["batch"] for r in rows) == sorted({1, fit["max_batch"]})
        for r in rows:
            assert r["step_ms"] > 0
            # tok_s is rounded to 0.1 and step_ms to 0.001 ms in the JSON: their rounding bounds the difference
            rounding = 0.05 + r["tok_s"] * 0.0005 / r["step_ms"]
            assert r["tok_s"] == pytest.approx(r["batch"] * 1000 / r["step_ms"], abs=rounding * 1.01)
            # a cell's stacked slices are padded to 16 bytes over all its rows, so a row costs at most what one row
            # alone costs (the fit is conservative), exactly that at batch 1
            assert r["cache_bytes"] <= fit["bytes_per_row"] * r["batch"]
            assert (r["cache_bytes"] == fit["bytes_per_row"]) == (r["batch"] == 1)
            assert r["filled_to"] < r["tokens_after"] <= 448 + 64
            if arm in ("bf16", "kivi4"):
                assert r["hot_fraction"] is None
            else:
                assert 0 < r["hot_fraction"] < 1
    assert result["captures"] == ["eager"]
    assert {r["capture"] for r in result["rows"]} == {"eager"}
    peaks = {s["arm"]: s for s in result["summary"]}
    assert set(peaks) == set(ARMS)
    assert peaks["bf16"]["x_bf16"] == 1.0
    assert peaks["kivi4"]["x_kivi4"] == 1.0
    assert peaks["bf16"]["peak_batch"] <= peaks["kivi4"]["peak_batch"] <= peaks["loopkv-m"]["peak_batch"]
    for s in peaks.values():
        assert s["x_bf16"] == pytest.approx(s["peak_tok_s"] / peaks["bf16"]["peak_tok_s"], abs=1e-3)
    table = stdout.strip().splitlines()[-len(ARMS) - 1:]  # the table comes last
    assert table[0].split()[:5] == ["capture", "arm", "ctx", "peak", "B"]
    assert [line.split()[:2] for line in table[1:]] == [["eager", arm] for arm in ARMS]


def test_plot_decode_smoke(decode_smoke, capsys):
    path, result, _ = decode_smoke
    png = pathlib.Path(_load("plot_decode").main(["--smoke", str(path)]))
    assert png.stat().st_size > 10_000
    assert png.read_bytes()[:4] == b"\x89PNG"
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "448" in line]
    assert [line.split("|")[2].strip() for line in rows] == list(ARMS)
    assert f"{result['summary'][-1]['peak_tok_s']:.1f}" in rows[-1]


def test_bench_profile_smoke(tmp_path, capsys):
    bench = _load("bench_profile")
    out = tmp_path / "profile.json"
    bench.main(["--smoke", "--out", str(out)])
    result = json.loads(out.read_text())
    assert result["benchmark"] == "bench_profile"
    assert result["command"] == f"python benchmarks/bench_profile.py --smoke --out {out}"
    assert {"torch", "transformers", "loopkv"} <= set(result["versions"])
    datetime.datetime.fromisoformat(result["date"])
    # the tiny model: 3 loops x 2 layers -> 4 cells x 3 options + 2 final cells x 2 options + KL_share
    assert result["profile"]["evaluations"] == 4 * 3 + 2 * 2 + 1
    assert list(result["arms"]) == ["tf32", "fp32", "tf32-mm", "tf32-host", "fp32-prefix"]
    for arm in result["arms"].values():
        assert arm["how"] == "extrapolated"  # 2 of the batches on 1 of the 2 documents
        rows = arm["sampled"]
        assert rows
        per_unit = sum(r["seconds_per_doc"] for r in rows) / sum(r["units"] for r in rows)
        assert arm["seconds_per_unit_per_doc"] == pytest.approx(per_unit)
        assert [r["fit_seconds_per_doc"] for r in rows] == pytest.approx([per_unit * r["units"] for r in rows])
        full = result["profile"]["documents"] * (per_unit * arm["units_per_doc"] + arm["reference_seconds_per_doc"])
        assert arm["full_profile_minutes"] == pytest.approx(full / 60)
        assert arm["minutes_per_evaluation"] == pytest.approx(full / 60 / result["profile"]["evaluations"])
        assert arm["measured_fraction_of_batch_work"] == pytest.approx(
            sum(r["units"] for r in rows) / (2 * arm["units_per_doc"]))
        # one 352-token document's exact pass: fp32 logits of positions 320.. and the final loop's K/V
        assert arm["reference_gib_per_doc"] * 2**30 >= 4 * (32 * 97 + 2 * 2 * 352 * 32 * 2)
    assert result["arms"]["fp32-prefix"]["units_per_doc"] > result["arms"]["fp32"]["units_per_doc"]
    check = result["tf32_check"]
    assert len(check["ouro_shape"]["jobs"]) == 2
    assert check["ouro_shape"]["compared"] == 2  # two documents: a standard error per job
    assert check["ouro_shape"]["tf32-mm"]["compared"] == 2
    assert check["small_model"]["damages"] == 16
    assert result["summary"]["evaluations_per_profile"] == 17
    assert set(result["summary"]["tf32_within_noise_floor"]) == {"ouro_shape", "ouro_shape (tf32-mm)", "small_model"}
    assert "min/profile" in capsys.readouterr().out


def test_bench_profile_measures_when_every_batch_runs_on_every_document(tmp_path):
    bench = _load("bench_profile")
    out = tmp_path / "profile.json"
    result = bench.main(["--smoke", "--arms", "fp32,tf32-host", "--sample-batches", "0", "--docs", "1",
                         "--tf32-jobs", "0", "--small-docs", "0", "--out", str(out)])
    for arm in result["arms"].values():
        assert arm["how"] == "measured"
        assert len(arm["sampled"]) == result["profile"]["batches"]
        assert arm["measured_fraction_of_batch_work"] == pytest.approx(1.0)
    assert result["arms"]["tf32-host"]["exact_on"] == "cpu"
    assert result["arms"]["tf32-host"]["units_per_doc"] == result["arms"]["fp32"]["units_per_doc"]


def test_bench_profile_times_the_small_model_on_the_cpu_clock(tmp_path):
    bench = _load("bench_profile")
    result = bench.main(["--device", "cpu", "--clock", "process", "--model", "small", "--docs", "2", "--doc-len",
                         "352", "--measure-docs", "1", "--sample-batches", "1", "--arms", "fp32", "--tf32-jobs", "0",
                         "--small-docs", "0", "--out", str(tmp_path / "profile.json")])
    assert result["model"]["shape"].startswith("loopkv small (trained)")
    assert result["profile"]["evaluations"] == 18 * 3 + 6 * 2 + 1  # 4 loops x 6 layers
    assert result["measured"]["clock"] == "process"
    assert result["arms"]["fp32"]["sampled"][0]["seconds_per_doc"] > 0
    with pytest.raises(SystemExit):
        bench.main(["--device", "cuda", "--clock", "process"])  # refused before anything runs


def test_profile_batches_and_cost_model_at_ouro_shape():
    """The batches the H200 run extrapolates over: Ouro-1.4B's 265 evaluations in 34 batches of 8; the exact
    prefix run once makes a batch of the final loop's cells cost little more than one row."""
    bench = _load("bench_profile")
    from loopkv.planning.profiler import _Runner

    batches = bench.profile_batches(bench.ouro_config(False), 8)
    assert sum(len(b) for b in batches) == 72 * 3 + 24 * 2 + 1
    assert len(batches) == 34
    run = _Runner(None, [], loops=4, layers=24, tau=float("inf"), share_source="int4", share_passes=2,
                  prefill_len=320, first=320)
    last_plain = batches[23]  # int4/int2 of final-loop cells 92..95
    assert [run.first_cell(j) for j in last_plain] == [92, 92, 93, 93, 94, 94, 95, 95]
    assert bench.cost_units(run, last_plain, start="prefix") == pytest.approx(92 / 96 + 8 * 4 / 96)
    # resumed from loop 3's checkpoint (cell 72): the carrier runs cells 72..94, rows join at 92..95
    assert bench.cost_units(run, last_plain, start="resume") == pytest.approx((95 - 72 + 2 * (4 + 3 + 2 + 1)) / 96)
    assert bench.cost_units(run, last_plain, start="rows") == 8
    assert bench.cost_units(run, batches[24], start="rows") == 16  # share jobs: two passes
    totals = {s: sum(bench.cost_units(run, b, start=s) for b in batches) for s in ("rows", "prefix", "resume")}
    # every evaluation's own cells, its passes included (the floor no schedule of rows goes below): 188.75 units
    floor = sum((2 if j == "kl_share" or j[1] == "share" else 1) * (96 - run.first_cell(j)) / 96
                for b in batches for j in b)
    assert floor == pytest.approx(188.75)
    assert totals["rows"] == 265 + 73  # 73 two-pass evaluations (72 shares and KL_share)
    assert totals["prefix"] == pytest.approx(215.79, abs=0.01)  # the H200 run before resuming
    assert floor < totals["resume"] < floor + 7 < totals["prefix"]
    assert bench.sample(batches, 4) == [0, 23, 24, 33]


@pytest.mark.parametrize("backend", [pytest.param(None, id="eager"), pytest.param("inductor", marks=pytest.mark.slow)])
def test_bench_soak_smoke(tmp_path, capsys, backend):
    """The soak's CPU path (Dynamo with the eager backend; Inductor in the slow set): three requests at batch 2, 1, 2
    with a reset before each; the compile hook saw one graph per batch size in the warm-up and none after; every
    sampled step, the steps where a row reaches page 0's or page 1's quantization included, equals an eager step on
    a copy of the cache."""
    out = tmp_path / "soak.json"
    extra = ["--backend", backend] if backend else []
    _load("bench_soak").main(["--smoke", "--out", str(out), *extra])
    result = json.loads(out.read_text())
    assert result["compile"] == {"backend": backend or "eager"}
    assert result["command"].endswith(" ".join(["", *extra]))
    _check_run_info(dict(result, command=result["command"].removesuffix(" ".join(["", *extra]))), "bench_soak", out)
    summary, requests = result["summary"], result["requests"]
    assert summary["passed"], summary["failures"]
    assert [(r["batch"], r["warmup"]) for r in requests] == [(2, True), (1, True), (2, False)]
    assert summary["events_warmup"]["compiles"] == summary["events_warmup"]["unique_graphs"] == 2
    assert set(summary["recompiles_after_warmup"].values()) == {0}
    assert summary["decode_steps"] == 120
    assert summary["lengths_as_expected"]
    reached = {h + 1 for r in requests for c in r["checks"] for h in c["held"]}
    assert {319, 320, 351, 352} <= reached
    assert summary["checks"] >= 10
    assert summary["checks_not_close"] == summary["tokens_differ"] == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-5].split()[:3] == ["req", "B", "prompts"]  # the table comes last
    assert lines[-1].endswith("PASSED")


def test_bench_serving_smoke(tmp_path):
    """A tiny model's trace through transformers' engine with LoopKV storage: the BF16 batch-1 step that sets the
    SLO, then one arm at one rate; every request comes back with its latencies, and the goodput is a rate of the
    ladder (or 0)."""
    out = tmp_path / "serving.json"
    _load("bench_serving").main(["--smoke", "--out", str(out)])
    result = json.loads(out.read_text())
    _check_run_info(result, "bench_serving", out)
    (row,) = result["rows"]
    assert (row["arm"], row["rate"], row["requests"]) == ("loopkv-m", 8.0, 3)
    assert 0.0 <= row["attainment"] <= 1.0
    assert row["slots"] >= 1
    assert row["pool_pages"] >= 1
    assert row["mean_ttft_s"] > 0
    assert row["tokens_per_s"] > 0
    assert result["slo"]["tpot_s"] == pytest.approx(result["slo"]["tpot_x"] * result["slo"]["bf16_batch1_step_s"])
    assert result["goodput_rps"]["loopkv-m"] in (0.0, 8.0)
