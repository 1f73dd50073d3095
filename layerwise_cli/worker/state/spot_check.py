"""Before a layer is skipped on its header digest: its sampled bytes in the file must be those the engine loaded."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Mapping
from contextlib import AbstractContextManager as ContextManager
from dataclasses import dataclass, field
from typing import Protocol

from layerwise_cli.checkpoint.delta.format import file_mapping
from layerwise_cli.checkpoint.delta.rebuild import rebuilt_sample
from layerwise_cli.checkpoint.format.header import TensorEntry
from layerwise_cli.checkpoint.format.samples import sample_bytes, sample_digest, sample_spans
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
               checkpoint: Checkpoint,
               fetch_windows: Callable[[list[tuple[str, int, int]]], ContextManager[Windows]] | None = None
               ) -> SpotCheck:
    """Sample every tensor of LAYERS in the source's files and compare with the samples their records keep.

    Args:
        layers: the layers the header digests would skip.
        entries: layer -> its tensors as this rank streams them.
        records: the worker's records (each keeps its tensors' samples from load time).
        checkpoint: the source.
        fetch_windows: for a source not on this machine (a Hub commit streamed): given every sample window
            as (shard, offset, length), fetches them and gives a reader of them (`remote_stream.SampledWindows`).
            None: the local shards are read.

    Returns:
        Which layers may be skipped, and which headers lied.
    """
    start = time.perf_counter()
    result = SpotCheck()
    shards = {shard.name: shard for shard in checkpoint.shards}
    sampled: list[tuple[str, list[TensorEntry]]] = []
    for layer in sorted(layers):
        record = records.get(layer)
        tensors = entries.get(layer, [])
        if record is None or any(entry.name not in record.samples for entry in tensors):
            result.unsampled.add(layer)
        else:
            sampled.append((layer, tensors))
    windows = [(entry.shard, shards[entry.shard].data_start + entry.begin + offset, length)
               for _, tensors in sampled for entry in tensors for offset, length in sample_spans(entry.nbytes)]
    with (fetch_windows(windows) if fetch_windows is not None and windows else LocalShards(checkpoint)) as source:
        for layer, tensors in sampled:
            record = records.get(layer)
            stale = None
            for entry in tensors:
                at = shards[entry.shard].data_start + entry.begin
                result.bytes_read += sample_bytes(entry.nbytes)
                if _patched(checkpoint, entry.name):
                    # A delta's step differs from the files here: its windows are rebuilt from them to sample.
                    found = _rebuilt_sample(checkpoint, entry, at)
                else:
                    found = _file_sample(source, entry, at)
                if found != record.samples[entry.name]:
                    stale = StaleDigest(layer, entry.name, source.where(entry.shard))
                    break
            if stale is None:
                result.confirmed.add(layer)
            else:
                result.stale.append(stale)
    result.seconds = time.perf_counter() - start
    return result


class Windows(Protocol):
    """Reads bytes of a source's shards (`read`) and names a shard in messages (`where`)."""

    def read(self, shard: str, offset: int, length: int) -> bytes: ...

    def where(self, shard: str) -> str: ...


class LocalShards:
    """The shards of a checkpoint on this machine, each opened once, read with `pread`."""

    def __init__(self, checkpoint: Checkpoint) -> None:
        self.checkpoint = checkpoint
        self.handles: dict[str, int] = {}

    def __enter__(self) -> LocalShards:
        return self

    def __exit__(self, *exc: object) -> None:
        for fd in self.handles.values():
            os.close(fd)

    def read(self, shard: str, offset: int, length: int) -> bytes:
        fd = self.handles.get(shard)
        if fd is None:
            fd = self.handles[shard] = os.open(self.checkpoint.shard_path(shard), os.O_RDONLY)
        return os.pread(fd, length, offset)

    def where(self, shard: str) -> str:
        return str(self.checkpoint.shard_path(shard))


def _file_sample(source: Windows, entry: TensorEntry, at: int) -> str:
    """The sample digest of ENTRY, whose data starts at offset AT of its shard, read from SOURCE."""
    return sample_digest(entry.dtype, entry.shape, entry.nbytes,
                         lambda offset, n: source.read(entry.shard, at + offset, n))


def _patched(checkpoint: Checkpoint, name: str) -> bool:
    """Whether a delta CHECKPOINT rebuilds (`Checkpoint.delta`) changes tensor NAME in any of its links."""
    chain = checkpoint.delta
    return chain is not None and any(name in link.patches for link in chain.links)


def _rebuilt_sample(checkpoint: Checkpoint, entry: TensorEntry, at: int) -> str:
    """The sample digest of ENTRY as the delta rebuilds it from the bytes at AT of its shard (its windows only)."""
    raw = file_mapping(checkpoint.shard_path(entry.shard))[at:at + entry.nbytes]
    return rebuilt_sample(checkpoint.delta, entry, raw)
