"""Loading, after vLLM's reload, the layers it put back unloaded: their model writes them outside what it sees.

vLLM's layerwise reload wraps each parameter's weight loader and counts what
it copies. A model whose `load_weights` writes a parameter with a bare
`param.copy_` (gpt-oss: attention sinks, the fused routed experts and their
biases) writes into the meta tensor the reload left in its place: nothing is
counted, vLLM's finalize logs `Failed to load weights` and puts the module's
old tensors back (`worker/reload/completion_check.py` lists them). Once it has, the
engine's own tensors are in place again, so the model's own `load_weights`,
given that layer's tensors again, writes them where they belong; what vLLM's
processing would do to them on the CPU (the MoE experts' packing) the CPU
repairs do next, as for every reloaded layer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from layerwise_cli.planning.plan import PlannedTensor


def holding_parents(modules: Iterable[str], handed: Iterable[str]) -> list[str]:
    """The HANDED parent layers that are, or hold, one of MODULES."""
    modules = list(modules)
    return sorted(parent for parent in set(handed)
                  if any(module == parent or module.startswith(parent + ".") for module in modules))


def load_put_back_layers(model: torch.nn.Module, parents: list[str], stream: list[PlannedTensor],
                         read: Callable[[PlannedTensor], torch.Tensor]) -> int:
    """Hand every tensor of PARENTS in STREAM to MODEL's own `load_weights`, outside vLLM's reload.

    Returns:
        The number of tensors handed over.
    """
    wanted = set(parents)
    items = [item for item in stream if item.parent in wanted]
    model.load_weights((item.entry.name, read(item)) for item in items)
    return len(items)
