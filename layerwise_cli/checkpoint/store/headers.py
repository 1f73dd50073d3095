"""A checkpoint under a URL prefix: its config, index and shard headers read by range, each object pinned."""

from __future__ import annotations

import hashlib
import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from layerwise_cli.checkpoint.format.header import ShardHeader, header_length, parse_header
from layerwise_cli.checkpoint.format.layout import (
    INDEX_NAME,
    SINGLE_FILE,
    check_index,
    check_unique_tensors,
    index_weight_map,
    natural_key,
    shard_file,
)
from layerwise_cli.checkpoint.store.objects import StoreSource, is_missing
from layerwise_cli.errors import LayerwiseError

# Shard headers read at once (as from the Hub).
_THREADS = 8
# What a store pin looks like: `etags:` and 16 hex digits of the objects' identities.
PIN_PREFIX = "etags:"


@dataclass(frozen=True)
class StoreHeaders:
    """What `read_store_headers` read: shard headers, config, index, and each object's pinned identity.

    Attributes:
        pinned: filename -> (identity, size) of every object read (config, index, shards).
        pin: one name for all of them (`store_pin`): what the operation carries to each process.
    """

    shards: list[ShardHeader]
    config: dict | None
    index: dict | None
    header_bytes_read: int
    pinned: dict[str, tuple[str, int]]
    pin: str


def store_pin(pinned: dict[str, tuple[str, int]]) -> str:
    """`etags:<16 hex>`: a digest of every object's name, identity and size. Equal pins, the same bytes."""
    text = "\n".join(f"{name}\t{identity}\t{size}" for name, (identity, size) in sorted(pinned.items()))
    return PIN_PREFIX + hashlib.sha256(text.encode()).hexdigest()[:16]


def read_store_headers(source: StoreSource, expected_pin: str | None = None) -> StoreHeaders:
    """Read the config, index and shard headers under SOURCE's prefix by range requests, never tensor data.

    Args:
        source: the store and prefix (its `pinned` fills with what is read).
        expected_pin: the pin an earlier step of the operation read (`store_pin`); None: this read pins.

    Returns:
        The headers, shards in natural sort order, and the pin.

    Raises:
        LayerwiseError: one line naming the object: missing (or the bucket), access denied, a bad header, or
            objects that changed since EXPECTED_PIN was read (the store keeps no old versions to read instead).
    """
    config = _read_json(source, "config.json", optional=True)
    index = _read_json(source, INDEX_NAME, optional=True)
    index_where = source.where(INDEX_NAME)
    if index is not None:
        names = sorted(set(index_weight_map(index, index_where).values()), key=natural_key)
        if not names:
            raise LayerwiseError("index names no shard files", where=index_where)
        for name in names:
            shard_file(None, name, index_where)
    else:
        names = [SINGLE_FILE]
    with ThreadPoolExecutor(max_workers=max(1, min(_THREADS, len(names)))) as pool:
        futures = [pool.submit(_read_header, source, name, index is not None) for name in names]
    shards, read = [], 0
    for future in futures:
        shard, n = future.result()
        shards.append(shard)
        read += n
    check_unique_tensors(shards, source.shown)
    if index is not None:
        check_index(index["weight_map"], shards, index_where)
    pin = store_pin(source.pinned)
    if expected_pin is not None and pin != expected_pin:
        raise LayerwiseError(f"the objects changed since this operation pinned them ({expected_pin}, now {pin}), "
                             "and the store keeps no earlier version to read: refused", where=source.shown)
    return StoreHeaders(shards, config, index, read, dict(source.pinned), pin)


def _read_json(source: StoreSource, name: str, *, optional: bool) -> dict | None:
    try:
        data = source.read(name)[0]
    except LayerwiseError as exc:
        if optional and is_missing(exc):
            if source.bucket_missing():
                raise LayerwiseError("no such bucket", where=source.shown) from None
            return None
        raise
    try:
        value = json.loads(data)
    except ValueError as exc:
        raise LayerwiseError(f"not valid JSON: {exc}", where=source.where(name)) from None
    if not isinstance(value, dict):
        raise LayerwiseError("not a JSON object", where=source.where(name))
    return value


def _read_header(source: StoreSource, name: str, indexed: bool) -> tuple[ShardHeader, int]:
    """A shard's 8-byte length, then its header: two range requests, the second pinned to the first's ETag."""
    where = source.where(name)
    try:
        prefix, _identity, size = source.read(name, 0, 8)
    except LayerwiseError as exc:
        if is_missing(exc):
            what = f"index names shard {name!r}, which is not there" if indexed else \
                f"no {SINGLE_FILE} or {INDEX_NAME} under the prefix"
            raise LayerwiseError(what, where=source.where(INDEX_NAME) if indexed else source.shown) from None
        raise
    length = header_length(prefix, size, where)
    raw = source.read(name, 8, 8 + length)[0] if length else b""
    if len(raw) < length:
        raise LayerwiseError(f"truncated: the store sent {len(raw)} of the {length} header bytes", where=where)
    return parse_header(name, raw, file_size=size, where=where), 8 + length
