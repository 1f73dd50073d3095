"""Online quantization for any CPU through vLLM's online lifecycle: `layerwise_fp8` and `layerwise_int8`.

vLLM's own online methods (`fp8_per_tensor`, `fp8_per_block`) need FP8 GPU
kernels, and `int8_per_channel_weight_only` quantizes only MoE experts, with
an x86 kernel that needs AMX tiles. These two methods quantize every linear
layer of a model on any CPU, built exactly like vLLM's online linear methods
(`vllm/model_executor/layers/quantization/online/fp8.py`,
`Fp8PerTensorOnlineLinearMethod`):

- `uses_meta_device = True`: `create_weights` puts the weight on the meta
  device in checkpoint format (bf16) and calls `initialize_online_processing`,
  so vLLM buffers a layer's checkpoint tensors and processes the layer as
  soon as its last element arrives, at the first load and at every reload;
- `process_weights_after_loading` quantizes, guarded by
  `_already_called_process_weights_after_loading` (vLLM's layerwise reload
  clears the flag before processing a layer again);
- the scale is created there (`replace_parameter`), not in `create_weights`,
  so a layer completes on the checkpoint's element count.

The kernels are plain torch and emulate the formats: `apply` dequantizes the
weight to the activation dtype and runs `torch.nn.functional.linear`. The
engine computes with quantized weights (the numerics of a quantized rollout)
and holds them in 8 bits, but it is not faster than bf16. Scales are computed
on each tensor-parallel rank's own shard (no collective), so a TP=2 engine's
weights are those of a fresh TP=2 engine, not of a TP=1 engine.

Importing this module registers both methods with vLLM; layerwise imports it
in the user's process (`start_engine`), in every worker (the worker
extension) and through vLLM's `vllm.general_plugins` entry point
(`layerwise_cli.worker.quantization.online_quant:register`).
"""

from __future__ import annotations

import torch

# vLLM's online lifecycle, through the project's one door for private vLLM symbols. This module
# subclasses vLLM's classes, so it loads them (and vLLM) when it is imported: only engine code imports it.
from layerwise_cli import vllm_compat
from layerwise_cli.worker.repairs import mla_cpu_repair

LinearBase = vllm_compat.linear_base_class()
LinearMethodBase = vllm_compat.load(vllm_compat.LINEAR_METHOD_BASE)
QuantizationConfig = vllm_compat.load(vllm_compat.QUANTIZATION_CONFIG)
register_quantization_config = vllm_compat.load(vllm_compat.REGISTER_QUANTIZATION_CONFIG)
# What vLLM's own online methods call from `create_weights` (vllm/model_executor/model_loader/reload/layerwise.py).
initialize_online_processing = vllm_compat.load(vllm_compat.INITIALIZE_ONLINE_PROCESSING)
ModelWeightParameter = vllm_compat.load(vllm_compat.MODEL_WEIGHT_PARAMETER)
replace_parameter = vllm_compat.load(vllm_compat.REPLACE_PARAMETER)

FP8 = "layerwise_fp8"
INT8 = "layerwise_int8"
# Method name -> what it does, for docs and error messages.
METHODS = {
    FP8: "FP8 E4M3 per tensor (emulated: torch.float8_e4m3fn weight, float32 scale)",
    INT8: "int8 per output channel, symmetric (int8 weight, float32 scale per row)",
}
# The tensors a quantized layer holds instead of its checkpoint weight.
QUANTIZED_TENSORS = ("weight", "weight_scale")

_FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448
_INT8_MAX = 127.0
_TINY = torch.finfo(torch.float32).tiny


def quantize(method: str, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize one checkpoint-format weight `[out, in]` as METHOD does; deterministic, plain torch.

    Args:
        method: `layerwise_fp8` or `layerwise_int8`.
        weight: the full-precision weight (this rank's shard).

    Returns:
        (quantized weight of the same shape, float32 scale: shape `[1]` for
        FP8 per tensor, `[out]` for int8 per channel).
    """
    values = weight.detach().to(torch.float32)
    if method == FP8:
        scale = (values.abs().amax().clamp_min(_TINY) / _FP8_MAX).reshape(1)
        quantized = (values / scale).clamp_(-_FP8_MAX, _FP8_MAX).to(torch.float8_e4m3fn)
        return quantized, scale
    if method == INT8:
        scale = values.abs().amax(dim=1).clamp_min(_TINY) / _INT8_MAX
        quantized = torch.round(values / scale[:, None]).clamp_(-128, 127).to(torch.int8)
        return quantized, scale
    raise ValueError(f"unknown layerwise online quantization {method!r}; choose from {sorted(METHODS)}")


def dequantize(quantized: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The weight a quantized layer computes with, in `dtype`."""
    values = quantized.to(torch.float32)
    values = values * scale if scale.numel() == 1 else values * scale[:, None]
    return values.to(dtype)


class LayerwiseOnlineLinearMethod(LinearMethodBase):
    """Loads a full-precision checkpoint onto meta and quantizes each linear layer as soon as it is loaded."""

    uses_meta_device: bool = True

    def __init__(self, method: str) -> None:
        if method not in METHODS:
            raise ValueError(f"unknown layerwise online quantization {method!r}; choose from {sorted(METHODS)}")
        self.method = method

    def create_weights(self, layer: torch.nn.Module, input_size_per_partition: int,
                       output_partition_sizes: list[int], input_size: int, output_size: int,
                       params_dtype: torch.dtype, **extra_weight_attrs) -> None:
        output_size_per_partition = sum(output_partition_sizes)
        layer.logical_widths = output_partition_sizes
        layer.input_size_per_partition = input_size_per_partition
        layer.output_size_per_partition = output_size_per_partition
        layer.orig_dtype = params_dtype
        weight = ModelWeightParameter(
            # Checkpoint format, on meta: materialized, loaded and quantized when the layer is complete.
            data=torch.empty(output_size_per_partition, input_size_per_partition, device="meta", dtype=params_dtype),
            input_dim=1,
            output_dim=0,
            weight_loader=extra_weight_attrs.get("weight_loader"),
        )
        layer.register_parameter("weight", weight)
        initialize_online_processing(layer)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        if getattr(layer, "_already_called_process_weights_after_loading", False):
            return
        quantized, scale = quantize(self.method, layer.weight.data)
        replace_parameter(layer, "weight", quantized)
        replace_parameter(layer, "weight_scale", scale)
        # Prevent duplicate processing; vLLM's layerwise reload removes the flag before processing again.
        layer._already_called_process_weights_after_loading = True

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        weight = dequantize(layer.weight, layer.weight_scale, x.dtype)
        return torch.nn.functional.linear(x, weight, bias)


class _LayerwiseOnlineConfig(QuantizationConfig):
    """Model-level config: every linear layer gets `LayerwiseOnlineLinearMethod`; the rest stays unquantized."""

    method: str = ""

    @classmethod
    def get_name(cls) -> str:
        return cls.method

    @classmethod
    def get_supported_act_dtypes(cls) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16, torch.float32]

    @classmethod
    def get_min_capability(cls) -> int:
        return 0  # plain torch: any device

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []  # online: nothing to read from the checkpoint

    @classmethod
    def from_config(cls, config: dict) -> _LayerwiseOnlineConfig:
        raise ValueError(f"{cls.method} is an online quantization: start the engine with "
                         f"quantization={cls.method!r} on a full-precision checkpoint")

    def get_quant_method(self, layer: torch.nn.Module, prefix: str):
        if isinstance(layer, LinearBase):
            # vLLM requires a method for every linear layer; embeddings and the LM head stay unquantized.
            return LayerwiseOnlineLinearMethod(self.method)
        return None


class LayerwiseFp8Config(_LayerwiseOnlineConfig):
    method = FP8


class LayerwiseInt8Config(_LayerwiseOnlineConfig):
    method = INT8


_CONFIGS = {FP8: LayerwiseFp8Config, INT8: LayerwiseInt8Config}


def register() -> None:
    """Register both methods with vLLM and apply the CPU rotary repair (idempotent; vLLM's plugin entry point)."""
    for name, config in _CONFIGS.items():
        register_quantization_config(name)(config)
    # Not quantization: this entry point is layerwise's one hook in every vLLM process before a model is built.
    mla_cpu_repair.apply_rope_repair()


def is_layerwise_method(quantization: str | None) -> bool:
    """Whether QUANTIZATION names one of these methods (the user's process must register them first)."""
    return quantization in METHODS


def quantized_by(module: torch.nn.Module) -> str | None:
    """The method that quantized MODULE, if it is one of these."""
    method = getattr(module, "quant_method", None)
    return method.method if isinstance(method, LayerwiseOnlineLinearMethod) else None


register()
