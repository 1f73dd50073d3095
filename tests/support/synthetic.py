"""Generate small Qwen3-style checkpoints in chosen tensor orders (headers exact, data synthetic).

Used by the tests, the benchmarks and `layerwise demo`'s fixtures. Needs no
torch: tensors are written as raw bytes from a seeded generator.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from layerwise_cli.checkpoint.format.header import DTYPE_SIZES, TensorEntry, encode_header

LAYOUTS = ("in_order", "split_layer", "trainer_export", "experts_spread")


@dataclass(frozen=True)
class SyntheticModel:
    """Shapes of a Qwen3 (dense) or Qwen3-MoE model."""

    layers: int = 2
    hidden: int = 64
    heads: int = 2
    kv_heads: int = 1
    head_dim: int = 64
    intermediate: int = 128
    vocab: int = 128
    experts: int = 0  # 0: dense Qwen3; >0: Qwen3-MoE with this many experts
    moe_intermediate: int = 32
    top_k: int = 2
    tie_word_embeddings: bool = False
    dtype: str = "BF16"
    prefix: str = "model."  # e.g. "model.language_model." for multimodal wrappers

    def tensors(self) -> list[tuple[str, tuple[int, ...]]]:
        """All checkpoint tensors, in model order."""
        p, h = self.prefix, self.hidden
        out = [(f"{p}embed_tokens.weight", (self.vocab, h))]
        for i in range(self.layers):
            L = f"{p}layers.{i}."
            out += [
                (L + "input_layernorm.weight", (h,)),
                (L + "self_attn.q_proj.weight", (self.heads * self.head_dim, h)),
                (L + "self_attn.k_proj.weight", (self.kv_heads * self.head_dim, h)),
                (L + "self_attn.v_proj.weight", (self.kv_heads * self.head_dim, h)),
                (L + "self_attn.o_proj.weight", (h, self.heads * self.head_dim)),
                (L + "self_attn.q_norm.weight", (self.head_dim,)),
                (L + "self_attn.k_norm.weight", (self.head_dim,)),
                (L + "post_attention_layernorm.weight", (h,)),
            ]
            if self.experts:
                out.append((L + "mlp.gate.weight", (self.experts, h)))
                for e in range(self.experts):
                    E = f"{L}mlp.experts.{e}."
                    out += [
                        (E + "gate_proj.weight", (self.moe_intermediate, h)),
                        (E + "up_proj.weight", (self.moe_intermediate, h)),
                        (E + "down_proj.weight", (h, self.moe_intermediate)),
                    ]
            else:
                out += [
                    (L + "mlp.gate_proj.weight", (self.intermediate, h)),
                    (L + "mlp.up_proj.weight", (self.intermediate, h)),
                    (L + "mlp.down_proj.weight", (h, self.intermediate)),
                ]
        out.append((f"{p}norm.weight", (h,)))
        if not self.tie_word_embeddings:
            out.append(("lm_head.weight", (self.vocab, h)))
        return out

    def config(self) -> dict:
        """A `config.json` that vLLM and transformers accept for these shapes."""
        torch_dtype = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}[self.dtype]
        config = {
            "architectures": ["Qwen3MoeForCausalLM" if self.experts else "Qwen3ForCausalLM"],
            "model_type": "qwen3_moe" if self.experts else "qwen3",
            "hidden_size": self.hidden,
            "intermediate_size": self.intermediate,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab,
            "max_position_embeddings": 512,
            "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0,
            "hidden_act": "silu",
            "tie_word_embeddings": self.tie_word_embeddings,
            "torch_dtype": torch_dtype,
            "dtype": torch_dtype,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "attention_bias": False,
            "attention_dropout": 0.0,
            "use_sliding_window": False,
        }
        if self.experts:
            config.update({
                "num_experts": self.experts,
                "num_experts_per_tok": self.top_k,
                "moe_intermediate_size": self.moe_intermediate,
                "decoder_sparse_step": 1,
                "mlp_only_layers": [],
                "norm_topk_prob": True,
                "output_router_logits": False,
                "router_aux_loss_coef": 0.001,
            })
        return config


def shard_groups(model: SyntheticModel, layout: str, shards: int = 4) -> list[list[str]]:
    """Split the model's tensor names into shards for a layout.

    - `in_order`: consecutive tensors of model order, evenly split.
    - `split_layer`: in order, but the middle decoder layer's q_proj/k_proj stay
      in one shard and its v_proj (and up_proj) move to the next.
    - `trainer_export`: one shard per parameter type across all layers
      (q_proj of every layer, then k_proj of every layer, ...), as trainers that
      gather by parameter group write them.
    - `experts_spread` (MoE): expert e of every layer goes to shard e % shards.
    """
    names = [name for name, _ in model.tensors()]
    if layout == "in_order":
        return _even_split(names, shards)
    if layout == "split_layer":
        groups = _even_split(names, 2)
        middle = f"{model.prefix}layers.{model.layers // 2}."
        moved = [n for n in names if n.startswith(middle) and n.endswith(("v_proj.weight", "mlp.up_proj.weight"))]
        kept = [n for n in names if n.startswith(middle) and n not in moved]
        first = [n for n in groups[0] if n not in moved] + [n for n in kept if n not in groups[0]]
        second = [n for n in names if n not in first]
        return [first, second]
    if layout == "trainer_export":
        kinds: dict[str, list[str]] = {}
        for n in names:
            kinds.setdefault(_param_kind(n), []).append(n)
        groups = list(kinds.values())
        return [[n for group in groups[i::shards] for n in group] for i in range(min(shards, len(groups)))]
    if layout == "experts_spread":
        if not model.experts:
            raise ValueError("experts_spread needs a MoE model (experts > 0)")
        groups = [[] for _ in range(shards)]
        for n in names:
            parts = n.split(".experts.")
            index = int(parts[1].split(".")[0]) % shards if len(parts) == 2 else 0
            groups[index].append(n)
        return groups
    raise ValueError(f"unknown layout {layout!r}: choose from {', '.join(LAYOUTS)}")


def _param_kind(name: str) -> str:
    parts = name.split(".")
    if ".experts." in name:
        return "experts." + parts[-2]
    return ".".join(p for p in parts if not p.isdigit() and p not in {"model", "layers"})


def _even_split(names: list[str], shards: int) -> list[list[str]]:
    shards = max(1, min(shards, len(names)))
    size = -(-len(names) // shards)
    return [names[i:i + size] for i in range(0, len(names), size)]


def write_safetensors(
    path: str | os.PathLike[str],
    tensors: Iterable[tuple[str, str, tuple[int, ...]]],
    data: Callable[[str, int], bytes] | None = None,
    metadata: dict[str, str] | None = None,
) -> int:
    """Write a safetensors file from (name, dtype, shape), header in the given order.

    Args:
        path: file to write.
        tensors: names, dtypes and shapes, written in this order.
        data: returns the bytes of a tensor given its name and size; default
            is seeded pseudo-random bytes, every value finite (real weights
            need real tensors: see `normal_weights`).
        metadata: the `__metadata__` strings.

    Returns:
        The file size in bytes.
    """
    offset = 0
    entries = []
    for name, dtype, shape in tensors:
        n = DTYPE_SIZES[dtype]
        for d in shape:
            n *= d
        entries.append(TensorEntry(name, dtype, tuple(shape), os.path.basename(path), offset, offset + n))
        offset += n
    header = encode_header(entries, metadata)
    fill = data or _pseudo_random_bytes
    with open(path, "wb") as f:
        f.write(header)
        for entry in entries:
            f.write(fill(entry.name, entry.nbytes))
    return len(header) + offset


# Bit 6 of every byte cleared: the top exponent bit of every little-endian
# F64/F32/F16/BF16/F8 value is then zero, so no value is NaN or Inf (which the
# reload, `reorder --verify` and `inspect-order --scan` refuse or report).
_FINITE = bytes(b & 0xBF for b in range(256))


def _pseudo_random_bytes(name: str, n: int) -> bytes:
    return random.Random(name).randbytes(n).translate(_FINITE)


@dataclass
class WrittenCheckpoint:
    path: Path
    shards: list[Path] = field(default_factory=list)
    total_bytes: int = 0


def write_checkpoint(
    folder: str | os.PathLike[str],
    model: SyntheticModel,
    layout: str = "in_order",
    shards: int = 4,
    *,
    index: bool = True,
    data: Callable[[str, int], bytes] | None = None,
) -> WrittenCheckpoint:
    """Write a synthetic checkpoint (config, shards, index) in a layout.

    Args:
        folder: created if missing.
        model: shapes.
        layout: one of `LAYOUTS`.
        shards: number of shard files (layouts may use fewer).
        index: write `model.safetensors.index.json`.
        data: tensor byte source (see `write_safetensors`).

    Returns:
        The written paths and the tensor bytes in total.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    shapes = dict(model.tensors())
    groups = [g for g in shard_groups(model, layout, shards) if g]
    written = WrittenCheckpoint(folder)
    weight_map: dict[str, str] = {}
    total = len(groups)
    item = DTYPE_SIZES[model.dtype]
    for i, names in enumerate(groups, start=1):
        name = f"model-{i:05d}-of-{total:05d}.safetensors" if total > 1 else "model.safetensors"
        write_safetensors(folder / name, [(n, model.dtype, shapes[n]) for n in names], data, {"format": "pt"})
        written.shards.append(folder / name)
        for n in names:
            weight_map[n] = name
            size = item
            for d in shapes[n]:
                size *= d
            written.total_bytes += size
    if index and total > 1:
        (folder / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": written.total_bytes}, "weight_map": weight_map}, indent=2)
        )
    (folder / "config.json").write_text(json.dumps(model.config(), indent=2))
    return written


def normal_weights(model: SyntheticModel, seed: int = 0, std: float = 0.02) -> Callable[[str, int], bytes]:
    """A `data` source of real weights: normal(0, std) values (norms 1.0) in the model's dtype.

    Random bytes are not valid weights (NaN and inf break online quantization
    and make outputs meaningless); engines need these. One tensor is drawn per
    distinct shape and reused, so large checkpoints stay cheap to write.
    """
    import torch  # noqa: PLC0415 - torch: heavy (test collection stays fast)

    dtype = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}[model.dtype]
    generator = torch.Generator().manual_seed(seed)
    shapes = dict(model.tensors())
    cache: dict[tuple, bytes] = {}

    def data(name: str, nbytes: int) -> bytes:
        shape = tuple(shapes[name])
        norm = name.endswith("norm.weight")
        key = (shape, norm)
        if key not in cache:
            tensor = torch.ones(shape) if norm else torch.randn(shape, generator=generator) * std
            cache[key] = tensor.to(dtype).contiguous().view(torch.uint8).numpy().tobytes()
        assert len(cache[key]) == nbytes
        return cache[key]

    return data
