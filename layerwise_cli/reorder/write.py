"""Write a rewritten checkpoint's shards: headers first, then tensor bytes copied raw from the source's shards."""

from __future__ import annotations

import errno
import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from layerwise_cli.checkpoint.chunks import CHUNK_BYTES, read_chunks
from layerwise_cli.checkpoint.finite import ByteScan, NonFinite
from layerwise_cli.checkpoint.header import ShardHeader, TensorEntry, encode_header, read_shard_header
from layerwise_cli.checkpoint.hub import HubFetcher
from layerwise_cli.checkpoint.layout import INDEX_NAME
from layerwise_cli.checkpoint.sources import Checkpoint
from layerwise_cli.errors import LayerwiseError
from layerwise_cli.reorder.result import ReorderProgress
from layerwise_cli.reorder.shards import PlannedShard


def shard_header(shard: PlannedShard, metadata: dict[str, str]) -> tuple[bytes, dict[str, tuple[int, int]]]:
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
    shards: list[PlannedShard],
    metadata: dict[str, str],
    out: Path,
    tmp: Path,
    verify: bool,
    progress: Callable[[ReorderProgress], None] | None,
    allow_nonfinite: bool = False,
    nonfinite: list[NonFinite] | None = None,
) -> tuple[dict[str, str], int]:
    """Create every DST shard (header, space reserved), then copy tensors in, one SRC shard at a time.

    With `verify`, each tensor's bytes are hashed and checked for NaN/Inf as
    they are copied; a non-finite tensor is refused unless `allow_nonfinite`,
    and then appended to `nonfinite`.
    """
    # Where each tensor goes: DST shard, absolute file offset.
    target: dict[str, tuple[PlannedShard, int]] = {}
    remaining: dict[str, int] = {}
    bytes_written = 0
    for shard in shards:
        header, offsets = shard_header(shard, metadata)
        path = out / shard.name
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            write_chunk(fd, header, 0)
            _reserve(fd, len(header) + shard.nbytes)
        finally:
            os.close(fd)
        bytes_written += len(header)
        for entry in shard.tensors:
            target[entry.name] = (shard, len(header) + offsets[entry.name][0])
        remaining[shard.name] = len(shard.tensors)

    total = sum(s.nbytes for s in shards)
    done_bytes = 0
    done_shards = 0
    hashes: dict[str, str] = {}
    buf = bytearray(CHUNK_BYTES)
    # Fetch source shards in the order the plan needs them: the one holding the earliest destination tensor first.
    rank = {entry.name: i for i, entry in enumerate(t for s in shards for t in s.tensors)}
    ordered = sorted(checkpoint.shards, key=lambda s: min((rank[t.name] for t in s.tensors), default=len(rank)))
    fetcher = HubFetcher(checkpoint.source, checkpoint.revision, tmp / "fetch") if checkpoint.kind == "hub" else None

    def report(phase: str, file: str) -> None:
        if progress is not None:
            progress(ReorderProgress(phase, done_bytes, total, done_shards, len(shards), file))

    report("write", "")
    for src_shard in ordered:
        if not src_shard.tensors:
            continue
        if fetcher is not None:
            report("fetch", src_shard.name)
            path, delete = fetcher.shard(src_shard.name)
            local = _local_header(path, src_shard, checkpoint)
        else:
            path, delete, local = checkpoint.shard_path(src_shard), False, src_shard
        src_fd = os.open(path, os.O_RDONLY)
        try:
            by_dst: dict[str, list[TensorEntry]] = {}
            for entry in sorted(local.tensors, key=lambda t: t.begin):
                by_dst.setdefault(target[entry.name][0].name, []).append(entry)
            for dst_name, entries in by_dst.items():
                dst_fd = os.open(out / dst_name, os.O_WRONLY)
                try:
                    for entry in entries:
                        hasher = hashlib.sha256() if verify else None
                        scan = ByteScan(entry.dtype) if verify else None
                        src_at = local.data_start + entry.begin
                        dst_at = target[entry.name][1]
                        copied = 0
                        for view in read_chunks(src_fd, src_at, entry.nbytes, buf, tensor=entry.name, where=str(path)):
                            if hasher is not None:
                                hasher.update(view)
                                scan.update(view)
                            write_chunk(dst_fd, view, dst_at + copied)
                            copied += len(view)
                            done_bytes += len(view)
                            report("write", dst_name)
                        if hasher is not None:
                            hashes[entry.name] = hasher.hexdigest()
                            if scan.found:
                                found = NonFinite(entry.name, src_shard.name, scan.nan, scan.inf)
                                if not allow_nonfinite:
                                    raise LayerwiseError(
                                        f"--verify: {found.describe()}; refusing, nothing was put in place "
                                        "(use --allow-nonfinite to write it anyway)", where=str(path))
                                if nonfinite is not None:
                                    nonfinite.append(found)
                        remaining[dst_name] -= 1
                    if remaining[dst_name] == 0:
                        os.fsync(dst_fd)
                        done_shards += 1
                        report("write", dst_name)
                finally:
                    os.close(dst_fd)
        finally:
            os.close(src_fd)
            if delete:
                path.unlink(missing_ok=True)
    return hashes, bytes_written + total


def _local_header(path: Path, remote: ShardHeader, checkpoint: Checkpoint) -> ShardHeader:
    """Read a fetched shard's header and check it is the one planned from the Hub's metadata."""
    local, _ = read_shard_header(path, remote.name)
    planned = {(t.name, t.dtype, t.shape, t.nbytes) for t in remote.tensors}
    if {(t.name, t.dtype, t.shape, t.nbytes) for t in local.tensors} != planned:
        raise LayerwiseError(
            "the downloaded shard differs from the metadata read before (repo changed? pin --revision)",
            where=f"{checkpoint.source}/{remote.name}",
        )
    return local


def write_index(checkpoint: Checkpoint, shards: list[PlannedShard], out: Path) -> None:
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
