"""Where a `RangeFetcher` gets its bytes: one interface (size, identity, range read) for the Hub and object stores.

`RangeFetcher` (`hub_fetch.py`) keeps the logic every source shares: ranges in hand-over order, neighbours
merged, a bounded window ahead, several connections, parts already on disk never fetched again. A source only
answers three questions, each about one file, pinned to an identity read once at the start:

- `metadata(filename)`: the file's identity (a Hub file's sha256, an object's ETag) and size;
- `fetch(filename, identity, start, end, write)`: bytes `[start, end)` of exactly that identity, handed to
  `write(offset, chunk)` in order, resumed after a dropped connection, refused if the file changed;
- `open_blob` and `finish`: where the bytes land on disk, and what happens once a file is whole (the Hub
  checks its sha256 and links it into its cache; an object store keeps nothing).

`HubSource` is the Hub's (huggingface_hub's client, the Hub cache); `store.StoreSource` is an object store's or
an HTTPS server's (obstore).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from layerwise_cli.checkpoint.hub_blob import PartialBlob
from layerwise_cli.checkpoint.hub_http import FetchPolicy, stream_range
from layerwise_cli.checkpoint.hub_pin import HubPin, hub_error, repo_cache_folder
from layerwise_cli.errors import LayerwiseError

Write = Callable[[int, bytes], None]


class RangeSource(Protocol):
    """What a `RangeFetcher` reads from: files of one pinned source, each with an identity and a size."""

    def metadata(self, filename: str) -> tuple[str, int]:
        """(identity, size) of FILENAME, as pinned for this operation; raises a one-line `LayerwiseError`."""
        ...

    def fetch(self, filename: str, identity: str, start: int, end: int, write: Write) -> None:
        """Hand bytes `[start, end)` of FILENAME at IDENTITY to `write(offset, chunk)`, in order.

        Raises:
            LayerwiseError: one line naming the file: stalled, gone, changed since pinned, or the last failure.
        """
        ...

    def open_blob(self, filename: str, identity: str, size: int, *, keep: bool) -> PartialBlob:
        """The file the bytes of FILENAME are written to (kept in a cache, or private and deleted on close)."""
        ...

    def finish(self, blob: PartialBlob) -> None:
        """Called after each part of BLOB arrives: a source may verify and keep a complete file."""
        ...

    def where(self, filename: str) -> str:
        """How messages name FILENAME of this source (never with a credential)."""
        ...


class HubSource:
    """A Hub repo at one commit: huggingface_hub's metadata and HTTP client, files kept in the Hub cache.

    Args:
        pin: the repo and commit; no request names a branch.
        cache_dir: the Hub cache (None: huggingface_hub's `HF_HUB_CACHE`).
        token: as huggingface_hub takes it; sent only to the Hub's origin.
        policy: stall bound, retries and backoff.
    """

    def __init__(self, pin: HubPin, *, cache_dir: str | Path | None = None, token: str | bool | None = None,
                 policy: FetchPolicy | None = None) -> None:
        from huggingface_hub.utils import build_hf_headers

        self.pin, self.token, self.policy = pin, token, policy or FetchPolicy()
        self.repo_folder = repo_cache_folder(pin.repo_id, cache_dir)
        self._headers = build_hf_headers(token=token)

    def metadata(self, filename: str) -> tuple[str, int]:
        from huggingface_hub import get_hf_file_metadata, hf_hub_url

        try:
            # With huggingface_hub's retries on 429/5xx: a fetch is worth waiting for (a 404 is not retried).
            meta = get_hf_file_metadata(hf_hub_url(self.pin.repo_id, filename, revision=self.pin.commit),
                                        token=self.token, retry_on_errors=True)
        except Exception as exc:
            raise hub_error(exc, self.pin.repo_id, self.pin.commit) from exc
        if meta.commit_hash and meta.commit_hash != self.pin.commit:
            raise LayerwiseError(f"the Hub answered for commit {meta.commit_hash}", where=self.where(filename))
        if not meta.etag or meta.size is None:
            raise LayerwiseError("the Hub gave no sha256 (ETag) or size for the file", where=self.where(filename))
        return meta.etag, meta.size

    def fetch(self, filename: str, identity: str, start: int, end: int, write: Write) -> None:
        # The commit pins the bytes (the sha256 is checked once the file is whole, `finish`).
        from huggingface_hub import hf_hub_url

        url = hf_hub_url(self.pin.repo_id, filename, revision=self.pin.commit)
        stream_range(url, start, end, write, headers=self._headers, policy=self.policy, where=self.where(filename))

    def open_blob(self, filename: str, identity: str, size: int, *, keep: bool) -> PartialBlob:
        return PartialBlob(self.repo_folder, filename, identity, size, keep=keep, where=self.where(filename))

    def finish(self, blob: PartialBlob) -> None:
        blob.finish(self.pin.commit)

    def where(self, filename: str) -> str:
        return f"{self.pin}/{filename}"
