"""worker/in_place.py: which layers vLLM's reload may load into the engine's own tensors, and that doing so through
vLLM's own reload functions (no engine: a small module tree) leaves exactly what vLLM's fresh buffers leave.

The engine-level proof (answers equal an engine started fresh, storage kept) is in tests/test_reload_engine.py.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from layerwise_cli import vllm_compat
from layerwise_cli.worker.stream.in_place import in_place_materialization, kernel_views

pytestmark = pytest.mark.slow  # imports vLLM


def _info(layer: nn.Module, *, complete: bool = True, kernel: dict | None = None):
    """What vLLM records for LAYER during a reload: its tensors on meta, the engine's kept aside."""
    params = {name: p for name, p in layer._parameters.items() if p is not None}
    buffers = {name: b for name, b in layer._buffers.items() if b is not None}
    kernel_params = dict(params) if kernel is None else kernel
    for name, tensor in params.items():
        meta = tensor.data.to("meta")
        meta.__class__ = tensor.__class__
        meta.__dict__ = tensor.__dict__.copy()
        layer._parameters[name] = meta
    total = sum(t.numel() for t in (*params.values(), *buffers.values()))
    return SimpleNamespace(kernel_tensors=(kernel_params, buffers), load_numel=total if complete else total - 1,
                           load_numel_total=total, restore_device=torch.device("cpu"))


class Norm(nn.Module):
    def __init__(self, n: int = 8) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n), requires_grad=False)


def test_a_complete_layer_with_the_engines_layout_gets_views_of_the_engines_tensors():
    layer = Norm()
    engine = layer.weight
    engine.output_dim = 0
    info = _info(layer)
    views = kernel_views(layer, info)
    assert views is not None and set(views) == {"weight"}
    view = views["weight"]
    assert view.data_ptr() == engine.data_ptr() and view is not engine
    assert type(view) is type(engine) and view.output_dim == 0  # the class and attributes vLLM would give it


def test_a_first_load_is_left_to_vllm():
    layer = Norm()
    info = _info(layer)
    info.kernel_tensors = None
    assert kernel_views(layer, info) is None


def test_an_incomplete_layer_is_left_to_vllm():
    layer = Norm()
    assert kernel_views(layer, _info(layer, complete=False)) is None


@pytest.mark.parametrize("engine_tensor", [
    torch.empty(0),  # vLLM's CPU GEMM dispatch moved the weight into a kernel handle
    torch.empty(8, dtype=torch.float16),  # processing changed the dtype
    torch.empty(16)[::2],  # the same shape with other strides
], ids=["emptied", "dtype", "strides"])
def test_a_layout_the_processing_changed_is_left_to_vllm(engine_tensor):
    layer = Norm()
    info = _info(layer, kernel={"weight": nn.Parameter(engine_tensor, requires_grad=False)})
    assert kernel_views(layer, info) is None


def test_a_plain_tensor_where_vllm_materializes_a_parameter_is_left_to_vllm():
    layer = Norm()
    assert kernel_views(layer, _info(layer, kernel={"weight": torch.empty(8)})) is None


def test_tensors_sharing_storage_are_left_to_vllm():
    layer = Norm()
    layer.bias2 = nn.Parameter(torch.randn(8), requires_grad=False)
    shared = nn.Parameter(torch.empty(8), requires_grad=False)
    twin = nn.Parameter(shared.data, requires_grad=False)  # same storage
    info = _info(layer, kernel={"weight": shared, "bias2": twin})
    assert kernel_views(layer, info) is None


def test_declared_padding_the_loaders_skip_is_left_to_vllm():
    layer = Norm()
    layer.weight.weight_loader_numel = 6  # as vLLM's MoE weights declare padding
    assert kernel_views(layer, _info(layer)) is None


# --------------------------------------------------------------------------- through vLLM's own reload functions


def _pack_method():
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase  # noqa: PLC0415 - vllm: heavy (test collection stays fast)

    class Pack(QuantizeMethodBase):
        """Like vLLM's CPU oneDNN dispatch: the weight moves into a packed copy and the parameter is emptied."""

        def create_weights(self, *args, **kwargs): ...

        def apply(self, *args, **kwargs): ...

        def process_weights_after_loading(self, layer: nn.Module) -> None:
            layer.packed = layer.weight.detach().t().contiguous() * 2
            layer.weight = nn.Parameter(torch.empty(0), requires_grad=False)

    return Pack()


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Module()
    model.norm = Norm(16)
    model.embed = nn.Module()
    model.embed.weight = nn.Parameter(torch.randn(32, 16), requires_grad=False)
    model.proj = nn.Module()
    model.proj.weight = nn.Parameter(torch.randn(16, 16), requires_grad=False)
    model.proj.quant_method = _pack_method()
    return model


def _first_load(model: nn.Module) -> None:
    """What vLLM's loader does at start-up: record the checkpoint layout, load, process."""
    from vllm.model_executor.model_loader.reload.layerwise import record_metadata_for_reloading  # noqa: PLC0415 - vllm: heavy (test collection stays fast)

    record_metadata_for_reloading(model)
    model.proj.quant_method.process_weights_after_loading(model.proj)


def _reload(model: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """vLLM's layerwise reload, fed as `model.load_weights` feeds it: each tensor through its parameter's loader."""
    from vllm.model_executor.model_loader.reload.layerwise import (  # noqa: PLC0415 - vllm: heavy (test collection stays fast)
        finalize_layerwise_reload,
        initialize_layerwise_reload,
    )
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader  # noqa: PLC0415 - vllm: heavy (test collection stays fast)

    initialize_layerwise_reload(model)
    for name, tensor in tensors.items():
        param = model.get_parameter(name)
        getattr(param, "weight_loader", default_weight_loader)(param, tensor)
    finalize_layerwise_reload(model, None)


def _new_weights() -> dict[str, torch.Tensor]:
    torch.manual_seed(7)
    return {"norm.weight": torch.randn(16), "embed.weight": torch.randn(32, 16), "proj.weight": torch.randn(16, 16)}


def test_vllms_reload_in_place_leaves_what_its_fresh_buffers_leave_and_keeps_storage():
    fresh, in_place = _model(0), _model(0)
    for model in (fresh, in_place):
        _first_load(model)
    before = {name: t.data_ptr() for name, t in in_place.named_parameters()}
    new = _new_weights()

    with in_place_materialization(fresh, enabled=False) as none_done:
        _reload(fresh, new)
    with in_place_materialization(in_place) as done:
        _reload(in_place, new)

    assert none_done.names == set()
    assert done.names == {"norm", "embed"}  # proj's processing empties its weight: vLLM's fresh buffer
    assert done.bytes == (16 + 32 * 16) * 4
    # The engine's storage is kept, and holds the new weights; the processed layer equals vLLM's result.
    assert {name: t.data_ptr() for name, t in in_place.named_parameters()} == before
    torch.testing.assert_close(in_place.norm.weight, new["norm.weight"], rtol=0, atol=0)
    torch.testing.assert_close(in_place.embed.weight, new["embed.weight"], rtol=0, atol=0)
    for name, tensor in fresh.state_dict().items():
        torch.testing.assert_close(in_place.state_dict()[name], tensor, rtol=0, atol=0)
    torch.testing.assert_close(in_place.proj.packed, fresh.proj.packed, rtol=0, atol=0)
    torch.testing.assert_close(in_place.proj.packed, new["proj.weight"].t() * 2, rtol=0, atol=0)


def test_vllms_materialize_is_put_back_after_the_reload_and_after_a_failure():
    module = vllm_compat.reload_layerwise_module()
    original = module.materialize_layer
    with pytest.raises(RuntimeError, match="loader failed"), in_place_materialization(_model(0)):
        assert module.materialize_layer is not original
        raise RuntimeError("loader failed")
    assert module.materialize_layer is original


def test_the_diagnostic_switch_leaves_every_layer_to_vllm(monkeypatch):
    monkeypatch.setenv("LAYERWISE_FRESH_BUFFERS", "1")
    model = _model(0)
    _first_load(model)
    module = vllm_compat.reload_layerwise_module()
    original = module.materialize_layer
    with in_place_materialization(model) as done:
        assert module.materialize_layer is original
        _reload(model, _new_weights())
    assert done.names == set()
    torch.testing.assert_close(model.norm.weight, _new_weights()["norm.weight"], rtol=0, atol=0)
