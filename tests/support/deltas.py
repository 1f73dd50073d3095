"""Training steps written as sparse deltas, for the delta tests: A (*multiply*), B an RL-like step from it."""

from __future__ import annotations

import json
from pathlib import Path

from layerwise_cli.checkpoint.sources import open_checkpoint
from layerwise_cli.planning.inspect import inspect_order
from layerwise_cli.writer.delta_step import write_delta
from layerwise_cli.writer.save import save_checkpoint
from tests.support.engine_support import copy_non_weights, load_tensors


def rl_step(tensor, fraction: float, seed: int):
    """TENSOR with FRACTION of its values moved one unit in the last place (their bit pattern + 1): still finite."""
    import torch  # noqa: PLC0415 - torch: heavy (test collection stays fast)

    gen = torch.Generator().manual_seed(seed)
    mask = torch.rand(tensor.shape, generator=gen) < fraction
    bits = {2: torch.int16, 4: torch.int32}[tensor.element_size()]
    bumped = (tensor.contiguous().view(bits) + 1).view(tensor.dtype)
    return torch.where(mask & bumped.isfinite(), bumped, tensor)


def save_step(tensors: dict, folder: Path, like: Path, **kwargs):
    """`save_checkpoint` of TENSORS into FOLDER (small shards), with LIKE's config and tokenizer files."""
    config = json.loads((like / "config.json").read_text())
    saved = save_checkpoint(tensors.items(), folder, config=config, max_shard_size=60_000, marker=None, **kwargs)
    copy_non_weights(like, folder)
    return saved


def write_steps(root: Path, demo_models) -> dict[str, Path]:
    """A (`step_1`, *multiply*'s tensors), B in full (`b_full`), delta(A->B) (`step_2`, by `save_checkpoint`) and
    delta(B->A) (`step_3`, by `write_delta`).

    B is A after an RL-like step: 1% of the values of every tensor one unit in the last place off, and every
    fourth parent layer taken from *add* (so that the answers change too).
    """
    a_dir, add_dir = demo_models["multiply"], demo_models["add"]
    plan = inspect_order(str(a_dir)).plan
    changed = {layer.name for layer in plan.layers[2::4]}
    parent = {item.entry.name: item.parent for item in plan.layer_order}
    a, add = load_tensors(a_dir), load_tensors(add_dir)
    b = {name: add[name] if parent.get(name) in changed else rl_step(t, 0.01, i)
         for i, (name, t) in enumerate(sorted(a.items()))}
    save_step(a, root / "step_1", a_dir)
    save_step(b, root / "b_full", a_dir)
    ab = save_step(b, root / "step_2", a_dir, base=root / "step_1")
    assert ab.delta is not None, ab.fallback
    ba = write_delta(root / "b_full", root / "step_1", root / "step_3", marker=None)
    assert ba.delta is not None, ba.fallback
    return {"A": root / "step_1", "B": root / "b_full", "AB": root / "step_2", "BA": root / "step_3",
            "tensors": a}


def changed_copy(tensor, fraction: float, seed: int):
    """TENSOR with about FRACTION of its values moved to a neighbouring representable value."""
    import torch  # noqa: PLC0415 - torch: heavy (test collection stays fast)

    gen = torch.Generator().manual_seed(seed)
    mask = torch.rand(tensor.shape, generator=gen) < fraction
    bumped = torch.nextafter(tensor.float(), torch.full_like(tensor.float(), 10.0)).to(tensor.dtype)
    bumped = torch.where(bumped == tensor, tensor + 1, bumped)
    return torch.where(mask, bumped, tensor)


def small_state_dict(dtype, seed: int = 0) -> dict:
    """Four tensors of DTYPE named as a decoder's (an embedding, two layers): a step small enough for logic tests."""
    import torch  # noqa: PLC0415 - torch: heavy (test collection stays fast)

    gen = torch.Generator().manual_seed(seed)
    return {
        "model.embed_tokens.weight": torch.randn(64, 32, generator=gen).to(dtype),
        "model.layers.0.mlp.down_proj.weight": torch.randn(32, 48, generator=gen).to(dtype),
        "model.layers.0.input_layernorm.weight": torch.randn(32, generator=gen).to(dtype),
        "model.layers.1.mlp.down_proj.weight": torch.randn(32, 48, generator=gen).to(dtype),
    }


def stored_bytes(directory: Path) -> dict:
    """Every tensor of the checkpoint in DIRECTORY as the bytes its shard stores (uint8 arrays), by name."""
    import numpy as np  # noqa: PLC0415 - numpy: heavy (test collection stays fast)

    checkpoint = open_checkpoint(str(directory))
    out = {}
    for shard in checkpoint.shards:
        data = (directory / shard.name).read_bytes()
        for t in shard.tensors:
            out[t.name] = np.frombuffer(data, dtype=np.uint8)[shard.data_start + t.begin:shard.data_start + t.end]
    return out
