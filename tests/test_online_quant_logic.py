"""layerwise's online quantizers alone (no engine): formats, bounds, determinism, registration with vLLM."""

from __future__ import annotations

import pytest

from layerwise_cli.cli._options import check_quantization
from layerwise_cli.errors import UsageError

pytestmark = pytest.mark.slow  # imports vLLM


@pytest.fixture(scope="module")
def online_quant():
    from layerwise_cli.worker.quantization import online_quant  # noqa: PLC0415 - torch: heavy (test collection stays fast)

    return online_quant


def _weight(seed: int = 0, rows: int = 48, cols: int = 64):
    import torch  # noqa: PLC0415 - torch: heavy (test collection stays fast)

    generator = torch.Generator().manual_seed(seed)
    return (0.2 * torch.randn(rows, cols, generator=generator)).to(torch.bfloat16)


def test_online_quant_fp8_per_tensor_format_and_error_bound(online_quant):
    import torch  # noqa: PLC0415 - torch: heavy (test collection stays fast)

    weight = _weight()
    quantized, scale = online_quant.quantize(online_quant.FP8, weight)
    assert quantized.dtype == torch.float8_e4m3fn and quantized.shape == weight.shape
    assert scale.dtype == torch.float32 and scale.shape == (1,)
    # The largest magnitude maps to E4M3's largest finite value.
    assert quantized.to(torch.float32).abs().max().item() == 448.0
    back = online_quant.dequantize(quantized, scale, torch.float32)
    # E4M3 keeps 3 mantissa bits: relative error at most 2**-4 (plus bf16 rounding of the input).
    err = (back - weight.float()).abs()
    assert (err <= weight.float().abs() * 2 ** -4 + scale.item() * 2 ** -9).all()


def test_online_quant_int8_per_channel_format_and_error_bound(online_quant):
    import torch  # noqa: PLC0415 - torch: heavy (test collection stays fast)

    weight = _weight(1)
    weight[5] = 0  # an all-zero row must not divide by zero
    quantized, scale = online_quant.quantize(online_quant.INT8, weight)
    assert quantized.dtype == torch.int8 and scale.shape == (weight.shape[0],)
    assert quantized[5].abs().max().item() == 0
    rows = [r for r in range(weight.shape[0]) if r != 5]
    assert (quantized[rows].abs().amax(dim=1) == 127).all()  # each row's largest magnitude -> 127
    back = online_quant.dequantize(quantized, scale, torch.float32)
    assert ((back - weight.float()).abs() <= scale[:, None] / 2 + 1e-7).all()


@pytest.mark.parametrize("method", ["layerwise_fp8", "layerwise_int8"])
def test_online_quant_is_deterministic_and_seed_sensitive(online_quant, method):
    # --verify re-quantizes SOURCE and compares bit for bit: the same input must give the same bits.
    import torch  # noqa: PLC0415 - torch: heavy (test collection stays fast)

    first, first_scale = online_quant.quantize(method, _weight(2))
    again, again_scale = online_quant.quantize(method, _weight(2).clone())
    other, _ = online_quant.quantize(method, _weight(3))
    assert torch.equal(first.view(torch.uint8), again.view(torch.uint8)) and torch.equal(first_scale, again_scale)
    assert not torch.equal(first.view(torch.uint8), other.view(torch.uint8))


def test_online_quant_registered_with_vllm(online_quant):
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS, get_quantization_config  # noqa: PLC0415 - vllm: heavy (test collection stays fast)

    online_quant.register()  # idempotent: the entry point and the imports may both call it
    assert QUANTIZATION_METHODS.count("layerwise_fp8") == QUANTIZATION_METHODS.count("layerwise_int8") == 1
    assert get_quantization_config("layerwise_fp8") is online_quant.LayerwiseFp8Config
    config = get_quantization_config("layerwise_int8")()
    assert config.get_name() == "layerwise_int8" and config.get_config_filenames() == []
    with pytest.raises(ValueError, match="online quantization"):
        config.from_config({})


def test_online_quant_unknown_method_is_refused(online_quant):
    with pytest.raises(ValueError, match="layerwise_fp8"):
        online_quant.quantize("layerwise_fp4", _weight())


def test_online_quant_accepted_by_the_commands_usage_check():
    check_quantization("layerwise_fp8")
    check_quantization("layerwise_int8")
    with pytest.raises(UsageError, match="layerwise_int8"):
        check_quantization("layerwise_fp4")
