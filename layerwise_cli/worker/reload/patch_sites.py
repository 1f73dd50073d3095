"""Where a sparse delta's tensors lie in the engine, and which layers must not be patched in place (`delta_patch`).

A place is proposed from the module that loads a tensor (its parameter or buffer of that name, whole, or its
share of a fused one in the order of the model's `packed_modules_mapping`) and taken only when the engine's
bytes there sample as the layer's record says the tensor was loaded (`checkpoint.samples`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from layerwise_cli.checkpoint.format.dtypes import torch_dtype
from layerwise_cli.checkpoint.format.header import TensorEntry
from layerwise_cli.checkpoint.format.samples import sample_digest
from layerwise_cli.planning.plan import PlannedTensor
from layerwise_cli.worker.state.layer_records import LayerRecord


@dataclass(frozen=True)
class PatchSite:
    """Where one checkpoint tensor's bytes are in the engine: a contiguous run of one of its tensors.

    Attributes:
        entry: the checkpoint tensor.
        module: the engine module holding it.
        attribute: the parameter or buffer of that module.
        offset: where the run starts in that tensor, in elements.
    """

    entry: TensorEntry
    module: str
    attribute: str
    offset: int

    def region(self, modules: Mapping[str, torch.nn.Module]) -> torch.Tensor:
        """The run, as a flat view of the engine's tensor."""
        return stored(modules[self.module], self.attribute).detach().view(-1).narrow(0, self.offset,
                                                                                     self.entry.numel)


def stored(module: torch.nn.Module, attribute: str) -> torch.Tensor | None:
    """MODULE's parameter or buffer ATTRIBUTE (None: it has neither of that name)."""
    tensor = module._parameters.get(attribute)
    return tensor if tensor is not None else module._buffers.get(attribute)


def not_patchable(layer: str, modules: Mapping[str, torch.nn.Module], covers: list[str], derived,
                   never: set[str]) -> str | None:
    """Why LAYER's tensors may not be patched in place (state derived from them, or a reason to hand it over)."""
    if layer in never:
        return "it must be handed to vLLM (its module hooks or its kernel need the reload)"
    if len(covers) > 1:
        return f"{covers[1]} shares its storage"
    inside = [name for name, _ in modules[layer].named_modules(prefix=layer)] if layer in modules else [layer]
    for name in inside:
        kernel = getattr(modules[name], "cpu_linear", None)
        if kernel is not None and _holds_state(kernel):
            return f"{name} computes with a CPU kernel built from its weights"
    for alias in getattr(derived, "aliases", ()):
        if not alias.live and (alias.source in inside or alias.module in inside):
            return f"{alias.name} is derived from a weight and no longer shares its storage"
    for name in getattr(derived, "unknown", {}):
        if name.rpartition(".")[0] in inside:
            return f"{name} is a buffer of unknown origin"
    return None


def _holds_state(kernel) -> bool:
    """Whether a CPU kernel callable carries state of its own (a packed copy, a oneDNN handle) or is stateless."""
    if kernel is torch.nn.functional.linear:
        return False
    return bool(getattr(kernel, "__closure__", None) or getattr(kernel, "__defaults__", None)
                or not hasattr(kernel, "__code__"))


def find_site(item: PlannedTensor, items: list[PlannedTensor], modules: Mapping[str, torch.nn.Module],
              packed: Mapping[str, list[str]], record: LayerRecord | None) -> tuple[PatchSite | None, str | None]:
    """Where ITEM's bytes lie in its module, shown by their samples; (None, why) when not found."""
    entry, module = item.entry, modules.get(item.parent)
    attribute = entry.name.rpartition(".")[2]
    tensor = None if module is None else stored(module, attribute)
    if tensor is None or tensor.device.type == "meta" or not tensor.is_contiguous():
        return None, f"{item.parent} has no stored {attribute} in checkpoint layout"
    if tensor.dtype != torch_dtype(entry.dtype):
        return None, f"{item.parent}.{attribute} is {tensor.dtype}, the checkpoint's {entry.dtype}"
    offset = _offset(item, items, tensor.numel(), packed)
    if offset is None:
        return None, f"{entry.name}'s place in {item.parent}.{attribute} is not known"
    recorded = record.samples.get(entry.name) if record is not None else None
    if recorded is None:
        return None, f"the record of {item.parent} has no samples of {entry.name}"
    site = PatchSite(entry, item.parent, attribute, offset)
    if _engine_sample(site, modules) != recorded:
        return None, f"{item.parent}.{attribute} does not hold {entry.name} as loaded (its layout changed)"
    return site, None


def _offset(item: PlannedTensor, items: list[PlannedTensor], numel: int, packed: Mapping[str, list[str]]) -> int | None:
    """ITEM's offset in its module's tensor of NUMEL elements: 0 when it is the whole; else its share of a fused
    tensor, in the order of `packed_modules_mapping`; None when neither."""
    if item.entry.numel == numel:
        return 0
    order = packed.get(item.parent.rpartition(".")[2])
    attribute = item.entry.name.rpartition(".")[2]
    members = [other for other in items if other.parent == item.parent
               and other.entry.name.rpartition(".")[2] == attribute]
    rank = {short: index for index, short in enumerate(order or ())}
    shorts = [member.entry.name.rsplit(".", 2)[-2] for member in members]
    if not order or any(short not in rank for short in shorts) or len(set(shorts)) != len(shorts):
        return None
    members = [member for _, member in sorted(zip(shorts, members, strict=True), key=lambda pair: rank[pair[0]])]
    if sum(member.entry.numel for member in members) != numel:
        return None
    offset = 0
    for member in members:
        if member is item:
            return offset
        offset += member.entry.numel
    return None


def _engine_sample(site: PatchSite, modules: Mapping[str, torch.nn.Module]) -> str:
    """The sample digest of the engine's bytes at SITE (`checkpoint.samples`; only the windows leave the device)."""
    flat = site.region(modules).view(torch.uint8)
    entry = site.entry

    def window(at: int, n: int):
        part = flat[at:at + n]
        return (part if part.device.type == "cpu" else part.cpu()).numpy()

    return sample_digest(entry.dtype, entry.shape, flat.numel(), window)
