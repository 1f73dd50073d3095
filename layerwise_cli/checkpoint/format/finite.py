"""Find NaN and Inf in tensors cheaply, as they stream (reload, `reorder --verify`, `inspect-order --scan`)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from layerwise_cli.checkpoint.format.chunks import CHUNK_BYTES, read_chunks
from layerwise_cli.checkpoint.format.digests import DigestMismatch, TensorHasher, header_digests
from layerwise_cli.checkpoint.format.dtypes import dtype_name
from layerwise_cli.errors import LayerwiseError, describe_exception

# Floating dtypes torch reduces natively: a sum is non-finite when any element is
# (NaN and Inf propagate through every partial sum), and costs one read of the
# tensor (about 9 GB/s on one CPU core here, a quarter of a copy). A finite
# tensor whose sum overflows is caught by the exact count, which then finds none.
_SUMMED = ("F64", "F32", "F16", "BF16")
# One-byte floats, by their bit patterns (torch has no fast CPU kernels for them):
# (mask, value): a byte b is non-finite when b & mask == value. E4M3FN has NaN
# only (S.1111.111), E5M2 Inf and NaN (S.11111.xx), the FNUZ kinds NaN only
# (1.0000.000, "negative zero"), E8M0 NaN only (0xFF).
_BYTE_PATTERNS = {
    "F8_E4M3": (0x7F, 0x7F),
    "F8_E5M2": (0x7C, 0x7C),
    "F8_E4M3FNUZ": (0xFF, 0x80),
    "F8_E5M2FNUZ": (0xFF, 0x80),
    "F8_E8M0": (0xFF, 0xFF),
}
# Elements per chunk when counting exactly (bounds the boolean temporaries).
_COUNT_CHUNK = 1 << 24


@dataclass(frozen=True)
class NonFinite:
    """A tensor that holds NaN or Inf values."""

    name: str
    shard: str
    nan: int
    inf: int

    def describe(self) -> str:
        return f"tensor {self.name} has {self.nan} NaN and {self.inf} Inf values"

    def to_dict(self) -> dict:
        return {"name": self.name, "shard": self.shard, "nan": self.nan, "inf": self.inf}


def refusal(found: NonFinite, where: str) -> LayerwiseError:
    """The one-line error for a non-finite tensor in a reload, saying how to load it anyway."""
    return LayerwiseError(f"{found.describe()}; refusing (use --allow-nonfinite to load anyway)", where=where)


def suspect_flag(tensor, dtype: str | None = None):
    """A 0-dim bool tensor on the tensor's device: True when the tensor may hold NaN/Inf, else it holds none.

    Asynchronous on an accelerator (nothing is read back). None for dtypes that
    cannot hold NaN or Inf (integers, bool, packed 4- and 6-bit floats).
    """
    import torch  # noqa: PLC0415 - torch: heavy, only where a tensor is touched

    dtype = dtype or dtype_name(tensor)
    if dtype in _SUMMED:
        if tensor.numel() == 0:
            return None
        return ~torch.isfinite(tensor.sum())
    if dtype in _BYTE_PATTERNS:
        if tensor.numel() == 0:
            return None
        mask, value = _BYTE_PATTERNS[dtype]
        raw = tensor.reshape(-1).view(torch.uint8)
        if mask == 0xFF:
            # One exact pattern: 0x80 is the smallest int8 value, 0xFF the largest uint8.
            return (raw.view(torch.int8).amin() == -128) if value == 0x80 else (raw.amax() == 0xFF)
        return (raw & mask).amax() == value
    return None


def count_nonfinite(tensor, dtype: str | None = None) -> tuple[int, int]:
    """(NaN count, Inf count) of a tensor, exactly, in chunks. (0, 0) for dtypes without them."""
    import torch  # noqa: PLC0415 - torch: heavy, only where a tensor is touched

    dtype = dtype or dtype_name(tensor)
    flat = tensor.reshape(-1)
    nan = inf = 0
    if dtype in _SUMMED:
        for start in range(0, flat.numel(), _COUNT_CHUNK):
            chunk = flat[start:start + _COUNT_CHUNK]
            nan += int(torch.isnan(chunk).sum())
            inf += int(torch.isinf(chunk).sum())
    elif dtype in _BYTE_PATTERNS:
        mask, value = _BYTE_PATTERNS[dtype]
        raw = flat.view(torch.uint8)
        for start in range(0, raw.numel(), _COUNT_CHUNK):
            chunk = raw[start:start + _COUNT_CHUNK]
            hit = (chunk & mask) == value
            if dtype == "F8_E5M2":  # exponent all ones: Inf with a zero mantissa, else NaN
                infinite = hit & ((chunk & 0x03) == 0)
                inf += int(infinite.sum())
                nan += int((hit & ~infinite).sum())
            else:
                nan += int(hit.sum())
    return nan, inf


def any_suspect(tensors: Iterable[object]) -> bool:
    """Whether any of the tensors may hold NaN or Inf (`suspect_flag`), with one read-back."""
    return _any_flag(suspect_flag(tensor) for tensor in tensors)


def _any_flag(flags: Iterable[object]) -> bool:
    """Whether any of the `suspect_flag` results (None: cannot hold NaN/Inf) is set: one read-back for all."""
    import torch  # noqa: PLC0415 - torch: heavy, only where a tensor is touched

    present = [flag for flag in flags if flag is not None]
    return bool(present) and bool(torch.stack(present).any())


def first_nonfinite(tensors: Iterable[tuple[str, str, object]]) -> NonFinite | None:
    """The first of (name, shard, tensor) that holds NaN or Inf, or None.

    One read-back for the whole group (cheap suspicion flags first), then an
    exact count only for suspects. On an accelerator, call it under the stream
    that produced the tensors.
    """
    group = [(name, shard, tensor, suspect_flag(tensor)) for name, shard, tensor in tensors]
    if not _any_flag(flag for *_, flag in group):
        return None
    for name, shard, tensor, flag in group:
        if flag is not None and bool(flag):
            nan, inf = count_nonfinite(tensor)
            if nan or inf:
                return NonFinite(name, shard, nan, inf)
    return None


def first_nonfinite_shared(tensors: list[tuple[str, str, object]], submit) -> NonFinite | None:
    """`first_nonfinite` for host tensors, with the second half of every tensor's first pass on another thread.

    SUBMIT is an executor's `submit` (one thread on another core): it runs the
    suspicion pass over the tensors' second halves while this thread runs it
    over their first halves. Only a suspect group is then counted exactly.
    """
    halves = []
    for _, _, tensor in tensors:
        flat = tensor.reshape(-1)
        middle = flat.numel() // 2
        halves.append((flat[:middle], flat[middle:]))
    other = submit(any_suspect, [second for _, second in halves])
    mine = any_suspect([first for first, _ in halves])
    if not other.result() and not mine:
        return None
    return first_nonfinite(tensors)


# Raw little-endian bytes (reorder --verify, inspect-order --scan) are checked by
# bit patterns with numpy, without torch (its import alone costs 250 MiB here):
# (element width in bytes, mask, value, mantissa mask). An element x is
# non-finite when x & mask == value; with a mantissa mask it is NaN when
# x & mantissa != 0, else Inf; without one it is NaN. About 5 GB/s on one core
# here, against 0.9 GB/s for the SHA-256 it runs beside.
_BIT_PATTERNS = {
    "F64": (8, 0x7FF0000000000000, 0x7FF0000000000000, 0x000FFFFFFFFFFFFF),
    "F32": (4, 0x7F800000, 0x7F800000, 0x007FFFFF),
    "F16": (2, 0x7C00, 0x7C00, 0x03FF),
    "BF16": (2, 0x7F80, 0x7F80, 0x007F),
    "F8_E5M2": (1, 0x7C, 0x7C, 0x03),
    "F8_E4M3": (1, 0x7F, 0x7F, None),
    "F8_E4M3FNUZ": (1, 0xFF, 0x80, None),
    "F8_E5M2FNUZ": (1, 0xFF, 0x80, None),
    "F8_E8M0": (1, 0xFF, 0xFF, None),
}


def nonfinite_elements(data, dtype: str):
    """The indexes of the NaN and Inf elements of DATA (raw little-endian bytes of whole DTYPE elements), as int64;
    None for a dtype without NaN or Inf to find."""
    pattern = _BIT_PATTERNS.get(dtype)
    if pattern is None:
        return None
    import numpy as np  # noqa: PLC0415 - numpy: 0.1 s to import, only where an array is built

    width, mask, value, _ = pattern
    x = np.frombuffer(data, dtype=f"<u{width}", count=len(data) // width)
    return np.flatnonzero(np.bitwise_and(x, mask) == value).astype(np.int64)


class ByteScan:
    """Non-finite counts of one tensor whose raw little-endian bytes arrive in chunks."""

    def __init__(self, dtype: str) -> None:
        self.dtype = dtype
        self._pattern = _BIT_PATTERNS.get(dtype)
        self.checked = self._pattern is not None
        self._carry = b""
        self.nan = 0
        self.inf = 0

    def update(self, data) -> None:
        """Add the next bytes of the tensor (any length; a partial element waits for the next call)."""
        if self._pattern is None:
            return
        import numpy as np  # noqa: PLC0415 - numpy: 0.1 s to import, only where an array is built

        width, mask, value, mantissa = self._pattern
        if self._carry:
            data = self._carry + bytes(data)
        usable = len(data) - len(data) % width
        self._carry = bytes(data[usable:])
        if not usable:
            return
        x = np.frombuffer(data, dtype=f"<u{width}", count=usable // width)
        masked = np.bitwise_and(x, mask)
        if value == mask:
            # The masked value cannot exceed the mask: one reduction finds any.
            if masked.max() != mask:
                return
        elif not (masked == value).any():
            return
        hit = masked == value
        if mantissa is None:
            self.nan += int(np.count_nonzero(hit))
            return
        nan = hit & (np.bitwise_and(x, mantissa) != 0)
        self.nan += int(np.count_nonzero(nan))
        self.inf += int(np.count_nonzero(hit)) - int(np.count_nonzero(nan))

    @property
    def found(self) -> bool:
        return bool(self.nan or self.inf)


@dataclass(frozen=True)
class ScanReport:
    """What a data scan of a whole checkpoint found."""

    tensors: int
    tensors_checked: int
    bytes: int
    seconds: float
    nonfinite: tuple[NonFinite, ...]
    # Tensors whose bytes were hashed against their shard header's `layerwise.digests`, and those that differ.
    digests_checked: int = 0
    digest_mismatches: tuple[DigestMismatch, ...] = ()

    def to_dict(self) -> dict:
        return {"tensors": self.tensors, "tensors_checked": self.tensors_checked, "bytes": self.bytes,
                "seconds": self.seconds, "nonfinite": [found.to_dict() for found in self.nonfinite],
                "digests_checked": self.digests_checked,
                "digest_mismatches": [found.to_dict() for found in self.digest_mismatches]}


def scan_checkpoint(checkpoint, progress=None) -> ScanReport:
    """Read every tensor's bytes and count its NaN and Inf values; check header digests in the same pass.

    A shard whose header carries `layerwise.digests` has every tensor's bytes
    hashed as they are read (see `checkpoint.digests`) and compared with it.

    Args:
        checkpoint: an opened `Checkpoint` (local, or a Hub source: each shard
            is then fetched through the Hub cache).
        progress: called as `progress(bytes_done, bytes_total)` while reading.

    Returns:
        The tensors read and those holding non-finite values, in file order.
    """
    start = time.perf_counter()
    total = checkpoint.total_bytes
    done = checked = hashed = 0
    found: list[NonFinite] = []
    mismatches: list[DigestMismatch] = []
    buf = bytearray(CHUNK_BYTES)
    for shard in checkpoint.shards:
        path = _shard_file(checkpoint, shard.name)
        digests = header_digests(shard, where=str(path))
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as exc:
            raise describe_exception(exc, where=str(path)) from exc
        try:
            for entry in sorted(shard.tensors, key=lambda t: t.begin):
                scan = ByteScan(entry.dtype)
                checked += scan.checked
                hasher = TensorHasher(entry.dtype, entry.shape) if digests is not None else None
                if scan.checked or hasher is not None:
                    read = 0
                    for view in read_chunks(fd, shard.data_start + entry.begin, entry.nbytes, buf,
                                            tensor=entry.name, where=str(path)):
                        scan.update(view)
                        if hasher is not None:
                            hasher.update(view)
                        read += len(view)
                        if progress is not None:
                            progress(done + read, total)
                done += entry.nbytes
                if scan.found:
                    found.append(NonFinite(entry.name, shard.name, scan.nan, scan.inf))
                if hasher is not None and digests is not None:
                    hashed += 1
                    if hasher.hexdigest() != digests[entry.name]:
                        mismatches.append(DigestMismatch(entry.name, shard.name, digests[entry.name],
                                                         hasher.hexdigest()))
        finally:
            os.close(fd)
    if progress is not None:
        progress(total, total)
    return ScanReport(tensors=len(checkpoint.tensors), tensors_checked=checked, bytes=total,
                      seconds=time.perf_counter() - start, nonfinite=tuple(found), digests_checked=hashed,
                      digest_mismatches=tuple(mismatches))


def _shard_file(checkpoint, name: str):
    if checkpoint.local_dir is not None:
        return checkpoint.shard_path(name)
    from huggingface_hub import hf_hub_download  # noqa: PLC0415 - huggingface_hub: 0.4 s to import, only for a Hub source

    try:
        return Path(hf_hub_download(checkpoint.source, name, revision=checkpoint.revision))
    except Exception as exc:
        raise describe_exception(exc, where=f"{checkpoint.source}/{name}") from exc
