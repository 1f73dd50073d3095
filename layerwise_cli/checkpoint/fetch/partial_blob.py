"""A Hub file filled by byte ranges in the Hub cache's own layout: kept, resumed, verified, then linked."""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import hashlib
import json
import os
import shutil
import tempfile
import threading
from pathlib import Path

from layerwise_cli.errors import LayerwiseError

# Not huggingface_hub's own `<etag>.incomplete`: huggingface_hub resumes that file by appending to its end, so a
# file filled at scattered offsets under that name would be "completed" into a blob with holes. The suffix still
# ends in `.incomplete`, so `hf cache` lists (and cleans) what a killed fetch left.
PARTIAL_SUFFIX = ".layerwise.incomplete"
# Which byte ranges of the partial file have arrived and were flushed to disk before being recorded.
RECORD_SUFFIX = ".layerwise-ranges.incomplete"

Interval = tuple[int, int]


def add_interval(intervals: list[Interval], start: int, end: int) -> list[Interval]:
    """`intervals` (sorted, disjoint, half-open) with `[start, end)` added, touching ones merged."""
    out: list[Interval] = []
    for a, b in sorted([*intervals, (start, end)]):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def covers(intervals: list[Interval], start: int, end: int) -> bool:
    """True when `[start, end)` lies inside one of `intervals` (merged, as `add_interval` keeps them)."""
    return start >= end or any(a <= start and end <= b for a, b in intervals)


class PartialBlob:
    """One file of a pinned repo, filled at the offsets its ranges arrive at.

    Kept (`keep=True`), it lives in the repo's cache folder as `blobs/<etag>.layerwise.incomplete` with a record
    of the ranges that arrived (flushed to disk first), under an exclusive lock; a later run resumes from the
    record, and a record that does not match the file is discarded with it. When every byte has arrived,
    `finish` checks the file's LFS sha256 (its etag) and only then moves it to `blobs/<etag>` and links
    `snapshots/<commit>/<filename>` to it, so huggingface_hub finds it offline. Another process already
    filling the same blob (a second rank on the node), or `keep=False` (bounded disk), gets a private file in a
    temporary folder that `close` deletes: it holds only the ranges asked, and nothing stays.

    If the blob is already in the cache, it is read from there and nothing is fetched.

    An object store's objects use the same layout in layerwise's own cache (`store.StoreSource`): `etag` is then
    a key of the object's pinned identity, `verify=False` (each request named the ETag), and `finish(None)` moves
    the complete file into `blobs/` without linking a snapshot.
    """

    def __init__(self, repo_folder: Path, filename: str, etag: str, size: int, *, keep: bool, where: str,
                 verify: bool = True) -> None:
        self.repo_folder, self.filename, self.etag, self.size, self.where = repo_folder, filename, etag, size, where
        # False: every request named the identity (an object store's `If-Match`), so the bytes are that object's.
        self.verify = verify
        self.blob = repo_folder / "blobs" / etag
        self.received: list[Interval] = []
        self.linked = False
        self._lock_fd: int | None = None
        self._private: Path | None = None
        self._mutex = threading.Lock()  # the connections filling this file mark and finish through it
        if self.blob.is_file() and self.blob.stat().st_size == size:
            self.path, self.received = self.blob, [(0, size)] if size else []
        elif keep and self._lock():
            self.path = repo_folder / "blobs" / f"{etag}{PARTIAL_SUFFIX}"
            self.received = self._resume()
        else:
            self._private = Path(tempfile.mkdtemp(prefix="layerwise-fetch-"))
            self.path = self._private / etag
            self._create()
        self.fd = os.open(self.path, os.O_RDWR)

    @property
    def complete(self) -> bool:
        return covers(self.received, 0, self.size)

    @property
    def kept(self) -> bool:
        """True when what arrives stays in the Hub cache (False: a private file `close` deletes)."""
        return self._private is None

    def write(self, offset: int, data: bytes) -> None:
        view = memoryview(data)
        while view:
            written = os.pwrite(self.fd, view, offset)
            view, offset = view[written:], offset + written

    def release(self, start: int, end: int) -> bool:
        """Give the disk under `[start, end)` of a private file back (punch a hole); False where it cannot.

        Only a private (bounded-disk) file: bytes kept in the Hub cache stay. Best effort: a file system
        without hole punching keeps the bytes until `close`.
        """
        if self.kept or end <= start:
            return False
        return punch_hole(self.fd, start, end - start)

    def mark(self, start: int, end: int) -> None:
        """Record `[start, end)` as arrived: flushed to disk first, so a killed process never records a hole."""
        with self._mutex:
            self.received = add_interval(self.received, start, end)
            if self.kept and self.path != self.blob:
                self._write_record()

    def _write_record(self) -> None:
        os.fdatasync(self.fd)
        record = self._record_path()
        tmp = record.with_name(record.name + ".tmp")
        tmp.write_text(json.dumps({"etag": self.etag, "size": self.size, "received": self.received}))
        os.replace(tmp, record)

    def finish(self, commit: str | None) -> None:
        """If every byte is here: check the sha256, then move the file to `blobs/` and link it for `commit`
        (None: no link, an object store's file).

        Raises:
            LayerwiseError: the bytes do not match the Hub's sha256 (the partial file is deleted).
        """
        with self._mutex:
            if self.kept and not self.linked and self.complete:
                self._finish(commit)

    def _finish(self, commit: str | None) -> None:
        if self.path != self.blob:
            digest = file_digest(self.fd, len(self.etag)) if self.verify else self.etag
            if digest != self.etag:
                self._discard()
                raise LayerwiseError(f"the bytes fetched do not match the Hub's sha256 {self.etag} (got {digest})",
                                     where=self.where)
            os.replace(self.path, self.blob)  # the open descriptor follows the file
            self._record_path().unlink(missing_ok=True)
            self.path = self.blob
        if commit is not None:
            _link(self.blob, self.repo_folder / "snapshots" / commit / self.filename)
        self.linked = True

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.fd)
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the lock
        if self._private is not None:
            shutil.rmtree(self._private, ignore_errors=True)

    # Set-up.

    def _lock(self) -> bool:
        """Take this blob's lock in the cache; False when another process holds it or the cache is read-only."""
        locks = self.repo_folder.parent / ".locks" / self.repo_folder.name
        try:
            locks.mkdir(parents=True, exist_ok=True)
            (self.repo_folder / "blobs").mkdir(parents=True, exist_ok=True)
            fd = os.open(locks / f"{self.etag}.layerwise.lock", os.O_RDWR | os.O_CREAT, 0o644)
        except OSError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            return False
        self._lock_fd = fd
        return True

    def _record_path(self) -> Path:
        return self.repo_folder / "blobs" / f"{self.etag}{RECORD_SUFFIX}"

    def _resume(self) -> list[Interval]:
        """The ranges a killed run left, when its record matches its file; otherwise start from nothing."""
        try:
            record = json.loads(self._record_path().read_text())
            received = [(int(a), int(b)) for a, b in record["received"]]
            if (record["etag"], record["size"]) == (self.etag, self.size) and self.path.stat().st_size == self.size \
                    and all(0 <= a < b <= self.size for a, b in received):
                return add_interval(received[1:], *received[0]) if received else []
        except (OSError, ValueError, KeyError, TypeError, IndexError):
            pass
        self._discard()
        self._create()
        return []

    def _create(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "wb") as f:
            f.truncate(self.size)  # sparse: only the ranges that arrive take disk

    def _discard(self) -> None:
        self.received = []
        self.path.unlink(missing_ok=True)
        self._record_path().unlink(missing_ok=True)


def punch_hole(fd: int, offset: int, length: int) -> bool:
    """Linux `fallocate(PUNCH_HOLE | KEEP_SIZE)`: free the blocks under the range, keep the file's size."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        punch_hole_keep_size = 0x02 | 0x01
        return libc.fallocate(fd, punch_hole_keep_size, ctypes.c_longlong(offset), ctypes.c_longlong(length)) == 0
    except (OSError, AttributeError):
        return False


def file_digest(fd: int, etag_length: int) -> str:
    """The Hub's id of a file's content: sha256 for an LFS etag (64 hex), git's blob sha1 for a 40-hex one."""
    size = os.fstat(fd).st_size
    digest = hashlib.sha256() if etag_length == 64 else hashlib.sha1(b"blob %d\0" % size)
    offset, step = 0, 8 << 20
    while offset < size:
        chunk = os.pread(fd, min(step, size - offset), offset)
        if not chunk:
            break
        digest.update(chunk)
        offset += len(chunk)
    return digest.hexdigest()


def _link(blob: Path, pointer: Path) -> None:
    # Relative, as huggingface_hub links its snapshots (the cache folder can be moved).
    pointer.parent.mkdir(parents=True, exist_ok=True)
    target = os.path.relpath(blob, pointer.parent)
    tmp = pointer.with_name(pointer.name + ".layerwise-link")
    tmp.unlink(missing_ok=True)
    os.symlink(target, tmp)
    os.replace(tmp, pointer)
