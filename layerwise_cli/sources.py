"""Resolve a SOURCE (file, directory or Hub repo id) into a checkpoint's headers."""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from .errors import LayerwiseError, describe_exception
from .safetensors_header import ShardHeader, TensorEntry, _check_layout, _parse_entry, read_shard_header

INDEX_NAME = "model.safetensors.index.json"
_REPO_ID_RE = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")


@dataclass
class Checkpoint:
    """A checkpoint's headers: its shards in the order vLLM reads them, and its config."""

    source: str
    kind: str  # "file", "directory" or "hub"
    shards: list[ShardHeader]
    config: dict | None = None
    # Local directory holding the shards (None for a Hub source read remotely).
    local_dir: Path | None = None
    revision: str | None = None
    header_bytes_read: int = 0
    index: dict | None = field(default=None, repr=False)

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
        return self.local_dir / name


def natural_key(name: str) -> list[object]:
    """Sort key that orders `model-2-of-10` before `model-10-of-10`, as vLLM does."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def looks_like_repo_id(source: str) -> bool:
    """True for `org/name` that is not an existing local path."""
    return bool(_REPO_ID_RE.match(source)) and not os.path.exists(source)


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
    if path.is_file():
        if revision:
            raise LayerwiseError("--revision applies to Hub repo ids only", where=source)
        shard, read = read_shard_header(path)
        config = _read_local_config(path.parent)
        return Checkpoint(str(path), "file", [shard], config, path.parent, None, read)
    if path.is_dir():
        if revision:
            raise LayerwiseError("--revision applies to Hub repo ids only", where=source)
        return _open_directory(path)
    if looks_like_repo_id(source):
        return _open_hub(source, revision)
    raise LayerwiseError("no such file or directory, and not a Hub repo id (org/name)", where=source)


def _open_directory(path: Path) -> Checkpoint:
    index = None
    index_path = path / INDEX_NAME
    if index_path.is_file():
        index = _read_json(index_path)
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise LayerwiseError("index has no weight_map of tensor name -> shard file", where=str(index_path))
        names = sorted(set(weight_map.values()), key=natural_key)
        for name in names:
            if not (path / name).is_file():
                raise LayerwiseError(f"index names shard {name!r}, which does not exist", where=str(index_path))
    else:
        names = sorted((p.name for p in path.glob("*.safetensors") if p.is_file()), key=natural_key)
    if not names:
        raise LayerwiseError("no .safetensors files in the directory", where=str(path))
    shards, read = [], 0
    for name in names:
        shard, n = read_shard_header(path / name, name)
        shards.append(shard)
        read += n
    if index is not None:
        _check_index(index["weight_map"], shards, str(index_path))
    return Checkpoint(str(path), "directory", shards, _read_local_config(path), path, None, read, index)


def _check_index(weight_map: dict[str, str], shards: list[ShardHeader], where: str) -> None:
    present = {(t.name, s.name) for s in shards for t in s.tensors}
    for tensor, shard in weight_map.items():
        if (tensor, shard) not in present:
            raise LayerwiseError(f"index says {tensor!r} is in {shard!r}, but that shard has no such tensor", where=where)


def _read_local_config(folder: Path) -> dict | None:
    config = folder / "config.json"
    return _read_json(config) if config.is_file() else None


def _read_json(path: Path) -> dict:
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise describe_exception(exc, where=str(path)) from exc
    if not isinstance(doc, dict):
        raise LayerwiseError("not a JSON object", where=str(path))
    return doc


def _open_hub(repo_id: str, revision: str | None) -> Checkpoint:
    """Read headers from the Hub with HTTP range requests (huggingface_hub's metadata API)."""
    from huggingface_hub import HfApi, hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError

    where = f"{repo_id}@{revision}" if revision else repo_id
    api = HfApi()
    try:
        meta = api.get_safetensors_metadata(repo_id, revision=revision)
    except Exception as exc:
        raise describe_exception(exc, where=where) from exc
    shards = []
    for name in sorted(meta.files_metadata, key=natural_key):
        file_meta = meta.files_metadata[name]
        tensors = [
            _parse_entry(name, key, {"dtype": info.dtype, "shape": list(info.shape),
                                     "data_offsets": list(info.data_offsets)}, f"{where}/{name}")
            for key, info in file_meta.tensors.items()
        ]
        _check_layout(tensors, 0, None, f"{where}/{name}")
        shards.append(ShardHeader(name, header_len=0, file_size=None, metadata=dict(file_meta.metadata or {}),
                                  tensors=tensors))
    try:
        config_path = hf_hub_download(repo_id, "config.json", revision=revision)
        config = _read_json(Path(config_path))
    except EntryNotFoundError:
        config = None
    except Exception as exc:
        raise describe_exception(exc, where=where) from exc
    return Checkpoint(repo_id, "hub", shards, config, None, revision, 0)
