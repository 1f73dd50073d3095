"""Checksums of an engine's weights as the engine holds them."""

from __future__ import annotations

import hashlib

import torch


def tensor_sha256(tensor: torch.Tensor) -> str:
    """SHA-256 of a tensor's bytes (on the host), with its dtype and shape."""
    data = tensor.detach().cpu().contiguous()
    digest = hashlib.sha256(f"{data.dtype}{tuple(data.shape)}".encode())
    if data.numel():
        flat = data.reshape(-1)
        digest.update(flat.view(torch.uint8).numpy().tobytes() if flat.dtype != torch.bool
                      else flat.numpy().tobytes())
    return digest.hexdigest()


def storage_pointers(model: torch.nn.Module) -> dict[str, int]:
    """Data pointer of every parameter and buffer that keeps storage (to prove a reload was in place)."""
    out: dict[str, int] = {}
    for module_name, module in model.named_modules():
        prefix = f"{module_name}." if module_name else ""
        for name, tensor in list(module._parameters.items()) + list(module._buffers.items()):
            if tensor is not None and tensor.device.type != "meta" and tensor.numel():
                out[prefix + name] = tensor.data_ptr()
    return out


def model_checksums(model: torch.nn.Module) -> dict[str, str]:
    """Digest every parameter and buffer that keeps storage, and CPU repacked weights.

    On CPU, vLLM repacks dense linear weights into the closure of
    `layer.cpu_linear` and empties `weight`; packed tensors captured there are
    digested too, under `<module>.cpu_linear.<n>` (a oneDNN handle is opaque
    and cannot be digested).

    Returns:
        Qualified name -> hex digest, sorted by name.
    """
    out: dict[str, str] = {}
    for module_name, module in model.named_modules():
        prefix = f"{module_name}." if module_name else ""
        for name, tensor in list(module._parameters.items()) + list(module._buffers.items()):
            if tensor is None or tensor.device.type == "meta" or tensor.numel() == 0:
                continue
            out[prefix + name] = tensor_sha256(tensor)
        packed = getattr(module, "cpu_linear", None)
        for index, cell in enumerate(getattr(packed, "__closure__", None) or ()):
            value = cell.cell_contents
            if isinstance(value, torch.Tensor) and value.numel():
                out[f"{prefix}cpu_linear.{index}"] = tensor_sha256(value)
    return dict(sorted(out.items()))
