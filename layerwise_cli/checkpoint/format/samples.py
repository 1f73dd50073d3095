"""Spot samples of a tensor's bytes: a few fixed windows hashed together, to test a header digest's claim cheaply.

A header digest (`checkpoint.digests`) is the file's claim about itself:
whatever rewrites a shard's bytes can carry the old `__metadata__` along. So a
layer is never skipped on a header digest alone. When a layer is loaded, the
sample digest of each of its tensors is recorded with it; before it is
skipped, the same windows are read from the new file and must hash the same.

The windows
-----------
A tensor of `n` bytes is sampled in `WINDOWS` windows of `WINDOW_BYTES`
bytes, at offsets `(n - WINDOW_BYTES) * i // (WINDOWS - 1)` for i = 0 ..
WINDOWS-1 (its head, its tail, its middle, and evenly between); a tensor of at
most `WINDOWS * WINDOW_BYTES` bytes is taken whole. The offsets depend only on
the tensor's size, never on where it lies in a file, so a resharded copy
samples the same bytes. The sample digest is the xxh3-128 of the tensor's
description (`digests.tensor_prefix`), a version tag, and the windows in order.

What it catches and what it does not: any rewrite of a tensor's values that
touches a sampled window (a new training step rewrites all of them), and any
change of dtype or shape. A change confined to bytes between the windows
(36 KiB of a 4 MiB tensor, under 1 byte in 100, is sampled) is not seen; `reload --verify`
and `inspect-order --scan` read every byte.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable

import xxhash

from layerwise_cli.checkpoint.format.digests import tensor_prefix

WINDOW_BYTES = 4096
WINDOWS = 9
_TAG = b"layerwise-sample/v1\n"


def sample_spans(nbytes: int) -> list[tuple[int, int]]:
    """The (offset, length) windows sampled from a tensor of NBYTES bytes (see the module docstring)."""
    if nbytes <= WINDOWS * WINDOW_BYTES:
        return [(0, nbytes)] if nbytes else []
    last = nbytes - WINDOW_BYTES
    return [(last * i // (WINDOWS - 1), WINDOW_BYTES) for i in range(WINDOWS)]


def sample_bytes(nbytes: int) -> int:
    """How many bytes a sample of a tensor of NBYTES bytes reads."""
    return sum(length for _, length in sample_spans(nbytes))


def sample_digest(dtype: str, shape: Iterable[int], nbytes: int, read: Callable[[int, int], object]) -> str:
    """The sample digest of one tensor.

    Args:
        dtype: the safetensors dtype name.
        shape: the tensor's shape.
        nbytes: its size in bytes.
        read: `read(offset, length)` gives that many bytes of the tensor's data (any bytes-like object).

    Returns:
        32 lowercase hex digits.
    """
    hasher = xxhash.xxh3_128(tensor_prefix(dtype, shape))
    hasher.update(_TAG)
    for offset, length in sample_spans(nbytes):
        data = read(offset, length)
        if len(data) != length:
            raise ValueError(f"sample window at {offset} holds {len(data)} bytes, not {length}")
        hasher.update(data)
    return hasher.hexdigest()


def buffer_sample(dtype: str, shape: Iterable[int], data) -> str:
    """The sample digest of a tensor whose whole raw bytes are in memory (any bytes-like object)."""
    view = memoryview(data).cast("B")
    return sample_digest(dtype, shape, len(view), lambda at, n: view[at:at + n])


def file_sample(fd: int, data_at: int, dtype: str, shape: Iterable[int], nbytes: int) -> str:
    """The sample digest of a tensor whose data starts at absolute offset DATA_AT of the open file FD."""
    return sample_digest(dtype, shape, nbytes, lambda at, n: os.pread(fd, n, data_at + at))
