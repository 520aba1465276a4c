import os

import torch

# Without a GPU, Triton kernels run in the interpreter; it must be chosen before triton is imported
# (triton reads TRITON_INTERPRET when @triton.jit decorates), so set it here, first.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def interpret_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"
