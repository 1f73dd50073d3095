"""A remote source read while it arrives: the byte ranges a rank hands over, fetched from a pinned commit or store.

The source is a Hub commit (a `HubPin`) or a URL's objects pinned to their ETags (`store.StoreSource`, never kept
on disk): both go through the same `RangeFetcher`.

The worker's side of `checkpoint/fetch/range_fetcher.RangeFetcher`. `RemoteStream.start` fetches, in hand-over
order and a bounded window ahead, exactly the tensors this rank's stream hands to vLLM (the layers skipped on
their header digests are never fetched) and, when the fetch keeps what arrives in the Hub cache, the shards'
headers and the tensors vLLM skips on purpose, so that a shard fetched whole is verified against its sha256 and
linked into `snapshots/<commit>/` for `hf_hub_download` and `from_pretrained` to find. `read` waits for a
tensor's bytes and copies them into a tensor of its own: the reader never touches a byte that has not arrived.
`SampledWindows` fetches only the sample windows the spot check reads before it trusts a header digest.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch

from layerwise_cli.checkpoint.fetch.range_fetcher import ByteRange, RangeFetcher, tensor_range
from layerwise_cli.checkpoint.fetch.range_source import RangeSource
from layerwise_cli.checkpoint.format.dtypes import torch_dtype
from layerwise_cli.checkpoint.format.header import ShardHeader, TensorEntry
from layerwise_cli.checkpoint.hub.pin import HubPin
from layerwise_cli.checkpoint.hub.range_source import range_source
from layerwise_cli.checkpoint.sources import Checkpoint


class RemoteStream:
    """The tensors of one pinned source that a rank reads, fetched by byte range as the reader needs them.

    Args:
        pin: the repo and the commit (no request names a branch), or a store's objects (`StoreSource`).
        checkpoint: the source's headers (read at `pin.commit`).
        handed_over: the tensors to read, in the order they are read (the stream's hand-over order).
        keep: keep what arrives in the Hub cache (complete shards verified and linked); False: bounded disk,
            only those tensors, in private files deleted on `close`.
        extra: tensors fetched after the stream when `keep` (vLLM skips them, but a shard is linked only whole).
        connections, window_bytes, part_bytes: as `RangeFetcher` takes them.
    """

    def __init__(self, pin: HubPin | RangeSource, checkpoint: Checkpoint, handed_over: Iterable[TensorEntry], *,
                 keep: bool = True, extra: Iterable[TensorEntry] = (), connections: int = 4,
                 window_bytes: int = 256 << 20,
                 part_bytes: int = 16 << 20, cache_dir: str | Path | None = None) -> None:
        self.pin = pin
        self.shards: dict[str, ShardHeader] = {shard.name: shard for shard in checkpoint.shards}
        ranges = [tensor_range(self.shards[entry.shard], entry) for entry in handed_over]
        if keep:
            # The headers and what vLLM skips, after the stream: a shard the stream covers whole is then linked.
            ranges += [ByteRange(shard.name, 0, shard.data_start) for shard in checkpoint.shards]
            ranges += [tensor_range(self.shards[entry.shard], entry) for entry in extra]
        self.planned_bytes = sum(r.size for r in ranges)
        self.fetcher = RangeFetcher(range_source(pin, cache_dir=cache_dir), ranges, connections=connections,
                                    window_bytes=window_bytes, part_bytes=part_bytes, keep=keep)

    def start(self) -> RemoteStream:
        """Read each file's size and sha256 at the commit, and start the connections (raises one line)."""
        self.fetcher.start()
        return self

    def read(self, entry: TensorEntry) -> torch.Tensor:
        """ENTRY's tensor, once its bytes arrived (a copy of its own; raises the fetch's failure)."""
        shard = self.shards[entry.shard]
        tensor = torch.empty(entry.shape, dtype=torch_dtype(entry.dtype))
        if entry.nbytes:
            flat = tensor.reshape(-1).view(torch.uint8)
            self.fetcher.readinto(entry.shard, shard.data_start + entry.begin, flat.numpy().data)
        return tensor

    def check(self) -> None:
        """Let the fetch end, then raise its failure (a stall, a sha256 mismatch, a vanished commit)."""
        self.fetcher.check()

    def close(self) -> None:
        self.fetcher.close()

    @property
    def bytes_fetched(self) -> int:
        return self.fetcher.bytes_fetched

    def where(self, shard: str) -> str:
        """How messages name a shard of this source: `org/model@<commit>/<shard>`, `s3://bucket/prefix/<shard>`."""
        return self.fetcher.source.where(shard)


class SampledWindows:
    """The sample windows of some tensors (`checkpoint/samples.sample_spans`), fetched at once, then read.

    What the spot check reads before it trusts a header digest, without fetching the tensors themselves.
    """

    def __init__(self, pin: HubPin | RangeSource, checkpoint: Checkpoint, windows: Iterable[tuple[str, int, int]], *,
                 keep: bool = True, cache_dir: str | Path | None = None) -> None:
        ranges = [ByteRange(shard, start, start + length) for shard, start, length in windows]
        self.fetcher = RangeFetcher(range_source(pin, cache_dir=cache_dir), ranges, keep=keep, part_bytes=1 << 20)
        self.pin = pin

    def __enter__(self) -> SampledWindows:
        self.fetcher.start()
        self.fetcher.check()  # every window is here (or the failure raised)
        return self

    def __exit__(self, *exc: object) -> None:
        self.fetcher.close()

    def read(self, shard: str, offset: int, length: int) -> bytes:
        return self.fetcher.read(shard, offset, length)

    def where(self, shard: str) -> str:
        return self.fetcher.source.where(shard)
