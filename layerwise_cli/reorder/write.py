"""Write a rewritten checkpoint's shards: headers first, then tensor bytes copied raw from the source's shards.

Header digests (`layerwise.digests`, see `checkpoint.digests`) are taken from
the bytes as they are copied, with no pass of their own. A shard's header must
be written before its data (the header's length places the data section), and
its tensors arrive from several source shards in any order; but a digest is
always 32 hex digits, so the header is first written with a placeholder of the
same length for every digest (`PLACEHOLDER`, which no reader accepts as a
digest) and rewritten in place, byte for byte the same length, once the shard's
last tensor has been copied and before the shard is fsync'd. A shard whose
copy did not finish is never put in place, so no placeholder ever survives.
"""

from __future__ import annotations

import errno
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from layerwise_cli.checkpoint.format.chunks import CHUNK_BYTES, read_chunks
from layerwise_cli.checkpoint.format.digests import DigestMismatch, TensorHasher, digests_metadata, header_digests
from layerwise_cli.checkpoint.format.finite import ByteScan, NonFinite
from layerwise_cli.checkpoint.format.header import ShardHeader, TensorEntry, encode_header, read_shard_header
from layerwise_cli.checkpoint.format.layout import INDEX_NAME
from layerwise_cli.checkpoint.shard_copy import copy_fetcher
from layerwise_cli.checkpoint.sources import Checkpoint
from layerwise_cli.checkpoint.store.objects import display_url
from layerwise_cli.errors import LayerwiseError
from layerwise_cli.reorder.output_shards import OutputShard
from layerwise_cli.reorder.result import ReorderProgress


@dataclass(frozen=True)
class CopyResult:
    """What `write_shards` copied."""

    digests: dict[str, str]  # tensor name -> digest of the bytes read from SRC (empty when not hashing)
    bytes_written: int  # headers and tensor data
    source_digests_checked: int  # tensors whose SRC header digest was compared with their bytes (all matched)


# What a destination header holds for each digest until its shard is complete: as long as a digest, and not
# hex (`header_digests` refuses it), so a header left unpatched by a bug could never pass for a real one.
PLACEHOLDER = "-" * 32


def shard_header(shard: OutputShard, metadata: dict[str, str]) -> tuple[bytes, dict[str, tuple[int, int]]]:
    """Encode a shard's header (with `checkpoint.header.encode_header`) and place each tensor in the data section.

    Returns:
        The bytes before the data section (length prefix, JSON, padding) and,
        per tensor name, its [begin, end) in the data section.
    """
    offsets: dict[str, tuple[int, int]] = {}
    position = 0
    for entry in shard.tensors:
        offsets[entry.name] = (position, position + entry.nbytes)
        position += entry.nbytes
    placed = [replace(entry, begin=offsets[entry.name][0], end=offsets[entry.name][1])
              for entry in sorted(shard.tensors, key=lambda t: t.name)]
    return encode_header(placed, metadata or None), offsets


def write_chunk(fd: int, data: memoryview | bytes, offset: int) -> None:
    """Write all of `data` at `offset` (the one place tensor bytes are written)."""
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        view = view[n:]
        offset += n


def _reserve(fd: int, size: int) -> None:
    # Reserving the space up front turns a full disk into an error before any
    # tensor is copied; filesystems without fallocate get a sparse file.
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise
        os.ftruncate(fd, size)


def write_shards(
    checkpoint: Checkpoint,
    shards: list[OutputShard],
    metadata: dict[str, str],
    out: Path,
    tmp: Path,
    verify: bool,
    progress: Callable[[ReorderProgress], None] | None,
    allow_nonfinite: bool = False,
    nonfinite: list[NonFinite] | None = None,
    digests: bool = False,
) -> CopyResult:
    """Create every DST shard (header, space reserved), then copy tensors in, one SRC shard at a time.

    With `digests` or `verify`, each tensor's digest (`checkpoint.digests`) is
    taken from its bytes as they are copied, and checked against the digest
    the source shard's header gives, if it gives one: a difference is an
    error (the source's bytes are not what its writer wrote). With `digests`,
    each DST header carries them (see the module docstring). With `verify`,
    each floating tensor is also checked for NaN/Inf as it is copied; a
    non-finite tensor is refused unless `allow_nonfinite`, and then appended
    to `nonfinite`.
    """
    created = _create_shards(shards, metadata, out, digests)
    copy = _ShardCopy(checkpoint, shards, created, metadata, out, tmp, verify=verify, digests=digests,
                      progress=progress, allow_nonfinite=allow_nonfinite, nonfinite=nonfinite)
    copy.report("write", "")
    for src_shard in _fetch_order(checkpoint, shards):
        if src_shard.tensors:
            copy.source_shard(src_shard)
    return CopyResult(copy.hashes if copy.hashing else {}, created.header_bytes + copy.total, copy.source_checked)


@dataclass
class _CreatedShards:
    """The DST shards as created: where each tensor goes, what each still waits for, the headers written."""

    target: dict[str, tuple[OutputShard, int]]  # tensor name -> its DST shard, absolute file offset
    remaining: dict[str, int]  # DST shard name -> tensors not yet copied into it
    headers: dict[str, bytes]  # DST shard name -> the header written (placeholders for digests)
    header_bytes: int  # all headers together


def _create_shards(shards: list[OutputShard], metadata: dict[str, str], out: Path, digests: bool) -> _CreatedShards:
    """Create every DST shard: its header written (with placeholder digests with DIGESTS), its data's space reserved."""
    created = _CreatedShards({}, {}, {}, 0)
    for shard in shards:
        header, offsets = shard_header(shard, _shard_metadata(shard, metadata, {} if digests else None))
        created.headers[shard.name] = header
        path = out / shard.name
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            write_chunk(fd, header, 0)
            _reserve(fd, len(header) + shard.nbytes)
        finally:
            os.close(fd)
        created.header_bytes += len(header)
        for entry in shard.tensors:
            created.target[entry.name] = (shard, len(header) + offsets[entry.name][0])
        created.remaining[shard.name] = len(shard.tensors)
    return created


def _fetch_order(checkpoint: Checkpoint, shards: list[OutputShard]) -> list[ShardHeader]:
    """SRC shards in the order the plan needs them: the one holding the earliest destination tensor first."""
    rank = {entry.name: i for i, entry in enumerate(t for s in shards for t in s.tensors)}
    return sorted(checkpoint.shards, key=lambda s: min((rank[t.name] for t in s.tensors), default=len(rank)))


@dataclass(frozen=True)
class _Source:
    """One SRC shard being copied: its name, the file read, how errors name it, the digests its header claims."""

    name: str
    path: Path
    named: str
    claimed: dict[str, str] | None


class _ShardCopy:
    """The copy of SRC tensors into the created DST shards: bytes, digests, NaN/Inf scans and progress so far."""

    def __init__(self, checkpoint: Checkpoint, shards: list[OutputShard], created: _CreatedShards,
                 metadata: dict[str, str], out: Path, tmp: Path, *, verify: bool, digests: bool,
                 progress: Callable[[ReorderProgress], None] | None, allow_nonfinite: bool,
                 nonfinite: list[NonFinite] | None) -> None:
        self.checkpoint, self.created, self.metadata, self.out = checkpoint, created, metadata, out
        self.verify, self.digests, self.hashing = verify, digests, digests or verify
        self.progress, self.allow_nonfinite, self.nonfinite = progress, allow_nonfinite, nonfinite
        self.by_name = {shard.name: shard for shard in shards}
        self.shard_count = len(shards)
        self.total = sum(s.nbytes for s in shards)
        self.done_bytes = 0
        self.done_shards = 0
        self.hashes: dict[str, str] = {}
        self.source_checked = 0
        self.buf = bytearray(CHUNK_BYTES)
        # A Hub repo's or a URL's shards are fetched one at a time (a URL's at the ETags its headers were read at).
        self.fetcher = copy_fetcher(checkpoint, tmp / "fetch")

    def report(self, phase: str, file: str) -> None:
        if self.progress is not None:
            self.progress(ReorderProgress(phase, self.done_bytes, self.total, self.done_shards, self.shard_count,
                                          file))

    def source_shard(self, src_shard: ShardHeader) -> None:
        """Copy every tensor of one SRC shard (fetched first from the Hub or a URL) into its DST shards."""
        if self.fetcher is not None:
            self.report("fetch", src_shard.name)
            path, delete = self.fetcher.shard(src_shard.name)
            local = _local_header(path, src_shard, self.checkpoint)
        else:
            path, delete, local = self.checkpoint.shard_path(src_shard), False, src_shard
        # What the source's writer says each tensor's bytes hash to (None: it says nothing).
        # Errors name the shard as the user knows it: its file, or its place in the Hub repo or under the URL.
        named = f"{_shown(self.checkpoint)}/{src_shard.name}" if self.fetcher is not None else str(path)
        source = _Source(src_shard.name, path, named, header_digests(local, where=named) if self.hashing else None)
        src_fd = os.open(path, os.O_RDONLY)
        try:
            by_dst: dict[str, list[TensorEntry]] = {}
            for entry in sorted(local.tensors, key=lambda t: t.begin):
                by_dst.setdefault(self.created.target[entry.name][0].name, []).append(entry)
            for dst_name, entries in by_dst.items():
                self._into(dst_name, entries, src_fd, local, source)
        finally:
            os.close(src_fd)
            if delete:
                path.unlink(missing_ok=True)

    def _into(self, dst_name: str, entries: list[TensorEntry], src_fd: int, local: ShardHeader,
              source: _Source) -> None:
        """Copy ENTRIES of one SRC shard into the DST shard DST_NAME; the last of its tensors completes it."""
        dst_fd = os.open(self.out / dst_name, os.O_WRONLY)
        try:
            for entry in entries:
                self._tensor(entry, src_fd, local.data_start + entry.begin, dst_fd, dst_name, source)
                self.created.remaining[dst_name] -= 1
            if self.created.remaining[dst_name] == 0:
                if self.digests:
                    _patch_header(dst_fd, self.by_name[dst_name], self.hashes, self.created.headers[dst_name],
                                  self.metadata, self.out)
                os.fsync(dst_fd)
                self.done_shards += 1
                self.report("write", dst_name)
        finally:
            os.close(dst_fd)

    def _tensor(self, entry: TensorEntry, src_fd: int, src_at: int, dst_fd: int, dst_name: str,
                source: _Source) -> None:
        """Copy one tensor's bytes, hashing them and scanning them for NaN/Inf as they pass."""
        hasher = TensorHasher(entry.dtype, entry.shape) if self.hashing else None
        scan = ByteScan(entry.dtype) if self.verify else None
        dst_at = self.created.target[entry.name][1]
        copied = 0
        for view in read_chunks(src_fd, src_at, entry.nbytes, self.buf, tensor=entry.name, where=str(source.path)):
            if hasher is not None:
                hasher.update(view)
            if scan is not None:
                scan.update(view)
            write_chunk(dst_fd, view, dst_at + copied)
            copied += len(view)
            self.done_bytes += len(view)
            self.report("write", dst_name)
        if hasher is not None:
            self.hashes[entry.name] = hasher.hexdigest()
            if source.claimed is not None:
                _check_claim(entry.name, source.name, source.claimed[entry.name], self.hashes[entry.name],
                             source.named)
                self.source_checked += 1
        if scan is not None and scan.found:
            found = NonFinite(entry.name, source.name, scan.nan, scan.inf)
            if not self.allow_nonfinite:
                raise LayerwiseError(
                    f"--verify: {found.describe()}; refusing, nothing was put in place "
                    "(use --allow-nonfinite to write it anyway)", where=str(source.path))
            if self.nonfinite is not None:
                self.nonfinite.append(found)


def _shard_metadata(shard: OutputShard, metadata: dict[str, str], digests: dict[str, str] | None) -> dict[str, str]:
    """A DST shard's `__metadata__`: the source's (without its digests), and with DIGESTS, digests (placeholders for
    the tensors not given)."""
    if digests is None:
        return metadata
    return {**metadata, **digests_metadata({t.name: digests.get(t.name, PLACEHOLDER) for t in shard.tensors})}


def _patch_header(fd: int, shard: OutputShard, hashes: dict[str, str], written: bytes, metadata: dict[str, str],
                  out: Path) -> None:
    """Rewrite a complete DST shard's header over the placeholder one: same length, so no byte of data moves."""
    header, _ = shard_header(shard, _shard_metadata(shard, metadata, {t.name: hashes[t.name] for t in shard.tensors}))
    if len(header) != len(written):  # pragma: no cover - digests and placeholders have one length
        raise LayerwiseError(f"internal error: the header with digests is {len(header)} bytes, not "
                             f"{len(written)}; please report this", where=str(out / shard.name))
    write_chunk(fd, header, 0)


def _check_claim(tensor: str, shard: str, claimed: str, actual: str, where: str) -> None:
    """Refuse to copy bytes that do not hash to the digest the source's own header gives them."""
    if claimed != actual:
        found = DigestMismatch(tensor, shard, claimed, actual)
        raise LayerwiseError(f"{found.describe()}: the source is corrupt or its digests are wrong; nothing was put "
                             "in place", where=where)


def _local_header(path: Path, remote: ShardHeader, checkpoint: Checkpoint) -> ShardHeader:
    """Read a fetched shard's header and check it is the one planned from the Hub's (or the URL's) headers."""
    local, _ = read_shard_header(path, remote.name)
    planned = {(t.name, t.dtype, t.shape, t.nbytes) for t in remote.tensors}
    if {(t.name, t.dtype, t.shape, t.nbytes) for t in local.tensors} != planned:
        raise LayerwiseError(
            "the downloaded shard differs from the metadata read before (repo changed? pin --revision)",
            where=f"{_shown(checkpoint)}/{remote.name}",
        )
    return local


def _shown(checkpoint: Checkpoint) -> str:
    """How messages name a fetched CHECKPOINT: its repo id, or its URL without credentials."""
    return display_url(checkpoint.source) if checkpoint.kind == "store" else checkpoint.source


def write_index(checkpoint: Checkpoint, shards: list[OutputShard], out: Path) -> None:
    """Write the index (`weight_map` sorted by tensor name), keeping the source index's other metadata."""
    meta: dict[str, object] = {}
    if checkpoint.index and isinstance(checkpoint.index.get("metadata"), dict):
        meta.update(checkpoint.index["metadata"])  # e.g. total_parameters
    meta["total_size"] = sum(s.nbytes for s in shards)
    weight_map = {t.name: s.name for s in shards for t in s.tensors}
    doc = {"metadata": meta, "weight_map": dict(sorted(weight_map.items()))}
    path = out / INDEX_NAME
    with open(path, "w", encoding="utf-8") as f:
        f.write(json.dumps(doc, indent=2) + "\n")
        f.flush()
        os.fsync(f.fileno())
