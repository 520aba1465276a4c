"""loopkv.serving.host_syncs: each counted call is counted once under the package of the code that made it, a tensor
built on a device from a tensor is not, torch's methods come back on exit, and the steps' counts are differences."""

import collections

import pytest
import torch

from loopkv.serving.host_syncs import Step, between, count_host_syncs, mean_per_step


def _call_from(filename: str, code: str, **names) -> dict:
    """Run ``code`` as if it were in ``filename`` (the frame the counter attributes the call to); its namespace."""
    exec(compile(code, filename, "exec"), names)
    return names


def test_calls_are_counted_by_the_callers_package():
    t = torch.arange(3)
    originals = {name: getattr(torch.Tensor, name) for name in ("tolist", "item", "__bool__", "__int__")}
    counts = collections.Counter()
    with count_host_syncs(counts):
        _call_from("/site-packages/transformers/generation/x.py", "t.tolist(); int(t[0]); bool(t[1])", t=t)
        _call_from("/repo/loopkv/cache/x.py", "t[0].item(); torch.tensor([1, 2], device='cpu')", t=t, torch=torch)
        _call_from("/repo/loopkv/ops/x.py", "t.tolist()", t=t)
        _call_from("/elsewhere/x.py", "torch.tensor([1])", torch=torch)  # no device argument
        with pytest.warns(UserWarning, match="copy construct"):
            _call_from("/elsewhere/x.py", "torch.tensor(t, device='cpu')", t=t, torch=torch)  # not host data
        assert _call_from("/elsewhere/x.py", "out = t.tolist()", t=t)["out"] == [0, 1, 2]  # the methods still work
    assert counts == {("transformers", "tolist"): 1, ("transformers", "__int__"): 1,
                      ("transformers", "__bool__"): 1, ("loopkv", "item"): 1, ("loopkv", "tensor(device=)"): 1,
                      ("loopkv.ops", "tolist"): 1, ("other", "tolist"): 1}
    assert {name: getattr(torch.Tensor, name) for name in originals} == originals
    t.tolist()
    assert sum(counts.values()) == 7  # nothing counted after the exit


def test_a_steps_syncs_are_those_until_the_next_step():
    c = collections.Counter
    steps = [Step(start_s=1.0, tokens=9, syncs=c()), Step(start_s=1.5, tokens=2, syncs=c({("loopkv", "item"): 2})),
             Step(start_s=1.75, tokens=2, syncs=c({("loopkv", "item"): 2, ("other", "tolist"): 1}))]
    got = between(steps)
    assert [(step.tokens, seconds) for step, seconds, _ in got] == [(9, 0.5), (2, 0.25)]
    assert [counts for _, _, counts in got] == [c({("loopkv", "item"): 2}), c({("other", "tolist"): 1})]
    assert mean_per_step([counts for _, _, counts in got]) == {"loopkv:item": 1.0, "other:tolist": 0.5}
    assert mean_per_step([]) == {}
