"""Shard names, the index and JSON files: the rules local and Hub sources share."""

from __future__ import annotations

import json
import re
from pathlib import Path, PurePosixPath

from layerwise_cli.checkpoint.format.header import ShardHeader
from layerwise_cli.errors import LayerwiseError, describe_exception

INDEX_NAME = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# Files that hold weights (or index them) in any format: what a checkpoint's other files are not.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf", ".onnx", ".npz")
WEIGHT_INDEX_SUFFIXES = (".safetensors.index.json", ".bin.index.json", ".pt.index.json")


def is_weight_file(name: str) -> bool:
    """True for a weight file or a weight index, of any format."""
    return name.endswith(WEIGHT_SUFFIXES) or name.endswith(WEIGHT_INDEX_SUFFIXES)


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
    # huggingface_hub's cache: snapshots/<commit>/f -> ../../blobs/<hash> (or a folder of the repo:
    # snapshots/<commit>/step_120/f, a run pushed a folder per step).
    snapshot = next((p for p in (root, *root.parents) if p.parent.name == "snapshots"), None)
    if snapshot is not None:
        inside.append(snapshot.parent.parent / "blobs")
    if not any(real == r or r in real.parents for r in inside):
        raise LayerwiseError(
            f"shard {name!r} resolves to {real}, outside the checkpoint directory {root}; refusing to read it",
            where=where,
        )
    return path


def natural_key(name: str) -> list[object]:
    """Sort key that orders `model-2-of-10` before `model-10-of-10`, as vLLM does."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


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


def check_index(weight_map: dict[str, str], shards: list[ShardHeader], where: str) -> None:
    """Refuse an index entry whose shard does not hold that tensor."""
    present = {(t.name, s.name) for s in shards for t in s.tensors}
    for tensor, shard in weight_map.items():
        if (tensor, shard) not in present:
            raise LayerwiseError(
                f"index says {tensor!r} is in {shard!r}, but that shard has no such tensor", where=where
            )


def read_json(path: Path) -> dict:
    """A JSON object file, or a one-line error naming it."""
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


def index_weight_map(index: object, where: str) -> dict[str, str]:
    """The index's tensor name -> shard file map, checked to be one."""
    found = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(found, dict) or not all(isinstance(v, str) for v in found.values()):
        raise LayerwiseError("index has no weight_map of tensor name -> shard file", where=where)
    return found
