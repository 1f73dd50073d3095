"""Read a model's fused-module mapping from the installed vLLM's model class.

Returns plain data; `parents.mapping_for_config` builds the `LayerMapping`
(this module does not import `parents`, which imports it).
"""

from __future__ import annotations

import functools
import importlib.util
import sys

from layerwise_cli import vllm_compat
from layerwise_cli.errors import LayerwiseError


def vllm_installed() -> bool:
    """True when `vllm` can be found, without importing it."""
    try:
        return importlib.util.find_spec("vllm") is not None
    except (ImportError, ValueError):  # a meta-path finder refused it, or a broken vllm in sys.modules
        return False


@functools.lru_cache(maxsize=32)
def model_class_from_vllm(architecture: str) -> type | None:
    """vLLM's model class for ARCHITECTURE (None when vLLM does not know it); raises what vLLM's import raises."""
    return vllm_compat.model_class_for(architecture)


def model_class_if_installed(architecture: str | None) -> type | None:
    """vLLM's model class for ARCHITECTURE when vLLM is installed and knows it, else None (never raises)."""
    if not architecture or not vllm_installed():
        return None
    try:
        return model_class_from_vllm(architecture)
    except Exception:  # noqa: BLE001 - vLLM import failures vary by platform: the package's rules apply
        return None


def fusions_from_vllm(architecture: str, *, required: bool) -> tuple[dict[str, str], bool] | None:
    """Read the fusions of vLLM's model class for `architecture`.

    Reads what the class's `load_weights` fuses: `packed_modules_mapping`
    (q/k/v -> qkv_proj, ...) and the stacked renames of its
    `hf_to_vllm_mapper` (`.gate_proj` -> `.gate_up_proj`, ...), and whether it
    is a mixture-of-experts model (its experts load into one fused module per
    layer).

    Args:
        architecture: the name in `config.json`'s `architectures`.
        required: raise instead of returning None when vLLM cannot answer.

    Returns:
        (checkpoint module -> fused vLLM module, whether experts are fused),
        or None when vLLM is absent or does not know the architecture.
    """
    if not vllm_installed():
        if required:
            raise LayerwiseError("--mapping vllm needs vLLM installed (pip install 'layerwise[cpu]' or '[gpu]')")
        return None
    try:
        model_cls = model_class_from_vllm(architecture)
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
    mapper = getattr(model_cls, "hf_to_vllm_mapper", None)
    for original, (target, _shard) in (getattr(mapper, "orig_to_new_stacked", None) or {}).items():
        # ".mlp.gate_proj" -> ".mlp.gate_up_proj": the module names are the last parts.
        packed[original.rsplit(".", 1)[-1]] = target.rsplit(".", 1)[-1]
    return packed, _is_moe(model_cls)


def _is_moe(model_cls: type) -> bool:
    # MixtureOfExperts is a Protocol with data members, so issubclass() refuses
    # it; vLLM's MoE models name it as a base class.
    try:
        MixtureOfExperts = vllm_compat.mixture_of_experts_class()
    except Exception:  # noqa: BLE001
        MixtureOfExperts = None
    if MixtureOfExperts is not None and MixtureOfExperts in model_cls.__mro__:
        return True
    # MoE models that do not implement expert load balancing still expose
    # their checkpoint -> fused-experts mapping, or build their experts from
    # vLLM's FusedMoE layers (FusedMoE, SharedFusedMoE, FusedMoEFactory, ...).
    if callable(getattr(model_cls, "get_expert_mapping", None)):
        return True
    module = sys.modules.get(model_cls.__module__)
    return any("FusedMoE" in name for name in vars(module)) if module is not None else False
