"""Fetch a remote checkpoint's files for a copy (`layerwise reorder`): a Hub repo's or a URL's, one shard at a time.

Both fetchers answer the same two questions: a local path for one shard (and whether to delete it after use),
and a local folder holding the checkpoint's other files (config, tokenizer, model card). A Hub repo's is
`hub.HubFetcher` (huggingface_hub, through the Hub cache); a URL's is `StoreFetcher`: every byte read through
`store.StoreSource` at the ETags the checkpoint's headers were pinned at, so an object overwritten during the
copy is refused, naming it, never mixed into the copy; a shard already whole in the store cache at that ETag is
read from there.
"""

from __future__ import annotations

import os
from pathlib import Path

from layerwise_cli.checkpoint.fetch.policy import FetchPolicy
from layerwise_cli.checkpoint.format.layout import is_weight_file, shard_file
from layerwise_cli.checkpoint.hub.repo import HubFetcher
from layerwise_cli.checkpoint.sources import Checkpoint
from layerwise_cli.checkpoint.steps.store import list_objects
from layerwise_cli.checkpoint.store.objects import StoreSource
from layerwise_cli.errors import LayerwiseError, describe_exception


class StoreFetcher:
    """A URL checkpoint's files, fetched whole into FETCH_DIR at the identities its headers were read at.

    Args:
        checkpoint: a checkpoint opened from a URL (`kind == "store"`, `pinned` set).
        fetch_dir: a private folder; each shard is written there and deleted by the caller after use.
    """

    def __init__(self, checkpoint: Checkpoint, fetch_dir: Path) -> None:
        self.checkpoint = checkpoint
        self.fetch_dir = fetch_dir
        self.source = StoreSource(checkpoint.source, pinned=checkpoint.pinned, policy=FetchPolicy())

    def shard(self, name: str) -> tuple[Path, bool]:
        """A local path for shard NAME at its pinned ETag, and whether to delete it after use: the store cache's
        file when an earlier fetch kept it whole there, else a copy fetched now (resumed after a dropped
        connection)."""
        cached = self.source.cached(name)
        if cached is not None:
            return cached, False
        identity, size = self.source.metadata(name)
        return self._write(name, size, lambda write: self.source.fetch(name, identity, 0, size, write)), True

    def other_files(self) -> Path:
        """Fetch every object under the prefix that is no weight file or index (config, tokenizer, ...); the folder.

        Each is read whole and pinned at its first read; names that would leave the folder are refused.
        """
        folder = self.fetch_dir / "other"
        for path, _, size in list_objects(self.checkpoint.source):
            name = path.rsplit("/", 1)[-1]
            if is_weight_file(name) or name.startswith(".") or any(p.startswith(".") for p in path.split("/")):
                continue
            shard_file(folder, path, self.source.shown)  # refuses `..` and absolute names
            data = self.source.read(path)[0]
            if len(data) != size:
                raise LayerwiseError(f"the store sent {len(data)} of {size} bytes", where=self.source.where(path))
            self._write(path, size, lambda write, data=data: write(0, data), folder=folder)
        return folder

    def _write(self, name: str, size: int, fill, *, folder: Path | None = None) -> Path:
        target = (folder or self.fetch_dir) / name
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        except OSError as exc:
            raise describe_exception(exc, where=str(target)) from exc
        try:
            os.ftruncate(fd, size)
            fill(lambda offset, chunk: os.pwrite(fd, chunk, offset))
        except OSError as exc:
            raise describe_exception(exc, where=str(target)) from exc
        finally:
            os.close(fd)
        return target


def copy_fetcher(checkpoint: Checkpoint, fetch_dir: Path) -> HubFetcher | StoreFetcher | None:
    """What fetches CHECKPOINT's files for a copy: a Hub repo's or a URL's fetcher; None for local files."""
    if checkpoint.kind == "hub":
        return HubFetcher(checkpoint.source, checkpoint.commit or checkpoint.revision, fetch_dir)
    if checkpoint.kind == "store":
        return StoreFetcher(checkpoint, fetch_dir)
    return None
