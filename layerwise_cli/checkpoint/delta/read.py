"""Reading a delta file: finding it, and its header and metadata checked against each other (`read_delta`).

The format itself (what each entry holds) is `checkpoint.delta`'s docstring; its positions are checked when they
are read (`Delta.positions`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from math import prod
from pathlib import Path

from layerwise_cli.checkpoint.delta.format import (
    BITMAP,
    DELTA_FILE,
    FORMAT,
    KINDS,
    KINDS_V2,
    METADATA_KEY,
    POSITIONS_SUFFIX,
    VALUES_SUFFIX,
    WHOLE,
    WHOLE_SUFFIX,
    Delta,
    TensorPatch,
)
from layerwise_cli.checkpoint.delta.v2 import CODEC, FORMAT_V2, MAX_SPAN, SPARSE, Chunk
from layerwise_cli.checkpoint.format.header import DTYPE_SIZES, ShardHeader, read_shard_header
from layerwise_cli.errors import LayerwiseError, describe_exception

_HEX = frozenset("0123456789abcdef")
# The most a delta's first range request asks for (`first_header_read`).
HEADER_RANGE = 256 * 1024


def delta_file(path: str | os.PathLike[str]) -> Path | None:
    """The delta file of PATH (a delta step directory, or the file itself), or None when PATH is not a delta.

    Reads one header at most.
    """
    path = Path(path)
    try:
        candidate = path / DELTA_FILE if path.is_dir() else path
        if not candidate.is_file() or not candidate.name.endswith(".safetensors"):
            return None
    except OSError as exc:  # a name too long, a loop of symlinks: one line naming the path
        raise describe_exception(exc, where=str(path)) from exc
    try:
        header, _ = read_shard_header(candidate)
    except LayerwiseError:
        return candidate if candidate.name == DELTA_FILE else None  # a damaged delta is refused by `read_delta`
    return candidate if METADATA_KEY in header.metadata else None


def first_header_read(size: int) -> int:
    """The bytes the first range request for a SIZE-byte delta file's header asks for (a longer header takes a
    second request for the rest): a sixteenth of the file, at most `HEADER_RANGE`.

    One request holds the whole header of most links (70 KB for a 0.4 GiB Qwen3-architecture model's 44 MB
    delta), and what it reads past the header stays under a sixteenth of what the link costs anyway.
    """
    return max(8, min(HEADER_RANGE, size // 16))


def base_location_of(header: ShardHeader, where: str) -> str:
    """The base location a delta's header names (from its metadata alone: what a chain's walk follows).

    Raises:
        LayerwiseError: the header has no delta metadata with a base location (not a delta).
    """
    try:
        location = json.loads(header.metadata[METADATA_KEY])["base"]["location"]
    except (KeyError, TypeError, ValueError):
        raise LayerwiseError(f"not a delta: its header has no {METADATA_KEY} base location", where=where) from None
    if not isinstance(location, str):
        raise LayerwiseError(f"not a delta: its header has no {METADATA_KEY} base location", where=where)
    return location


def read_delta(path: str | os.PathLike[str]) -> Delta:
    """Read and validate a delta file's header and metadata (not yet its positions: `Delta.positions`).

    Args:
        path: a delta step directory or its `delta.safetensors`.

    Returns:
        The delta.

    Raises:
        LayerwiseError: one line naming the file (and the tensor): truncated, not a delta, malformed
            metadata, or entries that do not match what the metadata describes.
    """
    path = Path(path)
    file = path / DELTA_FILE if path.is_dir() else path
    header, _ = read_shard_header(file)
    where = str(file)
    raw = header.metadata.get(METADATA_KEY)
    if raw is None:
        raise LayerwiseError(f"not a delta: its header has no {METADATA_KEY} metadata", where=where)
    try:
        doc = json.loads(raw)
    except ValueError:
        raise LayerwiseError(f"__metadata__ {METADATA_KEY} is not valid JSON", where=where) from None
    found = doc.get("format") if isinstance(doc, dict) else None
    if found not in (FORMAT, FORMAT_V2):
        raise LayerwiseError(f"delta format {found!r} is not {FORMAT!r} or {FORMAT_V2!r} (written by another "
                             "version?)", where=where)
    version = 2 if found == FORMAT_V2 else 1
    if version == 2 and doc.get("codec") != CODEC:
        raise LayerwiseError(f"delta codec {doc.get('codec')!r} is not {CODEC!r} (written by another version?)",
                             where=where)
    base, step, tensors = doc.get("base"), doc.get("step"), doc.get("tensors")
    if not isinstance(base, dict) or not isinstance(base.get("location"), str):
        raise LayerwiseError(f"__metadata__ {METADATA_KEY} has no base location", where=where)
    base_digests = _digest_map(base.get("digests"), "base", where)
    step_digests = _digest_map(step.get("digests") if isinstance(step, dict) else None, "step", where)
    if set(base_digests) != set(step_digests):
        odd = sorted(set(base_digests) ^ set(step_digests))[0]
        raise LayerwiseError(f"tensor {odd}: in only one of the base's and the step's digests", where=where)
    if not isinstance(tensors, dict):
        raise LayerwiseError(f"__metadata__ {METADATA_KEY} has no \"tensors\" object", where=where)
    patches = {name: _patch(name, spec, where, version) for name, spec in tensors.items()}
    _check_entries(header, patches, base_digests, step_digests, where)
    return Delta(file, header, base["location"], base_digests, step_digests, patches, version)


def _digest_map(value: object, which: str, where: str) -> dict[str, str]:
    if not isinstance(value, dict) or not value:
        raise LayerwiseError(f"__metadata__ {METADATA_KEY} has no {which} digests", where=where)
    for name, digest in value.items():
        if not (isinstance(digest, str) and len(digest) == 32 and set(digest) <= _HEX):
            raise LayerwiseError(f"tensor {name}: {which} digest is not 32 lowercase hex digits", where=where)
    return dict(value)


def _patch(name: str, spec: object, where: str, version: int) -> TensorPatch:
    if not isinstance(spec, dict):
        raise LayerwiseError(f"tensor {name}: its entry in {METADATA_KEY} is not an object", where=where)
    dtype, shape, kind, changed = spec.get("dtype"), spec.get("shape"), spec.get("kind"), spec.get("changed")
    if dtype not in DTYPE_SIZES:
        raise LayerwiseError(f"tensor {name}: dtype {dtype!r} cannot be patched", where=where)
    if not (isinstance(shape, list) and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                            for d in shape)):
        raise LayerwiseError(f"tensor {name}: shape {shape!r} is not a list of non-negative integers", where=where)
    kinds = KINDS_V2 if version == 2 else KINDS
    if kind not in kinds:
        raise LayerwiseError(f"tensor {name}: kind {kind!r} is not one of {', '.join(kinds)}", where=where)
    numel = prod(shape)
    if not (isinstance(changed, int) and not isinstance(changed, bool) and 0 < changed <= numel):
        raise LayerwiseError(f"tensor {name}: changed {changed!r} is not between 1 and its {numel} elements",
                             where=where)
    if kind == WHOLE and changed != numel:
        raise LayerwiseError(f"tensor {name}: stored whole, but changed {changed} of {numel}", where=where)
    chunks = _chunks(name, spec.get("chunks"), numel, changed, where) if kind == SPARSE else ()
    return TensorPatch(name, dtype, tuple(shape), kind, changed, chunks)


def _chunks(name: str, value: object, numel: int, changed: int, where: str) -> tuple[Chunk, ...]:
    """A v2 sparse patch's chunks from the metadata's `[[start, count], ...]`: starts increasing and in range,
    each count at least one and at most its span, the counts adding up to CHANGED."""
    if not (isinstance(value, list) and value and all(
            isinstance(pair, list) and len(pair) == 2
            and all(isinstance(n, int) and not isinstance(n, bool) for n in pair) for pair in value)):
        raise LayerwiseError(f"tensor {name}: chunks {value!r} is not a list of [start, count] pairs", where=where)
    starts = [start for start, _ in value] + [numel]
    chunks = tuple(Chunk(start, end, count) for (start, count), end in zip(value, starts[1:], strict=True))
    for index, chunk in enumerate(chunks):
        if not 0 <= chunk.start < chunk.end <= numel or chunk.end - chunk.start >= MAX_SPAN:
            raise LayerwiseError(f"tensor {name}: chunk {index} spans elements {chunk.start} to {chunk.end} of "
                                 f"{numel} (starts must increase, each span under {MAX_SPAN})", where=where)
        if not 0 < chunk.count <= chunk.end - chunk.start:
            raise LayerwiseError(f"tensor {name}: chunk {index} has {chunk.count} changes in "
                                 f"{chunk.end - chunk.start} elements", where=where)
    total = sum(chunk.count for chunk in chunks)
    if total != changed:
        raise LayerwiseError(f"tensor {name}: its chunks hold {total} changes, its header says {changed}",
                             where=where)
    return chunks


def expected_entries(patch: TensorPatch) -> dict[str, tuple[str | tuple[str, ...], tuple[int, ...] | None]]:
    """Each file entry of PATCH: key -> (dtype, or the dtypes allowed; shape, None for any one-dimensional)."""
    if patch.kind == WHOLE:
        return {patch.name + WHOLE_SUFFIX: (patch.dtype, patch.shape)}
    if patch.kind == SPARSE:  # compressed streams: bytes, of a length only their frames know
        return {key: ("U8", None) for key in patch.entry_keys()}
    if patch.kind == BITMAP:
        positions = ("U8", ((patch.numel + 7) // 8,))
    else:
        positions = (index_dtype(patch.numel), (patch.changed,))
    return {patch.name + POSITIONS_SUFFIX: positions, patch.name + VALUES_SUFFIX: (patch.dtype, (patch.changed,))}


def index_dtype(numel: int) -> str:
    """The dtype of an index of positions into NUMEL elements: I32 while it fits, I64 beyond."""
    return "I32" if numel < 2**31 else "I64"


def _check_entries(header: ShardHeader, patches: Mapping[str, TensorPatch], base: Mapping[str, str],
                   step: Mapping[str, str], where: str) -> None:
    present = {t.name: t for t in header.tensors}
    wanted: set[str] = set()
    for name, patch in patches.items():
        if name not in step:
            raise LayerwiseError(f"tensor {name}: patched, but not in the step's digests", where=where)
        if base[name] == step[name]:
            raise LayerwiseError(f"tensor {name}: patched, but its base and step digests are equal", where=where)
        for key, (dtype, shape) in expected_entries(patch).items():
            wanted.add(key)
            entry = present.get(key)
            if entry is None:
                raise LayerwiseError(f"tensor {name}: entry {key} is missing", where=where)
            if entry.dtype != dtype or (entry.shape != shape if shape is not None else len(entry.shape) != 1):
                expected = f"{dtype}{list(shape)}" if shape is not None else f"{dtype}[bytes]"
                raise LayerwiseError(f"tensor {name}: entry {key} is {entry.dtype}{list(entry.shape)}, expected "
                                     f"{expected}", where=where)
    extra = sorted(set(present) - wanted)
    if extra:
        raise LayerwiseError(f"entry {extra[0]} is not described by {METADATA_KEY}", where=where)
    for name in step:
        if name not in patches and base[name] != step[name]:
            raise LayerwiseError(f"tensor {name}: its step digest differs from its base's, and the delta holds no "
                                 "patch for it", where=where)

