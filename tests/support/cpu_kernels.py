"""Which derived CPU kernels vLLM builds on this machine, asked of vLLM's own dispatch (no engine).

What vLLM's reload leaves stale on CPU depends on the CPU: `dispatch_cpu_unquantized_gemm`
(`vllm/model_executor/layers/utils.py`) packs a copy of a linear weight (SGL on AMX, oneDNN where it
supports bf16, e.g. AVX-512) or falls back to `F.linear` on the weight itself (AVX2: oneDNN has no bf16
matmul there), and prepacks a width-4 bf16 causal-conv weight only with AVX512-BF16 or ARM bf16.
A kernel built from a copy is what a reload leaves stale (the tied head's; the Mamba2 `conv_weights`
view then keeps the unpacked original). The tests ask the same function the engine calls, on the
same machine, so their expectations follow the CPU they run on, not the CPU they were written on.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable
from pathlib import Path

from layerwise_cli.client.engine.in_process import cuda_available

VOCAB_PADDING = 64  # vLLM's DEFAULT_VOCAB_PADDING_SIZE


def take_linear_fallback(set_attribute=setattr) -> None:
    """Make vLLM's CPU GEMM dispatch compute with `F.linear` on the stored weight, as on an AVX2 CPU (no oneDNN
    bf16 matmul, no SGL kernel): the dense linear weights then keep their loaded layout, as on a GPU.

    SET_ATTRIBUTE: `monkeypatch.setattr` in a test (undone after it); plain `setattr` in a worker process.
    """
    from vllm import _custom_ops  # noqa: PLC0415 - vllm: heavy (test collection stays fast)
    from vllm.model_executor.layers import utils  # noqa: PLC0415 - vllm: heavy (test collection stays fast)

    set_attribute(_custom_ops, "_supports_onednn", False)
    set_attribute(utils, "check_cpu_sgl_kernel", lambda *args: False)


def on_cpu() -> bool:
    return not cuda_available()


def _module_with_weight(weight):
    import torch  # noqa: PLC0415 - torch: heavy (test collection stays fast)

    module = torch.nn.Module()
    module.weight = torch.nn.Parameter(weight, requires_grad=False)
    return module


@functools.cache
def linear_kernel_holds_a_copy(out_features: int, in_features: int) -> bool:
    """True when vLLM's CPU GEMM kernel of a bf16 weight this shape does not follow an in-place update of it."""
    import torch  # noqa: PLC0415 - torch: heavy (test collection stays fast)
    import torch.nn.functional as F  # noqa: PLC0415 - torch: heavy (test collection stays fast)
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm  # noqa: PLC0415 - vllm: heavy (test collection stays fast)

    generator = torch.Generator().manual_seed(0)
    module = _module_with_weight(torch.randn(out_features, in_features, generator=generator, dtype=torch.bfloat16))
    dispatch_cpu_unquantized_gemm(module, remove_weight=False)
    with torch.no_grad():
        module.weight.copy_(torch.randn(out_features, in_features, generator=generator, dtype=torch.bfloat16))
    x = torch.randn(3, in_features, generator=generator, dtype=torch.bfloat16)
    kernel = module.cpu_linear(x, module.weight, None).float()
    return not torch.allclose(kernel, F.linear(x, module.weight).float(), rtol=2e-2, atol=2e-2)


def linear_kernels_are_read_back() -> bool:
    """Whether `--verify` reads dense linear weights back through their CPU kernels here (`#kernel` entries).

    Only a kernel that holds a copy is read back; vLLM's `F.linear` fallback
    (AVX2) computes with the stored weight, which is compared as a tensor.
    """
    return on_cpu() and linear_kernel_holds_a_copy(256, 256)


@functools.cache
def conv_weight_is_prepacked(channels: int = 256, width: int = 4) -> bool:
    """True when vLLM replaces a bf16 causal-conv weight `[channels, 1, width]` by a prepacked one after loading."""
    import torch  # noqa: PLC0415 - torch: heavy (test collection stays fast)
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm  # noqa: PLC0415 - vllm: heavy (test collection stays fast)

    module = _module_with_weight(torch.randn(channels, 1, width, dtype=torch.bfloat16))
    before = module.weight.data_ptr()
    dispatch_cpu_unquantized_gemm(module, remove_weight=False)
    return module.weight.data_ptr() != before or module.weight.dim() != 3


def head_shape(checkpoint: Path) -> tuple[int, int]:
    """The engine's LM head `(padded vocabulary, hidden size)` for a checkpoint's config."""
    config = json.loads((Path(checkpoint) / "config.json").read_text())
    vocab = -(-config["vocab_size"] // VOCAB_PADDING) * VOCAB_PADDING
    return vocab, config["hidden_size"]


# The report's refreshed tensors that stand for their whole module in `--verify`'s names.
MODULE_WIDE = ("cpu_linear", "w13_weight", "w2_weight")


def verify_name(module: str, tensor: str) -> str:
    """`--verify`'s name for a refreshed (module, tensor) of the report: a kernel or MoE experts' module itself,
    an alias buffer as `module.tensor`."""
    return module if tensor in MODULE_WIDE else f"{module}.{tensor}"


def left_stale_by_vllm(candidates: Iterable[str], checkpoint: Path) -> tuple[str, ...]:
    """Of the derived state a repair exists for, what vLLM's reload leaves stale on this machine.

    `candidates` are `--verify`'s names: `lm_head` (a tied head's kernel), `...conv_weights` (the Mamba2
    view of `conv1d.weight`), `...experts.routed_experts` (CPU MoE experts, prepacked only when the kernel
    is built: stale on every CPU). Nothing is stale on a GPU.
    """
    if not on_cpu():
        return ()

    def stale(name: str) -> bool:
        if name == "lm_head":
            return linear_kernel_holds_a_copy(*head_shape(checkpoint))
        if name.endswith(".conv_weights"):
            return conv_weight_is_prepacked()
        if name.endswith(".routed_experts"):
            return True
        raise ValueError(f"no rule for {name}: say when vLLM leaves it stale")

    return tuple(name for name in candidates if stale(name))
