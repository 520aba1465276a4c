"""benchmarks/probe_timeline.py's summary of a launch's program timeline, on a hand-made timeline; and the op's
``timeline`` argument refused where it cannot run."""

import importlib.util
import math
import pathlib
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def probe():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        spec = importlib.util.spec_from_file_location("probe_timeline", ROOT / "benchmarks" / "probe_timeline.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return mod


def test_analyze_on_a_hand_made_launch(probe):
    us = 1000  # the timeline is in ns
    # (start, end, SM, program, row-head, pages); 2 near programs per row-head (program 0, 1), history after
    rows = [
        (0, 10 * us, 0, 2, 0, 4),  # history, 4 pages: 10 us
        (0, 7 * us, 1, 3, 0, 2),  # history, 2 pages: 7 us  -> 1.5 us per page, 4 us fixed
        (2 * us, 13 * us, 1, 2, 1, 4),  # history, 4 pages: 11 us (its SM starts it 2 us in)
        (10 * us, 12 * us, 0, 0, 0, 0),  # near: 2 us
        (12 * us, 16 * us, 0, 1, 0, 0),  # near: 4 us, the last program of the launch
        (0, 0, 0, 0, 1, 0),  # a row of the buffer no program wrote: dropped
    ]
    got = probe.analyze(torch.tensor(rows, dtype=torch.int64), nnear=2)
    assert got["programs"] == 5
    assert got["span_us"] == pytest.approx(16)
    assert (got["near"]["count"], got["far"]["count"]) == (2, 3)
    assert got["near"]["median_us"] == pytest.approx(2)  # torch's median of an even count: the lower one
    assert got["near"]["mean_us"] == pytest.approx(3)
    assert got["near"]["first_start_us"] == pytest.approx(10)
    assert got["far"]["last_end_us"] == pytest.approx(13)
    # least squares of (4, 10), (2, 7), (4, 11): slope (10.5 - 7) / 2 = 1.75, fixed 10.5 - 4 * 1.75 = 3.5
    assert got["far_us_per_page"] == pytest.approx(1.75)
    assert got["far_us_fixed"] == pytest.approx(3.5)
    assert got["sms"] == got["sms_used"] == 2
    assert got["resident"] == pytest.approx((10 + 7 + 11 + 2 + 4) / (16 * 2))
    # SM 0 starts at 0, SM 1 at 0: no ramp; SM 0 ends at 16, SM 1 at 13: tails 0 and 3
    assert got["ramp_us"] == pytest.approx(0)
    assert got["tail_us"] == pytest.approx(1.5)
    assert got["tail_max_us"] == pytest.approx(3)
    # the first tenth (0 - 1.6 us): one program running on each SM
    assert got["resident_by_tenth"][0] == pytest.approx(1.0)
    # integral of the profile = mean residency
    assert sum(got["resident_by_tenth"]) / 10 == pytest.approx(got["resident"])
    # by start eighth (2 us each): history programs with the full chunk (4 pages) start at 0 and 2 us, near at 10, 12
    eighths = got["by_eighth"]
    assert [e["far_full"] for e in eighths] == [1, 1, 0, 0, 0, 0, 0, 0]
    assert [e["near"] for e in eighths] == [0, 0, 0, 0, 0, 1, 1, 0]
    assert eighths[1]["far_full_median_us"] == pytest.approx(11)
    assert eighths[6]["near_median_us"] == pytest.approx(4)


def test_analyze_without_history_programs(probe):
    us = 1000
    rows = [(0, 3 * us, 0, 0, 0, 0), (1 * us, 4 * us, 0, 1, 0, 0)]
    got = probe.analyze(torch.tensor(rows, dtype=torch.int64), nnear=2)
    assert got["far"] == {"count": 0}
    assert "far_us_per_page" not in got
    assert got["resident"] == pytest.approx(6 / 4)
    assert math.isfinite(got["span_us"])


def test_timeline_is_refused_off_cuda():
    from loopkv.ops import triton_attention as ta
    from tests.ops.test_triton_attention import make_cell

    st = make_cell(1, 1, 64, 2, 4, [400])
    q = torch.randn(1, 1, 64)
    with pytest.raises(ValueError, match="CUDA only"):
        ta.cell_attention(q, *st, 4, math.inf, 0.125, timeline=torch.zeros(600, dtype=torch.int64))
