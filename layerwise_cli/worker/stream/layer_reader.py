"""Read one parent layer of a stream: its tensors from the shards, sampled, hashed or queued, staged, checked."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from layerwise_cli.checkpoint.format.digests import layer_digest, tensor_digest
from layerwise_cli.checkpoint.format.finite import first_nonfinite, first_nonfinite_shared, refusal
from layerwise_cli.checkpoint.format.samples import buffer_sample
from layerwise_cli.planning.plan import PlannedTensor
from layerwise_cli.worker.stream.hash_backlog import HashBacklog
from layerwise_cli.worker.stream.remote_stream import RemoteStream
from layerwise_cli.worker.stream.shard_reader import ShardReader, layer_batches, raw_bytes
from layerwise_cli.worker.stream.staging import copy_in_chunks, handed_over, staging_threads, to_device
from layerwise_cli.worker.stream.stats import ReadAheadStats

# A layer the engine waits for is checked by two threads when it holds at least this many bytes.
_SHARED_CHECK_BYTES = 8 << 20


class LayerReader:
    """Reads a stream's parent layers one at a time (`load`), for whichever thread reads: `open_stream`'s options.

    It owns what reading needs: the shard reader, the pinned-staging pool and
    copy stream on CUDA, the hashing backlog, and (`start_shared_check`) the
    thread on the engine's cores that checks half of a layer the engine waits
    for. `engine_waiting` is set by the engine's side while it waits for the
    next layer. `release` lets go of all of it.
    """

    def __init__(self, stream: list[PlannedTensor], folder: Path, *, device: torch.device | None,
                 readahead: bool, stats: ReadAheadStats, check_finite: bool, hash_layers: frozenset[str],
                 digests: dict[str, str], skip_layer: Callable[[str, str], bool] | None, skipped: set[str],
                 samples: dict[str, str], may_skip: Callable[[str, dict[str, str]], bool] | None,
                 copy_threads: int | None, remote: RemoteStream | None = None, delta=None) -> None:
        self.folder = folder
        self.device = device
        self.readahead = readahead
        self.stats = stats
        self.check_finite = check_finite
        self.hash_layers = hash_layers
        self.digests = digests
        self.skip_layer = skip_layer
        self.skipped = skipped
        self.samples = samples
        self.may_skip = may_skip
        self.reader = ShardReader(folder, remote=remote, delta=delta)
        self.cuda = device is not None and device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(device=device) if self.cuda else None
        threads = staging_threads() if copy_threads is None else copy_threads
        self.pool = (ThreadPoolExecutor(threads, thread_name_prefix="layerwise-staging")
                     if self.cuda and threads > 1 else None)

        # Release each shard once its last planned tensor is read, as vLLM's loader
        # does file by file: a shard's mapped pages leave the process as soon as
        # the engine has freed its tensors, not at the end of the stream.
        self.last_of_shard = {item.entry.shard: item for item in stream}

        batches = layer_batches(stream)
        # A layer split into several runs of the stream cannot be dropped: part of it would already be handed over.
        self.runs = Counter(batch[0].parent for batch in batches)
        # Each run of one parent layer, with its tensors' bytes, in stream order.
        self.batches = [(batch, sum(item.entry.nbytes for item in batch)) for batch in batches]
        self.largest_batch = max((nbytes for _, nbytes in self.batches), default=0)
        # The backlog keeps views of at most two of the largest layers' bytes.
        self.backlog = HashBacklog(digests, stats, 2 * self.largest_batch)
        self.helper: ThreadPoolExecutor | None = None
        self.engine_waiting = threading.Event()

    def start_shared_check(self, wanted: bool) -> None:
        """When WANTED (the reading thread runs beside the engine's cores), off CUDA: one thread on the engine's cores.

        It checks half of a layer the engine waits for. Started here, by the engine's thread, so that it runs
        where the engine does.
        """
        if wanted and not self.cuda:
            self.helper = ThreadPoolExecutor(1, thread_name_prefix="layerwise-check")
            self.helper.submit(lambda: None).result()

    def read_host(self, item: PlannedTensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the tensor on the host, its raw bytes): safetensors' view of the file, plus a pinned copy for CUDA."""
        stats = self.stats
        start = time.perf_counter()
        tensor = self.reader.read(item)
        stats.read_bytes += item.entry.nbytes + self.reader.delta_nbytes(item)
        if self.last_of_shard.get(item.entry.shard) is item:
            self.reader.release(item.entry.shard)
        host = tensor
        if self.cuda:
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            copy_in_chunks(host, tensor, self.pool)
        sampled = time.perf_counter()
        stats.read_s += sampled - start
        self.samples[item.entry.name] = buffer_sample(item.entry.dtype, item.entry.shape, raw_bytes(tensor))
        stats.sample_s += time.perf_counter() - sampled
        return host, tensor

    def hash_batch(self, batch: list[PlannedTensor], raws: list[torch.Tensor]) -> None:
        """Hash a layer's tensors in full into `digests`."""
        start = time.perf_counter()
        for item, raw in zip(batch, raws):
            self.digests[item.entry.name] = tensor_digest(item.entry.dtype, item.entry.shape, raw_bytes(raw))
        self.stats.hash_s += time.perf_counter() - start

    def dropped(self, batch: list[PlannedTensor]) -> bool:
        """After hashing: True when `skip_layer` drops the layer."""
        parent = batch[0].parent
        if self.skip_layer(parent, layer_digest({item.entry.name: self.digests[item.entry.name] for item in batch})):
            self.skipped.add(parent)
            return True
        return False

    def load(self, batch: list[PlannedTensor], nbytes: int) -> list[tuple] | None:
        """Read one parent layer (NBYTES: its tensors' bytes); with `check_finite`, refuse it if any holds NaN or Inf.

        None when the layer is hashed and `skip_layer` drops it.
        """
        # The engine waits for this layer (the first always): its idle core checks part of it.
        share = (self.helper.submit if self.helper is not None
                 and (not self.stats.read_layers or self.engine_waiting.is_set()) else None)
        read = [self.read_host(item) for item in batch]
        if self._hashed_and_dropped(batch, [raw for _, raw in read], nbytes):
            return None
        loaded = [(item, *to_device(host, self.device, self.copy_stream)) for item, (host, _) in zip(batch, read)]
        if self.check_finite:
            self._check(loaded, nbytes, share)
        self.stats.read_layers += 1
        return loaded

    def _hashed_and_dropped(self, batch: list[PlannedTensor], raws: list[torch.Tensor], nbytes: int) -> bool:
        """Hash a layer of `hash_layers` now, or queue it for later; True when its hash drops it (`dropped`)."""
        parent = batch[0].parent
        if parent not in self.hash_layers:
            return False
        may_drop = self.skip_layer is not None and parent is not None and self.runs[parent] == 1
        # Hashed in full only when the hash can decide a skip now: the layer is whole in this run and its
        # samples equal its record's. A changed layer (a full change: every one) costs no hash at all.
        if may_drop and (self.may_skip is None or self.may_skip(
                parent, {item.entry.name: self.samples[item.entry.name] for item in batch})):
            self.hash_batch(batch, raws)
            return self.dropped(batch)
        if self.readahead:
            self.backlog.add(batch, raws, nbytes)
        else:
            self.stats.unhashed_layers += 1
        return False

    def _check(self, loaded: list[tuple], nbytes: int, share) -> None:
        """Refuse the layer (NBYTES) if a tensor of LOADED holds NaN or Inf.

        With SHARE (the checking thread's `submit`), a layer of at least `_SHARED_CHECK_BYTES` is checked half there.
        """
        start = time.perf_counter()
        tensors = [(item.entry.name, item.entry.shard, tensor) for item, tensor, _ in loaded]
        if self.cuda:
            # Reduced on the device, after the copies, on their stream: one read-back per layer.
            with torch.cuda.stream(self.copy_stream):
                found = first_nonfinite(tensors)
        elif share is not None and nbytes >= _SHARED_CHECK_BYTES:
            found = first_nonfinite_shared(tensors, share)
        else:
            found = first_nonfinite(tensors)
        self.stats.check_s += time.perf_counter() - start
        if found is not None:
            raise refusal(found, self.reader.where(found.shard))

    def handover(self, item: PlannedTensor, tensor, event) -> tuple[PlannedTensor, torch.Tensor]:
        return item, handed_over(tensor, event, self.device)

    def release(self) -> None:
        """Let go of the shards, the staging pool and the checking thread."""
        self.reader.close()
        if self.pool is not None:
            self.pool.shutdown(wait=True)
        if self.helper is not None:
            self.helper.shutdown(wait=True)
