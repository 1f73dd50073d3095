"""Which CPU kernel handles `--verify` and the fingerprints read back (`worker/fingerprints.py`), without an engine."""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F

from layerwise_cli.worker.proof.fingerprints import module_fingerprints


def _linear(weight: torch.Tensor, kernel) -> torch.nn.Module:
    """A layer as vLLM's CPU dispatch leaves it: its weight, a quant method that calls `cpu_linear`."""
    module = torch.nn.Module()
    module.weight = torch.nn.Parameter(weight, requires_grad=False)
    module.input_size_per_partition = weight.shape[1]
    module.params_dtype = weight.dtype
    module.quant_method = SimpleNamespace(apply=lambda layer, x: layer.cpu_linear(x, layer.weight, None))
    module.cpu_linear = kernel
    return module


def test_a_kernel_that_holds_nothing_is_not_read_back():
    weight = torch.randn(8, 16)
    # vLLM's fallback (AVX2): computes with the weight it is passed, the stored one.
    module = _linear(weight, lambda x, weight, bias: F.linear(x, weight, bias))
    assert set(module_fingerprints(module)) == {"weight"}


def test_a_kernel_holding_a_copy_is_read_back_and_a_stale_copy_shows():
    weight = torch.randn(8, 16)
    packed = weight.clone()  # what oneDNN or SGL keep: a copy captured by the handle
    module = _linear(weight, lambda x, weight, bias: F.linear(x, packed, bias))
    before = module_fingerprints(module)
    assert set(before) == {"weight", "#kernel"}
    with torch.no_grad():
        module.weight.add_(1.0)  # an in-place reload of the stored weight only
    after = module_fingerprints(module)
    assert after["weight"] != before["weight"] and after["#kernel"] == before["#kernel"]  # the copy is stale
    with torch.no_grad():
        packed.copy_(module.weight)
    assert module_fingerprints(module)["#kernel"] != before["#kernel"]


def test_a_kernel_with_bound_defaults_or_without_a_stored_weight_is_read_back():
    weight = torch.randn(8, 16)
    copy = weight.clone()
    with_default = _linear(weight, lambda x, weight, bias, _w=copy: F.linear(x, _w, bias))
    assert "#kernel" in module_fingerprints(with_default)
    hidden = _linear(weight, lambda x, weight, bias: F.linear(x, weight, bias))
    hidden.weight = torch.nn.Parameter(torch.empty(0), requires_grad=False)  # repacked: the weight emptied
    hidden.cpu_linear = (lambda w: lambda x, weight, bias: F.linear(x, w, bias))(weight)
    assert "#kernel" in module_fingerprints(hidden)
