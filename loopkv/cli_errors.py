"""What the ``loopkv`` command line does with a user's mistake, and the checks it makes before any work.

A user error ends the command with exit status 2 and one line on stderr, ``loopkv COMMAND: error: ...``,
that names the problem and the fix; never a traceback. Ctrl-C ends it with status 130 (what a shell reports
for SIGINT) and one line. The checks here run before a command loads a model or computes anything: output
paths, input files, the device, the model directory; the token ids of ``--documents`` are checked as each
file is read, naming the file.

Only the standard library is imported at module level (``import loopkv.cli`` stays light).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

EXIT_ERROR = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT


class UserError(ValueError):
    """A mistake in what the user passed; its message names the problem and the fix."""


def one_line(text: Any) -> str:
    """``text`` with every run of whitespace, newlines included, as one space."""
    return " ".join(str(text).split())


def run_command(name: str, command: Callable[[Any], int], args: Any) -> int:
    """``command(args)``, with a user error or Ctrl-C turned into one line on stderr and exit status 2 / 130."""
    try:
        return command(args)
    except KeyboardInterrupt:
        print(f"loopkv {name}: interrupted{_resume_hint(name, args)}", file=sys.stderr)
        return EXIT_INTERRUPTED
    except OSError as err:  # a path that is missing, a folder, not permitted: after the up-front checks, rare
        message = _describe_os_error(err)
    except ValueError as err:  # UserError and the library's ValueErrors, which name the argument and the fix
        message = one_line(err)
    print(f"loopkv {name}: error: {message}", file=sys.stderr)
    return EXIT_ERROR


def _resume_hint(name: str, args: Any) -> str:
    out = getattr(args, "out", None)
    if name == "profile" and out and os.path.isfile(out):
        return f"; the partial profile is saved in {out}: rerun with --resume to continue it"
    return ""


def _describe_os_error(err: OSError) -> str:
    path = err.filename if err.filename is not None else "a path"
    if isinstance(err, IsADirectoryError):
        return f"{path} is a folder; pass a file"
    if isinstance(err, FileNotFoundError):
        return f"{path} does not exist; check the path"
    if isinstance(err, PermissionError):
        return f"no permission to use {path}; pass a path you can read and write"
    return one_line(err)


# ------------------------------------------------------------------------------------------- paths
def check_output_file(path: str, flag: str, *, default_name: str = "out.json") -> None:
    """Refuse, before any work, an output path that cannot be written: a folder, a folder that does not
    exist, a folder without write permission."""
    if os.path.isdir(path):
        raise UserError(f"{flag} {path} is a folder; pass a file path such as {os.path.join(path, default_name)}")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise UserError(f"{flag} {path}: the folder {parent} does not exist; create it first or pass a path in an "
                        "existing folder")
    if not os.access(parent, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise UserError(f"{flag} {path} cannot be written (no permission); pass a path you can write")


def check_output_dir(path: str, flag: str) -> None:
    """Refuse, before any work, an output folder that is a file or cannot be created or written."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise UserError(f"{flag} {path} is a file, not a folder; pass a folder path (created if missing)")
    existing = os.path.abspath(path)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing) or not os.access(existing, os.W_OK):
        raise UserError(f"{flag} {path} cannot be created or written in {existing}; pass a folder you can write")


def png_path(path: str) -> str:
    """The file a PNG for ``path`` is written to: ``path`` itself when it ends in ``.png``, else ``path.png``
    (what matplotlib would write for a name without a suffix; a name with another suffix gets ``.png`` too)."""
    return path if path.lower().endswith(".png") else path + ".png"


def check_input_file(path: str, what: str) -> None:
    """Refuse a missing input file or a folder given as a file, naming the argument."""
    if os.path.isdir(path):
        raise UserError(f"{what} {path} is a folder; pass the file itself")
    if not os.path.exists(path):
        raise UserError(f"{what} {path} does not exist; check the path")


@contextmanager
def reading(path: str, what: str, *, kind: str) -> Iterator[None]:
    """Read the loopkv JSON file ``path`` (``kind``: "plan" or "profile") inside the block; any error while
    reading or checking it names the file: empty, binary and truncated files included."""
    check_input_file(path, what)
    try:
        yield
    except UserError:
        raise
    except UnicodeDecodeError as err:
        raise UserError(f"{what} {path} is not a text file; pass the {kind} JSON that loopkv wrote") from err
    except ValueError as err:
        cause = err if isinstance(err, json.JSONDecodeError) else err.__cause__
        if isinstance(cause, json.JSONDecodeError):
            state = "empty" if not cause.doc.strip() else f"{cause.msg} at line {cause.lineno} column {cause.colno}"
            raise UserError(f"{what} {path} is not valid JSON ({state}); pass the {kind} JSON that loopkv wrote "
                            "(write it again if it was cut short)") from err
        raise UserError(f"{what} {path}: {one_line(err)}") from err


# ------------------------------------------------------------------------------------ model, device
def check_model_dir(path: str) -> None:
    """Refuse a checkpoint folder without ``config.json`` (an empty folder, a parent folder)."""
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise UserError(f"MODEL {path} has no config.json, so it is not a checkpoint folder; pass the folder that "
                        "save_pretrained wrote (config.json and the weights), or 'small'")


def resolve_device(spec: str | None) -> str:
    """``--device``: a torch device this machine has (default cuda if available, else cpu)."""
    import torch

    if spec is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(spec)
    except (RuntimeError, ValueError) as err:
        raise UserError(f"--device {spec!r} is not a torch device ({one_line(err)}); pass cpu, cuda or cuda:N") from err
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise UserError(f"--device {spec}: torch sees no CUDA GPU on this machine; pass --device cpu")
        if device.index is not None and device.index >= count:
            raise UserError(f"--device {spec}: this machine has {count} CUDA GPU(s), cuda:0 to cuda:{count - 1}; "
                            "pass one of them")
    elif device.type == "meta":
        raise UserError("--device meta holds no data; pass cpu, cuda or cuda:N")
    elif device.type != "cpu":
        try:
            torch.empty(1, device=device)
        except (RuntimeError, AssertionError) as err:
            raise UserError(f"--device {spec} is not usable here ({one_line(err)}); pass cpu, cuda or cuda:N") from err
    return spec


# ---------------------------------------------------------------------------------------- documents
def read_token_file(path: str) -> Any:
    """The content of a ``.pt`` or ``.npy`` token-id file; ``UserError`` naming it if it cannot be read."""
    check_input_file(path, "--documents")
    try:
        if path.endswith(".npy"):
            import numpy as np

            return np.load(path)
        import torch

        return torch.load(path, map_location="cpu", weights_only=True)
    except OSError:
        raise
    except Exception as err:  # noqa: BLE001 (pickle, zip and numpy each raise their own type for a bad file)
        raise UserError(f"--documents {path} cannot be read as token ids ({type(err).__name__}: "
                        f"{one_line(err)[:200]}); save a tensor of token ids with torch.save or numpy.save") from err


def token_rows(data: Any, path: str, *, vocab_size: int) -> list:
    """The documents of a token-id file's content ``data`` (a tensor, array or list, [N] or [n, N]) as 1-D
    ``int64`` tensors; ``UserError`` naming ``path`` for anything else or an id outside the vocabulary."""
    import numpy as np
    import torch

    fix = "save a tensor of token ids, [N] or [n, N] (torch.save(ids, path) or numpy.save)"
    if isinstance(data, np.ndarray):
        data = torch.from_numpy(data)
    if isinstance(data, (list, tuple)) and all(isinstance(r, (torch.Tensor, np.ndarray)) for r in data):
        rows = [torch.as_tensor(r) for r in data]
    elif isinstance(data, (torch.Tensor, list, tuple)):
        try:
            tensor = torch.as_tensor(data)
        except (TypeError, ValueError, RuntimeError) as err:
            raise UserError(f"--documents {path} holds a {type(data).__name__} that is not token ids; {fix}") from err
        if tensor.dim() not in (1, 2):
            raise UserError(f"--documents {path} holds a {tensor.dim()}-D tensor {list(tensor.shape)}; {fix}")
        rows = [tensor] if tensor.dim() == 1 else list(tensor)
    else:
        raise UserError(f"--documents {path} holds a {type(data).__name__}, not token ids; {fix}")
    if not rows:
        raise UserError(f"--documents {path} holds no documents; {fix}")
    out = []
    for i, row in enumerate(rows):
        where = f"--documents {path}" + (f" (document {i})" if len(rows) > 1 else "")
        if row.dim() != 1 or row.numel() == 0:
            raise UserError(f"{where} is not a non-empty 1-D row of token ids (shape {list(row.shape)}); {fix}")
        if row.dtype.is_floating_point or row.dtype.is_complex or row.dtype == torch.bool:
            raise UserError(f"{where} holds {row.dtype} values, not integer token ids; {fix}")
        low, high = int(row.min()), int(row.max())
        if low < 0 or high >= vocab_size:
            raise UserError(f"{where} has token id {high if high >= vocab_size else low} but the model's vocabulary "
                            f"is ids 0 to {vocab_size - 1}; tokenize the documents with this model's tokenizer")
        out.append(row.long())
    return out
