"""Resolve a SOURCE (file, directory, Hub repo id, store URL) into a checkpoint's headers; local ones here."""

from __future__ import annotations

import errno
import os
import re
import stat
from dataclasses import dataclass, field, replace
from pathlib import Path

from layerwise_cli.checkpoint.fetch.policy import FetchPolicy
from layerwise_cli.checkpoint.format.header import ShardHeader, TensorEntry, read_shard_header
from layerwise_cli.checkpoint.format.layout import (
    INDEX_NAME,
    check_index,
    check_unique_tensors,
    index_weight_map,
    natural_key,
    read_json,
    shard_file,
)
from layerwise_cli.checkpoint.hub.pin import HubPin, hub_error, pin_commit
from layerwise_cli.checkpoint.hub.repo import cached_snapshot, download_checkpoint, offline, read_hub_headers
from layerwise_cli.checkpoint.store.objects import StoreSource, display_url, is_store_url
from layerwise_cli.errors import LayerwiseError, describe_exception

_REPO_ID_RE = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint's headers: its shards in the order vLLM reads them, and its config; built once, never changed.

    A list given for `shards` is stored as a tuple; `dataclasses.replace` makes a variant.
    """

    source: str
    kind: str  # "file", "directory", "hub" or "store" (a URL: `s3://bucket/prefix`, `https://host/path`)
    shards: tuple[ShardHeader, ...]
    config: dict | None = None
    # Local directory holding the shards (None for a Hub or store source read remotely).
    local_dir: Path | None = None
    revision: str | None = None
    header_bytes_read: int = 0
    index: dict | None = field(default=None, repr=False)
    # The commit a Hub source was read at (`revision` resolved once, `hub.pin.pin_commit`); None for local files.
    commit: str | None = None
    # A sparse delta this checkpoint is rebuilt through (`checkpoint.delta.source`): then `source` is the delta,
    # the shards and `local_dir` are its base's, and every tensor is read through `delta.rebuild.rebuilt_tensor`.
    delta: object | None = field(default=None, repr=False, compare=False)
    # A store source's objects as first read: filename -> (ETag or Last-Modified, size); `revision` is their
    # digest (`store.headers.store_pin`). None for other kinds.
    pinned: dict[str, tuple[str, int]] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "shards", tuple(self.shards))

    @property
    def tensors(self) -> list[TensorEntry]:
        return [t for shard in self.shards for t in shard.tensors]

    @property
    def total_bytes(self) -> int:
        return sum(shard.nbytes for shard in self.shards)

    def shard_path(self, shard: ShardHeader | str) -> Path:
        name = shard if isinstance(shard, str) else shard.name
        if self.local_dir is None:
            raise LayerwiseError("shards are not on this machine (Hub source not downloaded)", where=self.source)
        return shard_file(self.local_dir, name, self.source)


def looks_like_repo_id(source: str) -> bool:
    """True for `org/name` that is not a local path (a dangling or looping symlink is a local path)."""
    return bool(_REPO_ID_RE.match(source)) and not os.path.lexists(source)


def resolve_local(source: str, revision: str | None = None) -> Path:
    """A local directory (or file) for SOURCE; Hub repo ids are downloaded (weights and config).

    Pass a pinned commit (`Checkpoint.commit`, `HubPin.commit`) as `revision` so that no request names a
    branch; a commit the Hub no longer has fails with one line naming repo and commit.
    """
    path = Path(source)
    if path.exists():
        return path
    if is_store_url(source):
        # Callers stream a URL source (`reload_plan`); nothing downloads one whole.
        raise LayerwiseError("a URL source is read by byte range, not downloaded", where=display_url(source))
    if looks_like_repo_id(source):
        try:
            return download_checkpoint(source, revision)
        except Exception as exc:
            raise hub_error(exc, source, revision) from exc
    raise LayerwiseError("no such file or directory, and not a Hub repo id (org/name)", where=source)


def open_checkpoint(source: str, revision: str | None = None) -> Checkpoint:
    """Read the headers of every shard of SOURCE, never its tensor data.

    Args:
        source: a `.safetensors` file, a directory of them (with or without
            `model.safetensors.index.json`), a Hub repo id `org/name`, or a URL of such a directory
            (`s3://bucket/prefix`, `gs://`, `az://`, `https://host/path`; read by range through obstore).
        revision: a Hub branch, tag or commit (Hub sources only); for a URL, the pin an earlier step read
            (`etags:...`), refused if the objects changed since.

    Returns:
        The checkpoint, shards in natural sort order.

    Raises:
        LayerwiseError: the source is missing or any header is invalid.
    """
    if is_store_url(source):
        return _open_store(source, revision)
    path = Path(source)
    kind = _local_kind(source)
    if kind == "file":
        if revision:
            raise LayerwiseError("--revision applies to Hub repo ids only", where=source)
        _refuse_pickle(path)
        shard, read = read_shard_header(path)
        config = _read_local_config(path.parent)
        return Checkpoint(str(path), "file", [shard], config, path.parent, None, read)
    if kind == "directory":
        if revision:
            raise LayerwiseError("--revision applies to Hub repo ids only", where=source)
        return _open_directory(path)
    if kind is not None:
        raise LayerwiseError(kind, where=source)
    if looks_like_repo_id(source):
        return _open_hub(source, revision)
    raise LayerwiseError("no such file or directory, and not a Hub repo id (org/name)", where=source)


_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")


def _local_kind(source: str) -> str | None:
    """"file", "directory", None when nothing is there, or why the local path cannot be used."""
    try:
        st = os.stat(source)
    except FileNotFoundError:
        # A symlink whose target is missing is a local path the user meant, not a Hub repo id.
        return "a symlink whose target does not exist (dangling link)" if os.path.islink(source) else None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return "a symlink that points back to itself (symlink loop)"
        if exc.errno == errno.ENOTDIR:
            return "not a directory: a part of this path is a file"
        raise describe_exception(exc, where=source) from exc
    if stat.S_ISDIR(st.st_mode):
        return "directory"
    if stat.S_ISREG(st.st_mode):
        return "file"
    return "not a regular file or directory (a device, FIFO or socket)"


def _refuse_pickle(path: Path) -> None:
    """A PyTorch pickle checkpoint gets a hint, not a safetensors header error."""
    magic = b""
    try:
        with open(path, "rb", buffering=0) as f:
            magic = f.read(4)
    except OSError as exc:
        raise describe_exception(exc, where=str(path)) from exc
    if path.name.endswith(_PICKLE_SUFFIXES) or magic == b"PK\x03\x04":  # torch.save writes a zip archive
        raise LayerwiseError(f"a PyTorch pickle checkpoint, not safetensors: {PICKLE_HINT}", where=str(path))


def _open_directory(path: Path) -> Checkpoint:
    index = None
    index_path = path / INDEX_NAME
    try:
        # Listed first: a folder that cannot be read says so, rather than "no .safetensors files".
        entries = sorted(os.listdir(path))
        if INDEX_NAME in entries:
            index = read_json(index_path)
            weight_map = index_weight_map(index, str(index_path))
            names = sorted(set(weight_map.values()), key=natural_key)
            for name in names:
                if not shard_file(path, name, str(index_path)).is_file():
                    raise LayerwiseError(f"index names shard {name!r}, which does not exist", where=str(index_path))
        else:
            names = sorted((n for n in entries if n.endswith(".safetensors") and (path / n).is_file()),
                           key=natural_key)
            for name in names:
                shard_file(path, name, str(path))
    except OSError as exc:
        raise describe_exception(exc, where=str(path)) from exc
    if not names:
        raise LayerwiseError(_no_shards_message(path, entries), where=str(path))
    shards, read = [], 0
    for name in names:
        shard, n = read_shard_header(path / name, name)
        shards.append(shard)
        read += n
    check_unique_tensors(shards, str(path))
    if index is not None:
        check_index(index["weight_map"], shards, str(index_path))
    return Checkpoint(str(path), "directory", shards, _read_local_config(path), path, None, read, index)


def _no_shards_message(path: Path, entries: list[str]) -> str:
    if any(n.endswith(".bin") or n.endswith(".bin.index.json") for n in entries):
        return f"no .safetensors files in the directory, only PyTorch .bin files: {PICKLE_HINT}"
    return "no .safetensors files in the directory"


# A `.bin` checkpoint is a pickle: loading one runs code it carries, so layerwise never reads it.
PICKLE_HINT = ("layerwise reads only safetensors, not PyTorch pickle checkpoints (.bin); convert it with "
               "transformers: AutoModelForCausalLM.from_pretrained(SRC).save_pretrained(DST, safe_serialization=True)")


def _read_local_config(folder: Path) -> dict | None:
    config = folder / "config.json"
    return read_json(config) if config.is_file() else None


def _open_hub(repo_id: str, revision: str | None) -> Checkpoint:
    """Read a Hub repo's shard headers at one commit: by HTTP range requests, or from the local cache offline.

    The revision is resolved to its commit once (`pin_commit`), first; every later request names the commit,
    and the checkpoint records it (`Checkpoint.commit`) for the callers to pass on.
    """
    where = f"{repo_id}@{revision}" if revision else repo_id
    pin = pin_commit(repo_id, revision)
    if offline():
        folder = cached_snapshot(repo_id, pin.commit, where)
        return replace(_open_directory(folder), source=repo_id, kind="hub", revision=revision, commit=pin.commit)
    found = read_hub_headers(pin, where)
    return Checkpoint(repo_id, "hub", found.shards, found.config, None, revision, found.header_bytes_read, found.index,
                      pin.commit)


def _open_store(url: str, revision: str | None) -> Checkpoint:
    """Read a URL source's headers by range, each object pinned to its ETag (or to REVISION, a pin read before)."""
    from layerwise_cli.checkpoint.store.headers import PIN_PREFIX, read_store_headers  # noqa: PLC0415 - `--help` stays fast: loaded when the command runs

    if revision and not revision.startswith(PIN_PREFIX):
        raise LayerwiseError("--revision applies to Hub repo ids only (a URL source is pinned to its objects' "
                             "ETags)", where=display_url(url))
    # Headers are read in pre-flight, before anything is paused: a few quick retries, not a fetch's patience.
    found = read_store_headers(StoreSource(url, policy=FetchPolicy(stall_s=30.0, retries=2, backoff_s=0.5)), revision)
    return Checkpoint(url, "store", found.shards, found.config, None, found.pin, found.header_bytes_read,
                      found.index, pinned=found.pinned)


def pin_source(source: str, revision: str | None) -> HubPin | None:
    """One operation's commit: a Hub repo id's revision resolved once, at the start (`pin_commit`).

    Every later step of the operation (every rank and server, pre-flight, the reload, `--verify`, the
    rollback) is handed `pin.commit` as its revision, so that a ref moved meanwhile changes nothing. None for
    a local path, which has no commit.

    Raises:
        LayerwiseError: one line naming the repo and revision (or commit): not found, vanished, unreachable.
    """
    return pin_commit(source, revision) if looks_like_repo_id(source) else None


def pinned_source(checkpoint: Checkpoint) -> HubPin | None:
    """The pin a Hub checkpoint was read at (None for local sources): `str(...)` is what a worker records."""
    if checkpoint.kind != "hub" or checkpoint.commit is None:
        return None
    return HubPin(checkpoint.source, checkpoint.commit, checkpoint.revision)
