"""``benchmarks/bench_cell_attention.py --smoke`` and ``benchmarks/bench_quality.py --smoke`` end to end (CPU; the cell
reader under Triton's interpreter where there is no GPU)."""

import datetime
import importlib
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
