"""Give vLLM's CPU rotary kernel the 2-D query and key it assumes, so MLA answers do not depend on the batch.

What vLLM (0.32.0) does wrong: `RotaryEmbedding.forward_cpu`
(`vllm/model_executor/layers/rotary_embedding/base.py`) passes query and key
as they come to `torch.ops._C.rotary_embedding` (`csrc/cpu/pos_encoding.cpp`),
which reads them as `[num_tokens, num_heads * head_size]`: tokens =
`positions.numel()`, heads = `query.size(-1) // head_size`, token stride =
`query.stride(-2)`. MLA (`vllm/model_executor/layers/mla.py`,
`MultiHeadLatentAttentionWrapper.forward`) passes 3-D views instead:
`q[..., qk_nope_head_dim:]`, `[T, H, 64]` with strides `(H*192, 192, 1)`, and
`k_pe`, `[T, 1, 64]` with strides `(640, 64, 1)` (a slice of the fused
`qkv_a` output). The kernel then takes one head per token and the head
stride as the token stride: it rotates the first T of the T*H query heads,
each with the position of another token (head h of token t gets
`positions[t*H + h]`, a token of another request once t*H + h passes the
request's end), leaves the rest unrotated, and rotates 64-wide slices of the
`qkv_a` output at steps of 64 instead of each token's `k_pe`. Standard
attention passes 2-D query and key and is not affected, and nor is DeepSeek's
YaRN rope (`DeepseekScalingRotaryEmbedding` has no CPU kernel and runs
`forward_native`); MLA models with a plain rope are. So a request's answer depends on the other requests in its batch
(measured: a prompt alone and the same prompt among four differ by up to 1 nat
in a logprob), and across generates it varies wherever the batches do (in the
default process layout, with when the requests reach the engine core).

The repair wraps `forward_cpu`: a query or key that is not 2-D is reshaped to
`[num_tokens, -1]` in a contiguous copy, vLLM's own kernel rotates that, and
the result is copied back into the caller's tensor, so the in-place contract
is kept (the copies hold the rope part only: `T*H*64` and `T*64` values).
2-D inputs, rope classes with their own `forward_cpu` and other platforms
(which never dispatch to `forward_cpu`) are untouched; the answers are those
of the same kernel on the layout it was written for. Off when
`LAYERWISE_NO_REPAIRS=1` is set (read at each call: in a worker process,
the value it was started with). Applied once per process, from the
`vllm.general_plugins` entry point (before vLLM builds a model: each rope
module binds its `forward_cpu` when it is built).
"""

from __future__ import annotations

import functools
import inspect
import logging

import torch

from layerwise_cli import vllm_compat, vllm_symbols
from layerwise_cli.engine_defaults import repairs_disabled

logger = logging.getLogger(__name__)

_MARK = "_layerwise_2d_rope_repair"  # set on the wrapper: applied once per process


def apply_rope_repair() -> bool:
    """Wrap vLLM's `RotaryEmbedding.forward_cpu` (idempotent); False, with a log line, where vLLM's code differs."""
    try:
        rope_class = vllm_compat.load(vllm_symbols.ROTARY_EMBEDDING)
    except (ImportError, AttributeError) as exc:
        logger.warning("layerwise: CPU rotary repair not applied: %s", exc)
        return False
    original = rope_class.__dict__.get("forward_cpu")
    if original is None or not callable(original):
        logger.warning("layerwise: CPU rotary repair not applied: %s.forward_cpu is not defined there",
                       rope_class.__qualname__)
        return False
    if getattr(original, _MARK, False):
        return True
    parameters = list(inspect.signature(original).parameters)
    if parameters != ["self", "positions", "query", "key"]:
        logger.warning("layerwise: CPU rotary repair not applied: %s.forward_cpu takes %s, not (self, positions, "
                       "query, key)", rope_class.__qualname__, parameters)
        return False
    rope_class.forward_cpu = _two_dimensional(original)
    return True


def _two_dimensional(forward_cpu):
    """FORWARD_CPU, called with query and key reshaped to `[num_tokens, -1]` and the result put back in place."""

    @functools.wraps(forward_cpu)
    def forward_cpu_2d(self, positions, query, key=None):
        if (query.dim() == 2 and (key is None or key.dim() == 2)) or repairs_disabled():
            return forward_cpu(self, positions, query, key)
        # Always a copy, then written back: no aliasing to reason about, and traceable by torch.compile (vLLM
        # compiles the model with fullgraph=True, compilation/wrapper.py; a data-pointer test breaks the graph).
        num_tokens = positions.numel()
        query_2d = query.reshape(num_tokens, -1).clone(memory_format=torch.contiguous_format)
        key_2d = None if key is None else key.reshape(num_tokens, -1).clone(memory_format=torch.contiguous_format)
        forward_cpu(self, positions, query_2d, key_2d)
        query.copy_(query_2d.view(query.shape))
        if key is not None:
            key.copy_(key_2d.view(key.shape))
        return query, key

    setattr(forward_cpu_2d, _MARK, True)
    return forward_cpu_2d
