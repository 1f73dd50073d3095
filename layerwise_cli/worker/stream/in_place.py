"""Let vLLM's reload load a layer into the engine's own tensors instead of fresh buffers, where nothing else changes.

vLLM's layerwise reload materializes each completed layer into freshly
allocated tensors (`materialize_layer`), runs the weight loaders into them,
processes the layer, and copies every tensor into the engine's storage
(`_copy_and_restore_kernel_tensors`). Where the engine's tensor has exactly
the layout of the fresh one (same class, shape, strides, dtype, device: the
layer's processing kept it as loaded) and the loaders write every element of
the layer (vLLM's own completion count), the fresh tensor and its copy add
nothing: layerwise hands vLLM a view of the engine's tensor instead. The
loaders then write in place, the processing reads and writes the same values
it would read and write in a fresh tensor, and vLLM's copy back is a copy of
a tensor onto itself, which torch skips. A processing step that replaces a
tensor (`layer.weight.data = packed`) replaces the view, and vLLM's copy back
writes the result into the engine's storage as before.

What this saves on the engine's thread: the allocation of every such tensor
(on the CPU, a large one is a fresh mapping whose pages fault on first write)
and one copy of its bytes. On an AVX-512 or AMX CPU that is the embedding,
the LM head, the norms, the mixers' own tensors and the MoE experts (vLLM
moves dense linear weights into kernel handles there, so their stored tensor
no longer has the loaded layout); where vLLM computes with the stored linear
weight (its `F.linear` fallback on AVX2 CPUs, a GPU) the linear layers too.

Everything else is vLLM's: the same loaders, the same processing, the same
bookkeeping the probe reads. A layer that does not qualify (first load,
incomplete, a layout the processing changed, tensors sharing storage) is
materialized by vLLM as usual.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from layerwise_cli import vllm_compat

# The diagnostic switch (`LAYERWISE_FRESH_BUFFERS=1`) lives where the client reads it too.
from layerwise_cli.engine_defaults import fresh_buffers_forced


@dataclass
class InPlaceLayers:
    """What one reload loaded in place: module names, and the bytes vLLM did not allocate for them."""

    names: set[str] = field(default_factory=set)
    bytes: int = 0


@contextlib.contextmanager
def in_place_materialization(model: torch.nn.Module, enabled: bool = True) -> Iterator[InPlaceLayers]:
    """While open, vLLM's reload materializes each qualifying layer of MODEL as views of the engine's tensors.

    Yields an `InPlaceLayers` filled as layers are materialized. With
    `enabled` False (or `LAYERWISE_FRESH_BUFFERS` set) nothing is changed.
    """
    done = InPlaceLayers()
    if not enabled or fresh_buffers_forced():
        yield done
        return
    reload_module = vllm_compat.reload_layerwise_module()
    original = reload_module.materialize_layer
    names = {id(module): name for name, module in model.named_modules()}

    def materialize_layer(layer: torch.nn.Module, info) -> None:
        views = kernel_views(layer, info)
        if views is None:
            original(layer, info)
            return
        for name, view in views.items():
            setattr(layer, name, view)
        done.names.add(names.get(id(layer), type(layer).__name__))
        done.bytes += sum(view.numel() * view.element_size() for view in views.values())

    reload_module.materialize_layer = materialize_layer
    try:
        yield done
    finally:
        reload_module.materialize_layer = original


def kernel_views(layer: torch.nn.Module, info) -> dict[str, torch.Tensor] | None:
    """For each tensor vLLM would materialize for LAYER, a view of the engine's own tensor; None: use vLLM's.

    Qualifies only a layer being reloaded (vLLM kept its engine tensors),
    not processed with the whole model (attention), whose loaders have copied
    every element (`load_numel` reached vLLM's own threshold, and no tensor
    declares padding the loaders skip), and where every tensor to materialize
    has an engine tensor of the same class, shape, strides, dtype and device
    that shares storage with no other tensor of the layer.
    """
    if info.kernel_tensors is None or info.load_numel_total is None or info.load_numel < info.load_numel_total:
        return None
    if vllm_compat.is_deferred_attention_layer(layer):
        return None
    params, buffers = info.kernel_tensors
    skip = vllm_compat.skip_tensors()
    views: dict[str, torch.Tensor] = {}
    storages: set[int] = set()
    for name, meta in vllm_compat.get_layer_tensors(layer).items():
        if name in skip or not meta.is_meta:
            continue
        kernel = params.get(name, buffers.get(name))
        if kernel is None or not same_layout(meta, kernel, info.restore_device):
            return None
        if getattr(meta, "weight_loader_numel", meta.numel()) != meta.numel():
            return None  # padding the loaders never write: vLLM's fresh tensor decides what it holds
        storage = kernel.untyped_storage().data_ptr()
        if storage in storages:
            return None
        storages.add(storage)
        view = kernel.detach()
        view.__class__ = meta.__class__
        view.__dict__ = meta.__dict__.copy()
        views[name] = view
    return views or None


def same_layout(meta: torch.Tensor, kernel: torch.Tensor, device) -> bool:
    """Whether KERNEL is what materializing META on DEVICE would allocate: class, shape, strides, dtype, device."""
    if kernel.is_meta or type(kernel) is not type(meta):
        return False
    if kernel.dtype != meta.dtype or kernel.shape != meta.shape or kernel.stride() != meta.stride():
        return False
    device = torch.device(device) if device is not None else torch.device("cpu")
    return kernel.device.type == device.type and (device.index is None or kernel.device.index == device.index)
