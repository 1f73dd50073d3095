"""Training steps written as sparse deltas, for the delta tests: A (*multiply*), B an RL-like step from it."""

from __future__ import annotations

from pathlib import Path

from tests.support.engine_support import copy_non_weights, load_tensors


def rl_step(tensor, fraction: float, seed: int):
    """TENSOR with FRACTION of its values moved one unit in the last place (their bit pattern + 1): still finite."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    mask = torch.rand(tensor.shape, generator=gen) < fraction
    bits = {2: torch.int16, 4: torch.int32}[tensor.element_size()]
    bumped = (tensor.contiguous().view(bits) + 1).view(tensor.dtype)
    return torch.where(mask & bumped.isfinite(), bumped, tensor)


def save_step(tensors: dict, folder: Path, like: Path, **kwargs):
    """`save_checkpoint` of TENSORS into FOLDER (small shards), with LIKE's config and tokenizer files."""
    import json

    from layerwise_cli.writer.save import save_checkpoint

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
    from layerwise_cli.planning.inspect import inspect_order
    from layerwise_cli.writer.delta_step import write_delta

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
