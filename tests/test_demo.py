"""``loopkv demo`` runs end to end on the shipped small model in a reduced setting (the CI check of the
README's main command; the full demo runs the same code with more prompts)."""

import pytest
import torch


def test_demo_quick_prints_the_table(tmp_path, capsys):
    from loopkv.cli import main

    assert main(["demo", "--quick", "--out", str(tmp_path), "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    for arm in ("BF16 (exact)", "KIVI-4", "KIVI-4 + V", "LoopKV-R", "LoopKV-M"):
        assert arm in out
    head = next(line for line in out.splitlines() if line.startswith("arm "))
    assert "ret@512" in head  # --quick runs what its help says
    assert "generate" in head
    assert "tok/s" not in head  # the CPU reference ops' speed is not the GPU story
    assert "KL (nats): mean over positions of KL(exact || arm)" in out
    assert "no tok/s column on cpu" in out
    assert (tmp_path / "loopkv-r.png").stat().st_size > 0
    assert (tmp_path / "loopkv-m.json").is_file()


def test_demo_help_says_what_quick_runs_and_where_it_writes(capsys):
    from loopkv.cli import main
    from loopkv.demo import _parse

    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "default: loopkv-demo/ in the current folder" in text
    quick = _parse(["--quick"])
    assert (f"retrieval on {quick.prompts} prompt of {quick.contexts} tokens, KL on {quick.kl_docs} document of "
            f"{quick.kl_len} tokens, generate on a {quick.gen_context}-token prompt") in text
    assert _parse([]).out == "loopkv-demo"


def test_demo_refuses_an_output_path_that_is_a_file_before_the_work(tmp_path, capsys, monkeypatch):
    from loopkv.cli import main

    def load_small(**kwargs):
        raise AssertionError("the demo loaded the model before checking --out")

    monkeypatch.setattr("loopkv.models.small.load_small", load_small)
    taken = tmp_path / "taken"
    taken.write_text("")
    assert main(["demo", "--quick", "--out", str(taken)]) == 2
    assert capsys.readouterr().err.strip() == (f"loopkv demo: error: --out {taken} is a file, not a folder; pass a "
                                               "folder path (created if missing)")


def test_table_shows_tok_s_only_when_asked():
    from loopkv.demo import Arm, format_table

    arms = [Arm("BF16 (exact)", None, stored_kib=24.0, retrieval={512: 1.0}, tok_s=12.5, answer_ok=True),
            Arm("KIVI-4", None, stored_kib=7.5, retrieval={512: 0.5}, tok_s=3.25, answer_ok=False)]
    gpu, cpu = format_table(arms, [512], tok_s=True), format_table(arms, [512], tok_s=False)
    assert gpu.splitlines()[0].split()[-1] == "tok/s"
    assert gpu.splitlines()[2].split()[-2:] == ["right", "12.5"]
    assert "tok/s" not in cpu
    assert cpu.splitlines()[3].split()[-1] == "wrong"


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
