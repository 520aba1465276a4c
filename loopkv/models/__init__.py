"""Looped models: loopkv's clean-room Ouro and the small model loopkv ships.

``loopkv.models.register_ouro()`` registers ``model_type="ouro"`` with transformers' ``AutoConfig`` and
``AutoModelForCausalLM``: call it once, then ``AutoModelForCausalLM.from_pretrained(folder_or_hub_id)`` or
``pipeline("text-generation", model=...)`` loads an Ouro checkpoint. Importing this package registers nothing
and imports no transformers.
"""

from __future__ import annotations

__all__ = ["register_ouro"]


def register_ouro() -> None:
    """Register Ouro with transformers' Auto classes (idempotent): :func:`loopkv.models.ouro.register_ouro`."""
    from loopkv.models.ouro import register_ouro as register

    register()
