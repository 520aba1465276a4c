"""``loopkv demo`` runs end to end on the shipped small model in a reduced setting (the CI check of the
README's main command; the full demo runs the same code with more prompts)."""

import pytest

from loopkv.models.small import SMALL_DIR


@pytest.mark.skipif(not (SMALL_DIR / "profile.json").is_file(), reason="the small model's profile is not shipped")
def test_demo_quick_prints_the_table(tmp_path, capsys):
    from loopkv.cli import main

    assert main(["demo", "--quick", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for arm in ("BF16 (exact)", "KIVI-4", "KIVI-4 + V", "LoopKV-R", "LoopKV-M"):
        assert arm in out
    assert (tmp_path / "loopkv-r.png").stat().st_size > 0
    assert (tmp_path / "loopkv-m.json").is_file()
