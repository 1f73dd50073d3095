"""Per-tensor and per-parent-layer content digests (xxh3-128), and where a shard's header carries them.

The tensor digest
-----------------
A tensor's digest is the xxh3-128 (seed 0) of its description followed by its
raw safetensors bytes:

    xxh3_128(b"<DTYPE>[<d0>,<d1>,...]\\n" + data)

where DTYPE is the safetensors dtype name (`BF16`, `F32`, ...), the shape is
written as a JSON list without spaces (`[]` for a scalar) and `data` is the
tensor's bytes exactly as they lie in the file's data section (little-endian,
row-major). It is written as 32 lowercase hex digits. Two tensors with the same
bytes but another dtype or shape get different digests: the bytes would not
load into the engine the same way.

The header key
--------------
A shard written by `save_checkpoint` carries, in its header's `__metadata__`
(a map of strings to strings, as the safetensors format requires), the key
`layerwise.digests` whose value is a JSON object:

    {"format": "xxh3-128/v1", "tensors": {"<tensor name>": "<32 hex digits>", ...}}

naming every tensor of that shard, and no other. A reader that meets another
`format` treats the shard as carrying no digests (a later format is never
misread); a value that is not of this shape is an error naming the shard.

The layer digest
----------------
A parent layer's digest is the xxh3-128 of its tensors' names and digests in
name order (`name`, a NUL byte, the 16 digest bytes, for each tensor), so it
changes when any tensor's bytes, dtype or shape change, or when a tensor is
added, removed or renamed. A reload can compare it with the digest of the
layer the engine holds without reading any tensor data.

Only `xxhash` is needed (no torch): see docs/performance.md, "Digest speed", for why xxh3-128.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import xxhash

from layerwise_cli.checkpoint.format.header import ShardHeader
from layerwise_cli.errors import LayerwiseError

METADATA_KEY = "layerwise.digests"
FORMAT = "xxh3-128/v1"
_HEX_LEN = 32
_HEX = frozenset("0123456789abcdef")


@dataclass(frozen=True)
class DigestMismatch:
    """A tensor whose bytes do not hash to the digest its shard's header gives."""

    name: str
    shard: str
    expected: str  # the header's
    actual: str  # of the bytes in the file

    def describe(self) -> str:
        return (f"tensor {self.name}: its bytes do not match the {METADATA_KEY} digest in the header "
                f"(header {self.expected}, bytes {self.actual})")

    def to_dict(self) -> dict:
        return {"name": self.name, "shard": self.shard, "expected": self.expected, "actual": self.actual}


def tensor_prefix(dtype: str, shape: Iterable[int]) -> bytes:
    """The description hashed before a tensor's bytes: `DTYPE[d0,d1,...]` and a newline."""
    return f"{dtype}[{','.join(str(int(d)) for d in shape)}]\n".encode("ascii")


class TensorHasher:
    """The digest of one tensor whose raw bytes arrive in chunks (a read, a copy, a device transfer)."""

    def __init__(self, dtype: str, shape: Iterable[int]) -> None:
        self._hash = xxhash.xxh3_128(tensor_prefix(dtype, shape))

    def update(self, data) -> None:
        """Add the next bytes of the tensor (any bytes-like object)."""
        self._hash.update(data)

    def hexdigest(self) -> str:
        return self._hash.hexdigest()


def tensor_digest(dtype: str, shape: Iterable[int], data) -> str:
    """The digest of one tensor from its whole raw bytes (see the module docstring).

    Args:
        dtype: the safetensors dtype name.
        shape: the tensor's shape.
        data: its raw little-endian bytes (any bytes-like object).

    Returns:
        32 lowercase hex digits.
    """
    hasher = TensorHasher(dtype, shape)
    hasher.update(data)
    return hasher.hexdigest()


def digests_metadata(digests: Mapping[str, str]) -> dict[str, str]:
    """The `__metadata__` entry that carries a shard's tensor digests.

    Args:
        digests: tensor name -> digest, for every tensor of the shard.

    Returns:
        `{METADATA_KEY: <JSON>}`, to merge into the shard's `__metadata__`.
    """
    doc = {"format": FORMAT, "tensors": dict(sorted(digests.items()))}
    return {METADATA_KEY: json.dumps(doc, separators=(",", ":"), ensure_ascii=False)}


def header_digests(shard: ShardHeader, where: str | None = None) -> dict[str, str] | None:
    """The tensor digests a shard's header carries, or None when it carries none (or another format's).

    Args:
        shard: a parsed header (its `metadata` is the header's `__metadata__`).
        where: the file or URL to name in errors (defaults to the shard's name).

    Returns:
        Tensor name -> digest, one for each tensor of the shard.

    Raises:
        LayerwiseError: the key is there but malformed, or does not name
            exactly the shard's tensors.
    """
    raw = shard.metadata.get(METADATA_KEY)
    if raw is None:
        return None
    where = where or shard.name
    try:
        doc = json.loads(raw)
    except ValueError:
        raise LayerwiseError(f"__metadata__ {METADATA_KEY} is not valid JSON", where=where) from None
    if not isinstance(doc, dict) or not isinstance(doc.get("format"), str):
        raise LayerwiseError(f"__metadata__ {METADATA_KEY} has no \"format\"", where=where)
    if doc["format"] != FORMAT:
        return None
    tensors = doc.get("tensors")
    if not isinstance(tensors, dict):
        raise LayerwiseError(f"__metadata__ {METADATA_KEY} has no \"tensors\" object", where=where)
    for name, digest in tensors.items():
        if not (isinstance(digest, str) and len(digest) == _HEX_LEN and set(digest) <= _HEX):
            raise LayerwiseError(f"__metadata__ {METADATA_KEY}: digest of tensor {name!r} is not "
                                 f"{_HEX_LEN} lowercase hex digits", where=where)
    names = {t.name for t in shard.tensors}
    extra = sorted(set(tensors) - names)
    if extra:
        raise LayerwiseError(f"__metadata__ {METADATA_KEY} names tensor {extra[0]!r}, which the shard does not hold",
                             where=where)
    missing = sorted(names - set(tensors))
    if missing:
        raise LayerwiseError(f"__metadata__ {METADATA_KEY} has no digest for tensor {missing[0]!r}", where=where)
    return dict(tensors)


def checkpoint_digests(shards: Iterable[ShardHeader]) -> dict[str, str] | None:
    """Every tensor's digest from the headers of a checkpoint's shards; None unless every shard carries them."""
    found: dict[str, str] = {}
    for shard in shards:
        digests = header_digests(shard)
        if digests is None:
            return None
        found.update(digests)
    return found


def layer_digest(tensors: Mapping[str, str]) -> str:
    """The digest of one parent layer from its tensors' digests (name -> digest); see the module docstring."""
    hasher = xxhash.xxh3_128()
    for name in sorted(tensors):
        hasher.update(name.encode("utf-8"))
        hasher.update(b"\0")
        hasher.update(bytes.fromhex(tensors[name]))
    return hasher.hexdigest()


def layer_digests(tensors: Mapping[str, str], parent_of: Callable[[str], str | None]) -> dict[str, str]:
    """Per parent layer, the digest of its tensors.

    Args:
        tensors: tensor name -> digest, for the whole checkpoint.
        parent_of: a tensor name's parent layer, or None for a tensor the
            engine does not load (such tensors are left out); with a
            `LayerMapping`: `lambda n: getattr(mapping.parent_of(n), "name", None)`.

    Returns:
        Parent layer name -> layer digest.
    """
    groups: dict[str, dict[str, str]] = {}
    for name, digest in tensors.items():
        parent = parent_of(name)
        if parent is not None:
            groups.setdefault(parent, {})[name] = digest
    return {parent: layer_digest(group) for parent, group in groups.items()}
