"""The timed ways of putting a checkpoint into device memory that `device_check` compares, and their sink.

Every variant reads the same checkpoint and hands each tensor to a `Sink`,
which holds one parent layer at a time (as an engine does until the layer is
complete) and, when verifying, checks each tensor's bytes against the digest
the shard header carries. On CPU the sink copies each tensor into memory of
its own (what "in device memory" means there: safetensors' tensors are lazy
views of the file mapping), so every variant touches every byte.

Nothing here imports vLLM: the lent GPU machine has none.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from layerwise_cli.checkpoint.format.chunks import read_chunks
from layerwise_cli.checkpoint.format.digests import tensor_digest
from layerwise_cli.checkpoint.format.dtypes import dtype_name
from layerwise_cli.checkpoint.format.header import TensorEntry
from layerwise_cli.planning.plan import PlannedTensor
from layerwise_cli.worker.stream.read_ahead import read_in_order
from layerwise_cli.worker.stream.shard_reader import ShardReader
from layerwise_cli.worker.stream.staging import copy_in_chunks, staging_threads
from layerwise_cli.worker.stream.stats import ReadAheadStats

# The layerwise variants: read_in_order's options, each one thing off against the product's default.
LAYERWISE = {
    "layerwise": {},
    "layerwise_no_readahead": {"readahead": False},
    "layerwise_no_check": {"check_finite": False},
    "layerwise_hash": {"hash": True},
    "layerwise_one_copy_thread": {"copy_threads": 1},
}
# What safetensors does, and the limits.
OTHERS = ("load_file", "safe_open_vllm_order", "staging_only", "pinned_copy_limit", "page_cache_read")
VARIANTS = (*LAYERWISE, *OTHERS)
DESCRIPTIONS = {
    "layerwise": "layerwise read_in_order (read-ahead, pinned staging in chunks, NaN/Inf check): the default",
    "layerwise_no_readahead": "the same, read-ahead off",
    "layerwise_no_check": "the same, NaN/Inf check off",
    "layerwise_hash": "the same, every layer hashed as it is read (xxh3-128, a reload without header digests)",
    "layerwise_one_copy_thread": "the same, one plain host copy per tensor (no chunked copies)",
    "load_file": "safetensors.torch.load_file(shard, device=DEV), shard by shard",
    "safe_open_vllm_order": "safe_open(shard).get_tensor(name).to(DEV) in vLLM's read order",
    "staging_only": "read + copy into pinned staging (the stream's functions), no transfer: the host half",
    "pinned_copy_limit": "limit: copies of the same bytes from one pinned host buffer to DEV",
    "page_cache_read": "limit: the shard files read with os.preadv by the staging threads",
}


@dataclass(frozen=True)
class Setup:
    """One checkpoint on disk, planned, and where to put it."""

    folder: Path
    layer_order: list[PlannedTensor]  # the stream the worker reads (planning.plan's layer order)
    read_order: list[TensorEntry]  # vLLM's read order (planning.plan.vllm_read_order)
    shards: list[Path]  # in natural order
    device: torch.device
    digests: dict[str, str]  # tensor name -> xxh3-128 digest from the shard headers (the reference)

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"


@dataclass(frozen=True)
class Sample:
    """One timed pass of a variant."""

    variant: str
    seconds: float
    tensors: int
    delivered_bytes: int
    peak_device_bytes: int | None  # CUDA: max_memory_allocated's rise over the pass; None on CPU
    held_peak_bytes: int  # the most tensor bytes the sink held at once
    stream: dict | None = None  # read_in_order's ReadAheadStats (layerwise variants)
    mismatches: list[str] = field(default_factory=list)  # verifying: tensors whose bytes differ
    verified: int = 0  # verifying: tensors checked against the header digests
    read_digests: dict[str, str] | None = None  # layerwise_hash: the digests the stream computed


class Sink:
    """Takes each delivered tensor: holds one parent layer at a time, and checks bytes when verifying."""

    def __init__(self, setup: Setup, verify: bool) -> None:
        self.setup = setup
        self.verify = verify
        self.entries = {item.entry.name: item.entry for item in setup.layer_order}
        self.held: list[torch.Tensor] = []
        self.held_bytes = 0
        self.held_peak = 0
        self.parent: str | None = None
        self.tensors = 0
        self.delivered = 0
        self.mismatches: list[str] = []
        self.verified = 0
        # Read-backs go through one pinned buffer (pageable device-to-host copies are several times slower).
        self.readback = None
        if verify and setup.cuda:
            largest = max(item.entry.nbytes for item in setup.layer_order)
            self.readback = torch.empty(largest, dtype=torch.uint8, pin_memory=True)

    def take(self, name: str, tensor: torch.Tensor, parent: str | None = None) -> None:
        if parent is None or parent != self.parent:
            self.held.clear()
            self.held_bytes = 0
        self.parent = parent
        if not self.setup.cuda:
            tensor = torch.empty_like(tensor).copy_(tensor)
        nbytes = tensor.numel() * tensor.element_size()
        self.tensors += 1
        self.delivered += nbytes
        if self.verify:
            self._check(name, tensor)
        if parent is not None:
            self.held.append(tensor)
            self.held_bytes += nbytes
            self.held_peak = max(self.held_peak, self.held_bytes)
        else:
            self.held_peak = max(self.held_peak, nbytes)

    def _check(self, name: str, tensor: torch.Tensor) -> None:
        entry = self.entries.get(name)
        expected = self.setup.digests.get(name)
        self.verified += 1
        if entry is None or expected is None:
            self.mismatches.append(f"{name}: not in the checkpoint's header digests")
            return
        if tuple(tensor.shape) != tuple(entry.shape) or dtype_name(tensor) != entry.dtype:
            self.mismatches.append(f"{name}: arrived as {dtype_name(tensor)}{list(tensor.shape)}, "
                                   f"expected {entry.dtype}{list(entry.shape)}")
            return
        flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        if self.readback is not None:
            host = self.readback[:flat.numel()]
            host.copy_(flat)  # synchronous: the buffer is read right after
        else:
            host = flat
        data = host.numpy().data if host.numel() else b""
        if tensor_digest(entry.dtype, entry.shape, data) != expected:
            self.mismatches.append(f"{name}: bytes differ from the file's")

    def finish(self) -> None:
        self.held.clear()
        self.held_bytes = 0


def _sync(setup: Setup) -> None:
    if setup.cuda:
        torch.cuda.synchronize(setup.device)


def run_variant(name: str, setup: Setup, *, verify: bool = False) -> Sample:
    """One pass of variant NAME over the whole checkpoint, timed from a synchronized start to a synchronized end."""
    sink = Sink(setup, verify)
    if name == "pinned_copy_limit":  # the pinned source is filled before the clock starts
        body = _pinned_copy_limit(_pinned_source(setup))
    else:
        body = _BODIES[name] if name in _BODIES else _layerwise_body(LAYERWISE[name])
    _sync(setup)
    before = None
    if setup.cuda:
        torch.cuda.reset_peak_memory_stats(setup.device)
        before = torch.cuda.memory_allocated(setup.device)
    start = time.perf_counter()
    extra = body(setup, sink)
    _sync(setup)
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated(setup.device) - before if before is not None else None
    sink.finish()
    return Sample(variant=name, seconds=seconds, tensors=sink.tensors, delivered_bytes=sink.delivered,
                  peak_device_bytes=peak, held_peak_bytes=sink.held_peak, mismatches=sink.mismatches,
                  verified=sink.verified, **(extra or {}))


def _layerwise_body(options: dict) -> Callable[[Setup, Sink], dict]:
    def body(setup: Setup, sink: Sink) -> dict:
        stats = ReadAheadStats()
        digests: dict[str, str] = {}
        hashed = {item.parent for item in setup.layer_order if item.parent is not None} if options.get("hash") else ()
        for item, tensor in read_in_order(setup.layer_order, setup.folder, device=setup.device, stats=stats,
                                          readahead=options.get("readahead", True),
                                          check_finite=options.get("check_finite", True),
                                          hash_layers=hashed, digests=digests,
                                          copy_threads=options.get("copy_threads")):
            sink.take(item.entry.name, tensor, item.parent)
            del tensor
        if stats.hashing_done is not None:
            stats.hashing_done()  # the layers hashed after their handover (the worker waits the same way)
        return {"stream": {"readahead_peak_bytes": stats.peak_bytes, "read_bytes": stats.read_bytes,
                           "stage_s": stats.read_s, "check_s": stats.check_s, "hash_s": stats.hash_s},
                "read_digests": digests if options.get("hash") else None}
    return body


def _load_file(setup: Setup, sink: Sink) -> None:
    for path in setup.shards:
        tensors = load_file(str(path), device=str(setup.device))
        for name in list(tensors):
            sink.take(name, tensors.pop(name))


def _safe_open_vllm_order(setup: Setup, sink: Sink) -> None:
    """As vLLM's safetensors iterator reads (shards in natural order, names sorted), then `.to(DEV)`."""
    by_shard: dict[str, list[str]] = {}
    for entry in setup.read_order:
        by_shard.setdefault(entry.shard, []).append(entry.name)
    for path in setup.shards:
        with safe_open(str(path), framework="pt", device="cpu") as handle:
            for name in by_shard.get(path.name, []):
                sink.take(name, handle.get_tensor(name).to(setup.device))


def _staging_only(setup: Setup, sink: Sink) -> None:
    """The stream's host half alone: ShardReader, then copy_in_chunks into pinned memory (CPU: plain memory)."""
    reader = ShardReader(setup.folder)
    threads = staging_threads()
    pool = ThreadPoolExecutor(threads) if setup.cuda and threads > 1 else None
    try:
        for item in setup.layer_order:
            tensor = reader.read(item)
            staged = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=setup.cuda)
            copy_in_chunks(staged, tensor, pool)
            sink.delivered += item.entry.nbytes
            sink.tensors += 1
            del tensor, staged
    finally:
        reader.close()
        if pool is not None:
            pool.shutdown(wait=True)


def _pinned_source(setup: Setup) -> torch.Tensor:
    """One host buffer the size of the largest tensor, pinned on CUDA, its pages touched."""
    largest = max(item.entry.nbytes for item in setup.layer_order)
    source = torch.empty(largest, dtype=torch.uint8, pin_memory=setup.cuda)
    source.fill_(1)
    return source


def _pinned_copy_limit(source: torch.Tensor) -> Callable[[Setup, Sink], None]:
    """Every tensor's bytes copied from SOURCE into a new device tensor, layer by layer (CPU: a memory copy)."""
    def body(setup: Setup, sink: Sink) -> None:
        stream = torch.cuda.Stream(device=setup.device) if setup.cuda else None
        held: list[torch.Tensor] = []
        parent = None
        for item in setup.layer_order:
            if item.parent != parent:
                held.clear()  # one layer held at a time, as the sink does
                parent = item.parent
            n = item.entry.nbytes
            if stream is not None:
                with torch.cuda.stream(stream):
                    held.append(source[:n].to(setup.device, non_blocking=True))
            else:
                held.append(torch.empty(n, dtype=torch.uint8).copy_(source[:n]))
            sink.delivered += n
            sink.tensors += 1
        if stream is not None:
            stream.synchronize()
        held.clear()
    return body


def _page_cache_read(setup: Setup, sink: Sink) -> None:
    """The shard files read in 64 MiB pieces by `staging_threads()` threads (checkpoint.chunks' read loop)."""
    piece = 64 << 20
    jobs = [(path, at, min(piece, size - at)) for path in setup.shards
            for size in [os.path.getsize(path)] for at in range(0, size, piece)]
    largest = max(n for _, _, n in jobs)
    buffers = threading.local()

    def read(job) -> int:
        path, at, n = job
        buf = getattr(buffers, "buf", None)
        if buf is None:
            buf = buffers.buf = bytearray(min(piece, largest))
        fd = os.open(path, os.O_RDONLY)
        try:
            return sum(len(view) for view in read_chunks(fd, at, n, buf, tensor="(file)", where=str(path)))
        finally:
            os.close(fd)

    with ThreadPoolExecutor(staging_threads()) as pool:
        sink.delivered += sum(pool.map(read, jobs))
    sink.tensors += len(setup.layer_order)


_BODIES = {
    "load_file": _load_file,
    "safe_open_vllm_order": _safe_open_vllm_order,
    "staging_only": _staging_only,
    "page_cache_read": _page_cache_read,
}
