"""``loopkv demo`` runs end to end on the shipped small model in a reduced setting (the CI check of the
README's main command; the full demo runs the same code with more prompts)."""

import pytest
import torch


def test_demo_quick_prints_the_table(tmp_path, capsys):
    from loopkv.cli import main

    assert main(["demo", "--quick", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for arm in ("BF16 (exact)", "KIVI-4", "KIVI-4 + V", "LoopKV-R", "LoopKV-M"):
        assert arm in out
    assert (tmp_path / "loopkv-r.png").stat().st_size > 0
    assert (tmp_path / "loopkv-m.json").is_file()


def test_kl_and_agreement_against_a_hand_computed_case():
    """``loopkv.demo.kl_and_agreement`` (the demo's KL and agreement columns): mean over
    positions of sum_v p log(p / q), and the share of positions whose argmax agrees."""
    import math

    from loopkv.demo import kl_and_agreement

    ref = torch.tensor([[0.0, math.log(3.0)], [0.0, 0.0]], dtype=torch.float64)  # p = (1/4, 3/4), (1/2, 1/2)
    got = torch.tensor([[0.0, 0.0], [math.log(3.0), 0.0]], dtype=torch.float64)  # q = (1/2, 1/2), (3/4, 1/4)
    want = (0.25 * math.log(0.5) + 0.75 * math.log(1.5) + 0.5 * math.log(2 / 3) + 0.5 * math.log(2.0)) / 2
    kl, agree = kl_and_agreement(ref, got)
    assert kl == pytest.approx(want, rel=1e-12)
    assert agree == 0.5  # position 0: 1 vs 0 (ties go to the first index); position 1: 0 vs 0
    assert kl_and_agreement(ref, ref) == (0.0, 1.0)
