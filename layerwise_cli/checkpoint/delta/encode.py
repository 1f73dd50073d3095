"""Encode one step against its base as a delta's patches and metadata (the formats: `checkpoint.delta.format`, v1,
and `checkpoint.delta.v2`)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

from layerwise_cli.checkpoint.delta.format import (
    BITMAP,
    FORMAT,
    INDEX,
    METADATA_KEY,
    POSITIONS_SUFFIX,
    VALUES_SUFFIX,
    WHOLE,
    WHOLE_FRACTION,
    WHOLE_SUFFIX,
    TensorPatch,
    unsigned_type,
)
from layerwise_cli.checkpoint.delta.read import index_dtype
from layerwise_cli.checkpoint.delta.v2 import CODEC, FORMAT_V2, SPARSE, chunk_keys, encode_chunks
from layerwise_cli.checkpoint.format.header import DTYPE_SIZES


@dataclass(frozen=True)
class EncodedPatch:
    """One tensor's patch, encoded: its description and its file entries (key, dtype, shape, raw bytes)."""

    patch: TensorPatch
    entries: tuple[tuple[str, str, tuple[int, ...], object], ...]

    @property
    def nbytes(self) -> int:
        return sum(int(data.size) for _, _, _, data in self.entries)


def can_patch(dtype: str) -> bool:
    """Whether tensors of DTYPE can be patched (whole bytes per element; sub-byte dtypes cannot)."""
    return dtype in DTYPE_SIZES


# The format version writers write by default: v2 (`checkpoint.delta.v2`); v1 for readers of older layerwise.
VERSION = 2


def encode_patch(name: str, dtype: str, shape: tuple[int, ...], base, new,
                 whole_fraction: float = WHOLE_FRACTION, version: int = VERSION) -> EncodedPatch | None:
    """The patch that turns BASE into NEW (raw bytes of one tensor), or None when they are equal bit for bit.

    Args:
        name: the tensor's name.
        dtype: its safetensors dtype (`can_patch` must hold).
        shape: its shape (the same in both).
        base: its raw bytes in the base (any bytes-like object or uint8 array).
        new: its raw bytes in the new step.
        whole_fraction: above this fraction of changed values the tensor is stored whole.
        version: the format: 2 (chunks of compressed gaps and differences) or 1.

    Returns:
        v2: a sparse patch, or the whole tensor where that is smaller or more than WHOLE_FRACTION changed; v1: the
        smallest of a bitmap patch, an index patch and the whole tensor.
    """
    import numpy as np  # noqa: PLC0415 - numpy: 0.1 s to import, only where an array is built

    size = DTYPE_SIZES[dtype]
    unsigned = unsigned_type(size)
    old = np.frombuffer(base, dtype=np.uint8).view(unsigned)
    now = np.frombuffer(new, dtype=np.uint8).view(unsigned)
    if old.size != now.size:
        raise ValueError(f"tensor {name}: {old.size} elements in the base, {now.size} in the new step")
    mask = old != now
    changed = int(np.count_nonzero(mask))
    if changed == 0:
        return None
    numel = now.size
    if version == 2:
        return _encode_v2(name, dtype, tuple(shape), old, now, mask, whole_fraction)
    bitmap_bytes = (numel + 7) // 8
    index_type = index_dtype(numel)
    index_bytes = changed * DTYPE_SIZES[index_type]
    sparse_bytes = min(bitmap_bytes, index_bytes) + changed * size
    if changed > whole_fraction * numel or sparse_bytes >= numel * size:
        patch = TensorPatch(name, dtype, tuple(shape), WHOLE, numel)
        return EncodedPatch(patch, ((name + WHOLE_SUFFIX, dtype, tuple(shape), np.frombuffer(new, dtype=np.uint8)),))
    values = now[mask].view(np.uint8)
    if bitmap_bytes <= index_bytes:
        positions = np.packbits(mask, bitorder="little")
        patch = TensorPatch(name, dtype, tuple(shape), BITMAP, changed)
        entry = (name + POSITIONS_SUFFIX, "U8", (bitmap_bytes,), positions)
    else:
        positions = np.flatnonzero(mask).astype(np.int32 if index_type == "I32" else np.int64)
        patch = TensorPatch(name, dtype, tuple(shape), INDEX, changed)
        entry = (name + POSITIONS_SUFFIX, index_type, (changed,), positions.view(np.uint8))
    return EncodedPatch(patch, (entry, (name + VALUES_SUFFIX, dtype, (changed,), values)))


def _encode_v2(name: str, dtype: str, shape: tuple[int, ...], old, now, mask, whole_fraction: float) -> EncodedPatch:
    """The v2 patch of a tensor whose elements (unsigned integers) go from OLD to NOW, MASK where they differ."""
    import numpy as np  # noqa: PLC0415 - numpy: 0.1 s to import, only where an array is built

    positions = np.flatnonzero(mask)
    changed, numel = positions.size, now.size
    chunks = [] if changed > whole_fraction * numel else encode_chunks(positions, now[positions] - old[positions],
                                                                        numel)
    nbytes = sum(len(gaps) + len(diffs) for _, gaps, diffs in chunks)
    if not chunks or nbytes >= now.nbytes:
        patch = TensorPatch(name, dtype, shape, WHOLE, numel)
        return EncodedPatch(patch, ((name + WHOLE_SUFFIX, dtype, shape, now.view(np.uint8)),))
    entries = []
    for index, (_, gaps, diffs) in enumerate(chunks):
        for key, frame in zip(chunk_keys(name, index), (gaps, diffs), strict=True):
            entries.append((key, "U8", (len(frame),), np.frombuffer(frame, dtype=np.uint8)))
    patch = TensorPatch(name, dtype, shape, SPARSE, changed, tuple(chunk for chunk, _, _ in chunks))
    return EncodedPatch(patch, tuple(entries))


def delta_metadata(base_location: str, base_digests: Mapping[str, str], step_digests: Mapping[str, str],
                   patches: list[TensorPatch], version: int = VERSION) -> dict[str, str]:
    """The delta file's `__metadata__`: `format: pt` and `layerwise.delta` (see the module docstring; v2 adds the
    codec, and each sparse patch's chunks as `[start, count]` pairs)."""

    def described(p: TensorPatch) -> dict:
        spec = {"dtype": p.dtype, "shape": list(p.shape), "kind": p.kind, "changed": p.changed}
        if p.kind == SPARSE:
            spec["chunks"] = [[chunk.start, chunk.count] for chunk in p.chunks]
        return spec

    doc = {
        "format": FORMAT_V2 if version == 2 else FORMAT,
        **({"codec": CODEC} if version == 2 else {}),
        "base": {"location": base_location, "digests": dict(sorted(base_digests.items()))},
        "step": {"digests": dict(sorted(step_digests.items()))},
        "tensors": {p.name: described(p) for p in sorted(patches, key=lambda p: p.name)},
    }
    return {"format": "pt", METADATA_KEY: json.dumps(doc, separators=(",", ":"), ensure_ascii=False)}
