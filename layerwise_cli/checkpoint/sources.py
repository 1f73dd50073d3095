"""Resolve a SOURCE (file, directory or Hub repo id) into a checkpoint's headers."""

from __future__ import annotations

import errno
import json
import os
import re
import stat
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path, PurePosixPath

from layerwise_cli.checkpoint.header import ShardHeader, TensorEntry, header_length, parse_header, read_shard_header
from layerwise_cli.errors import LayerwiseError, describe_exception

INDEX_NAME = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# Shard headers fetched at once from the Hub (huggingface_hub uses 8 threads too).
_HUB_THREADS = 8
_REPO_ID_RE = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint's headers: its shards in the order vLLM reads them, and its config; built once, never changed.

    A list given for `shards` is stored as a tuple; `dataclasses.replace` makes a variant.
    """

    source: str
    kind: str  # "file", "directory" or "hub"
    shards: tuple[ShardHeader, ...]
    config: dict | None = None
    # Local directory holding the shards (None for a Hub source read remotely).
    local_dir: Path | None = None
    revision: str | None = None
    header_bytes_read: int = 0
    index: dict | None = field(default=None, repr=False)

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


def shard_file(folder: Path | None, name: str, where: str) -> Path:
    """The path of shard NAME inside FOLDER, refusing any name that leads out of it.

    The one containment rule for shard paths, used wherever a shard name (from
    an index, a directory listing or a header) is joined to a folder: by every
    command, in this process and in vLLM's workers. vLLM's own loader lists the
    folder, so it never reads a shard outside it; neither may layerwise.

    Refused: an absolute path, a `..` component, an empty name, and a path
    that resolves (after following symlinks) outside FOLDER. In a Hub cache
    snapshot (`.../snapshots/<commit>/`), where every file is a symlink into
    the repo's `blobs/`, that `blobs/` folder counts as inside.

    Args:
        folder: the checkpoint folder; None checks the name only (a shard
            read from the Hub by URL).
        name: the shard's file name, relative to FOLDER.
        where: the file that named the shard (an index), for the message.

    Returns:
        FOLDER / NAME.

    Raises:
        LayerwiseError: the name leaves the checkpoint folder.
    """
    pure = PurePosixPath(name)
    if not name or "\x00" in name or pure.is_absolute() or ".." in pure.parts or name.startswith("\\"):
        raise LayerwiseError(
            f"shard {name!r} points outside the checkpoint directory (an absolute path or '..'); refusing to read it",
            where=where,
        )
    if folder is None:
        return Path(name)
    path = folder / name
    try:
        real = path.resolve()
        root = folder.resolve()
    except (OSError, RuntimeError) as exc:  # a symlink loop
        raise LayerwiseError(f"shard {name!r} cannot be resolved: {exc.strerror if isinstance(exc, OSError) else exc}",
                             where=where) from None
    inside = [root]
    if root.parent.name == "snapshots":  # huggingface_hub's cache: snapshots/<commit>/f -> ../../blobs/<hash>
        inside.append(root.parent.parent / "blobs")
    if not any(real == r or r in real.parents for r in inside):
        raise LayerwiseError(
            f"shard {name!r} resolves to {real}, outside the checkpoint directory {root}; refusing to read it",
            where=where,
        )
    return path


def natural_key(name: str) -> list[object]:
    """Sort key that orders `model-2-of-10` before `model-10-of-10`, as vLLM does."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def looks_like_repo_id(source: str) -> bool:
    """True for `org/name` that is not a local path (a dangling or looping symlink is a local path)."""
    return bool(_REPO_ID_RE.match(source)) and not os.path.lexists(source)


def open_checkpoint(source: str, revision: str | None = None) -> Checkpoint:
    """Read the headers of every shard of SOURCE, never its tensor data.

    Args:
        source: a `.safetensors` file, a directory of them (with or without
            `model.safetensors.index.json`), or a Hub repo id `org/name`.
        revision: a Hub branch, tag or commit (Hub sources only).

    Returns:
        The checkpoint, shards in natural sort order.

    Raises:
        LayerwiseError: the source is missing or any header is invalid.
    """
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
            index = _read_json(index_path)
            weight_map = _weight_map(index, str(index_path))
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
        _check_index(index["weight_map"], shards, str(index_path))
    return Checkpoint(str(path), "directory", shards, _read_local_config(path), path, None, read, index)


def _no_shards_message(path: Path, entries: list[str]) -> str:
    if any(n.endswith(".bin") or n.endswith(".bin.index.json") for n in entries):
        return f"no .safetensors files in the directory, only PyTorch .bin files: {PICKLE_HINT}"
    return "no .safetensors files in the directory"


# A `.bin` checkpoint is a pickle: loading one runs code it carries, so layerwise never reads it.
PICKLE_HINT = ("layerwise reads only safetensors, not PyTorch pickle checkpoints (.bin); convert it with "
               "transformers: AutoModelForCausalLM.from_pretrained(SRC).save_pretrained(DST, safe_serialization=True)")


def check_unique_tensors(shards: list[ShardHeader], where: str) -> None:
    """Refuse a tensor present in two shards: vLLM's loader would load it twice, the last copy winning.

    Raises:
        LayerwiseError: naming the tensor and both shards.
    """
    seen: dict[str, str] = {}
    for shard in shards:
        for entry in shard.tensors:
            if entry.name in seen:
                raise LayerwiseError(
                    f"tensor {entry.name!r} is in both {seen[entry.name]!r} and {shard.name!r} "
                    "(vLLM would load it twice); remove one copy", where=where)
            seen[entry.name] = shard.name


def _check_index(weight_map: dict[str, str], shards: list[ShardHeader], where: str) -> None:
    present = {(t.name, s.name) for s in shards for t in s.tensors}
    for tensor, shard in weight_map.items():
        if (tensor, shard) not in present:
            raise LayerwiseError(
                f"index says {tensor!r} is in {shard!r}, but that shard has no such tensor", where=where
            )


def _read_local_config(folder: Path) -> dict | None:
    config = folder / "config.json"
    return _read_json(config) if config.is_file() else None


def _read_json(path: Path) -> dict:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise describe_exception(exc, where=str(path)) from exc
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise LayerwiseError(f"not valid JSON ({type(exc).__name__})", where=str(path)) from None
    if not isinstance(doc, dict):
        raise LayerwiseError("not a JSON object", where=str(path))
    return doc


def _open_hub(repo_id: str, revision: str | None) -> Checkpoint:
    """Read a Hub repo's shard headers: by HTTP range requests, or from the local cache when offline."""
    from huggingface_hub import constants

    where = f"{repo_id}@{revision}" if revision else repo_id
    if constants.is_offline_mode():
        return _open_hub_cache(repo_id, revision, where)
    return _open_hub_remote(repo_id, revision, where)


def _open_hub_remote(repo_id: str, revision: str | None, where: str) -> Checkpoint:
    from huggingface_hub import get_hf_file_metadata, hf_hub_download, hf_hub_url
    from huggingface_hub.errors import RemoteEntryNotFoundError

    # One HEAD of config.json first, without huggingface_hub's download retries
    # (about 25 s of backoff when the Hub is unreachable): it fails fast, and
    # tells a missing repo from a missing revision.
    try:
        commit = get_hf_file_metadata(hf_hub_url(repo_id, "config.json", revision=revision)).commit_hash or revision
        has_config = True
    except RemoteEntryNotFoundError as exc:
        commit = exc.response.headers.get("X-Repo-Commit") or revision
        has_config = False  # a repo without config.json: plan with the generic mapping
    except Exception as exc:
        raise describe_exception(exc, where=where) from exc

    def download(filename: str, at: str | None) -> Path:
        try:
            return Path(hf_hub_download(repo_id, filename, revision=at))
        except RemoteEntryNotFoundError:
            raise
        except Exception as exc:
            raise describe_exception(exc, where=where) from exc

    def pinned(path: Path) -> str | None:
        # The cache keeps files under snapshots/<commit>/: pin every later request to it.
        return path.parent.name if re.fullmatch(r"[0-9a-f]{40}", path.parent.name) else commit

    # The first JSON file is fetched by the user's revision, so that the cache
    # records which commit that revision is (HF_HUB_OFFLINE=1 runs need it).
    config, index, index_where = None, None, f"{where}/{INDEX_NAME}"
    index_at = revision
    if has_config:
        config_path = download("config.json", revision)
        config = _read_json(config_path)
        commit = index_at = pinned(config_path)
    try:
        index_path = download(INDEX_NAME, index_at)
        index, commit = _read_json(index_path), pinned(index_path)
        names = sorted(set(_weight_map(index, index_where).values()), key=natural_key)
        if not names:
            raise LayerwiseError("index names no shard files", where=index_where)
        for name in names:
            shard_file(None, name, index_where)
    except RemoteEntryNotFoundError:
        names = [SINGLE_FILE]
    shards, read = [], 0
    for shard, n in _read_remote_headers(repo_id, commit, names, where, None if index is None else index_where):
        shards.append(shard)
        read += n
    check_unique_tensors(shards, where)
    if index is not None:
        _check_index(index["weight_map"], shards, index_where)
    return Checkpoint(repo_id, "hub", shards, config, None, revision, read, index)


def _weight_map(index: object, where: str) -> dict[str, str]:
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise LayerwiseError("index has no weight_map of tensor name -> shard file", where=where)
    return weight_map


def _read_remote_headers(
    repo_id: str, revision: str | None, names: list[str], where: str, index_where: str | None
) -> list[tuple[ShardHeader, int]]:
    from huggingface_hub import hf_hub_url
    from huggingface_hub.errors import RemoteEntryNotFoundError
    from huggingface_hub.utils import build_hf_headers

    headers = build_hf_headers()

    def read(name: str) -> tuple[ShardHeader, int]:
        url = hf_hub_url(repo_id, name, revision=revision)
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
            raise describe_exception(exc, where=f"{where}/{name}") from exc
    return results


def _read_remote_header(url: str, headers: dict[str, str], name: str, where: str) -> tuple[ShardHeader, int]:
    """Fetch exactly a shard's 8-byte length and its header: two range requests, no tensor data."""
    prefix, file_size = _get_range(url, headers, 0, 8, where)
    header_len = header_length(prefix, file_size, where)
    raw = _get_range(url, headers, 8, header_len, where)[0] if header_len else b""
    if len(raw) < header_len:
        raise LayerwiseError(f"truncated: the server sent {len(raw)} of the {header_len} header bytes", where=where)
    return parse_header(name, raw, file_size=file_size, where=where), 8 + header_len


def _get_range(url: str, headers: dict[str, str], start: int, length: int, where: str) -> tuple[bytes, int | None]:
    """GET bytes [start, start + length) of a Hub file; also return the file's size from Content-Range."""
    from huggingface_hub import constants
    from huggingface_hub.utils import get_session, hf_raise_for_status

    request_headers = {**headers, "Range": f"bytes={start}-{start + length - 1}"}
    with get_session().stream(
        "GET", url, headers=request_headers, timeout=constants.HF_HUB_DOWNLOAD_TIMEOUT, follow_redirects=True
    ) as response:
        if response.status_code == 416:  # the file is shorter than `start`
            return b"", _content_range_size(response.headers.get("Content-Range"))
        if response.status_code >= 400:
            response.read()  # hf_raise_for_status reads the error body
            hf_raise_for_status(response)
        if response.status_code != 206:
            # A server that ignores Range would send the whole shard: stop here.
            raise LayerwiseError(
                f"the server ignored the byte range request (HTTP {response.status_code}); "
                "not downloading the whole file",
                where=where,
            )
        body = bytearray()
        for chunk in response.iter_bytes():
            body += chunk
            if len(body) >= length:
                break
        return bytes(body[:length]), _content_range_size(response.headers.get("Content-Range"))


def _content_range_size(value: str | None) -> int | None:
    # "bytes 0-7/12345" or "bytes */12345": the part after "/" is the file size.
    total = (value or "").rpartition("/")[2].strip()
    return int(total) if total.isdigit() else None


def _open_hub_cache(repo_id: str, revision: str | None, where: str) -> Checkpoint:
    """HF_HUB_OFFLINE=1: read the headers of the shards in the local Hub cache."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        folder = Path(
            snapshot_download(
                repo_id, revision=revision, local_files_only=True, allow_patterns=["*.safetensors", "*.json"]
            )
        )
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
    return replace(_open_directory(folder), source=repo_id, kind="hub", revision=revision)


def _missing_cached_shards(folder: Path) -> list[str]:
    index_path = folder / INDEX_NAME
    if not index_path.is_file():
        return [] if any(folder.glob("*.safetensors")) else [SINGLE_FILE]
    try:
        names = set(json.loads(index_path.read_text(encoding="utf-8"))["weight_map"].values())
    except Exception:  # noqa: BLE001 - a broken index is reported by _open_directory
        return []
    names = {n for n in names if isinstance(n, str)}
    return sorted((n for n in names if not shard_file(folder, n, str(index_path)).is_file()), key=natural_key)
