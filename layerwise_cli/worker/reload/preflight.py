"""Check a checkpoint against the running engine before the engine is touched."""

from __future__ import annotations

from pathlib import Path

import torch

from layerwise_cli import vllm_compat
from layerwise_cli.checkpoint.hub.repo import download_checkpoint
from layerwise_cli.checkpoint.sources import Checkpoint, open_checkpoint
from layerwise_cli.errors import LayerwiseError
from layerwise_cli.planning.plan import Plan
from layerwise_cli.planning.reference import check_against_reference
from layerwise_cli.planning.skip_rules import skip_summary
from layerwise_cli.worker.stream.rank_plan import takes_checkpoint_tensors


def reference_checkpoint(model_path: str) -> Checkpoint | None:
    """The checkpoint the engine was started from (its headers), if on this machine."""
    path = Path(model_path)
    if not path.exists():
        try:
            path = download_checkpoint(model_path, local_files_only=True)
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
        Notes for the report: the tensors skipped as vLLM does (never read),
        and that no reference was available, if so.
    """
    source = plan.checkpoint.source
    notes: list[str] = []
    skipped = skip_summary(plan.skip_reasons)
    if skipped:
        notes.append(skipped)
    modules = dict(model.named_modules())
    for item in plan.file_order:
        if item.parent is None:
            continue
        module = modules.get(vllm_names[item.entry.name])
        if not takes_checkpoint_tensors(module):
            raise LayerwiseError(
                f"tensor {item.entry.name!r} maps to {vllm_names[item.entry.name]!r}, which is not a "
                "module of the engine's model with parameters or persistent buffers of its own (unknown tensor "
                "or other architecture)",
                where=source,
            )
    if reference is None:
        notes.append("no reference checkpoint on this machine: shapes checked by vLLM's loaders only")
        _refuse_partly_covered_layers(plan)
        return notes
    check_against_reference(plan.checkpoint, reference, plan.mapping, allow_partial=allow_partial)
    _refuse_partly_covered_layers(plan)
    return notes


def _refuse_partly_covered_layers(plan: Plan) -> None:
    """Refuse a fused layer the checkpoint covers only partly, even with --allow-partial.

    vLLM never completes such a layer while streaming; at the end it
    materializes the whole layer from fresh memory (uninitialized before vLLM
    0.34, zeros from 0.34), loads the parts it got and copies all of it into
    place, so the missing parts would not keep their weights.
    """
    partial = [hold for hold in plan.held.values() if hold.kind == "partial"]
    if partial:
        first = partial[0]
        more = f" (and {len(partial) - 1} more layer(s))" if len(partial) > 1 else ""
        raise LayerwiseError(
            f"fused layer {first.name} is only partly in the checkpoint: {first.reason}{more}; vLLM would "
            "overwrite the missing part with fresh memory, so a partial checkpoint must hold every "
            "part of each fused layer it touches", where=plan.checkpoint.source)


def refuse_direct_mode() -> None:
    """Raise `LayerwiseError` when this engine's vLLM reloads in its direct mode (0.34's `VLLM_RELOAD_MODE=direct`).

    The direct mode writes each tensor straight into the engine's storage and
    re-processes the whole model at the end: no per-layer buffers, none of the
    bookkeeping layerwise measures, skips and rolls back by, and no rollback
    of its own. layerwise drives the layerwise mode only; the check runs
    before anything of the engine is touched.
    """
    if vllm_compat.reload_mode() == "direct":
        raise LayerwiseError("this engine's vLLM runs its direct reload mode (VLLM_RELOAD_MODE=direct): layerwise "
                             "drives the layerwise mode only; start the engine without VLLM_RELOAD_MODE=direct")
