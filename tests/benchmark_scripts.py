"""The benchmark scripts (``benchmarks/*.py``, not a package) imported as modules, for tests of their functions."""

import importlib
import pathlib
import sys

BENCHMARKS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"


def load(name: str):
    """``benchmarks/<name>.py`` as a module (the folder on ``sys.path``, as the scripts import each other)."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    return importlib.import_module(name)
