"""What every benchmark records about its run: device, versions, date and the command line; and how it writes it."""

from __future__ import annotations

import datetime
import json
import os
import pathlib
import platform
import shlex
import sys
from collections.abc import Sequence

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def device_name(device) -> str:
    """The GPU's name, or the CPU's architecture and core count."""
    import torch

    if torch.device(device).type == "cuda":
        return torch.cuda.get_device_name(torch.device(device))
    return f"cpu ({platform.machine()}, {os.cpu_count()} cores, {torch.get_num_threads()} threads)"


def versions() -> dict:
    import torch
    import transformers

    import loopkv

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:  # triton is optional off Linux
        triton_version = None
    return {"torch": torch.__version__, "triton": triton_version, "transformers": transformers.__version__,
            "loopkv": loopkv.__version__, "cuda": torch.version.cuda, "python": platform.python_version()}


def command(script: str, argv: Sequence[str] | None) -> str:
    """The command line that ran ``script`` (a benchmark's ``__file__``) with ``argv`` (None: this process's)."""
    args = sys.argv[1:] if argv is None else list(argv)
    return shlex.join(["python", os.path.relpath(script, ROOT), *args])


def run_info(script: str, argv: Sequence[str] | None, device) -> dict:
    """The fields every result JSON starts with."""
    return {"benchmark": pathlib.Path(script).stem, "command": command(script, argv), "device": device_name(device),
            "versions": versions(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def write_json(path: str | os.PathLike, result: dict) -> None:
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1, default=str) + "\n")
