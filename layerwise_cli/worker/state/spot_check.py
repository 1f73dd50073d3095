"""Before a layer is skipped on its header digest: its sampled bytes in the file must be those the engine loaded."""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from layerwise_cli.checkpoint.header import TensorEntry
from layerwise_cli.checkpoint.samples import buffer_sample, file_sample, sample_bytes
from layerwise_cli.checkpoint.sources import Checkpoint
from layerwise_cli.worker.state.layer_records import LayerRecords


@dataclass(frozen=True)
class StaleDigest:
    """A tensor whose shard header claims the digest the engine loaded, while its sampled bytes differ."""

    layer: str  # the parent layer (engine name), reloaded because of it
    tensor: str
    file: str  # the shard file whose header digest is stale

    def describe(self) -> str:
        return (f"header digest is stale: {self.file}: tensor {self.tensor} claims the digest of the bytes the "
                f"engine holds, but its bytes differ (rewritten with the old __metadata__?); layer {self.layer} "
                "reloaded")

    def to_dict(self) -> dict:
        return {"layer": self.layer, "tensor": self.tensor, "file": self.file}


@dataclass
class SpotCheck:
    """What the spot check of the layers about to be skipped on their header digests found.

    Attributes:
        confirmed: layers whose every tensor's sample matched its record: skipped.
        stale: one entry per layer whose bytes differ from its record although the header claims otherwise.
        unsampled: layers whose record holds no sample for some tensor: reloaded (nothing to check against).
        bytes_read: bytes read from the files to sample.
        seconds: time spent.
    """

    confirmed: set[str] = field(default_factory=set)
    stale: list[StaleDigest] = field(default_factory=list)
    unsampled: set[str] = field(default_factory=set)
    bytes_read: int = 0
    seconds: float = 0.0

    def refuted(self) -> set[str]:
        """Layers whose header digest this check could not confirm (stale or unsampled): never recorded by it."""
        return {found.layer for found in self.stale} | self.unsampled


def spot_check(layers: Iterable[str], entries: Mapping[str, list[TensorEntry]], records: LayerRecords,
               checkpoint: Checkpoint) -> SpotCheck:
    """Sample every tensor of LAYERS in the source's files and compare with the samples their records keep.

    Args:
        layers: the layers the header digests would skip.
        entries: layer -> its tensors as this rank streams them.
        records: the worker's records (each keeps its tensors' samples from load time).
        checkpoint: the source (local: its shards are read).

    Returns:
        Which layers may be skipped, and which headers lied.
    """
    start = time.perf_counter()
    result = SpotCheck()
    shards = {shard.name: shard for shard in checkpoint.shards}
    handles: dict[str, int] = {}
    try:
        for layer in sorted(layers):
            record = records.get(layer)
            tensors = entries.get(layer, [])
            if record is None or any(entry.name not in record.samples for entry in tensors):
                result.unsampled.add(layer)
                continue
            stale = None
            for entry in tensors:
                fd = handles.get(entry.shard)
                if fd is None:
                    fd = handles[entry.shard] = os.open(checkpoint.shard_path(entry.shard), os.O_RDONLY)
                at = shards[entry.shard].data_start + entry.begin
                if _patched(checkpoint, entry.name):
                    # A delta's step differs from the files here: its bytes are rebuilt (read whole) to sample.
                    result.bytes_read += entry.nbytes
                    sample = _rebuilt_sample(checkpoint, entry, at)
                else:
                    result.bytes_read += sample_bytes(entry.nbytes)
                    sample = file_sample(fd, at, entry.dtype, entry.shape, entry.nbytes)
                if sample != record.samples[entry.name]:
                    stale = StaleDigest(layer, entry.name, str(checkpoint.shard_path(entry.shard)))
                    break
            if stale is None:
                result.confirmed.add(layer)
            else:
                result.stale.append(stale)
    finally:
        for fd in handles.values():
            os.close(fd)
    result.seconds = time.perf_counter() - start
    return result


def _patched(checkpoint: Checkpoint, name: str) -> bool:
    """Whether a delta CHECKPOINT rebuilds (`Checkpoint.delta`) changes tensor NAME in any of its links."""
    chain = checkpoint.delta
    return chain is not None and any(name in link.patches for link in chain.links)


def _rebuilt_sample(checkpoint: Checkpoint, entry: TensorEntry, at: int) -> str:
    """The sample digest of ENTRY as the delta rebuilds it from the bytes at AT of its shard (proved on the way)."""
    from layerwise_cli.checkpoint.delta import file_mapping
    from layerwise_cli.checkpoint.delta_source import rebuilt_bytes

    path = checkpoint.shard_path(entry.shard)
    raw = file_mapping(path)[at:at + entry.nbytes]
    return buffer_sample(entry.dtype, entry.shape, rebuilt_bytes(checkpoint.delta, entry, raw, str(path)))
