"""Whether vLLM's reload loaded every layer layerwise handed it: the layers its finalize puts back unloaded.

vLLM's layerwise reload counts, per module, the elements its wrapped weight
loaders copy. A model whose `load_weights` writes a parameter some other way
(gpt-oss: `param.copy_(...)` for attention sinks and the fused experts) copies
into the meta tensor the reload left there, so nothing is counted; at the end
vLLM's finalize logs `<Class>: Failed to load weights` and puts the module's
old tensors back. The reload returns as if it had succeeded. This module lists,
just before that finalize, every such module among the layers layerwise handed
tensors to, by vLLM's own count (`load_numel`), so that the reload can say no.

A module whose loaders count some of its parameters but not all (one written
bare beside others loaded through their loaders) reaches finalize partly
loaded; vLLM processes it as a padded layer ("Delayed processing"), with
whatever the materialized tensor held in the uncounted parameter, and logs
nothing. It is listed too: a parameter of its own that no loader of vLLM's
reload was handed (`loaded_weights`), while the module's shortfall covers it.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from layerwise_cli import vllm_compat
from layerwise_cli.units import human_bytes
from layerwise_cli.worker.stream.rank_plan import holds_parameters


@dataclass
class Unloaded:
    """The modules vLLM's reload could not load, filled when its finalize runs.

    Attributes:
        modules: every one, in model order.
        partial: those vLLM processed partly loaded (some of their parameters counted): unlike the others, which
            vLLM put back as they were, these hold what its processing made of the missing parameters.
    """

    modules: list[str] = field(default_factory=list)
    partial: list[str] = field(default_factory=list)


@contextmanager
def unloaded_layer_watch(model: torch.nn.Module, handed: Callable[[], Collection[str]],
                         planned: Collection[str] = ()) -> Iterator[Unloaded]:
    """While open, vLLM's finalize of a reload of MODEL first records the modules it could not load.

    Args:
        model: the engine's model.
        handed: the parent layers layerwise handed tensors to (read when vLLM finalizes).
        planned: every parent layer of the plan, handed or skipped: a module that is one is judged as itself.

    Yields:
        `Unloaded`, filled when vLLM finalizes.
    """
    reload_module = vllm_compat.reload_layerwise_module()
    original = vllm_compat.finalize_layerwise_processing()
    modules = dict(model.named_modules())
    names = {id(module): name for name, module in modules.items()}
    found = Unloaded()

    def finalize_layerwise_processing(finalized: torch.nn.Module, *args, **kwargs):
        infos = vllm_compat.layerwise_info()
        for name in unloaded_modules(finalized, names, handed(), planned):
            found.modules.append(name)
            info = infos.get(modules[name]) if name in modules else None
            if info is not None and info.load_numel > 0:
                found.partial.append(name)
        return original(finalized, *args, **kwargs)

    reload_module.finalize_layerwise_processing = finalize_layerwise_processing
    try:
        yield found
    finally:
        reload_module.finalize_layerwise_processing = original


def unloaded_modules(model: torch.nn.Module, names: dict[int, str], handed: Collection[str],
                     planned: Collection[str] = ()) -> list[str]:
    """Modules in or under a HANDED layer that vLLM's finalize will report as failed to load (its own rule).

    That is a module being reloaded (vLLM kept its tensors), not an attention
    layer processed with the whole model, with elements to load and none
    loaded by its wrapped loaders: a handed layer itself, or a module under
    one that holds parameters of its own and is no parent layer of the plan
    (a skipped one gets nothing on purpose).
    """
    infos = vllm_compat.layerwise_info()
    parents = set(handed)
    planned = set(planned)
    found = []
    for module in model.modules():
        info = infos.get(module)
        if info is None or not info.can_load() or info.kernel_tensors is None:
            continue
        if not info.load_numel_total or vllm_compat.is_deferred_attention_layer(module):
            continue
        if info.load_numel > 0 and not never_loaded_parameters(module, info):
            continue
        name = names.get(id(module), type(module).__name__)
        # Under a handed layer, only a module with parameters of its own takes checkpoint tensors: one holding
        # buffers alone (a rotary embedding's cos/sin cache) is derived from the config, and vLLM puts it back.
        if name in parents or (holds_parameters(module) and name not in planned
                               and any(name.startswith(parent + ".") for parent in parents)):
            found.append(name)
    return found


def never_loaded_parameters(module: torch.nn.Module, info) -> list[str]:
    """MODULE's own parameters that vLLM's reload never handed to a loader, when its count falls short by them.

    Empty when the module loaded completely, when nothing of it loaded (the
    whole module failed, `unloaded_modules` lists it), or when every parameter
    was handed to a loader (a shortfall of padding: a padded vocabulary).
    """
    if info.load_numel <= 0 or info.load_numel >= info.load_numel_total:
        return []
    handed = {name for name, _ in info.loaded_weights}
    skipped = vllm_compat.skip_tensors()
    # Elements to load, as vLLM's `get_tensor_load_numel` counts them (declared padding left out).
    missing = {name: getattr(param, "weight_loader_numel", param.numel()) for name, param in module._parameters.items()
               if param is not None and name not in handed and name not in skipped}
    missing = {name: numel for name, numel in missing.items() if numel > 0}
    shortfall = info.load_numel_total - info.load_numel
    return list(missing) if missing and sum(missing.values()) <= shortfall else []


def unloaded_description(names: list[str]) -> str:
    """Which layers vLLM could not load, and why (a clause)."""
    shown = ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")
    return (f"vLLM could not load {len(names)} layer(s) it was handed: {shown} (its reload counted no element, or "
            "not every parameter, loaded: it put their old tensors back and logs 'Failed to load weights', or "
            "processed them partly loaded)")


def unloaded_message(names: list[str]) -> str:
    """One line for the failed reload: which layers vLLM could not load, why, and what keeps them."""
    return f"{unloaded_description(names)}; --allow-unchecked keeps them as they were"


def stale_message(stale: list[str], *, accepted: bool = False) -> str:
    """One line for derived buffers a reload left stale (`derived_state.aliases_left_stale`)."""
    shown = "; ".join(stale[:4]) + (f"; and {len(stale) - 4} more" if len(stale) > 4 else "")
    verdict = ("accepted by --allow-unchecked" if accepted
               else "--allow-unchecked keeps the reload with them as they are")
    return f"{len(stale)} tensor(s) the engine derived at load were left stale by the reload: {shown}; {verdict}"


def peak_message(measured: int, predicted: int, at_tensor: str) -> str:
    """One line for a reload whose measured buffer peak is not the plan's prediction."""
    return (f"vLLM's reload buffered {human_bytes(measured)} ({measured} bytes) at its peak (at "
            f"{at_tensor or 'no tensor'}), not the {human_bytes(predicted)} ({predicted} bytes) the plan predicts: "
            "a layer completed otherwise than planned, so its completion is not shown")
