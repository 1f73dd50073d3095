"""Write a step as a sparse delta against its base step (`checkpoint.delta`), or say why a full step is due."""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from layerwise_cli.checkpoint.delta.encode import VERSION, EncodedPatch, can_patch, delta_metadata, encode_patch
from layerwise_cli.checkpoint.delta.format import DELTA_FILE, WHOLE_FRACTION, TensorPatch, file_mapping
from layerwise_cli.checkpoint.delta.rebuild import rebuilt_bytes
from layerwise_cli.checkpoint.delta.source import open_step
from layerwise_cli.checkpoint.format.digests import checkpoint_digests, tensor_digest
from layerwise_cli.checkpoint.format.header import TensorEntry, encode_header
from layerwise_cli.checkpoint.sources import Checkpoint
from layerwise_cli.errors import LayerwiseError
from layerwise_cli.writer.spill import Spilled, SpillFile, copy_range, write_all


@dataclass(frozen=True)
class NewTensor:
    """One tensor of the new step: its description, its raw bytes (a uint8 array) and their digest."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    data: object
    digest: str


@dataclass(frozen=True)
class SpilledDelta:
    """The patches of a delta, spilled: what the delta file will hold.

    Attributes:
        base_location: the base step's directory, as the delta names it.
        base_digests: tensor -> digest in the base (proved from its bytes).
        step_digests: tensor -> digest in the new step.
        patches: each patched tensor's patch, with where its entries lie in the spill file.
        delta_bytes: the delta file's tensor bytes.
        full_bytes: the full step's tensor bytes.
        changed_values: values that differ from the base (stored whole or not).
        total_values: values in the step.
        version: the delta format's version (`checkpoint.delta.encode.VERSION` unless asked otherwise).
    """

    base_location: str
    base_digests: dict[str, str]
    step_digests: dict[str, str]
    patches: tuple[tuple[TensorPatch, tuple[tuple[str, str, tuple[int, ...], int, int], ...]], ...]
    delta_bytes: int
    full_bytes: int
    changed_values: int
    total_values: int
    version: int = VERSION


_PATCHES = ".layerwise-patches"


class NoDelta(Exception):
    """Why no delta can be written against the base (a full step is written instead): `str(...)` says why."""


def open_base(base: str | os.PathLike[str]) -> Checkpoint:
    """The base step's headers (a delta's: the step it rebuilds, `delta.source.open_step`).

    Raises:
        NoDelta: the base is not on this machine, or cannot be read (a delta whose chain is broken included).
    """
    path = Path(base)
    if not path.exists():
        raise NoDelta(f"the base {base} does not exist on this machine")
    try:
        return open_step(str(path))
    except LayerwiseError as exc:
        raise NoDelta(f"the base cannot be read: {exc}") from None


def _within_chain(base: Checkpoint, max_chain: int | None) -> Checkpoint:
    """BASE, unless a delta against it would make its chain longer than MAX_CHAIN links (`NoDelta`)."""
    links = len(base.delta.links) if base.delta is not None else 0
    if max_chain is not None and links >= max_chain:
        raise NoDelta(f"its base is the end of a chain of {links} deltas (max_chain {max_chain}): a full step "
                      "starts a new chain")
    return base


class ShardBytes:
    """Raw tensor bytes out of a checkpoint's shard files, each file mapped once."""

    def __init__(self, checkpoint: Checkpoint) -> None:
        self._checkpoint = checkpoint
        self._shards = {shard.name: shard for shard in checkpoint.shards}
        self._maps: dict[str, object] = {}

    def of(self, entry: TensorEntry):
        """ENTRY's raw bytes, as a read-only view of its shard file's mapping; a delta's rebuilt and proved."""
        path = self._checkpoint.shard_path(entry.shard)
        mapped = self._maps.get(entry.shard)
        if mapped is None:
            mapped = self._maps[entry.shard] = file_mapping(path)
        start = self._shards[entry.shard].data_start
        raw = mapped[start + entry.begin:start + entry.end]
        chain = self._checkpoint.delta
        return raw if chain is None else rebuilt_bytes(chain, entry, raw, str(path))


def spill_delta(base: Checkpoint, new: Iterable[NewTensor], spill_fd: int, *,
                whole_fraction: float = WHOLE_FRACTION, version: int = VERSION) -> SpilledDelta:
    """Compare each new tensor with the base's, bit for bit, and append its patch's bytes to SPILL_FD.

    The base's digests are proved from its bytes as they are read: a header digest that its bytes do not
    hash to, like a base without them, is computed from the bytes (a base whose header lies is no base).

    Args:
        base: the base step (`open_base`).
        new: the new step's tensors, every one of them.
        spill_fd: a file open for writing, empty: receives the patches' bytes, one after another.
        whole_fraction: see `checkpoint.delta.encode.encode_patch`.
        version: the format to write: 2, or 1 for readers of older layerwise.

    Returns:
        The spilled delta, once every tensor was compared.

    Raises:
        NoDelta: the steps differ in their tensors, shapes or dtypes, a base header digest is false, or the
            delta would not be smaller than the full step.
    """
    import numpy as np  # noqa: PLC0415 - numpy: 0.1 s to import, only where an array is built

    claimed = checkpoint_digests(base.shards) or {}
    located = {t.name: t for t in base.tensors}
    reader = ShardBytes(base)
    base_digests: dict[str, str] = {}
    step_digests: dict[str, str] = {}
    patches = []
    offset = full = changed = values = 0
    for tensor in new:
        found = located.get(tensor.name)
        if found is None:
            raise NoDelta(f"tensor {tensor.name} is not in the base")
        entry = found
        if (entry.dtype, entry.shape) != (tensor.dtype, tensor.shape):
            raise NoDelta(f"tensor {tensor.name} is {tensor.dtype}{list(tensor.shape)}, the base's "
                          f"{entry.dtype}{list(entry.shape)}")
        if not can_patch(tensor.dtype):
            raise NoDelta(f"tensor {tensor.name} has dtype {tensor.dtype}, which a delta cannot patch")
        try:
            old = reader.of(entry)  # a delta base's rebuilt and proved by its digests
        except LayerwiseError as exc:
            raise NoDelta(f"the base cannot be proved: {exc}") from None
        digest = tensor_digest(entry.dtype, entry.shape, old)
        if tensor.name in claimed and claimed[tensor.name] != digest:
            raise NoDelta(f"the base cannot be proved: tensor {tensor.name}'s bytes do not hash to its header "
                          "digest")
        base_digests[tensor.name] = digest
        step_digests[tensor.name] = tensor.digest
        full += entry.nbytes
        values += int(np.prod(entry.shape))
        encoded = encode_patch(tensor.name, tensor.dtype, tensor.shape, old, tensor.data, whole_fraction, version)
        if encoded is not None:
            placed = _spill_patch(encoded, spill_fd, offset)
            offset += encoded.nbytes
            changed += encoded.patch.changed
            patches.append((encoded.patch, placed))
    missing = sorted(set(located) - set(step_digests))
    if missing:
        raise NoDelta(f"tensor {missing[0]} of the base is not in the new step")
    if not step_digests:
        raise NoDelta("the new step holds no tensors")
    if offset >= full:
        raise NoDelta(f"a delta ({offset} bytes) would not be smaller than the full step ({full} bytes)")
    return SpilledDelta(str(Path(base.source).absolute()), base_digests, step_digests, tuple(patches), offset, full,
                        changed, values, version)


def _spill_patch(encoded: EncodedPatch, fd: int, offset: int) -> tuple[tuple[str, str, tuple[int, ...], int, int], ...]:
    placed = []
    for key, dtype, shape, data in encoded.entries:
        raw = memoryview(data).cast("B")
        write_all(fd, raw, offset)
        placed.append((key, dtype, shape, offset, len(raw)))
        offset += len(raw)
    return tuple(placed)


def write_delta_file(out: Path, delta: SpilledDelta, spill_fd: int) -> Path:
    """Write OUT/delta.safetensors from DELTA and its spilled patches; fsync'd.

    Returns:
        The file written.
    """
    entries: list[TensorEntry] = []
    sources: list[tuple[int, int]] = []
    begin = 0
    for _, placed in sorted(delta.patches, key=lambda p: p[0].name):
        for key, dtype, shape, offset, nbytes in placed:
            entries.append(TensorEntry(key, dtype, shape, DELTA_FILE, begin, begin + nbytes))
            sources.append((offset, nbytes))
            begin += nbytes
    metadata = delta_metadata(delta.base_location, delta.base_digests, delta.step_digests,
                              [patch for patch, _ in delta.patches], delta.version)
    header = encode_header(entries, metadata)
    path = out / DELTA_FILE
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        write_all(fd, header, 0)
        at = len(header)
        for offset, nbytes in sources:
            copy_range(spill_fd, fd, offset, at, nbytes)
            at += nbytes
        os.fsync(fd)
    finally:
        os.close(fd)
    return path


def checkpoint_tensors(checkpoint: Checkpoint) -> Iterator[NewTensor]:
    """A full checkpoint's tensors as `NewTensor`s, each hashed from its bytes (views of the shard files)."""
    reader = ShardBytes(checkpoint)
    for shard in checkpoint.shards:
        for entry in shard.tensors:
            data = reader.of(entry)
            yield NewTensor(entry.name, entry.dtype, entry.shape, data,
                            tensor_digest(entry.dtype, entry.shape, data))


@dataclass(frozen=True)
class DeltaSummary:
    """What a delta written against a base holds.

    Attributes:
        base: the base step's directory, as the delta names it.
        patched: tensors the delta patches (the others are the base's).
        changed_values: values that differ from the base.
        total_values: values in the step.
        delta_bytes: the delta file's tensor bytes.
        full_bytes: the full step's tensor bytes.
    """

    base: str
    patched: int
    changed_values: int
    total_values: int
    delta_bytes: int
    full_bytes: int


# Links `save_checkpoint` lets a chain grow to before it writes a full step: every reload that rebuilds a step
# (a new host, a server catching up, the CPU's packed linear layers) decodes each link of its chain, and every
# open of a chain by URL names each link's objects. A full step every few steps keeps both bounded.
MAX_CHAIN_WRITTEN = 8


def write_delta_from_spill(base, spilled: list[Spilled], spill: SpillFile, tmp: Path,
                           whole_fraction: float | None,
                           max_chain: int | None = None) -> tuple[DeltaSummary | None, str | None]:
    """Write TMP/delta.safetensors against BASE from the spilled tensors; (None, why) when a full step is due.

    SPILLED: `save_checkpoint`'s tensors as they lie in SPILL (with their digests). MAX_CHAIN: the most links
    the new delta's chain may have (None: no bound below the readers' `MAX_CHAIN`).
    """
    mapped = file_mapping(spill.path)
    tensors = (NewTensor(s.name, s.dtype, s.shape, mapped[s.offset:s.offset + s.nbytes], s.digest)
               for s in spilled)
    return write_delta_against(base, tensors, tmp, whole_fraction, max_chain=max_chain)


def write_delta_against(base, tensors: Iterable[NewTensor], out: Path, whole_fraction: float | None, *,
                        version: int = VERSION, max_chain: int | None = None) -> tuple[DeltaSummary | None, str | None]:
    """Write OUT/delta.safetensors of TENSORS against BASE in format VERSION; (summary, None), or (None, why) when a
    full step is due (MAX_CHAIN: BASE is already that many links from its chain's full step).

    The patches are spilled to a file in OUT first (removed after), then written in the delta's order.
    """
    patches_path = out / _PATCHES
    fd = os.open(patches_path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        try:
            delta = spill_delta(_within_chain(open_base(base), max_chain), tensors, fd,
                                whole_fraction=WHOLE_FRACTION if whole_fraction is None else whole_fraction,
                                version=version)
        except NoDelta as why:
            return None, str(why)
        write_delta_file(out, delta, fd)
    finally:
        os.close(fd)
        os.unlink(patches_path)
    return delta_summary(delta), None


def delta_summary(delta: SpilledDelta) -> DeltaSummary:
    """The summary of a written delta."""
    return DeltaSummary(delta.base_location, len(delta.patches), delta.changed_values, delta.total_values,
                        delta.delta_bytes, delta.full_bytes)
