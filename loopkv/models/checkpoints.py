"""Where a checkpoint a user names lives: a folder, or a Hub id already in the local Hub cache. Never downloads.

:func:`checkpoint_folder` is what ``loopkv profile`` and ``loopkv eval`` resolve MODEL with (besides ``small``).
A Hub id is looked up as transformers does offline (``HF_HUB_OFFLINE=1``): ``snapshot_download(repo_id,
local_files_only=True)`` in the Hub cache (``HF_HUB_CACHE``, by default ``$HF_HOME/hub``), so a model fetched
once with ``hf download org/name`` or any ``from_pretrained`` works without network.

Only the standard library is imported at module level; ``huggingface_hub`` is imported by the lookup.
"""

from __future__ import annotations

import json
import os

__all__ = ["CheckpointError", "check_ouro_checkpoint", "checkpoint_folder"]


class CheckpointError(ValueError):
    """MODEL is not a checkpoint loopkv can load from where it was named; the message says what to do."""


def checkpoint_folder(spec: str, *, cache_dir: str | os.PathLike | None = None) -> str:
    """The folder of checkpoint ``spec``: ``spec`` itself when it is a folder, else the snapshot folder of the Hub
    id ``spec`` (``org/name``, revision ``main``) in the local Hub cache (``cache_dir``, default the Hub's cache).

    Raises :class:`CheckpointError` naming the cache it looked in; never touches the network.
    """
    if os.path.isdir(spec):
        return spec
    if os.path.exists(spec):
        raise CheckpointError(f"MODEL {spec} is a file, not a checkpoint folder; pass the folder that "
                                      "save_pretrained wrote (config.json and the weights), a Hub id or 'small'")
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    where = os.fspath(cache_dir) if cache_dir is not None else constants.HF_HUB_CACHE
    try:
        folder = snapshot_download(spec, local_files_only=True, cache_dir=cache_dir)
    except HFValidationError:  # not of the form name or org/name: a path that does not exist
        raise CheckpointError(
            f"MODEL {spec!r} is neither a checkpoint directory nor 'small': no such folder; pass the folder that "
            "save_pretrained wrote, a Hub id already in the local Hub cache (org/name), or 'small'") from None
    except (LocalEntryNotFoundError, FileNotFoundError):
        raise CheckpointError(
            f"MODEL {spec!r} is neither a checkpoint directory nor 'small', and the Hub id {spec} is not in the local "
            f"Hub cache ({where}); loopkv never downloads: fetch it first (hf download {spec}), set HF_HOME or "
            "HF_HUB_CACHE to the cache that holds it, or pass the checkpoint folder") from None
    if not os.path.isfile(os.path.join(folder, "config.json")):
        raise CheckpointError(
            f"MODEL {spec!r}: its snapshot in the local Hub cache ({folder}) has no config.json (an interrupted "
            f"download?); fetch it again (hf download {spec}) or pass the checkpoint folder")
    return folder


def check_ouro_checkpoint(folder: str) -> None:
    """Refuse a checkpoint whose ``config.json`` names another architecture than Ouro (``model_type``)."""
    try:
        with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
            model_type = json.load(f).get("model_type")
    except (OSError, ValueError, AttributeError):
        return  # unreadable or not a JSON object: from_pretrained names the problem
    if model_type not in (None, "ouro"):
        raise CheckpointError(
            f"MODEL {folder} is a {model_type!r} checkpoint (config.json's model_type); the loopkv command line "
            "loads Ouro checkpoints (model_type 'ouro'). Profile and evaluate another looped model from Python: "
            "README.md, 'Using it with your looped model'")
