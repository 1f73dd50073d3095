"""Read a tensor's bytes from a shard file in fixed-size chunks: the one read loop of copy, verify and scan."""

from __future__ import annotations

import os
from collections.abc import Iterator

from layerwise_cli.errors import LayerwiseError

# Bytes read per call: what a copy, a verify or a NaN/Inf scan holds in memory.
CHUNK_BYTES = 8 << 20


def read_chunks(fd: int, at: int, nbytes: int, buf: bytearray, *, tensor: str, where: str) -> Iterator[memoryview]:
    """Yield the `nbytes` bytes at file offset `at` of `fd`, as views into `buf`, one read at a time.

    Each view is valid until the next one is asked for (`buf` is reused), so
    a caller hashes, scans or writes it before moving on.

    Args:
        fd: a file opened for reading.
        at: the absolute offset of the tensor's first byte.
        nbytes: the tensor's size.
        buf: the reusable read buffer; its length is the most read at once.
        tensor: the tensor's name, for the message.
        where: the file, for the message.

    Raises:
        LayerwiseError: the file ended before `nbytes` were read.
    """
    read = 0
    while read < nbytes:
        view = memoryview(buf)[: min(len(buf), nbytes - read)]
        got = os.preadv(fd, [view], at + read)
        if got <= 0:
            raise LayerwiseError(f"tensor {tensor!r}: file ended while reading (changed while reading?)", where=where)
        yield view[:got]
        read += got
