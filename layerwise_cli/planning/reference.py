"""Compare a checkpoint's headers with the engine's starting checkpoint (its reference), without torch."""

from __future__ import annotations

from layerwise_cli.checkpoint.sources import Checkpoint
from layerwise_cli.errors import LayerwiseError
from layerwise_cli.planning.parents import LayerMapping

_FLOAT_DTYPES = {"F64", "F32", "F16", "BF16"}


def check_against_reference(checkpoint: Checkpoint, reference: Checkpoint, mapping: LayerMapping, *,
                            allow_partial: bool) -> None:
    """Raise `LayerwiseError` unless CHECKPOINT can replace REFERENCE's weights tensor for tensor.

    Every tensor must be one the reference has, with the same shape and a
    compatible dtype (floating dtypes convert into each other); unless
    `allow_partial`, every reference tensor that feeds a parent layer must
    be present. Tensors vLLM's loader skips on purpose (`mapping.skip_reason`:
    rotary buffers, a tied head, MTP layers) are neither unknown in CHECKPOINT
    nor missing from it. Headers only: this runs before an engine starts, and
    again inside every worker.

    Args:
        checkpoint: the new weights (`source` names them in errors).
        reference: the checkpoint the engine is (or will be) started from.
        mapping: tensor name -> parent layer (tensors without one are not required).
        allow_partial: accept a checkpoint that covers only some tensors.
    """
    source = checkpoint.source
    known = {t.name: t for t in reference.tensors}
    for entry in checkpoint.tensors:
        if mapping.skip_reason(entry.name) is not None:
            continue  # vLLM's loader never reads it: whether the reference has it does not matter
        ref = known.get(entry.name)
        if ref is None:
            raise LayerwiseError(f"unknown tensor {entry.name!r}: the engine's checkpoint has no such tensor, "
                                 "and vLLM's loader would not skip it", where=source)
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
        present = {t.name for t in checkpoint.tensors}
        missing = [name for name in known if name not in present and mapping.parent_of(name) is not None]
        if missing:
            shown = ", ".join(repr(m) for m in missing[:3])
            more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
            raise LayerwiseError(f"missing {len(missing)} tensor(s) the engine needs: {shown}{more} "
                                 "(--allow-partial to reload only what is there)", where=source)
