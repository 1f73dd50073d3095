"""Private copies of one engine layer, loaded from SOURCE by vLLM's own loaders, for checks and repairs."""

from __future__ import annotations

import copy
from types import MethodType

from layerwise_cli import vllm_compat


def scratch_copy(module, info, exclude: frozenset[str] = frozenset()):
    """A private copy of `module` in checkpoint format, sharing no tensor a loader could write into.

    Args:
        module: the engine's layer.
        info: vLLM's reload record of it (`LAYERWISE_INFO[module]`).
        exclude: tensors of the module the copy leaves out (buffers derived
            from another layer's weights: `derived_state`; they are not loaded).
    """
    import torch  # noqa: PLC0415 - torch: heavy, only where a tensor is touched

    scratch = copy.copy(module)
    scratch._parameters = {}
    scratch._buffers = {}
    scratch._modules = dict(module._modules)
    scratch._non_persistent_buffers_set = set(module._non_persistent_buffers_set) - set(exclude)
    scratch.__dict__.pop("_already_called_process_weights_after_loading", None)
    # The engine's kernel handle must not answer for the copy: processing builds the copy's own.
    scratch.__dict__.pop("cpu_linear", None)
    restore_params, restore_buffers = info.restore_metadata
    with torch.device(info.restore_device):
        for name, meta in restore_params.items():
            scratch.register_parameter(name, _fresh_tensor(meta, scratch, module, zeros=True))
        for name, meta in restore_buffers.items():
            scratch.register_buffer(name, _fresh_tensor(meta, scratch, module, zeros=True),
                                    persistent=name not in scratch._non_persistent_buffers_set)
    # Tensors vLLM leaves out of its metadata (`bias`, expert maps) stay live on
    # the engine's layer: give the copy its own clones of them.
    for name, tensor in module._parameters.items():
        if tensor is not None and name not in scratch._parameters and name not in exclude:
            scratch.register_parameter(name, _fresh_tensor(tensor, scratch, module, zeros=False))
    for name, tensor in module._buffers.items():
        if tensor is not None and name not in scratch._buffers and name not in exclude:
            scratch.register_buffer(name, _fresh_tensor(tensor, scratch, module, zeros=False),
                                    persistent=name not in scratch._non_persistent_buffers_set)
    return scratch


def _fresh_tensor(template, scratch, module, *, zeros: bool):
    """A new tensor shaped like `template` (zeros, or a copy of its values), with its attributes.

    Weight loaders bound to the engine's layer (or to vLLM's placeholder) are
    rebound to the copy, and layerwise's buffering wrappers are removed, so
    that loading the copy never touches the engine's layer or its buffers.
    """
    import torch  # noqa: PLC0415 - torch: heavy, only where a tensor is touched

    layer_ref_sentinel = vllm_compat.layer_ref_sentinel()

    if zeros or template.device.type == "meta":
        tensor = torch.zeros(tuple(template.shape), dtype=template.dtype)
    else:
        tensor = template.detach().clone()
    tensor.__class__ = template.__class__
    attributes = {}
    for key, value in template.__dict__.items():
        while callable(value) and getattr(value, "__name__", "") == vllm_compat.ONLINE_PROCESS_LOADER_NAME:
            value = value.__wrapped__
        if isinstance(value, MethodType) and (value.__self__ is module or value.__self__ is layer_ref_sentinel):
            value = value.__func__.__get__(scratch)
        attributes[key] = value
    tensor.__dict__ = attributes
    return tensor


def load_alone(model, name: str, scratch, tensors: list) -> int:
    """Load TENSORS (SOURCE's tensors of layer NAME) into SCRATCH through `model.load_weights`.

    The copy stands in for the engine's layer only while the model's own
    loader runs (its name mapping, fusing and sharding apply), then the
    engine's layer is put back. Nothing is processed.

    Returns:
        The number of elements the loaders copied into the layer.
    """
    CopyCounter = vllm_compat.copy_counter_class()

    module = model.get_submodule(name)
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    parent._modules[child] = scratch
    try:
        with CopyCounter() as counter:
            model.load_weights(iter(tensors))
    finally:
        parent._modules[child] = module
    return counter.copied_numel


def process_copy(scratch) -> None:
    """What vLLM does to a layer once all its weights are loaded (repacking, online quantization)."""
    quant_method = getattr(scratch, "quant_method", None)
    if isinstance(quant_method, vllm_compat.quantize_method_base_class()):
        if getattr(quant_method, "moe_kernel", None) is not None:
            # Process the copy as a fresh engine does, not as a weight update:
            # vLLM's MoE methods skip the kernel's own processing (CPU prepack)
            # once a kernel exists, which is what a reload gets wrong on CPU.
            quant_method = copy.copy(quant_method)
            quant_method.moe_kernel = None
            scratch.quant_method = quant_method
        quant_method.process_weights_after_loading(scratch)
        if hasattr(scratch, "update_param_tp_status"):
            scratch.update_param_tp_status()
