"""Reading single tensors out of a checkpoint's shards: the reader, layer runs and raw bytes."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open

from layerwise_cli.checkpoint.delta.buffers import RebuildBuffers
from layerwise_cli.checkpoint.delta.rebuild import rebuilt_tensor
from layerwise_cli.checkpoint.sources import shard_file
from layerwise_cli.planning.plan import PlannedTensor

if TYPE_CHECKING:
    from layerwise_cli.worker.stream.remote_stream import RemoteStream


def layer_batches(stream: list[PlannedTensor]) -> list[list[PlannedTensor]]:
    """Split a stream into runs of consecutive tensors with the same parent layer."""
    batches: list[list[PlannedTensor]] = []
    for item in stream:
        if batches and batches[-1][0].parent == item.parent:
            batches[-1].append(item)
        else:
            batches.append([item])
    return batches


class ShardReader:
    """Reads single tensors from a checkpoint's shards, keeping each shard open.

    Given a `RemoteStream`, the shards are a pinned remote source's (a Hub commit, or a store's objects at their
    ETags), read as their bytes arrive (`remote_stream`).
    With a DELTA (`Checkpoint.delta`), FOLDER holds the delta's base and every tensor read is the step's,
    rebuilt from the base's and proved by its digests (`delta.rebuild.rebuilt_tensor`), into buffers reused
    once vLLM has let go of them (`RebuildBuffers`, until `close`).
    """

    def __init__(self, folder: Path, *, remote: RemoteStream | None = None, delta=None) -> None:
        self._folder = folder
        self._remote = remote
        self._handles: dict[str, object] = {}
        self._delta = delta
        self._buffers = RebuildBuffers() if delta is not None else None

    def where(self, shard: str) -> str:
        """How messages name SHARD: its path, or `org/model@<commit>/<shard>` for a remote source."""
        return self._remote.where(shard) if self._remote is not None else str(self._folder / shard)

    def read(self, item: PlannedTensor) -> torch.Tensor:
        if self._remote is not None:
            return self._remote.read(item.entry)
        shard = item.entry.shard
        handle = self._handles.get(shard)
        if handle is None:
            path = shard_file(self._folder, shard, str(self._folder))
            handle = self._handles[shard] = safe_open(str(path), framework="pt", device="cpu")
        tensor = handle.get_tensor(item.entry.name)
        if self._delta is None:
            return tensor
        return rebuilt_tensor(self._delta, item.entry, tensor, str(self._folder / shard), self._buffers)

    def delta_nbytes(self, item: PlannedTensor) -> int:
        """The bytes of the delta files `read` takes for ITEM beside its base's (0 without a delta)."""
        return 0 if self._delta is None else self._delta.patch_nbytes(item.entry.name)

    def release(self, shard: str) -> None:
        """Drop a shard's handle; its file mapping goes once the tensors read from it are freed too."""
        self._handles.pop(shard, None)

    def close(self) -> None:
        self._handles.clear()
        if self._buffers is not None:
            self._buffers.close()


def raw_bytes(tensor: torch.Tensor):
    """A contiguous host tensor's raw bytes, without a copy (b"" for an empty one)."""
    flat = tensor.reshape(-1)
    return flat.view(torch.uint8).numpy().data if flat.numel() else b""
