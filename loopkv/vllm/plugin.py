"""The ``vllm.general_plugins`` entry point (pyproject.toml): ``loopkv = "loopkv.vllm.plugin:register"``.

vLLM calls :func:`register` in every process it starts (vllm/plugins/__init__.py, ``load_general_plugins``),
maybe more than once, so it is idempotent. It refuses a vLLM outside the supported range, reads the plan named by
``$LOOPKV_PLAN`` (a bad file fails vLLM's start with the reason), and makes vLLM build Ouro from
:class:`loopkv.vllm.model.LoopKVOuroForCausalLM` (a lazy ``module:Class`` string: nothing of the model or CUDA is
imported here). ``VLLM_PLUGINS`` (vLLM's own filter) can leave loopkv out.
"""

from __future__ import annotations

from loopkv.vllm.settings import load_plan

SUPPORTED_VLLM = ">=0.26,<0.27"  # the series whose internals docs/vllm.md reads; pyproject's `vllm` extra
OURO_ARCHITECTURE = "OuroForCausalLM"
MODEL_CLASS = "loopkv.vllm.model:LoopKVOuroForCausalLM"

_registered = False


def check_vllm_version(version: str) -> None:
    """Raise ``RuntimeError`` naming the supported range when ``version`` (vLLM's) is outside it."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    try:
        parsed = Version(version)
    except InvalidVersion as err:
        raise RuntimeError(f"cannot read the installed vLLM's version {version!r}; loopkv's plugin supports "
                           f"vllm{SUPPORTED_VLLM}") from err
    if not SpecifierSet(SUPPORTED_VLLM).contains(parsed, prereleases=True):
        raise RuntimeError(
            f"loopkv's vLLM plugin supports vllm{SUPPORTED_VLLM} and vLLM {version} is installed: its attention "
            f"and KV-cache internals differ between releases. Install `pip install 'loopkv[vllm]'` (vllm"
            f"{SUPPORTED_VLLM}), or leave loopkv out of this vLLM with VLLM_PLUGINS set to the plugins you want")


def installed_vllm_version() -> str:
    """The installed vLLM's version, from its package metadata (no vLLM import)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("vllm")
    except PackageNotFoundError:
        import vllm  # installed without metadata (a copied tree): its own attribute

        return vllm.__version__


def register() -> None:
    """Check vLLM's version and the ``$LOOPKV_PLAN`` file, and serve Ouro through loopkv's model class."""
    global _registered
    if _registered:
        return
    check_vllm_version(installed_vllm_version())
    load_plan()  # $LOOPKV_PLAN only; additional_config is read where vLLM builds the model
    from vllm import ModelRegistry

    ModelRegistry.register_model(OURO_ARCHITECTURE, MODEL_CLASS)
    _registered = True
