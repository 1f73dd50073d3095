"""What a stream read, and where the reading thread's time went."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class ReadAheadStats:
    """What the stream read, and where the reading side's time went (all of it in the reading thread)."""

    peak_bytes: int = 0
    _held: int = 0
    # Layers read (and checked) so far.
    read_layers: int = 0
    # Bytes of tensor data taken from the shards (skipped layers decided from headers are never read).
    read_bytes: int = 0
    # Seconds getting tensors from the shards (CPU: mapping them; CUDA: also staging into pinned memory).
    read_s: float = 0.0
    # Seconds taking each tensor's spot sample (`checkpoint.samples`), for the next reload's header check.
    sample_s: float = 0.0
    # Seconds hashing bytes in full to decide a skip (layers whose samples match their record).
    hash_s: float = 0.0
    # Seconds in the NaN/Inf check.
    check_s: float = 0.0
    # Layers handed over unhashed (their samples showed them changed, or no hash could skip them now) and
    # hashed afterwards; and those never hashed (no read-ahead thread, or the stream stopped early).
    hashed_after_handover: int = 0
    unhashed_layers: int = 0
    # The CPUs the reading thread ran on (None: no read-ahead thread).
    reader_cpus: list[int] | None = None
    # Once the stream ended: waits until the reading thread has hashed its backlog (None: nothing to wait for).
    hashing_done: Callable[[], None] | None = None

    def add(self, n: int) -> None:
        self._held += n
        self.peak_bytes = max(self.peak_bytes, self._held)

    def remove(self, n: int) -> None:
        self._held -= n
