"""`--verify` for layers quantized online: re-quantize SOURCE with the engine's own method, compare bit for bit."""

from __future__ import annotations

import torch

from layerwise_cli import vllm_compat
from layerwise_cli.worker.quantization.online_quant import quantized_by


def online_method(module: torch.nn.Module) -> str | None:
    """The name of the online quantization method of MODULE, or None if it is not quantized online.

    An online method (vLLM's `Fp8PerTensorOnlineLinearMethod`, its int8 MoE
    method, layerwise's `layerwise_fp8`/`layerwise_int8`) declares
    `uses_meta_device = True`: it loads the checkpoint-format weight and
    quantizes it in `process_weights_after_loading`.
    """
    method = getattr(module, "quant_method", None)
    if method is None or not getattr(method, "uses_meta_device", False):
        return None
    return quantized_by(module) or type(method).__name__


def drop_processing_outputs(scratch: torch.nn.Module, module: torch.nn.Module, info) -> list[str]:
    """Remove from SCRATCH the tensors MODULE's online method created when it processed the layer.

    The scratch copy must be in checkpoint format, as vLLM's reload restores a
    layer (`restore_layer_on_meta`): only the tensors of its reload metadata
    (the full-precision weight) and the ones vLLM leaves live (`bias`).
    Scales and other tensors the method creates in
    `process_weights_after_loading` would otherwise count as elements SOURCE
    does not cover, and processing the copy recreates them.

    Returns:
        The names removed.
    """
    skip_tensors = vllm_compat.load(vllm_compat.SKIP_TENSORS)

    if online_method(module) is None:
        return []
    restore_params, restore_buffers = info.restore_metadata
    keep = set(restore_params) | set(restore_buffers) | set(skip_tensors)
    dropped = [name for name in list(scratch._parameters) + list(scratch._buffers) if name not in keep]
    for name in dropped:
        scratch._parameters.pop(name, None)
        scratch._buffers.pop(name, None)
    return dropped


def require_recomputed(entry: dict, module: torch.nn.Module | None) -> dict:
    """A quantized layer is checked or failed: never "not checked".

    A layer quantized online that `--verify` could not re-quantize from
    SOURCE (skipped for any reason) becomes an error naming the method; one
    it compared is marked with the method (`quantized`), so the result says
    how many quantized layers were proven.
    """
    method = online_method(module) if module is not None else None
    if method is None:
        return entry
    entry = dict(entry, quantized=method)
    if entry["status"] == "skipped":
        entry.update(status="error", detail=f"quantized online by {method}; --verify could not re-quantize it "
                     f"from SOURCE: {entry['detail']}")
    return entry
