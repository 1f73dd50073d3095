"""Check a checkpoint against the running engine before the engine is touched."""

from __future__ import annotations

from pathlib import Path

import torch

from ..errors import LayerwiseError
from ..plan import Plan
from ..sources import Checkpoint, open_checkpoint

_FLOAT_DTYPES = {"F64", "F32", "F16", "BF16"}


def reference_checkpoint(model_path: str) -> Checkpoint | None:
    """The checkpoint the engine was started from (its headers), if on this machine."""
    path = Path(model_path)
    if not path.exists():
        try:
            from huggingface_hub import snapshot_download

            path = Path(snapshot_download(model_path, local_files_only=True,
                                          allow_patterns=["*.safetensors", "*.json"]))
        except Exception:  # noqa: BLE001 - no local reference: the checks that need one are skipped
            return None
    try:
        return open_checkpoint(str(path))
    except LayerwiseError:
        return None


def preflight(plan: Plan, model: torch.nn.Module, vllm_names: dict[str, str],
              reference: Checkpoint | None, *, allow_partial: bool) -> list[str]:
    """Raise `LayerwiseError` if the checkpoint cannot be loaded cleanly.

    Checks, in this order: every tensor maps to a module of the engine that
    has parameters; with the engine's own starting checkpoint as reference,
    every tensor is one the engine knows with the same shape and a compatible
    dtype, and (unless `allow_partial`) every reference tensor is present.

    Args:
        plan: the source's plan (headers already validated when read).
        model: the engine's model.
        vllm_names: checkpoint name -> parent module name in the engine.
        reference: the engine's starting checkpoint, or None if unavailable.
        allow_partial: accept a checkpoint that covers only some parameters.

    Returns:
        Notes for the report (for example, that no reference was available).
    """
    source = plan.checkpoint.source
    notes: list[str] = []
    modules = dict(model.named_modules())
    for item in plan.file_order:
        if item.parent is None:
            continue
        module = modules.get(vllm_names[item.entry.name])
        if module is None or not any(True for _ in module.parameters(recurse=False)):
            raise LayerwiseError(
                f"tensor {item.entry.name!r} maps to {vllm_names[item.entry.name]!r}, which is not a "
                "parameterised module of the engine's model (unknown tensor or other architecture)",
                where=source,
            )
    if reference is None:
        notes.append("no reference checkpoint on this machine: shapes checked by vLLM's loaders only")
        return notes
    known = {t.name: t for t in reference.tensors}
    for entry in plan.checkpoint.tensors:
        ref = known.get(entry.name)
        if ref is None:
            raise LayerwiseError(f"unknown tensor {entry.name!r}: the engine's checkpoint has no such tensor",
                                 where=source)
        if ref.shape != entry.shape:
            raise LayerwiseError(
                f"tensor {entry.name!r} has shape {list(entry.shape)}, the engine expects {list(ref.shape)}",
                where=source,
            )
        if ref.dtype != entry.dtype and not (ref.dtype in _FLOAT_DTYPES and entry.dtype in _FLOAT_DTYPES):
            raise LayerwiseError(
                f"tensor {entry.name!r} has dtype {entry.dtype}, the engine expects {ref.dtype}", where=source
            )
    if not allow_partial:
        present = {t.name for t in plan.checkpoint.tensors}
        missing = [name for name in known if name not in present and plan.mapping.parent_of(name) is not None]
        if missing:
            shown = ", ".join(repr(m) for m in missing[:3])
            more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
            raise LayerwiseError(f"missing {len(missing)} tensor(s) the engine needs: {shown}{more} "
                                 "(--allow-partial to reload only what is there)", where=source)
    return notes
