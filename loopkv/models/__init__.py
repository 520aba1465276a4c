"""Looped models: loopkv's clean-room Ouro and Huginn, and the small model loopkv ships.

``loopkv.models.register_ouro()`` registers ``model_type="ouro"`` with transformers' ``AutoConfig`` and
``AutoModelForCausalLM``: call it once, then ``AutoModelForCausalLM.from_pretrained(folder_or_hub_id)`` or
``pipeline("text-generation", model=...)`` loads an Ouro checkpoint; ``register_huginn()`` does the same for
``model_type="huginn_raven"`` (huginn-0125). Importing this package registers nothing
and imports no transformers.
"""

from __future__ import annotations

__all__ = ["register_huginn", "register_ouro"]


def register_huginn() -> None:
    """Register Huginn (``model_type="huginn_raven"``) with transformers' Auto classes (idempotent):
    :func:`loopkv.models.huginn.register_huginn`."""
    from loopkv.models.huginn import register_huginn as register

    register()


def register_ouro() -> None:
    """Register Ouro with transformers' Auto classes (idempotent): :func:`loopkv.models.ouro.register_ouro`."""
    from loopkv.models.ouro import register_ouro as register

    register()
