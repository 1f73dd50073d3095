"""A small Qwen3-shaped state dict and its config, for the writer, digest and reading tests (no engine)."""

from __future__ import annotations

import random

import torch

CONFIG = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 64, "hidden_size": 32,
          "num_hidden_layers": 3, "tie_word_embeddings": False}


def qwen3_like(layers: int = 3, hidden: int = 32, vocab: int = 64, seed: int = 0) -> dict[str, torch.Tensor]:
    """A Qwen3-shaped state dict: bf16 matrices, f32 norms, names as `save_pretrained` writes them."""
    g = torch.Generator().manual_seed(seed)

    def w(*shape: int, dtype=torch.bfloat16) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dtype)

    sd = {"model.embed_tokens.weight": w(vocab, hidden), "model.norm.weight": w(hidden, dtype=torch.float32),
          "lm_head.weight": w(vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}"
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            sd[f"{p}.self_attn.{proj}.weight"] = w(hidden, hidden)
        for norm in ("q_norm", "k_norm"):
            sd[f"{p}.self_attn.{norm}.weight"] = w(16, dtype=torch.float32)
        for proj in ("gate_proj", "up_proj"):
            sd[f"{p}.mlp.{proj}.weight"] = w(2 * hidden, hidden)
        sd[f"{p}.mlp.down_proj.weight"] = w(hidden, 2 * hidden)
        sd[f"{p}.input_layernorm.weight"] = w(hidden, dtype=torch.float32)
        sd[f"{p}.post_attention_layernorm.weight"] = w(hidden, dtype=torch.float32)
    return sd


def shuffled(sd: dict, seed: int):
    """SD's items in an order drawn from SEED, as a generator: the writer never sees a dict."""
    items = list(sd.items())
    random.Random(seed).shuffle(items)
    yield from items
