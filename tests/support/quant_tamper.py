"""A worker extension for engine tests of online quantization: layerwise's own, plus two test-only probes.

Started with `EngineOptions(extra={"worker_extension_cls": TAMPER_EXTENSION_CLS})`
(the workers import it; the repository root is on their `sys.path`).
"""

from __future__ import annotations

import torch

from layerwise_cli.worker.extension import LayerwiseWorkerExtension
from layerwise_cli.worker.quantization.online_quant import quantized_by

TAMPER_EXTENSION_CLS = "tests.support.quant_tamper.QuantTamperExtension"


class QuantTamperExtension(LayerwiseWorkerExtension):
    """`layerwise_test_quantized` lists what the engine holds; `layerwise_test_flip` corrupts one element."""

    def layerwise_test_quantized(self) -> dict:
        """Module -> {tensor: dtype} for every linear layer quantized by layerwise's online methods."""
        model = self.model_runner.get_model()
        return {name: {key: str(tensor.dtype) for key, tensor in module._parameters.items() if tensor is not None}
                for name, module in model.named_modules() if quantized_by(module)}

    def layerwise_test_flip(self, module_name: str, tensor_name: str = "weight") -> dict:
        """Flip the lowest bit of the first byte of one tensor, in place (what a stray write would do)."""
        tensor = getattr(self.model_runner.get_model().get_submodule(module_name), tensor_name)
        with torch.no_grad():
            raw = tensor.data.reshape(-1).view(torch.uint8)
            raw[0] ^= 1
        return {"ok": True}
