"""Where a `RangeFetcher` gets its bytes: one interface (size, identity, range read) for the Hub and object stores.

`RangeFetcher` (`range_fetcher.py`) keeps the logic every source shares: ranges in hand-over order, neighbours
merged, a bounded window ahead, several connections, parts already on disk never fetched again. A source only
answers three questions, each about one file, pinned to an identity read once at the start:

- `metadata(filename)`: the file's identity (a Hub file's sha256, an object's ETag) and size;
- `fetch(filename, identity, start, end, write)`: bytes `[start, end)` of exactly that identity, handed to
  `write(offset, chunk)` in order, resumed after a dropped connection, refused if the file changed;
- `open_blob` and `finish`: where the bytes land on disk, and what happens once a file is whole (the Hub
  checks its sha256 and links it into its cache; an object store keeps nothing).

`hub.range_source.HubSource` is the Hub's (huggingface_hub's client, the Hub cache); `store.objects.StoreSource` is
an object store's or an HTTPS server's (obstore).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from layerwise_cli.checkpoint.fetch.partial_blob import PartialBlob

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
