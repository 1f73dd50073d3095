"""Read a model's fused-module mapping from the installed vLLM's model class."""

from __future__ import annotations

import importlib.util

from .errors import LayerwiseError
from .parents import LayerMapping


def vllm_installed() -> bool:
    """True when `vllm` can be imported, without importing it."""
    return importlib.util.find_spec("vllm") is not None


def mapping_from_vllm(architecture: str, tie_word_embeddings: bool, *, required: bool) -> LayerMapping | None:
    """Build a mapping from vLLM's model class for `architecture`.

    Reads the class's `packed_modules_mapping` (q/k/v -> qkv_proj, ...) and
    whether it is a mixture-of-experts model (its experts load into one fused
    module per layer).

    Args:
        architecture: the name in `config.json`'s `architectures`.
        tie_word_embeddings: whether the checkpoint ties `lm_head` to the embeddings.
        required: raise instead of returning None when vLLM cannot answer.

    Returns:
        The mapping, or None when vLLM is absent or does not know the architecture.
    """
    if not vllm_installed():
        if required:
            raise LayerwiseError("--mapping vllm needs vLLM installed (pip install 'layerwise[cpu]' or '[gpu]')")
        return None
    try:
        from vllm.model_executor.models import ModelRegistry

        model_cls = ModelRegistry._try_load_model_cls(architecture)  # noqa: SLF001 - no public lookup by name
    except Exception as exc:  # vLLM import failures vary by platform
        if required:
            raise LayerwiseError(f"vLLM could not load the model class for {architecture}: {exc}") from exc
        return None
    if model_cls is None:
        if required:
            raise LayerwiseError(f"vLLM has no model class for architecture {architecture!r}")
        return None
    packed: dict[str, str] = {}
    for fused, parts in (getattr(model_cls, "packed_modules_mapping", None) or {}).items():
        for part in parts:
            packed[part] = fused
    fused_experts = bool(getattr(model_cls, "is_mixture_of_experts", False)) or _has_moe_interface(model_cls)
    return LayerMapping("vllm", architecture, packed, fused_experts, tie_word_embeddings)


def _has_moe_interface(model_cls: type) -> bool:
    try:
        from vllm.model_executor.models.interfaces import MixtureOfExperts

        return issubclass(model_cls, MixtureOfExperts)
    except Exception:
        return False
