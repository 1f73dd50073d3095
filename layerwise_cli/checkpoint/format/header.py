"""Read and validate safetensors headers without touching tensor data."""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from math import prod
from typing import BinaryIO

from layerwise_cli.errors import LayerwiseError, describe_exception

# Bytes per element for every dtype the safetensors format names with a whole
# number of bytes per element.
DTYPE_SIZES: dict[str, int] = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1, "F8_E4M3FNUZ": 1, "F8_E5M2FNUZ": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8, "C64": 8,
}
# Bits per element for every dtype the safetensors library (0.8) accepts,
# sub-byte ones included; a tensor of those must end on a byte boundary.
DTYPE_BITS: dict[str, int] = {
    **{name: 8 * size for name, size in DTYPE_SIZES.items()},
    "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6,
}
# The safetensors library refuses headers above 100 MB; so do we, before
# allocating anything.
MAX_HEADER_BYTES = 100_000_000


@dataclass(frozen=True)
class TensorEntry:
    """One tensor as a shard's header describes it."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    shard: str
    # Offsets relative to the start of the data section, as in the header.
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    @property
    def numel(self) -> int:
        return prod(self.shape)


@dataclass(frozen=True)
class ShardHeader:
    """A parsed safetensors header: one shard of a checkpoint (a list given for `tensors` is kept as a tuple)."""

    name: str
    header_len: int
    file_size: int | None
    metadata: dict[str, str] = field(default_factory=dict)
    tensors: tuple[TensorEntry, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "tensors", tuple(self.tensors))

    @property
    def data_start(self) -> int:
        return 8 + self.header_len

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


def read_shard_header(path: str | os.PathLike[str], name: str | None = None) -> tuple[ShardHeader, int]:
    """Read one shard's header from disk, reading only the header bytes.

    Args:
        path: the `.safetensors` file.
        name: the name to report (defaults to the file's base name).

    Returns:
        The validated header and the number of bytes read from the file.

    Raises:
        LayerwiseError: the file is missing, truncated or its header is invalid.
    """
    path = os.fspath(path)
    display = name or os.path.basename(path)
    try:
        # Unbuffered: a buffered reader would fetch 8 KiB for the 8-byte
        # prefix, reaching into the tensor data of a small header.
        with open(path, "rb", buffering=0) as f:
            file_size = os.fstat(f.fileno()).st_size
            header_len = header_length(_read_exactly(f, 8), file_size, path)
            raw = _read_exactly(f, header_len)
            if len(raw) < header_len:
                raise LayerwiseError("truncated while reading the header (file changed?)", where=path)
    except LayerwiseError:
        raise
    except OSError as exc:
        raise describe_exception(exc, where=path) from exc
    shard = parse_header(display, raw, file_size=file_size, where=path)
    return shard, 8 + header_len


def encode_header(tensors: Iterable[TensorEntry], metadata: dict[str, str] | None = None) -> bytes:
    """Encode a safetensors header: the 8-byte length, then the JSON padded with spaces to 8 bytes.

    The one header writer: `reorder` and the test checkpoints both use it.

    Args:
        tensors: the entries, in the order their keys are written; `begin` and
            `end` are offsets in the data section.
        metadata: the `__metadata__` strings, written first; None writes none.

    Returns:
        The bytes that precede the data section (its length is the data start).
    """
    doc: dict[str, object] = {}
    if metadata is not None:
        doc["__metadata__"] = metadata
    for entry in tensors:
        doc[entry.name] = {"dtype": entry.dtype, "shape": list(entry.shape), "data_offsets": [entry.begin, entry.end]}
    raw = json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    raw += b" " * (-len(raw) % 8)  # the data section starts 8-byte aligned, as safetensors writes it
    return struct.pack("<Q", len(raw)) + raw


def _read_exactly(f: BinaryIO, n: int) -> bytes:
    """Read n bytes (fewer only at the end of the file) from an unbuffered file."""
    chunks, left = [], n
    while left > 0:
        chunk = f.read(left)
        if not chunk:
            break
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def header_length(prefix: bytes, file_size: int | None, where: str) -> int:
    """Check a file's first 8 bytes and return the header length they give.

    Args:
        prefix: the first (up to) 8 bytes of the file.
        file_size: the whole file's size, or None when unknown.
        where: the file or URL to name in errors.

    Returns:
        The header length, known to fit in the file and under the 100 MB limit.
    """
    if len(prefix) < 8:
        size = file_size if file_size is not None else len(prefix)
        raise LayerwiseError(f"truncated: {size} bytes, shorter than the 8-byte header length", where=where)
    (header_len,) = struct.unpack("<Q", prefix[:8])
    if file_size is not None and header_len > file_size - 8:
        raise LayerwiseError(
            f"header length {header_len} runs past the end of the file ({file_size} bytes)", where=where
        )
    if header_len > MAX_HEADER_BYTES:
        raise LayerwiseError(f"header length {header_len} exceeds the 100 MB limit", where=where)
    return header_len


def read_header_by_range(read_range: Callable[[int, int], tuple[bytes, int | None]], name: str, where: str,
                         first_bytes: int) -> tuple[ShardHeader, int]:
    """A file's header read by range: its first FIRST_BYTES in one request (the whole header of most files), the
    rest of a longer header in a second; the header and the header bytes (8 + its length).

    Args:
        read_range: bytes `[start, end)` of the file (fewer at its end) and the file's size (None: unknown).
        name: the file's name in the header.
        where: the file or URL to name in errors.
        first_bytes: how much the first request asks for (at least 8).
    """
    first, size = read_range(0, first_bytes)
    length = header_length(first[:8], size, where)
    raw = first[8:8 + length]
    if len(raw) < length:
        raw += read_range(8 + len(raw), 8 + length)[0]
    if len(raw) < length:
        raise LayerwiseError(f"truncated: the server sent {len(raw)} of the {length} header bytes", where=where)
    return parse_header(name, raw, file_size=size, where=where), 8 + length


def parse_header(name: str, raw: bytes, *, file_size: int | None, where: str | None = None) -> ShardHeader:
    """Validate a header's JSON bytes and turn them into a `ShardHeader`.

    Checks what a loader would trip on later: JSON object, known dtypes,
    integer shapes, offsets that match the shape, lie in the data section,
    and do not overlap; with `file_size`, that the data section is exactly
    as long as the tensors need.

    Args:
        name: the shard's name within its checkpoint.
        raw: the header bytes (without the 8-byte length prefix).
        file_size: the whole file's size, or None when unknown (Hub).
        where: the file or URL to name in errors.

    Returns:
        The parsed header, tensors in the header's own order.
    """
    where = where or name
    try:
        doc = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise LayerwiseError("header is not valid UTF-8", where=where) from None
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, and ints past Python's digit limit
        raise LayerwiseError(f"header is not valid JSON ({exc.__class__.__name__})", where=where) from None
    if not isinstance(doc, dict):
        raise LayerwiseError(f"header is a JSON {type(doc).__name__}, not an object", where=where)
    metadata = doc.pop("__metadata__", None)
    if metadata is None:
        metadata = {}
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise LayerwiseError("__metadata__ must map strings to strings", where=where)
    tensors = [_parse_entry(name, key, value, where) for key, value in doc.items()]
    _check_layout(tensors, len(raw), file_size, where)
    return ShardHeader(name=name, header_len=len(raw), file_size=file_size, metadata=metadata, tensors=tensors)


def _parse_entry(shard: str, key: str, value: object, where: str) -> TensorEntry:
    if not isinstance(value, dict):
        raise LayerwiseError(f"tensor {_short(key)}: entry is not an object", where=where)
    dtype = value.get("dtype")
    shape = value.get("shape")
    offsets = value.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in DTYPE_BITS:
        raise LayerwiseError(f"tensor {_short(key)}: unknown dtype {_short(dtype)}", where=where)
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        raise LayerwiseError(
            f"tensor {_short(key)}: shape {_short(shape)} is not a list of non-negative integers", where=where
        )
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(_is_count(o) for o in offsets)
        or offsets[0] > offsets[1]
    ):
        raise LayerwiseError(f"tensor {_short(key)}: data_offsets {_short(offsets)} are not [begin, end]", where=where)
    bits = prod(shape) * DTYPE_BITS[dtype]
    if bits % 8:
        raise LayerwiseError(
            f"tensor {_short(key)}: {dtype}{_short(shape)} does not end on a byte boundary", where=where
        )
    expected = bits // 8
    if offsets[1] - offsets[0] != expected:
        raise LayerwiseError(
            f"tensor {_short(key)}: {dtype}{_short(shape)} needs {expected} bytes "
            f"but its offsets span {offsets[1] - offsets[0]}",
            where=where,
        )
    return TensorEntry(key, dtype, tuple(shape), shard, offsets[0], offsets[1])


def _short(value: object, limit: int = 80) -> str:
    """repr() of user data, cut so that an error stays one readable line."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _is_count(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 2**63


def _check_layout(tensors: list[TensorEntry], header_len: int, file_size: int | None, where: str) -> None:
    # The safetensors library (and so vLLM's loader) needs the tensors to tile
    # the data section exactly: sorted by offset, each starts where the last ended.
    end = 0
    prev: TensorEntry | None = None
    for cur in sorted(tensors, key=lambda t: (t.begin, t.end)):
        if cur.begin < end:
            assert prev is not None
            raise LayerwiseError(f"tensors {_short(prev.name)} and {_short(cur.name)} overlap", where=where)
        if cur.begin > end:
            after = f"after {_short(prev.name)}" if prev else "at the start of the data section"
            raise LayerwiseError(
                f"{cur.begin - end} unused bytes {after} (tensor {_short(cur.name)} starts at {cur.begin})", where=where
            )
        end, prev = cur.end, cur
    if file_size is None:
        return
    data_len = file_size - 8 - header_len
    if end > data_len:
        assert prev is not None
        raise LayerwiseError(
            f"tensor {_short(prev.name)} ends at byte {end} of the data section, but the file holds {data_len} "
            "(truncated file?)",
            where=where,
        )
    if end != data_len:
        raise LayerwiseError(
            f"file size does not match the header: {data_len - end} bytes after the last tensor", where=where
        )
