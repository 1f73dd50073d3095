"""The layers a skip would leave to module hooks vLLM reruns after every reload (vLLM 0.34's `finalize_model_weights`).

From vLLM 0.34 on, a reload ends with `weight_utils.finalize_model_weights`:
every module's own `process_weights_after_loading()` runs again, children
first, on every layer, handed over or not (a quantized layer's submodules
excepted: its quant method processes them). A layer layerwise skips keeps the
tensors that hook already processed once; a hook that transforms them in place
(an in-place shuffle guarded by nothing) would transform them twice. So a layer
is skipped only when every hook vLLM will rerun on it is one layerwise reviewed
as idempotent (`vllm_compat.IDEMPOTENT_HOOKS`); a hook above the layers (on the
model itself) may read or rewrite any of them, and then no layer is skipped.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from layerwise_cli import vllm_compat


@dataclass(frozen=True)
class RerunHooks:
    """What vLLM will rerun after this reload that layerwise has not reviewed, and the layers it forbids to skip.

    Attributes:
        hand_over: parent layers that must be handed over (never skipped).
        hooks: module name -> the hook's qualified name, for each unreviewed hook found.
    """

    hand_over: frozenset[str] = frozenset()
    hooks: dict[str, str] = field(default_factory=dict)

    def note(self, could_skip: Iterable[str]) -> str | None:
        """One line for the report about the forced layers among COULD_SKIP (those with a record), or None."""
        forced = self.hand_over & set(could_skip)
        if not forced:
            return None
        shown = ", ".join(f"{name or 'the model'} ({hook})" for name, hook in sorted(self.hooks.items())[:3])
        more = f" and {len(self.hooks) - 3} more" if len(self.hooks) > 3 else ""
        return (f"{len(forced)} layer(s) handed over, not skipped: vLLM reruns every module's "
                f"process_weights_after_loading after a reload, and these are not reviewed as safe to rerun on "
                f"weights that were not re-sent: {shown}{more}")


def hook_name(module: torch.nn.Module) -> str | None:
    """`module.qualname` of the `process_weights_after_loading` vLLM would call on MODULE, or None (none)."""
    hook = getattr(type(module), "process_weights_after_loading", None)
    if not callable(hook):
        return None
    return f"{getattr(hook, '__module__', '?')}.{getattr(hook, '__qualname__', '?')}"


def rerun_hooks(model: torch.nn.Module, layers: Iterable[str]) -> RerunHooks:
    """The parent LAYERS a skip must not leave to vLLM's rerun hooks (none before vLLM 0.34).

    Walks the modules as `finalize_model_weights` does: below a module whose
    `quant_method` is vLLM's `QuantizeMethodBase`, nothing runs. A hook may
    read and rewrite what its module holds: the layers inside it (a child
    shared with a sibling too, by identity) and the layer it sits in. A hook
    on the model itself holds every layer.
    """
    if not vllm_compat.reruns_module_hooks():
        return RerunHooks()
    by_name = dict(model.named_modules())
    layer_modules = {name: by_name[name] for name in layers if name in by_name}
    reviewed = {f"{h.module}.{h.qualname}" for h in vllm_compat.IDEMPOTENT_HOOKS}
    quantize_method = vllm_compat.quantize_method_base_class()
    hooks: dict[str, str] = {}
    hand_over: set[str] = set()
    seen: set[int] = set()
    stack = [("", model)]
    while stack:
        name, module = stack.pop()
        if id(module) in seen:
            continue  # a module shared by several parents runs once (vLLM's rule too)
        seen.add(id(module))
        hook = hook_name(module)
        if hook is not None and hook not in reviewed:
            hooks[name] = hook
            inside = {id(sub) for sub in module.modules()}
            hand_over |= {layer for layer, held in layer_modules.items()
                          if id(held) in inside or any(sub is module for sub in held.modules())}
        if not isinstance(getattr(module, "quant_method", None), quantize_method):
            stack.extend((f"{name}.{child}" if name else child, sub) for child, sub in module.named_children())
    return RerunHooks(frozenset(hand_over), hooks)
