"""README.md's Python runs as written: every ```` ```python ```` block, in order, in one namespace, in a fresh folder,
on the CPU in CI and on the GPU where there is one (the small model loopkv ships stands in for a user's checkpoint, as
the README's code says; about 45 s on 2 CPU cores).

The rule, stated in README.md too: a block whose fence reads ```` ```python skip: <reason> ```` is not run (it needs
a GPU, a downloaded checkpoint, or hours); the reason must be given. Every other Python block runs.
"""

from __future__ import annotations

import pathlib
import re

import pytest
import torch

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
FENCE = re.compile(r"^```(?P<lang>py\w*)(?P<info>[^\n]*)\n(?P<code>.*?)^```[ \t]*$", re.DOTALL | re.MULTILINE)
SKIP = re.compile(r"^\s+skip:\s*(?P<reason>\S.*)$")


def python_blocks(text: str) -> list[tuple[int, str, str | None]]:
    """(line, code, skip reason or None) of each ```` ```python ```` block of ``text``; a fence with any other info
    than ``skip: <reason>``, or another name for Python (``py``, ``python3``), is an error, so that a typo cannot
    skip a block silently."""
    blocks = []
    for m in FENCE.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        info = m.group("info")
        skip = SKIP.match(info)
        if m.group("lang") != "python" or (info.strip() and not skip):
            raise ValueError(f"README.md line {line}: fence {m.group('lang') + info!r}; use ```python or "
                             "```python skip: <reason>")
        blocks.append((line, m.group("code"), skip.group("reason") if skip else None))
    return blocks


def test_the_fence_rule_finds_blocks_and_reasons():
    text = "a\n```python\nx = 1\n```\n```bash\nls\n```\n```python skip: needs a GPU\ny = 2\n```\n"
    assert python_blocks(text) == [(2, "x = 1\n", None), (8, "y = 2\n", "needs a GPU")]
    with pytest.raises(ValueError, match="line 2"):
        python_blocks("a\n```python skip\nx = 1\n```\n")  # no reason: refused, not skipped
    with pytest.raises(ValueError, match="line 1"):
        python_blocks("```python gpu\nx = 1\n```\n")
    with pytest.raises(ValueError, match="line 1"):
        python_blocks("```py\nx = 1\n```\n")


def test_readme_python_runs(tmp_path, monkeypatch):
    blocks = python_blocks(README.read_text())
    runnable = [(line, code) for line, code, reason in blocks if reason is None]
    assert len(runnable) >= 2, "README.md's checkpoint-to-plan steps are Python blocks that run"
    monkeypatch.chdir(tmp_path)  # the blocks write profile.json and plan.json where they run
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # many small ops on a shared 2-core machine: one thread is the fast choice
    namespace: dict = {"__name__": "__readme__"}
    try:
        for line, code in runnable:
            exec(compile(code, f"README.md:{line}", "exec"), namespace)  # README's code, as a user runs it
    finally:
        torch.set_num_threads(threads)
    assert (tmp_path / "plan.json").exists()
