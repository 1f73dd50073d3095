"""Delta format v2's streams: a tensor's changes as gaps and value differences, zstd-compressed in chunks.

A v2 patch of a tensor is cut into chunks, each a range of its elements
(`CHUNK_ELEMENTS` by the writer; the metadata gives each chunk's `start` and
`count`, the chunk ending where the next begins or at the tensor's end), with
two entries of its own, each one zstd frame (content size and checksum in its
header):

- `<tensor>::gaps.<i>`: how many unchanged elements precede each change
  (the first counted from the chunk's start), as uint16 with 0xFFFF an escape,
  byte-shuffled (every low byte, then every high byte), followed by the
  escaped gaps as little-endian uint32 in order;
- `<tensor>::diffs.<i>`: each changed element's new bits minus its base's,
  modulo 2**bits of the element (exact for every dtype), zigzag-mapped
  (0, -1, 1, -2, ... -> 0, 1, 2, 3, ...: a step of one unit in the last place
  either way is a small number) and byte-shuffled.

A chunk is decoded alone, at a cost per change (no pass over the elements it
leaves alone). The frames' sizes are checked against the header without
decoding them (`check_chunk`): a truncated chunk, or one that declares
another count of values than the metadata, is refused at pre-flight; a corrupt
stream fails its checksum when decoded.
"""

from __future__ import annotations

from dataclasses import dataclass

FORMAT_V2 = "layerwise-delta/v2"
CODEC = "zstd"
SPARSE = "sparse"
# Elements per chunk the writer cuts: 4 MiB of bf16 values, each chunk fetched by range and decoded on its own.
CHUNK_ELEMENTS = 1 << 21
GAPS = "::gaps."
DIFFS = "::diffs."
# zstd level 3: measured on the AdamW steps of `bench_rl_steps`, level 19 is 3 to 6% smaller and 30 x slower to write.
_LEVEL = 3
_ESCAPE = 0xFFFF
# A chunk spans fewer elements than this, so that an escaped gap fits its uint32.
MAX_SPAN = 1 << 32


class BadChunk(ValueError):
    """A chunk that cannot be decoded as its metadata describes it: `str(...)` says what is wrong."""


@dataclass(frozen=True)
class Chunk:
    """One chunk of a v2 patch: the elements [start, end) of its tensor, of which COUNT changed."""

    start: int
    end: int
    count: int


def chunk_keys(name: str, index: int) -> tuple[str, str]:
    """The file entries of chunk INDEX of tensor NAME's patch: its gaps and its value differences."""
    return f"{name}{GAPS}{index}", f"{name}{DIFFS}{index}"


def _compress(data: bytes) -> bytes:
    import pyzstd  # noqa: PLC0415 - pyzstd: kept off `layerwise --help`, loaded only for a v2 delta

    return pyzstd.compress(data, {pyzstd.CParameter.compressionLevel: _LEVEL, pyzstd.CParameter.checksumFlag: 1})


def _shuffled(array) -> bytes:
    """ARRAY's bytes grouped by significance: every element's first byte, then every second byte, ..."""
    import numpy as np  # noqa: PLC0415 - numpy: 0.1 s to import, only where an array is built

    size = array.dtype.itemsize
    return array.tobytes() if size == 1 else np.ascontiguousarray(array.view(np.uint8).reshape(-1, size).T).tobytes()


def _unshuffled(raw, count: int, unsigned):
    """The COUNT elements of type UNSIGNED whose bytes RAW holds grouped by significance (`_shuffled`)."""
    import numpy as np  # noqa: PLC0415 - numpy: 0.1 s to import, only where an array is built

    size = np.dtype(unsigned).itemsize
    planes = np.frombuffer(raw, dtype=np.uint8, count=count * size).reshape(size, count)
    # Each plane widened and shifted into place: contiguous passes, 3 x faster than a transposed copy.
    out = planes[0].astype(unsigned)
    for index in range(1, size):
        out |= planes[index].astype(unsigned) << (8 * index)
    return out


def encode_chunks(positions, diffs, numel: int, chunk_elements: int = CHUNK_ELEMENTS):
    """Tensor changes as v2 chunks: [(Chunk, gaps frame, diffs frame)] for every chunk holding a change.

    Args:
        positions: the changed elements, strictly increasing (an int64 array).
        diffs: new minus old bits there, modulo 2**bits (an unsigned array of the element's size).
        numel: the tensor's elements.
        chunk_elements: the elements each chunk spans (the last may span fewer).
    """
    import numpy as np  # noqa: PLC0415 - numpy: 0.1 s to import, only where an array is built

    signed = np.dtype(f"i{diffs.dtype.itemsize}")
    bits = 8 * diffs.dtype.itemsize
    as_signed = diffs.view(signed)
    zigzag = ((as_signed << 1) ^ (as_signed >> (bits - 1))).view(diffs.dtype)
    bounds = np.searchsorted(positions, np.arange(0, numel + chunk_elements, chunk_elements))
    out = []
    for index in range(0, (numel + chunk_elements - 1) // chunk_elements):
        lo, hi = int(bounds[index]), int(bounds[index + 1])
        if lo == hi:
            continue
        start = index * chunk_elements
        gaps = np.diff(positions[lo:hi], prepend=start - 1) - 1
        escaped = gaps >= _ESCAPE
        short = np.where(escaped, _ESCAPE, gaps).astype(np.uint16)
        gap_bytes = _shuffled(short) + gaps[escaped].astype("<u4").tobytes()
        chunk = Chunk(start, min(start + chunk_elements, numel), hi - lo)
        out.append((chunk, _compress(gap_bytes), _compress(_shuffled(zigzag[lo:hi]))))
    return out


def _frame_content_size(frame) -> int:
    """The decoded size FRAME declares, once it is shown to be exactly one whole zstd frame."""
    import pyzstd  # noqa: PLC0415 - pyzstd: kept off `layerwise --help`, loaded only for a v2 delta

    try:
        size = pyzstd.get_frame_size(frame)
        declared = pyzstd.get_frame_info(frame).decompressed_size
    except pyzstd.ZstdError:
        raise BadChunk(f"its {len(frame)}-byte {CODEC} stream is truncated or not a {CODEC} frame") from None
    if size != len(frame):
        raise BadChunk(f"its {CODEC} frame is {size} bytes, its entry {len(frame)}")
    if declared is None:
        raise BadChunk(f"its {CODEC} frame does not declare its decoded size")
    return declared


def check_chunk(chunk: Chunk, gaps, diffs, element_size: int) -> None:
    """Chunk's two frames, read from their headers only: whole, and as many values as the metadata says.

    Raises:
        BadChunk: a frame truncated or with bytes after it, or declaring another count of gaps or values.
    """
    gap_bytes, diff_bytes = _frame_content_size(gaps), _frame_content_size(diffs)
    _check_gap_bytes(gap_bytes, chunk)
    if diff_bytes != chunk.count * element_size:
        raise BadChunk(f"its values decode to {diff_bytes // element_size} differences, its header says "
                       f"{chunk.count}")


def _check_gap_bytes(size: int, chunk: Chunk) -> None:
    """SIZE decoded bytes of gaps can hold CHUNK's count of gaps: two bytes each, four more per escaped one."""
    if size < 2 * chunk.count or (size - 2 * chunk.count) % 4:
        raise BadChunk(f"its gaps decode to {size} bytes, not the {chunk.count} gaps its header says")


def _decoded(frame, size: int) -> bytes:
    """FRAME decoded, which must come to SIZE bytes (its checksum checked)."""
    import pyzstd  # noqa: PLC0415 - pyzstd: kept off `layerwise --help`, loaded only for a v2 delta

    if _frame_content_size(frame) != size:
        raise BadChunk(f"a {CODEC} frame decodes to {_frame_content_size(frame)} bytes, not {size}")
    try:
        raw = pyzstd.decompress(frame)
    except pyzstd.ZstdError as exc:
        raise BadChunk(f"its {CODEC} stream is corrupt ({exc})") from None
    if len(raw) != size:
        raise BadChunk(f"a {CODEC} frame decodes to {len(raw)} bytes, not {size}")
    return raw


def decode_positions(chunk: Chunk, gaps):
    """Chunk's changed positions (int64, strictly increasing, in [start, end)) from its gaps frame GAPS.

    Raises:
        BadChunk: a corrupt stream, a count other than the chunk's, or a position past the chunk's end.
    """
    import numpy as np  # noqa: PLC0415 - numpy: 0.1 s to import, only where an array is built

    declared = _frame_content_size(gaps)
    _check_gap_bytes(declared, chunk)
    raw = _decoded(gaps, declared)
    short = _unshuffled(raw, chunk.count, np.uint16)
    steps = short.astype(np.int64)
    escaped = short == _ESCAPE
    found = int(np.count_nonzero(escaped))
    if declared != 2 * chunk.count + 4 * found:
        raise BadChunk(f"its gaps hold {(declared - 2 * chunk.count) // 4} escaped gaps, {found} marked")
    if found:
        steps[escaped] = np.frombuffer(raw, dtype="<u4", offset=2 * chunk.count)
    steps += 1
    positions = np.cumsum(steps)
    positions += chunk.start - 1
    if chunk.count and positions[-1] >= chunk.end:
        raise BadChunk(f"position {int(positions[-1])} is past its chunk's end {chunk.end}")
    return positions


def decode_diffs(chunk: Chunk, diffs, unsigned):
    """Chunk's value differences (new minus old bits, modulo 2**bits) as an array of type UNSIGNED.

    Raises:
        BadChunk: a corrupt stream, or another count of values than the chunk's.
    """
    import numpy as np  # noqa: PLC0415 - numpy: 0.1 s to import, only where an array is built

    size = np.dtype(unsigned).itemsize
    zigzag = _unshuffled(_decoded(diffs, chunk.count * size), chunk.count, unsigned)
    return (zigzag >> 1) ^ (np.zeros(1, dtype=unsigned) - (zigzag & 1))
