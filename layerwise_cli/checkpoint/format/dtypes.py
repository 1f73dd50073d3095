"""safetensors' dtype names and torch's dtypes: one table, read both ways (torch is imported on first use)."""

from __future__ import annotations

import functools

# safetensors' dtype name (its format's own spelling) -> the torch attribute of that dtype. A torch too old to
# have one (the float8 types, the unsigned ints) simply lacks it.
_TORCH_ATTRIBUTES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8",
    "U64": "uint64", "U32": "uint32", "U16": "uint16", "U8": "uint8",
    "BOOL": "bool", "C64": "complex64",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "F8_E4M3FNUZ": "float8_e4m3fnuz",
    "F8_E5M2FNUZ": "float8_e5m2fnuz", "F8_E8M0": "float8_e8m0fnu",
}


@functools.cache
def _by_name() -> dict:
    # torch only when a tensor is made: the planner and --help run without it.
    import torch  # noqa: PLC0415 - torch: heavy, only where a tensor is touched

    return {name: getattr(torch, attr) for name, attr in _TORCH_ATTRIBUTES.items() if hasattr(torch, attr)}


@functools.cache
def _by_dtype() -> dict:
    return {dtype: name for name, dtype in _by_name().items()}


def torch_dtype(name: str):
    """The torch dtype of a safetensors dtype name (`BF16`), as `safetensors.torch` maps it."""
    if name in _by_name():
        return _by_name()[name]
    from safetensors.torch import _getdtype  # noqa: PLC0415 - torch: heavy; its own table, for a name ours lacks

    return _getdtype(name)


def dtype_name(tensor) -> str | None:
    """The safetensors name of a torch tensor's dtype; None for a dtype safetensors cannot store."""
    return _by_dtype().get(tensor.dtype)
