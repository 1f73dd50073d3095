"""A delta opened as the full step it rebuilds: the base's headers with the step's digests, read through the patch."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from layerwise_cli.checkpoint.delta import Delta, delta_file, read_delta
from layerwise_cli.checkpoint.digests import checkpoint_digests, digests_metadata, tensor_digest
from layerwise_cli.checkpoint.header import TensorEntry
from layerwise_cli.checkpoint.layout import read_json
from layerwise_cli.checkpoint.sources import Checkpoint, looks_like_repo_id, open_checkpoint
from layerwise_cli.errors import LayerwiseError


def open_step(source: str, revision: str | None = None) -> Checkpoint:
    """`open_checkpoint`, except that a local sparse delta is opened as the full step it rebuilds.

    For the callers that read tensors through `Checkpoint.delta` (a reload, its pre-flight, `--verify`);
    everything else opens a delta as the safetensors file it is.
    """
    if not looks_like_repo_id(source) and delta_file(source) is not None:
        if revision:
            raise LayerwiseError("--revision applies to Hub repo ids only", where=source)
        return open_delta_checkpoint(source)
    return open_checkpoint(source, revision)


def base_directory(delta: Delta) -> Path:
    """Where the delta's base is now: its recorded location, else a sibling of the delta's step of that name.

    Raises:
        LayerwiseError: neither exists (naming both).
    """
    recorded = Path(delta.base_location)
    if recorded.exists():
        return recorded
    beside = delta.path.parent.parent / recorded.name
    if beside.exists():
        return beside
    raise LayerwiseError(f"its base {delta.base_location} does not exist (nor {beside}): a delta is rebuilt from "
                         "its base step's files", where=str(delta.path))


def open_delta_checkpoint(path: str | Path) -> Checkpoint:
    """The full step a delta rebuilds, as a `Checkpoint`: what a reload plans, pre-flights and streams.

    Its shards are the base's (`local_dir` is the base's directory), their
    headers carrying the full step's digests (`layerwise.digests`), so that the
    skip of unchanged layers and the records work as for a full step; `delta`
    is the delta, which every read goes through (`rebuilt_tensor`). The base
    must hold exactly the delta's tensors, and where its headers carry digests,
    the delta's base digests.

    Raises:
        LayerwiseError: the delta or its base cannot be read, or the base is not the delta's base.
    """
    delta = read_delta(path)
    where = str(delta.path)
    base_dir = base_directory(delta)
    if delta_file(base_dir) is not None:
        raise LayerwiseError(f"its base {base_dir} is a delta itself: a delta applies to a full step", where=where)
    base = open_checkpoint(str(base_dir))
    names = {t.name: t for t in base.tensors}
    odd = sorted(set(names) ^ set(delta.base_digests))
    if odd:
        raise LayerwiseError(f"its base {base_dir} is not the delta's base: tensor {odd[0]} is in only one of them",
                             where=where)
    claimed = checkpoint_digests(base.shards) or {}
    for name, digest in claimed.items():
        if digest != delta.base_digests[name]:
            raise LayerwiseError(f"its base {base_dir} is not the delta's base: tensor {name} differs (header digest "
                                 f"{digest}, the delta's base {delta.base_digests[name]})", where=where)
    for name, patch in delta.patches.items():
        entry = names[name]
        if (entry.dtype, entry.shape) != (patch.dtype, patch.shape):
            raise LayerwiseError(f"tensor {name}: the patch is {patch.dtype}{list(patch.shape)}, the base's "
                                 f"{entry.dtype}{list(entry.shape)}", where=where)
    shards = [replace(shard, metadata={**shard.metadata, **digests_metadata(
        {t.name: delta.step_digests[t.name] for t in shard.tensors})}) for shard in base.shards]
    config_path = delta.path.parent / "config.json"
    config = read_json(config_path) if config_path.is_file() else base.config
    return replace(base, source=str(path), shards=shards, config=config, delta=delta)


def rebuilt_tensor(delta: Delta, entry: TensorEntry, base, where: str):
    """Tensor ENTRY of the step, from its BASE tensor (as read from the base's file) and the patch; proved.

    The base's bytes must hash to the delta's base digest, and the rebuilt
    bytes to the step's digest: what is handed over is the full step's tensor,
    or nothing.

    Args:
        delta: the delta.
        entry: the tensor as the base's header describes it.
        base: the base's tensor (a contiguous host torch tensor).
        where: the base's shard file, for the message.

    Returns:
        The step's tensor (BASE itself when the delta leaves it as it was).

    Raises:
        LayerwiseError: the base's bytes are not the delta's base, the patch is corrupt, or the result is not
            the step's tensor.
    """
    import torch

    raw = base.reshape(-1).view(torch.uint8).numpy()
    if tensor_digest(entry.dtype, entry.shape, raw) != delta.base_digests[entry.name]:
        raise LayerwiseError(f"tensor {entry.name}: its bytes are not the delta's base {delta.base_location} "
                             "(the base changed since the delta was written)", where=where)
    if entry.name not in delta.patches:
        return base
    out = delta.apply(entry.name, raw)
    if tensor_digest(entry.dtype, entry.shape, out) != delta.step_digests[entry.name]:
        raise LayerwiseError(f"tensor {entry.name}: the rebuilt bytes do not hash to the step's digest "
                             "(corrupt delta)", where=str(delta.path))
    return torch.from_numpy(out).view(base.dtype).reshape(base.shape)
