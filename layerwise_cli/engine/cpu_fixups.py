"""Work around what vLLM's CPU backend leaves undone after an in-place reload."""

from __future__ import annotations

import torch


def repack_cpu_moe_experts(model: torch.nn.Module, reloaded: set[str]) -> list[str]:
    """Redo the CPU prepack of unquantized MoE experts that this reload refilled.

    vLLM (0.32) prepacks unquantized CPU expert weights into its kernel's
    layout only when it first builds the MoE kernel
    (`UnquantizedFusedMoEMethod._setup_kernel` skips the kernel's
    `process_weights_after_loading` on a weight update). A reload therefore
    copies checkpoint-layout weights into the prepacked storage and the CPU
    kernel misreads them; vLLM's own `reload_weights` has the same fault. GPU
    backends reshuffle on every update and are not affected.

    Args:
        model: the engine's model.
        reloaded: names of the modules this reload processed; only these are
            repacked (repacking twice would scramble a layer).

    Returns:
        The names of the modules repacked, in place (storage pointers kept).
    """
    repacked = []
    for name, module in model.named_modules():
        if name not in reloaded:
            continue
        method = getattr(module, "quant_method", None)
        experts = getattr(getattr(method, "moe_kernel", None), "fused_experts", None)
        # By name through the class hierarchy: the x86 (AMX) and Arm kernels are
        # subclasses with their own `isa` (vllm/model_executor/layers/fused_moe/experts/cpu_moe.py).
        kernels = {cls.__name__ for cls in type(experts).__mro__}
        if "CPUUnquantizedExperts" not in kernels or getattr(experts, "_use_zentorch", False):
            continue
        from vllm import _custom_ops as ops

        for param in ("w13_weight", "w2_weight"):
            tensor = getattr(module, param)
            packed = ops.cpu_prepack_moe_weight(tensor.data.clone(), experts.isa)
            if packed.shape != tensor.shape:
                raise RuntimeError(f"{name}.{param}: CPU MoE prepack changed the shape; cannot repack in place")
            tensor.data.copy_(packed)
        repacked.append(name)
    return repacked
