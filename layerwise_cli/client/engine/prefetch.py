"""A pinned Hub commit's weight files fetched whole into the Hub cache while the engine starts, in this process.

The in-process `reload` command starts its engine on BASE and reloads a Hub repo into it: the engine's start and
the download are both long, and neither needs the other. `Prefetch` fetches the commit's shards by range over
several connections (`fetch.range_fetcher.RangeFetcher`) from the moment the pre-flight passed; each shard is verified
against its sha256 and linked into `snapshots/<commit>/` when complete. By the time the engine is up they are
(mostly) there, and the workers find the commit in the cache (`reload_plan.hub_checkpoint`): the reload reads
local files. Time is then the larger of fetch and start, plus the reload, not their sum.
"""

from __future__ import annotations

from layerwise_cli.checkpoint.fetch.range_fetcher import RangeFetcher, whole_files
from layerwise_cli.checkpoint.hub.pin import HubPin
from layerwise_cli.checkpoint.hub.range_source import HubSource
from layerwise_cli.checkpoint.sources import Checkpoint


class Prefetch:
    """Fetch every shard of CHECKPOINT (headers read at `pin.commit`) whole, in the order vLLM reads them."""

    def __init__(self, pin: HubPin, checkpoint: Checkpoint) -> None:
        sizes = {shard.name: shard.file_size or shard.data_start + max((t.end for t in shard.tensors), default=0)
                 for shard in checkpoint.shards}
        self.total_bytes = sum(sizes.values())
        # No reader to stay ahead of: the whole commit is the window. As many connections as huggingface_hub's
        # own `snapshot_download` opens (8), since a CDN limits each connection's speed.
        self.fetcher = RangeFetcher(HubSource(pin), whole_files(sizes), connections=8,
                                    window_bytes=max(1, self.total_bytes))

    def start(self) -> Prefetch:
        """Start the connections (raises one line naming repo and commit when a file is not there)."""
        self.fetcher.start()
        return self

    def finish(self) -> None:
        """Wait until every shard arrived, was verified and linked; raise the fetch's failure; close in any case."""
        try:
            self.fetcher.check()
        finally:
            self.fetcher.close()

    def cancel(self) -> None:
        """Stop fetching (what arrived stays in the cache, resumable)."""
        self.fetcher.close()

    @property
    def bytes_fetched(self) -> int:
        return self.fetcher.bytes_fetched
