import os

import torch

# Without a GPU, Triton kernels run in the interpreter; it must be chosen before triton is imported
# (triton reads TRITON_INTERPRET when @triton.jit decorates), so set it here, first.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

# Under pytest-xdist (README's test command runs ``-n auto``) each worker is a process with torch's own thread pool:
# share the cores among the workers instead of giving every worker all of them
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // _WORKERS))


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


@pytest.fixture
def error_on_recompile():
    """Dynamo raises on any recompile while the test runs. Through ``config.patch``, not ``monkeypatch``:
    pytest >= 9.2's monkeypatch restores an attribute missing from the instance ``__dict__`` by deleting it,
    and deleting a torch config entry hides it, so every later recompile in the session failed with
    "torch._dynamo.config.error_on_recompile does not exist"."""
    with torch._dynamo.config.patch(error_on_recompile=True):
        yield
