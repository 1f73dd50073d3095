"""Whether vLLM's reload loaded every layer layerwise handed it: the layers its finalize puts back unloaded.

vLLM's layerwise reload counts, per module, the elements its wrapped weight
loaders copy. A model whose `load_weights` writes a parameter some other way
(gpt-oss: `param.copy_(...)` for attention sinks and the fused experts) copies
into the meta tensor the reload left there, so nothing is counted; at the end
vLLM's finalize logs `<Class>: Failed to load weights` and puts the module's
old tensors back. The reload returns as if it had succeeded. This module lists,
just before that finalize, every such module among the layers layerwise handed
tensors to, by vLLM's own count (`load_numel`), so that the reload can say no.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager

import torch

from layerwise_cli import vllm_compat
from layerwise_cli.worker.stream.rank_plan import holds_parameters


@contextmanager
def unloaded_layer_watch(model: torch.nn.Module, handed: Callable[[], Collection[str]],
                         planned: Collection[str] = ()) -> Iterator[list[str]]:
    """While open, vLLM's finalize of a reload of MODEL first adds to the yielded list the modules it would put back.

    Args:
        model: the engine's model.
        handed: the parent layers layerwise handed tensors to (read when vLLM finalizes).
        planned: every parent layer of the plan, handed or skipped: a module that is one is judged as itself.

    Yields:
        The names of the modules vLLM could not load, filled when vLLM finalizes.
    """
    reload_module = vllm_compat.reload_layerwise_module()
    original = vllm_compat.finalize_layerwise_processing()
    names = {id(module): name for name, module in model.named_modules()}
    found: list[str] = []

    def finalize_layerwise_processing(finalized: torch.nn.Module, *args, **kwargs):
        found.extend(unloaded_modules(finalized, names, handed(), planned))
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
        if info.load_numel > 0 or not info.load_numel_total or vllm_compat.is_deferred_attention_layer(module):
            continue
        name = names.get(id(module), type(module).__name__)
        # Under a handed layer, only a module with parameters of its own takes checkpoint tensors: one holding
        # buffers alone (a rotary embedding's cos/sin cache) is derived from the config, and vLLM puts it back.
        if name in parents or (holds_parameters(module) and name not in planned
                               and any(name.startswith(parent + ".") for parent in parents)):
            found.append(name)
    return found


def unloaded_description(names: list[str]) -> str:
    """Which layers vLLM could not load, and why (a clause)."""
    shown = ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")
    return (f"vLLM could not load {len(names)} layer(s) it was handed: {shown} (its reload counted no element "
            "loaded and put their old tensors back: vLLM logs 'Failed to load weights')")


def unloaded_message(names: list[str]) -> str:
    """One line for the failed reload: which layers vLLM could not load, why, and what keeps them."""
    return f"{unloaded_description(names)}; --allow-unchecked keeps them as they were"
