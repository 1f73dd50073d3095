"""Stream the byte ranges a reload hands over from a pinned source, in order, a bounded window ahead.

The source is any `RangeSource`: a Hub commit (`hub.range_source.HubSource`, made from a `HubPin`) or an object
store's or HTTPS server's files pinned to their ETags (`store.objects.StoreSource`). The window, the order, the
merging of ranges and the resume are written once, here; a source only reads a file's identity and size, and a
range of it.

How the reload path uses it:

1. The client resolves the user's revision once (`hub.pin.pin_commit`, or a store's ETags) and passes the pin to
   every server, rank, pre-flight, `--verify` and rollback; a worker records it as what it holds.
2. A worker's stream (`worker/stream/remote_stream.py`), given its plan's byte ranges of the tensors it will hand
   over (in hand-over order; not the skipped ones; `tensor_range` makes one from a shard header's entry), starts a
   `RangeFetcher` on the source and those ranges, and before it reads a tensor's bytes calls
   `fetcher.readinto(filename, offset, buffer)` (or `fetcher.wait(...)`, then `os.preadv` on
   `fetcher.blobs[filename].fd`: the descriptor stays valid when the finished file is moved and linked): the
   reader never touches a byte that has not arrived. In bounded-disk mode (`keep=False`) it calls
   `fetcher.release(...)` once vLLM has taken the tensor.
3. Before the reload commits, `fetcher.check()` raises any failure (stall, sha256 mismatch, vanished commit; the
   next `wait`/`readinto` raises it too) as a one-line `LayerwiseError`, for the reload to roll back on;
   `close()` at the end, also on failure.
"""

from __future__ import annotations

import bisect
import os
import threading
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Self

from layerwise_cli.checkpoint.fetch.partial_blob import PartialBlob, add_interval, covers
from layerwise_cli.checkpoint.fetch.range_source import RangeSource
from layerwise_cli.checkpoint.format.header import ShardHeader, TensorEntry
from layerwise_cli.errors import LayerwiseError

MiB = 1 << 20


@dataclass(frozen=True)
class ByteRange:
    """Bytes `[start, end)` of one file of the source."""

    filename: str
    start: int
    end: int

    @property
    def size(self) -> int:
        return self.end - self.start


def range_requests(ranges: Iterable[ByteRange], part_bytes: int) -> list[ByteRange]:
    """The requests for `ranges`, in their order: neighbours merged, bytes asked twice fetched once, big ones split.

    A range that touches or overlaps the one before it in the same file is merged into it (one request); bytes
    an earlier range already covers are left out; a merged range longer than `part_bytes` is split, so that
    several connections share it and the window ahead is counted in parts of that size.
    """
    merged: list[ByteRange] = []
    seen: dict[str, list[tuple[int, int]]] = {}
    for r in ranges:
        for start, end in _uncovered(seen.get(r.filename, []), r.start, r.end):
            last = merged[-1] if merged else None
            if last and last.filename == r.filename and last.start <= start <= last.end:
                merged[-1] = ByteRange(r.filename, last.start, max(last.end, end))
            else:
                merged.append(ByteRange(r.filename, start, end))
            seen[r.filename] = add_interval(seen.get(r.filename, []), start, end)
    return [ByteRange(m.filename, s, min(s + part_bytes, m.end)) for m in merged
            for s in range(m.start, m.end, part_bytes)]


def _uncovered(intervals: list[tuple[int, int]], start: int, end: int) -> list[tuple[int, int]]:
    out, pos = [], start
    for a, b in intervals:
        if b <= pos or a >= end:
            continue
        if a > pos:
            out.append((pos, a))
        pos = max(pos, b)
    if pos < end:
        out.append((pos, end))
    return out


class RangeFetcher:
    """Fetch `ranges` of a pinned source over several connections, a bounded window ahead of the reader.

    Args:
        source: where the bytes come from, pinned: a Hub commit (`hub.range_source.HubSource`), or an object
            store's files at their ETags (`store.objects.StoreSource`); it carries its own fault policy.
        ranges: what the reader will read, in the order it reads it (a whole file: `ByteRange(f, 0, size)`;
            `whole_files(...)` lists them).
        connections: parallel connections (a CDN limits each connection's speed).
        window_bytes: how far ahead of the part the reader waits on fetching may go.
        part_bytes: the largest single request.
        keep: keep what arrives in the Hub cache (and link complete, verified files); False: bounded disk,
            only the asked ranges, in a private file deleted on `close`. An object store keeps nothing yet.
    """

    def __init__(self, source: RangeSource, ranges: Iterable[ByteRange], *, connections: int = 4,
                 window_bytes: int = 256 * MiB, part_bytes: int = 16 * MiB, keep: bool = True) -> None:
        self.connections, self.window_bytes, self.keep = connections, window_bytes, keep
        self.source = source
        self.parts = range_requests(ranges, part_bytes)
        self._ends = [0]
        for part in self.parts:
            self._ends.append(self._ends[-1] + part.size)
        self._by_file: dict[str, list[int]] = {}
        for i, part in enumerate(self.parts):
            self._by_file.setdefault(part.filename, []).append(i)
        for indices in self._by_file.values():
            # By offset, for `_parts_for`'s search: the reader's order may go back and forth within a file.
            indices.sort(key=lambda i: self.parts[i].start)
        self._arrived = [0] * len(self.parts)  # bytes from each part's start that are on disk
        self._cond = threading.Condition()
        self._next = self._reading = 0
        self._error: BaseException | None = None
        self._stop = False
        self._threads: list[threading.Thread] = []
        self.blobs: dict[str, PartialBlob] = {}
        # Each file's identity as `start` read it (a sha256, an ETag): every request of the fetch names it.
        self.identities: dict[str, str] = {}
        self._released: dict[str, list[tuple[int, int]]] = {}
        self.bytes_fetched = 0

    # Life.

    def start(self) -> Self:
        """Read each file's identity (sha256, ETag) and size as pinned, open its blob, start the connections.

        Raises:
            LayerwiseError: a file or the commit is not there (one line naming the source and the file).
        """
        names = list(self._by_file)
        with ThreadPoolExecutor(max_workers=max(1, min(8, len(names)))) as pool:
            metas = list(pool.map(self.source.metadata, names))
        try:
            for name, (identity, size) in zip(names, metas):
                self.identities[name] = identity
                self.blobs[name] = self.source.open_blob(name, identity, size, keep=self.keep)
            self._settle_arrived()
        except BaseException:
            self.close()
            raise
        for n in range(max(1, min(self.connections, len(self.parts)))):
            thread = threading.Thread(target=self._run, name=f"hub-fetch-{n}", daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def close(self) -> None:
        """Stop the connections, and release the files (a bounded-disk file is deleted)."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        for thread in self._threads:
            thread.join()
        for blob in self.blobs.values():
            blob.close()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # The reader's side.

    def wait(self, filename: str, offset: int, length: int, timeout: float | None = None) -> None:
        """Block until bytes `[offset, offset + length)` of `filename` are on disk.

        Raises:
            LayerwiseError: the bytes are not in the fetch plan, or the fetch failed (stall, sha256, Hub error).
        """
        needed = self._parts_for(filename, offset, offset + length)
        with self._cond:
            if any(a < offset + length and offset < b for a, b in self._released.get(filename, [])):
                raise LayerwiseError(f"bytes {offset}-{offset + length} were released (bounded disk)",
                                     where=self._where(filename))
            self._reading = max(self._reading, needed[0] if needed else 0)
            self._cond.notify_all()
            arrived = self._cond.wait_for(lambda: self._error is not None or all(
                self.parts[i].start + self._arrived[i] >= min(self.parts[i].end, offset + length)
                for i in needed), timeout)
            if self._error is not None:
                raise self._error
            if not arrived:
                raise LayerwiseError(f"bytes {offset}-{offset + length} did not arrive within {timeout:g} s",
                                     where=self._where(filename))

    def release(self, filename: str, offset: int, length: int) -> None:
        """The reader is done with these bytes: in bounded-disk mode their disk is given back at once.

        With `keep=False`, a reader that releases what it handed over keeps the disk in use near the window
        ahead; a later `wait` on released bytes fails. Kept files are left as they are.
        """
        blob = self.blobs[filename]
        if blob.release(offset, offset + length):
            with self._cond:
                self._released[filename] = add_interval(self._released.get(filename, []), offset, offset + length)

    def check(self) -> None:
        """The reader is done: let the fetch end (parts never waited on are fetched), then raise its failure.

        Call it before committing what was read: the sha256 of a file is checked after its last bytes arrive,
        so a mismatch found after the reader had every byte is raised here.
        """
        with self._cond:
            self._reading = len(self.parts)
            self._cond.notify_all()
        for thread in self._threads:
            thread.join()
        with self._cond:
            if self._error is not None:
                raise self._error

    def readinto(self, filename: str, offset: int, buffer: memoryview | bytearray) -> int:
        """Wait for `len(buffer)` bytes of `filename` at `offset`, then read them into `buffer`."""
        view = memoryview(buffer).cast("B")
        self.wait(filename, offset, len(view))
        return os.preadv(self.blobs[filename].fd, [view], offset)

    def read(self, filename: str, offset: int, length: int) -> bytes:
        buffer = bytearray(length)
        self.readinto(filename, offset, buffer)
        return bytes(buffer)

    def path(self, filename: str) -> Path:
        """Where `filename`'s bytes are now (its partial file, or its blob once linked); open it after `wait`."""
        return self.blobs[filename].path

    def _parts_for(self, filename: str, start: int, end: int) -> list[int]:
        indices = self._by_file.get(filename, [])
        starts = [self.parts[i].start for i in indices]
        first = max(0, bisect.bisect_right(starts, start) - 1)
        needed = [i for i in indices[first:] if self.parts[i].start < end and self.parts[i].end > start]
        have: list[tuple[int, int]] = []
        for i in needed:
            have = add_interval(have, self.parts[i].start, self.parts[i].end)
        if not covers(have, start, end):
            raise LayerwiseError(f"bytes {start}-{end} are not in the fetch plan", where=self._where(filename))
        return needed

    # The connections' side.

    def _settle_arrived(self) -> None:
        # What a previous run (or huggingface_hub) left: parts already on disk are never fetched again.
        for i, part in enumerate(self.parts):
            for a, b in self.blobs[part.filename].received:
                if a <= part.start < b:
                    self._arrived[i] = min(b, part.end) - part.start
        for blob in self.blobs.values():
            self.source.finish(blob)

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._stop or self._error is not None or self._next >= len(self.parts)
                                    or self._may_start(self._next))
                if self._stop or self._error is not None or self._next >= len(self.parts):
                    return
                i, self._next = self._next, self._next + 1
            if self._arrived[i] >= self.parts[i].size:
                continue
            try:
                self._fetch(i)
            except BaseException as exc:  # noqa: BLE001 - handed to the reader, which raises it
                with self._cond:
                    if self._error is None and not self._stop:
                        self._error = exc
                    self._cond.notify_all()
                return

    def _may_start(self, i: int) -> bool:
        return i <= self._reading or self._ends[i + 1] - self._ends[self._reading] <= self.window_bytes

    def _fetch(self, i: int) -> None:
        part = self.parts[i]
        blob = self.blobs[part.filename]

        def write(offset: int, chunk: bytes) -> None:
            if self._stop:
                raise LayerwiseError("fetch stopped", where=self._where(part.filename))
            blob.write(offset, chunk)
            with self._cond:
                self._arrived[i] = offset + len(chunk) - part.start
                self.bytes_fetched += len(chunk)
                self._cond.notify_all()

        self.source.fetch(part.filename, self.identities[part.filename], part.start + self._arrived[i], part.end, write)
        blob.mark(part.start, part.end)
        self.source.finish(blob)

    def _where(self, filename: str) -> str:
        return self.source.where(filename)


def tensor_range(shard: ShardHeader, tensor: TensorEntry) -> ByteRange:
    """The bytes of `tensor` in its shard's file (header offsets are relative to the data section)."""
    return ByteRange(shard.name, shard.data_start + tensor.begin, shard.data_start + tensor.end)


def whole_files(sizes: dict[str, int]) -> list[ByteRange]:
    """Every byte of each file (name -> size), in the order given: fetch complete files, to be linked."""
    return [ByteRange(name, 0, size) for name, size in sizes.items()]


def spread_parts(total_bytes: int, connections: int, *, floor: int = MiB, ceiling: int = 16 * MiB) -> int:
    """A part size that gives each of CONNECTIONS a share of TOTAL_BYTES, between FLOOR and CEILING.

    Whole files fetched at once (a delta file, a config) are often smaller than one default part: cut in parts
    of the default size, a 13 MB delta file would cross one connection, at one connection's rate (a CDN or a
    store paces each connection).
    """
    return max(floor, min(ceiling, -(-total_bytes // max(1, connections))))
