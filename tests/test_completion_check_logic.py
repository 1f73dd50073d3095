"""The completion check's rule, on vLLM's own reload records (`LayerReloadingInfo`) of a small module: no engine."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
types = pytest.importorskip("vllm.model_executor.model_loader.reload.types")

from layerwise_cli import vllm_compat  # noqa: E402
from layerwise_cli.worker.reload.completion_check import never_loaded_parameters, unloaded_modules  # noqa: E402


def _linear_with_bias() -> torch.nn.Module:
    """A module with two loadable parameters: `weight` (12 elements) and `scale` (3)."""
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(torch.zeros(3, 4))
    layer.scale = torch.nn.Parameter(torch.zeros(3))
    return layer


def _info(loaded: list[str], numel: int, total: int = 15) -> types.LayerReloadingInfo:
    info = types.LayerReloadingInfo(restore_metadata=({}, {}), restore_device=torch.device("cpu"))
    info.load_numel, info.load_numel_total = numel, total
    info.loaded_weights = [(name, None) for name in loaded]
    info.kernel_tensors = ({}, {})  # reloading: vLLM kept the engine's tensors
    return info


@pytest.mark.parametrize(("loaded", "numel", "expected"), [
    (["weight"], 12, ["scale"]),  # the scale written bare: never handed to a loader, the shortfall is its size
    (["weight", "scale"], 14, []),  # every parameter handed, one element short: padding the loader left
    (["weight", "scale"], 15, []),  # complete
    ([], 0, []),  # nothing loaded: the whole module failed, which `unloaded_modules` reports by itself
    (["weight"], 10, ["scale"]),  # short by more than the scale: still never handed
    (["scale"], 3, ["weight"]),
])
def test_never_loaded_parameters(loaded, numel, expected):
    assert never_loaded_parameters(_linear_with_bias(), _info(loaded, numel)) == expected


def test_a_parameter_smaller_than_the_shortfall_is_not_named_when_it_cannot_explain_it():
    # 14 of 15 counted with only `weight` handed: the scale (3) cannot be what is missing (1): vLLM's count is
    # not explained by a parameter left out; not listed.
    assert never_loaded_parameters(_linear_with_bias(), _info(["weight"], 14)) == []


def test_a_bias_written_bare_is_not_named():
    # vLLM's reload never moves a parameter named `bias` to the meta device (`SKIP_TENSORS`): a bare write lands.
    layer = torch.nn.Linear(4, 3, bias=True)
    assert never_loaded_parameters(layer, _info(["weight"], 12)) == []


def test_unloaded_modules_lists_a_partly_loaded_module_under_a_handed_layer(monkeypatch):
    model = torch.nn.Module()
    model.layer = torch.nn.Module()
    model.layer.proj = _linear_with_bias()
    model.other = _linear_with_bias()
    infos = {model.layer.proj: _info(["weight"], 12), model.other: _info(["weight"], 12)}
    monkeypatch.setattr(vllm_compat, "layerwise_info", lambda: infos)
    names = {id(module): name for name, module in model.named_modules()}
    assert unloaded_modules(model, names, ["layer"]) == ["layer.proj"]
    assert unloaded_modules(model, names, ["layer", "other"]) == ["layer.proj", "other"]
    infos[model.layer.proj] = _info(["weight", "scale"], 14)
    assert unloaded_modules(model, names, ["layer"]) == []
