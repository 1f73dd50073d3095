"""Hashing, chunk by chunk while the reader would wait, the layers a stream handed over unhashed."""

from __future__ import annotations

import time
from collections import deque

import torch

from layerwise_cli.checkpoint.format.chunks import CHUNK_BYTES
from layerwise_cli.checkpoint.format.digests import TensorHasher
from layerwise_cli.planning.plan import PlannedTensor
from layerwise_cli.worker.stream.shard_reader import raw_bytes
from layerwise_cli.worker.stream.stats import ReadAheadStats


class HashBacklog:
    """Tensors handed over unhashed (their layer changed), hashed chunk by chunk while the reader would wait.

    Their digests only serve the next reload's records, so they never delay a
    handover: the reader hashes one chunk at a time while the engine has not
    yet started the layer it was given, and after the stream while vLLM
    finalizes. Beyond two of the largest layers, the oldest are hashed before
    the reader reads on, so the views held stay bounded.
    """

    def __init__(self, digests: dict[str, str], stats: ReadAheadStats, max_bytes: int) -> None:
        self._digests = digests
        self._stats = stats
        self._max_bytes = max_bytes
        self._bytes = 0  # left to hash
        # [tensor name, hasher, raw bytes, bytes hashed so far, last tensor of its layer]
        self._jobs: deque[list] = deque()

    def add(self, batch: list[PlannedTensor], raws: list[torch.Tensor], new: int) -> None:
        """Queue a layer's tensors (NEW: their bytes) for hashing."""
        # Over the bound, the oldest are hashed now: the reader is ahead of what it must hash, not the engine.
        while self._jobs and self._bytes + new > self._max_bytes:
            self.step()
        for i, (item, raw) in enumerate(zip(batch, raws)):
            data = memoryview(raw_bytes(raw)).cast("B")
            self._jobs.append([item.entry.name, TensorHasher(item.entry.dtype, item.entry.shape), data, 0,
                               i == len(batch) - 1])
        self._bytes += new

    def step(self) -> bool:
        """Hash the next chunk; False when nothing is left."""
        if not self._jobs:
            return False
        start = time.perf_counter()
        job = self._jobs[0]
        name, hasher, data, done, last = job
        chunk = data[done:done + CHUNK_BYTES]
        hasher.update(chunk)
        self._bytes -= len(chunk)
        job[3] = done = done + len(chunk)
        if done >= len(data):
            self._digests[name] = hasher.hexdigest()
            self._jobs.popleft()
            self._stats.hashed_after_handover += last
        self._stats.hash_s += time.perf_counter() - start
        return True

    def abandon(self) -> None:
        """Drop what is left (and the views it holds)."""
        self._stats.unhashed_layers += sum(1 for job in self._jobs if job[4])
        self._jobs.clear()
        self._bytes = 0
