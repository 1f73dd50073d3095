"""Digests of what each module computes with, including weights that live only inside kernel handles."""

from __future__ import annotations

import hashlib
import types

from layerwise_cli import vllm_compat
from layerwise_cli.errors import LayerwiseError

# Rows of the identity matrix fed through a linear kernel per call when reading its weight back.
_READBACK_ROWS = 256


def _stored_weight(module):
    """The module's own `weight` when it keeps storage (not on meta, not emptied by CPU repacking), else None."""
    weight = module._parameters.get("weight")
    return weight if weight is not None and weight.device.type != "meta" and weight.numel() > 0 else None


def _reads_back(module) -> bool:
    """Whether a module's weights must be read back through its kernel to be fingerprinted.

    True for a linear layer whose weight lives only inside a kernel handle
    (CPU repacking empties `weight`), and for any layer with a CPU kernel
    handle (`cpu_linear`, e.g. the LM head) that may hold its own copy of a
    weight that is also stored. A handle that captures nothing (vLLM's
    `F.linear` fallback, where oneDNN has no bf16 matmul: AVX2) computes with
    the weight it is passed, the stored one, whose digest covers it: reading
    it back would cost width / 256 GEMMs of the layer for nothing.
    """
    if not hasattr(getattr(module, "quant_method", None), "apply"):
        return False
    stored = _stored_weight(module) is not None
    kernel = getattr(module, "cpu_linear", None)
    if kernel is not None:
        return not (stored and _holds_no_state(kernel))
    return isinstance(module, vllm_compat.linear_base_class()) and not stored


def _holds_no_state(kernel) -> bool:
    """Whether a CPU kernel handle is a plain function that captures nothing (no closure cells, no defaults)."""
    return isinstance(kernel, types.FunctionType) and not kernel.__closure__ and \
        not kernel.__defaults__ and not kernel.__kwdefaults__


def _kernel_readback_digest(module) -> str:
    """SHA-256 of the layer's kernel applied to the identity matrix, block by block, without bias.

    Row k of the output is column k of the weight the kernel computes with
    (one product by 1.0 per output, added to zeros: exact in any precision),
    so the digest covers every weight element even when the weight itself is
    an opaque handle.
    """
    import torch  # noqa: PLC0415 - torch: heavy, only where a tensor is touched

    weight = module._parameters.get("weight")
    stored = _stored_weight(module) is not None
    # Parallel layers know their input width per rank; `ReplicatedLinear` (MoE routers) only `input_size`.
    width = (getattr(module, "input_size_per_partition", None) or (weight.shape[-1] if stored else None)
             or getattr(module, "input_size", None))
    if width is None:
        raise LayerwiseError(f"cannot tell the input width of {type(module).__name__} to read its kernel back")
    dtype = getattr(module, "params_dtype", None) or (weight.dtype if stored else torch.get_default_dtype())
    device = next((t.device for t in module.parameters(recurse=False) if t.device.type != "meta"),
                  torch.device("cpu"))
    digest = hashlib.sha256(f"kernel {width} {dtype}".encode())
    with torch.no_grad():
        for start in range(0, width, _READBACK_ROWS):
            rows = min(_READBACK_ROWS, width - start)
            probe = torch.zeros(rows, width, dtype=dtype, device=device)
            index = torch.arange(rows, device=device)
            probe[index, start + index] = 1
            out = module.quant_method.apply(module, probe).detach().to("cpu").contiguous()
            digest.update(str(tuple(out.shape)).encode())
            digest.update(out.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def module_fingerprints(module, prefix: str = "") -> dict[str, str]:
    """Digests of one module's own tensors that keep storage, and `<prefix>#kernel` for hidden weights."""
    from layerwise_cli.worker.proof.checksums import tensor_sha256  # noqa: PLC0415 - torch: heavy, only where a tensor is touched

    out: dict[str, str] = {}
    for name, tensor in list(module._parameters.items()) + list(module._buffers.items()):
        if tensor is None or tensor.device.type == "meta" or tensor.numel() == 0:
            continue
        out[prefix + name] = tensor_sha256(tensor)
    if _reads_back(module):
        out[prefix + "#kernel"] = _kernel_readback_digest(module)
    return out


def model_fingerprints(model) -> dict[str, str]:
    """`module_fingerprints` of every module, qualified by module name, sorted."""
    out: dict[str, str] = {}
    for module_name, module in model.named_modules():
        out.update(module_fingerprints(module, f"{module_name}." if module_name else ""))
    return dict(sorted(out.items()))
