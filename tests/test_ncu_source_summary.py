"""benchmarks/ncu_source_summary.py on a hand-made source page: the loop band, the per-opcode sums and shares."""

import csv
import importlib.util
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def summary():
    spec = importlib.util.spec_from_file_location("ncu_source_summary", ROOT / "benchmarks" / "ncu_source_summary.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def write_page(path, rows):
    head = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed", "stall_long_sb",
            "stall_selected", "stall_long_sb (Not Issued)"]
    with open(path, "w", newline="") as f:
        f.write("==PROF== a line of ncu's own\n")
        w = csv.writer(f)
        w.writerow(["Kernel Name", "_cell_attn_kernel"])
        w.writerow(head)
        for r in rows:
            w.writerow(r)


def test_loop_band_and_per_opcode_sums(tmp_path, summary):
    # (address, sass, samples, executed, long_sb, selected, long_sb not issued)
    rows = [
        ("0x0", "LDC R1, c[0x0][0x28]", "40", "10", "30", "10", "30"),  # prologue: outside the loop band
        ("0x10", "@!P0 LOP3.LUT R2, R3, 0xf, RZ, 0xc0, !PT", "30", "1000", "10", "20", "10"),
        ("0x20", "LOP3.LUT R4, R3, 0xf0, RZ, 0xc0, !PT", "10", "1000", "0", "10", "0"),
        ("0x30", "HADD2.F32 R5, -RZ, R6.H0_H0", "60", "950", "57", "3", "57"),
        ("0x40", "BRA 0x10", "0", "899", "0", "0", "0"),  # below 0.9 x 1000: not in the band
    ]
    p = tmp_path / "src.csv"
    write_page(p, rows)
    got = summary.summarize(summary.read_source(str(p)))
    assert got["loop_instructions"] == 3
    assert got["loop_executions_per_instruction"] == 1000
    assert got["loop_share_of_samples"] == pytest.approx(100 / 140, abs=1e-4)
    assert got["loop_reasons"] == {"long_sb": pytest.approx(0.67), "selected": pytest.approx(0.33)}
    ops = {o["opcode"]: o for o in got["opcodes"]}
    assert [o["opcode"] for o in got["opcodes"]] == ["HADD2.F32", "LOP3.LUT"]  # by samples, predicate dropped
    assert ops["LOP3.LUT"]["instructions"] == 2
    assert ops["LOP3.LUT"]["samples"] == 40
    assert ops["LOP3.LUT"]["main_reasons"] == {"selected": 0.75, "long_sb": 0.25}
    assert ops["HADD2.F32"]["share"] == pytest.approx(0.6)
