"""Sparse delta checkpoints: one step stored as the values that changed against an exact base step.

The file
--------
A delta is one safetensors file, `delta.safetensors`, in a step directory of
its own (beside `config.json` and the completion marker). Any safetensors tool
opens it. Two versions of the format are read (the metadata's `format` says
which): v2, which layerwise writes, keeps each patched tensor's changes as
zstd-compressed gaps and bit differences in chunks (`checkpoint.delta.v2`,
kind `sparse`), or the whole tensor as below. Format v1, described here, holds
for each tensor of the step that differs from the base (bit for bit) either

- `<tensor>::positions` and `<tensor>::values`: where the tensor changed (in
  its flattened, row-major order) and the new values there, in the tensor's own
  dtype; positions are either a *bitmap* (U8, one bit per element, least
  significant bit first, `ceil(n / 8)` bytes, padding bits zero) or an *index*
  (I32, or I64 for a tensor of 2**31 elements or more: the changed positions,
  strictly increasing), whichever is smaller for that tensor; or
- `<tensor>::whole`: the whole new tensor, when more than `WHOLE_FRACTION` of
  it changed or the sparse form would not be smaller.

Why these two: a training step with a small learning rate changes values
scattered over the whole tensor, so runs of changed values are about one long
and run-length pairs cost 8 bytes per changed value, twice an int32 index. An
index costs 4 bytes per changed value and a bitmap 1/8 byte per element
whatever changed: the index is smaller below 1/32 (3.1%) changed, the bitmap
above. Taking the smaller per tensor keeps a bf16 delta at about 3% of the full
step at 1% changed, 9% at 3% and 16% at 10% (positions plus values, over
2 bytes per element).

The metadata
------------
The header's `__metadata__` holds `format: pt` and `layerwise.delta`, a JSON
object:

    {"format": "layerwise-delta/v1",      (v2: "layerwise-delta/v2", and "codec": "zstd")
     "base": {"location": "<the base step's directory>", "digests": {"<tensor>": "<digest>", ...}},
     "step": {"digests": {"<tensor>": "<digest>", ...}},
     "tensors": {"<tensor>": {"dtype": "BF16", "shape": [..], "kind": "index|bitmap|whole", "changed": k}, ...}}
    (v2: "kind": "sparse|whole", and a sparse patch's "chunks": [[start, count], ...])

`base.digests` and `step.digests` name every tensor of the step (the same
names: a delta never adds, drops, reshapes or retypes a tensor), each with its
xxh3-128 digest (`checkpoint.digests.tensor_digest`): the base's, which ties
the delta to its exact base (a tensor the base holds differently is refused),
and the full step's, which proves what a rebuild produced. `tensors` names the
tensors the delta patches, and no other; every other tensor's step digest
equals its base digest.

Reading
-------
`delta.read.read_delta` validates the header against the metadata (every
patched tensor has exactly its entries, of the right dtype and length); the
positions are validated when read (`Delta.positions`): in range, strictly
increasing, as many as the values, padding bits zero (a bitmap's bits counted,
`Delta.validate`). Every failure is one `LayerwiseError` naming
the file and the tensor.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from math import prod
from pathlib import Path

from layerwise_cli.checkpoint.delta.buffers import RebuildBuffers
from layerwise_cli.checkpoint.delta.v2 import (
    SPARSE,
    BadChunk,
    Chunk,
    check_chunk,
    chunk_keys,
    decode_diffs,
    decode_positions,
)
from layerwise_cli.checkpoint.format.header import DTYPE_SIZES, ShardHeader, TensorEntry
from layerwise_cli.errors import LayerwiseError

DELTA_FILE = "delta.safetensors"
METADATA_KEY = "layerwise.delta"
FORMAT = "layerwise-delta/v1"
# A tensor with more than this fraction of its values changed is stored whole.
WHOLE_FRACTION = 0.5

BITMAP = "bitmap"
INDEX = "index"
WHOLE = "whole"
KINDS = (BITMAP, INDEX, WHOLE)
# The kinds of format v2 (`checkpoint.delta.v2`): a sparse patch in chunks, or the whole tensor as in v1.
KINDS_V2 = (SPARSE, WHOLE)
POSITIONS_SUFFIX = "::positions"
VALUES_SUFFIX = "::values"
WHOLE_SUFFIX = "::whole"


@dataclass(frozen=True)
class TensorPatch:
    """One patched tensor as the delta's metadata describes it."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    kind: str  # BITMAP, INDEX or WHOLE (v1); SPARSE or WHOLE (v2)
    changed: int  # values that differ from the base (every value for WHOLE)
    chunks: tuple[Chunk, ...] = ()  # SPARSE: its chunks, in order

    @property
    def numel(self) -> int:
        return prod(self.shape)

    def entry_keys(self) -> tuple[str, ...]:
        """The names of this patch's entries in the file."""
        if self.kind == WHOLE:
            return (self.name + WHOLE_SUFFIX,)
        if self.kind == SPARSE:
            return tuple(key for index in range(len(self.chunks)) for key in chunk_keys(self.name, index))
        return (self.name + POSITIONS_SUFFIX, self.name + VALUES_SUFFIX)


@dataclass(frozen=True)
class Delta:
    """A validated delta file: its header, what it patches, and the digests of its base and of the full step.

    Attributes:
        path: the delta file.
        header: its safetensors header.
        base_location: where the base step was when the delta was written (as the writer named it).
        base_digests: tensor -> digest in the base, for every tensor of the step.
        step_digests: tensor -> digest in the full step the delta rebuilds, for every tensor.
        patches: tensor -> its patch, for the tensors that changed.
        version: the format's version: 1 (positions and new values, raw) or 2 (`checkpoint.delta.v2`).
    """

    path: Path
    header: ShardHeader
    base_location: str
    base_digests: Mapping[str, str]
    step_digests: Mapping[str, str]
    patches: Mapping[str, TensorPatch]
    version: int = 1
    _entries: dict[str, TensorEntry] = field(default_factory=dict, repr=False, compare=False)
    _mapped: dict[str, object] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._entries.update({t.name: t for t in self.header.tensors})

    @property
    def where(self) -> str:
        return str(self.path)

    @property
    def changed_values(self) -> int:
        """Values stored, over every patch."""
        return sum(p.changed for p in self.patches.values())

    def patch_nbytes(self, name: str) -> int:
        """The bytes tensor NAME's patch takes in the file (positions and values, or the whole tensor); 0: none."""
        patch = self.patches.get(name)
        return 0 if patch is None else sum(self._entries[key].nbytes for key in patch.entry_keys())

    def raw(self, key: str):
        """The raw bytes of one entry of the file, as a read-only numpy uint8 array (a view of its mapping)."""
        entry = self._entries[key]
        if "map" not in self._mapped:
            self._mapped["map"] = file_mapping(self.path)
        return self._mapped["map"][self.header.data_start + entry.begin:self.header.data_start + entry.end]

    def positions(self, name: str):
        """The changed positions of patched tensor NAME (strictly increasing, in range); validated here.

        An index is returned as stored (int32 or int64, a view of the file's mapping), a bitmap as int64. An
        index validated once (`validate`, at pre-flight) is not checked again: the mapping is read-only.

        Raises:
            LayerwiseError: out of range, not increasing, padding bits set, or not as many as the values.
        """
        import numpy as np  # noqa: PLC0415 - numpy: 0.1 s to import, only where an array is built

        patch = self.patches[name]
        n = patch.numel
        if patch.kind == WHOLE:
            return np.arange(n, dtype=np.int64)
        if patch.kind == SPARSE:
            return np.concatenate([positions for _, positions, _ in self.changes(name)])
        validated = self._mapped.setdefault("validated", set())
        raw = self.raw(name + POSITIONS_SUFFIX)
        if patch.kind == INDEX and name in validated:
            return raw.view(self._index_type(name))
        if patch.kind == BITMAP:
            self._check_bitmap(name, raw)
            # Its set bits, in order: a pass over every element (as bools, twice as fast as over bytes).
            found = np.flatnonzero(np.unpackbits(raw, bitorder="little")[:n].view(np.bool_))
        else:
            # Read where they are (an int32 index stays int32: every use takes it as it is).
            found = raw.view(self._index_type(name))
            if found.size and (found[0] < 0 or found[-1] >= n):
                bad = int(found[0] if found[0] < 0 else found[-1])
                self._bad(name, f"position {bad} is out of range for its {n} elements")
            # Strictly increasing from an in-range first to an in-range last: every position is in range.
            if found.size > 1 and not (found[1:] > found[:-1]).all():
                self._bad(name, "positions are not strictly increasing")
        if found.size != patch.changed:
            self._bad(name, f"{found.size} positions for {patch.changed} values")
        validated.add(name)
        return found

    def _check_bitmap(self, name: str, raw) -> None:
        """Bitmap RAW of patch NAME sets no bit past its elements, and as many bits as it stores values (the header
        check fixed its length); counted, not decoded."""
        import numpy as np  # noqa: PLC0415 - numpy: 0.1 s to import, only where an array is built

        patch = self.patches[name]
        spare = 8 * raw.size - patch.numel
        if spare and int(raw[-1]) >> (8 - spare):
            self._bad(name, f"bitmap sets bits past its {patch.numel} elements")
        count = int(np.bitwise_count(raw).sum(dtype=np.int64))
        if count != patch.changed:
            self._bad(name, f"{count} positions for {patch.changed} values")

    def _index_type(self, name: str):
        """The numpy integer type tensor NAME's index of positions is stored in (I32 or I64)."""
        import numpy as np  # noqa: PLC0415 - numpy: 0.1 s to import, only where an array is built

        return np.int32 if self._entries[name + POSITIONS_SUFFIX].dtype == "I32" else np.int64

    def apply(self, name: str, base, buffers: RebuildBuffers | None = None):
        """The new bytes of tensor NAME from its base bytes BASE (a numpy uint8 array); BASE itself when unpatched.

        The result is written into a buffer from BUFFERS (reused once free) where one is given, else a new one, and
        patched as one span of the whole tensor (`apply_spans`).

        Raises:
            LayerwiseError: the positions are invalid (`positions`), or BASE is not the tensor's size.
        """
        import numpy as np  # noqa: PLC0415 - numpy: 0.1 s to import, only where an array is built

        patch = self.patches.get(name)
        if patch is None:
            return base
        size = DTYPE_SIZES[patch.dtype]
        if base.size != patch.numel * size:
            self._bad(name, f"the base holds {base.size} bytes, the patch needs {patch.numel * size}")
        out = np.empty(base.size, dtype=np.uint8) if buffers is None else buffers.take(base.size)
        if patch.kind != WHOLE:  # a whole patch writes every byte
            np.copyto(out, base)
        self.apply_spans(name, [(out.view(unsigned_type(size)), 0)])
        return out

    def changes(self, name: str):
        """Each chunk of v2 patch NAME decoded, in order: (chunk, positions, differences of the bits).

        Positions are int64 and strictly increasing; differences are new minus old bits modulo 2**bits, as the
        unsigned integer type of the element's size.

        Raises:
            LayerwiseError: a chunk is corrupt, truncated or decodes to another count than its header's.
        """
        for index, chunk in enumerate(self.patches[name].chunks):
            yield (chunk, *self._chunk_changes(name, index))

    def _chunk_changes(self, name: str, index: int):
        """Chunk INDEX of v2 patch NAME decoded: its positions and differences (`changes`)."""
        patch = self.patches[name]
        chunk = patch.chunks[index]
        gaps, diffs = (self.raw(key) for key in chunk_keys(name, index))
        try:
            return decode_positions(chunk, gaps), decode_diffs(chunk, diffs, unsigned_type(DTYPE_SIZES[patch.dtype]))
        except BadChunk as exc:
            self._bad(name, f"chunk {index} (elements {chunk.start} to {chunk.end}): {exc}")

    def apply_spans(self, name: str, spans) -> None:
        """Patch tensor NAME's elements in each of SPANS in place: (array, start) pairs, each array holding the
        elements [start, start + array.size) as they are in the base, as the unsigned integer type of the
        element's size (writable numpy arrays).

        Only the changes inside the spans are applied: of a v2 patch only the chunks under a span are decoded,
        each once; v1 positions are read once. What a sample of a few windows of the step needs
        (`rebuild.rebuilt_sample`), not the whole tensor.

        Raises:
            LayerwiseError: a chunk under a span is corrupt, or the positions are invalid (`positions`).
        """
        patch = self.patches.get(name)
        if patch is None:
            return
        if patch.kind == WHOLE:
            whole = self.raw(name + WHOLE_SUFFIX)
            for span, start in spans:
                size = span.dtype.itemsize
                span[:] = whole[start * size:(start + span.size) * size].view(span.dtype)
            return
        if patch.kind == SPARSE:
            for index, chunk in enumerate(patch.chunks):
                under = [(span, start) for span, start in spans
                         if chunk.start < start + span.size and chunk.end > start]
                if under:
                    positions, diffs = self._chunk_changes(name, index)
                    for span, at, first, stop in _changes_in(positions, under):
                        span[at] += diffs[first:stop]  # modulo 2**bits, as in `apply`
            return
        values = self.raw(name + VALUES_SUFFIX)
        for span, at, first, stop in _changes_in(self.positions(name), spans):
            span[at] = values.view(span.dtype)[first:stop]

    def validate(self) -> None:
        """Check every patch's positions, as a reload does before it applies them (`positions`): an index read
        whole; a bitmap's bits counted and its padding read, its positions decoded only when applied; a v2
        chunk's frames read from their headers (whole, with the metadata's count), decoded only when applied."""
        for name, patch in self.patches.items():
            if patch.kind == SPARSE:
                self._check_chunks(name, patch)
            elif patch.kind == BITMAP:
                self._check_bitmap(name, self.raw(name + POSITIONS_SUFFIX))
            elif patch.kind == INDEX:
                self.positions(name)

    def _check_chunks(self, name: str, patch: TensorPatch) -> None:
        """Every chunk of v2 patch NAME, from its frames' headers (`v2.check_chunk`; no decoding)."""
        size = DTYPE_SIZES[patch.dtype]
        for index, chunk in enumerate(patch.chunks):
            try:
                check_chunk(chunk, *(self.raw(key) for key in chunk_keys(name, index)), size)
            except BadChunk as exc:
                self._bad(name, f"chunk {index} (elements {chunk.start} to {chunk.end}): {exc}")

    def refuse_nonfinite(self) -> None:
        """Refuse the delta if a new value it stores (sparse or whole) is NaN or Inf: the reload's check, early.

        A v2 sparse patch stores differences from the base, not values: a rebuilt tensor is checked when it is
        handed over, a tensor patched in place as it is written (`delta_patch`).

        Raises:
            LayerwiseError: naming the file, the tensor and the counts.
        """
        from layerwise_cli.checkpoint.format.finite import ByteScan  # noqa: PLC0415 - `--help` stays fast: loaded when the command runs

        for name, patch in sorted(self.patches.items()):
            if patch.kind == SPARSE:
                continue  # differences, not values: the new values are checked as they are applied
            scan = ByteScan(patch.dtype)
            scan.update(self.raw(name + (WHOLE_SUFFIX if patch.kind == WHOLE else VALUES_SUFFIX)))
            if scan.nan or scan.inf:
                raise LayerwiseError(f"tensor {name}: the delta's new values hold {scan.nan} NaN and {scan.inf} Inf; "
                                     "refusing to load it (--allow-nonfinite loads it anyway)", where=self.where)

    def _bad(self, name: str, what: str):
        raise LayerwiseError(f"tensor {name}: {what} (corrupt delta)", where=self.where)


def file_mapping(path: str | os.PathLike[str]):
    """A whole file as a read-only numpy uint8 array (a memory mapping: pages are read as they are touched)."""
    import numpy as np  # noqa: PLC0415 - numpy: 0.1 s to import, only where an array is built

    if os.path.getsize(path) == 0:
        return np.zeros(0, dtype=np.uint8)
    return np.memmap(path, dtype=np.uint8, mode="r")


def unsigned_type(size: int):
    """The numpy unsigned integer type of SIZE bytes: what a patch copies elements of any dtype as."""
    import numpy as np  # noqa: PLC0415 - numpy: 0.1 s to import, only where an array is built

    return {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[size]


def _changes_in(positions, spans):
    """For each (array, start) of SPANS, the changed POSITIONS inside it: (array, their indices in it, and the
    first and last-plus-one index of them in POSITIONS), POSITIONS being strictly increasing."""
    import numpy as np  # noqa: PLC0415 - numpy: 0.1 s to import, only where an array is built

    for span, start in spans:
        first, stop = (int(i) for i in np.searchsorted(positions, (start, start + span.size)))
        inside = positions[first:stop]
        yield span, (inside - start if start else inside), first, stop  # a whole tensor's: a view, not a copy
