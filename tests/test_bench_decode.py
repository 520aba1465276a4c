"""``benchmarks/bench_decode.py --smoke`` and ``benchmarks/plot_decode.py --smoke`` end to end on the CPU."""

import contextlib
import datetime
import importlib
import io
import json
import pathlib
import sys

import pytest

BENCHMARKS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"
ARMS = ("bf16", "kivi4", "kivi4v", "loopkv-r", "loopkv-m")


def _load(name: str):
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    return importlib.import_module(name)


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
            assert r["cache_bytes"] == fit["bytes_per_row"] * r["batch"]
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
