"""Hub sources: read a repo's headers by range requests, find it in the local cache, fetch its files."""

from __future__ import annotations

import contextlib
import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

from layerwise_cli.checkpoint.fetch.policy import FetchPolicy
from layerwise_cli.checkpoint.format.header import ShardHeader, header_length, parse_header
from layerwise_cli.checkpoint.format.layout import (
    INDEX_NAME,
    SINGLE_FILE,
    WEIGHT_INDEX_SUFFIXES,
    WEIGHT_SUFFIXES,
    check_index,
    check_unique_tensors,
    index_weight_map,
    natural_key,
    read_json,
    shard_file,
)
from layerwise_cli.checkpoint.hub.http_range import stream_range
from layerwise_cli.checkpoint.hub.pin import HubPin, commit_vanished, hub_error, offline
from layerwise_cli.errors import LayerwiseError, describe_exception

__all__ = ["CHECKPOINT_PATTERNS", "HubFetcher", "HubHeaders", "cached_snapshot", "download_checkpoint", "offline",
           "read_hub_headers", "read_hub_range"]

# The files of a repo that layerwise downloads (every `snapshot_download` here uses this one list): the
# weights, their index and config (`*.json`), and the tokenizer, because a downloaded source is also what an
# engine may be started on. Never pickles (`*.bin`), nor other formats' weights.
CHECKPOINT_PATTERNS = ["*.safetensors", "*.json", "tokenizer*", "*.model", "*.txt"]
# Shard headers fetched at once from the Hub (huggingface_hub uses 8 threads too).
_HUB_THREADS = 8


@dataclass(frozen=True)
class HubHeaders:
    """What `read_hub_headers` read from a repo: shard headers, config and index."""

    shards: list[ShardHeader]
    config: dict | None
    index: dict | None
    header_bytes_read: int


def download_checkpoint(repo_id: str, revision: str | None = None, *, local_files_only: bool = False) -> Path:
    """Download a repo's `CHECKPOINT_PATTERNS` files through the Hub cache; return the snapshot folder.

    Given a commit (`HubPin.commit`) as `revision`, no request names a branch. Raises huggingface_hub's own
    errors: callers decide what a failure means (`hub.pin.hub_error` names a vanished commit).
    """
    from huggingface_hub import snapshot_download  # noqa: PLC0415 - huggingface_hub: 0.4 s to import, only for a Hub source

    return Path(snapshot_download(repo_id, revision=revision, local_files_only=local_files_only,
                                  allow_patterns=CHECKPOINT_PATTERNS))


def read_hub_headers(pin: HubPin, where: str) -> HubHeaders:
    """Read a Hub repo's config, index and shard headers at a pinned commit by HTTP range requests.

    Never its tensor data, and every request names `pin.commit` (`pin_commit` resolved the revision).

    Args:
        pin: the repo and commit.
        where: the source as the user named it, for messages.

    Returns:
        The headers, shards in natural sort order.
    """
    from huggingface_hub import hf_hub_download  # noqa: PLC0415 - huggingface_hub: 0.4 s to import, only for a Hub source
    from huggingface_hub.errors import RemoteEntryNotFoundError  # noqa: PLC0415 - huggingface_hub: 0.4 s to import, only for a Hub source

    def download(filename: str) -> Path:
        try:
            return Path(hf_hub_download(pin.repo_id, filename, revision=pin.commit))
        except RemoteEntryNotFoundError:
            raise
        except Exception as exc:
            raise _pinned_error(exc, pin, where) from exc

    config, index, index_where = None, None, f"{where}/{INDEX_NAME}"
    with contextlib.suppress(RemoteEntryNotFoundError):  # a repo without config.json: the generic mapping
        config = read_json(download("config.json"))
    try:
        index = read_json(download(INDEX_NAME))
        names = sorted(set(index_weight_map(index, index_where).values()), key=natural_key)
        if not names:
            raise LayerwiseError("index names no shard files", where=index_where)
        for name in names:
            shard_file(None, name, index_where)
    except RemoteEntryNotFoundError:
        names = [SINGLE_FILE]
    shards, read = [], 0
    for shard, n in _read_remote_headers(pin, names, where, None if index is None else index_where):
        shards.append(shard)
        read += n
    check_unique_tensors(shards, where)
    if index is not None:
        check_index(index["weight_map"], shards, index_where)
    return HubHeaders(shards, config, index, read)


def _pinned_error(exc: BaseException, pin: HubPin, where: str) -> LayerwiseError:
    # A vanished commit names the commit; anything else keeps the source as the user named it.
    return hub_error(exc, pin.repo_id, pin.commit) if commit_vanished(exc) else describe_exception(exc, where=where)


def _read_remote_headers(
    pin: HubPin, names: list[str], where: str, index_where: str | None
) -> list[tuple[ShardHeader, int]]:
    from huggingface_hub import hf_hub_url  # noqa: PLC0415 - huggingface_hub: 0.4 s to import, only for a Hub source
    from huggingface_hub.errors import RemoteEntryNotFoundError  # noqa: PLC0415 - huggingface_hub: 0.4 s to import, only for a Hub source
    from huggingface_hub.utils import build_hf_headers  # noqa: PLC0415 - huggingface_hub: 0.4 s to import, only for a Hub source

    headers = build_hf_headers()

    def read(name: str) -> tuple[ShardHeader, int]:
        url = hf_hub_url(pin.repo_id, name, revision=pin.commit)
        return _read_remote_header(url, headers, name, f"{where}/{name}")

    with ThreadPoolExecutor(max_workers=max(1, min(_HUB_THREADS, len(names)))) as pool:
        futures = [pool.submit(read, name) for name in names]
    results = []
    for name, future in zip(names, futures):
        try:
            results.append(future.result())
        except RemoteEntryNotFoundError:
            if index_where is None:
                raise LayerwiseError(f"no {SINGLE_FILE} or {INDEX_NAME} in the repo", where=where) from None
            raise LayerwiseError(f"index names shard {name!r}, which is not in the repo", where=index_where) from None
        except LayerwiseError:
            raise
        except Exception as exc:
            raise _pinned_error(exc, pin, f"{where}/{name}") from exc
    return results


def _read_remote_header(url: str, headers: dict[str, str], name: str, where: str) -> tuple[ShardHeader, int]:
    """Fetch exactly a shard's 8-byte length and its header: two range requests, no tensor data."""
    prefix, file_size = read_hub_range(url, headers, 0, 8, where)
    header_len = header_length(prefix, file_size, where)
    raw = read_hub_range(url, headers, 8, header_len, where)[0] if header_len else b""
    if len(raw) < header_len:
        raise LayerwiseError(f"truncated: the server sent {len(raw)} of the {header_len} header bytes", where=where)
    return parse_header(name, raw, file_size=file_size, where=where), 8 + header_len


# Header reads happen in pre-flight, before anything is paused: a few quick retries, not the fetcher's patience.
_HEADER_POLICY = FetchPolicy(stall_s=0, retries=2, backoff_s=0.5)


def read_hub_range(url: str, headers: dict[str, str], start: int, length: int,
                   where: str) -> tuple[bytes, int | None]:
    """Bytes `[start, start + length)` of a Hub file (fewer at its end), and the file's size from Content-Range."""
    from huggingface_hub import constants  # noqa: PLC0415 - huggingface_hub: 0.4 s to import, only for a Hub source

    body = bytearray()
    policy = replace(_HEADER_POLICY, stall_s=float(constants.HF_HUB_DOWNLOAD_TIMEOUT))
    size = stream_range(url, start, start + length, lambda _offset, chunk: body.extend(chunk), headers=headers,
                        policy=policy, where=where)
    return bytes(body), size


def cached_snapshot(repo_id: str, revision: str | None, where: str) -> Path:
    """HF_HUB_OFFLINE=1: the repo's snapshot folder in the local Hub cache, every shard present.

    Raises:
        LayerwiseError: the repo, or one of its shards, is not in the cache.
    """
    from huggingface_hub.errors import LocalEntryNotFoundError  # noqa: PLC0415 - huggingface_hub: 0.4 s to import, only for a Hub source

    try:
        folder = download_checkpoint(repo_id, revision, local_files_only=True)
    except LocalEntryNotFoundError:
        raise LayerwiseError("not in the local Hub cache, and HF_HUB_OFFLINE=1 forbids downloading it",
                             where=where) from None
    except Exception as exc:
        raise describe_exception(exc, where=where) from exc
    missing = _missing_cached_shards(folder)
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise LayerwiseError(
            f"{missing[0]}{more} is not in the local Hub cache, and HF_HUB_OFFLINE=1 forbids downloading it",
            where=where,
        )
    return folder


def _missing_cached_shards(folder: Path) -> list[str]:
    # A broken index is not reported here: opening the folder reports it.
    index_path = folder / INDEX_NAME
    if not index_path.is_file():
        return [] if any(folder.glob("*.safetensors")) else [SINGLE_FILE]
    try:
        names = set(json.loads(index_path.read_text(encoding="utf-8"))["weight_map"].values())
    except Exception:  # noqa: BLE001 - see above
        return []
    names = {n for n in names if isinstance(n, str)}
    return sorted((n for n in names if not shard_file(folder, n, str(index_path)).is_file()), key=natural_key)


class HubFetcher:
    """Fetch a Hub repo's files for a copy: shards one at a time (from the local cache when there), other files."""

    def __init__(self, repo_id: str, revision: str | None, fetch_dir: Path) -> None:
        self.repo_id = repo_id
        self.revision = revision
        self.fetch_dir = fetch_dir

    def shard(self, name: str) -> tuple[Path, bool]:
        """Return a local path for shard `name` and whether to delete it after use."""
        from huggingface_hub import hf_hub_download, try_to_load_from_cache  # noqa: PLC0415 - huggingface_hub: 0.4 s to import, only for a Hub source

        repo, revision = self.repo_id, self.revision
        try:
            cached = try_to_load_from_cache(repo, name, revision=revision)
            if isinstance(cached, str):
                return Path(cached), False
            return Path(hf_hub_download(repo, name, revision=revision, local_dir=self.fetch_dir)), True
        except Exception as exc:
            raise describe_exception(exc, where=f"{repo}/{name}") from exc

    def other_files(self) -> Path:
        """Fetch the repo's non-weight files (config, tokenizer, README) through the Hub cache; return the folder."""
        from huggingface_hub import snapshot_download  # noqa: PLC0415 - huggingface_hub: 0.4 s to import, only for a Hub source

        ignore = [f"*{s}" for s in WEIGHT_SUFFIXES + WEIGHT_INDEX_SUFFIXES] + [".*"]
        try:
            return Path(snapshot_download(self.repo_id, revision=self.revision, ignore_patterns=ignore))
        except Exception as exc:
            raise describe_exception(exc, where=self.repo_id) from exc
