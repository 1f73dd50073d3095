"""Read a checkpoint's tensors in planned order, one layer ahead of the engine."""

from __future__ import annotations

import os
import queue
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Collection, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from layerwise_cli.checkpoint.chunks import CHUNK_BYTES
from layerwise_cli.checkpoint.digests import TensorHasher, layer_digest, tensor_digest
from layerwise_cli.checkpoint.finite import first_nonfinite, first_nonfinite_shared, refusal
from layerwise_cli.checkpoint.samples import buffer_sample
from layerwise_cli.checkpoint.sources import shard_file
from layerwise_cli.planning.plan import PlannedTensor
from layerwise_cli.worker.cpu_placement import move_to, spare_cpus

# Host copies into pinned memory are split into chunks of this size over a
# few threads: after start-up vLLM sets torch to one CPU thread on GPU
# workers, and one thread copying out of the page cache is slower than the
# device's copy engine.
_STAGING_CHUNK_BYTES = 64 << 20
# A layer the engine waits for is checked by two threads when it holds at least this many bytes.
_SHARED_CHECK_BYTES = 8 << 20


def layer_batches(stream: list[PlannedTensor]) -> list[list[PlannedTensor]]:
    """Split a stream into runs of consecutive tensors with the same parent layer."""
    batches: list[list[PlannedTensor]] = []
    for item in stream:
        if batches and batches[-1][0].parent == item.parent:
            batches[-1].append(item)
        else:
            batches.append([item])
    return batches


class ShardReader:
    """Reads single tensors from a checkpoint's shards, keeping each shard open."""

    def __init__(self, folder: Path) -> None:
        self._folder = folder
        self._handles: dict[str, object] = {}

    def read(self, item: PlannedTensor) -> torch.Tensor:
        from safetensors import safe_open

        shard = item.entry.shard
        handle = self._handles.get(shard)
        if handle is None:
            path = shard_file(self._folder, shard, str(self._folder))
            handle = self._handles[shard] = safe_open(str(path), framework="pt", device="cpu")
        return handle.get_tensor(item.entry.name)

    def release(self, shard: str) -> None:
        """Drop a shard's handle; its file mapping goes once the tensors read from it are freed too."""
        self._handles.pop(shard, None)

    def close(self) -> None:
        self._handles.clear()


def staging_threads() -> int:
    """Threads for host-side staging copies on CUDA: half the CPUs this process may use, 1 to 8."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return max(1, min(8, cpus // 2))


def copy_in_chunks(dst: torch.Tensor, src: torch.Tensor, pool: ThreadPoolExecutor | None,
                   chunk_bytes: int = _STAGING_CHUNK_BYTES) -> None:
    """`dst.copy_(src)` for two contiguous tensors of one dtype and shape, in byte ranges over POOL.

    torch releases the GIL inside `copy_`, so the chunks copy in parallel.
    """
    nbytes = src.numel() * src.element_size()
    if pool is None or nbytes <= chunk_bytes:
        dst.copy_(src)
        return
    flat_dst = dst.reshape(-1).view(torch.uint8)
    flat_src = src.reshape(-1).view(torch.uint8)

    def copy(start: int) -> None:
        flat_dst[start:start + chunk_bytes].copy_(flat_src[start:start + chunk_bytes])

    for future in [pool.submit(copy, start) for start in range(0, nbytes, chunk_bytes)]:
        future.result()


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


_DONE = object()


def read_in_order(stream: list[PlannedTensor], folder: Path, **options) -> Iterator[tuple[PlannedTensor, torch.Tensor]]:
    """Yield (planned tensor, tensor) in stream order: `open_stream`, read as a generator (closed with it)."""
    opened = open_stream(stream, folder, **options)
    try:
        yield from opened
    finally:
        opened.close()


class OpenStream:
    """A stream `open_stream` started: iterate it once; `close` it in any case (it stops the reading thread)."""

    def __init__(self, tensors: Iterator, abort: Callable[[], None], wake: Callable[[], None]) -> None:
        self._tensors = tensors
        self._abort = abort
        self._wake = wake

    def __iter__(self) -> Iterator[tuple[PlannedTensor, torch.Tensor]]:
        return self._tensors

    def wake(self) -> None:
        """Tell the reading thread that new idle work is there (any thread may call it)."""
        self._wake()

    def close(self) -> None:
        """Stop reading and let go of the shards (a no-op once the stream was read to its end)."""
        self._tensors.close()  # runs the stream's own clean-up when it was started
        self._abort()


def open_stream(
    stream: list[PlannedTensor],
    folder: Path,
    *,
    device: torch.device | None = None,
    readahead: bool = True,
    stats: ReadAheadStats | None = None,
    check_finite: bool = True,
    hash_layers: Collection[str] = (),
    digests: dict[str, str] | None = None,
    skip_layer: Callable[[str, str], bool] | None = None,
    skipped: set[str] | None = None,
    samples: dict[str, str] | None = None,
    may_skip: Callable[[str, dict[str, str]], bool] | None = None,
    copy_threads: int | None = None,
    ahead_bytes: int | None = None,
    idle: Callable[[], bool] | None = None,
) -> OpenStream:
    """Start reading STREAM; iterating the result yields (planned tensor, tensor) in stream order.

    The reading thread starts at once, so the first layers are read (and
    checked) while the caller prepares the engine (vLLM's reload moves the
    model's layers to the meta device before it asks for the first tensor).

    With `readahead`, a thread reads the next parent layers while the engine
    loads and processes the current one, at most `ahead_bytes` of layers the
    engine has not started (always at least one layer). On CPU the tensors are
    safetensors' views of the file mapping (no copy: holding them costs
    mapped page cache, not memory of their own), so the reader may run two of
    the largest layers ahead: a small layer (a norm) takes the engine no time,
    and a reader only one layer ahead would make it wait for the next. On a CUDA
    device, tensors are staged in pinned host memory (copied by a few
    threads) and copied to the device asynchronously on a side stream, so the
    engine's processing (online quantization) runs on the device.

    On the CPU, the reading thread moves beside the cores vLLM bound the
    worker to (`cpu_placement`), and a layer the engine waits for (the first
    one always) is checked by two threads: the reader and one on the engine's
    idle cores.

    Args:
        stream: tensors in the order to hand them over.
        folder: directory holding the shard files.
        device: where the engine wants tensors (None or CPU: stay on host).
        readahead: overlap reading with loading.
        stats: receives the peak bytes read but not yet handed over.
        check_finite: refuse a parent layer holding NaN or Inf before any of
            its tensors is handed over (a cheap reduction per tensor, one
            read-back per layer; see `layerwise_cli.checkpoint.finite`).
        hash_layers: parent layers whose tensors are hashed as they are read
            (xxh3-128, `checkpoint.digests`), in the reading thread, when the
            hash can decide a skip (see `may_skip`); each tensor's digest goes
            into `digests`.
        digests: receives tensor name -> digest for the hashed tensors.
        skip_layer: called as `skip_layer(parent, layer_digest)` once a hashed
            layer that the stream holds in one run is read, before any of its
            tensors is handed over; True drops the layer (added to `skipped`).
        skipped: receives the layers `skip_layer` dropped.
        samples: receives tensor name -> sample digest (`checkpoint.samples`)
            of every tensor read, for the records.
        may_skip: called as `may_skip(parent, samples)` for a layer of
            `hash_layers` that `skip_layer` could drop: False (its samples
            differ from the record's: it changed) hands it over unhashed. None:
            always True. Layers `skip_layer` cannot drop are never hashed.
        copy_threads: threads for the host copies into pinned staging on CUDA
            (None: `staging_threads()`; 1: one plain copy per tensor).
        ahead_bytes: bytes of read layers the engine has not started that the
            reader may hold before it reads another (a layer is read whenever
            none is held). None: twice the largest layer on CPU, one layer at
            a time on CUDA (staging holds pinned and device memory).
        idle: work for the reading thread while it may not read on, after the
            hashing backlog: called until it returns False (nothing to do now),
            and again after `OpenStream.wake`, and after the stream until the
            caller waits for the thread (`stats.hashing_done`).

    Returns:
        An `OpenStream` (iterate it once; close it in any case), yielding each planned tensor with its data.

    Raises:
        LayerwiseError: a tensor holds NaN or Inf (naming its shard file), at
            the point in the stream where its layer would be handed over.
    """
    stats = stats or ReadAheadStats()
    digests = digests if digests is not None else {}
    samples = samples if samples is not None else {}
    skipped = skipped if skipped is not None else set()
    hash_layers = frozenset(hash_layers)
    reader = ShardReader(folder)
    cuda = device is not None and device.type == "cuda"
    copy_stream = torch.cuda.Stream(device=device) if cuda else None
    threads = staging_threads() if copy_threads is None else copy_threads
    pool = ThreadPoolExecutor(threads, thread_name_prefix="layerwise-staging") if cuda and threads > 1 else None

    # Release each shard once its last planned tensor is read, as vLLM's loader
    # does file by file: a shard's mapped pages leave the process as soon as
    # the engine has freed its tensors, not at the end of the stream.
    last_of_shard = {item.entry.shard: item for item in stream}

    def read_host(item: PlannedTensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the tensor on the host, its raw bytes): safetensors' view of the file, plus a pinned copy for CUDA."""
        start = time.perf_counter()
        tensor = reader.read(item)
        stats.read_bytes += item.entry.nbytes
        if last_of_shard.get(item.entry.shard) is item:
            reader.release(item.entry.shard)
        host = tensor
        if cuda:
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            copy_in_chunks(host, tensor, pool)
        sampled = time.perf_counter()
        stats.read_s += sampled - start
        samples[item.entry.name] = buffer_sample(item.entry.dtype, item.entry.shape, raw_bytes(tensor))
        stats.sample_s += time.perf_counter() - sampled
        return host, tensor

    def to_device(host: torch.Tensor):
        if not cuda:
            return host, None
        with torch.cuda.stream(copy_stream):
            # The caching host allocator keeps `pinned` from reuse until this copy is done.
            staged = host.to(device, non_blocking=True)
            event = torch.cuda.Event()
            event.record(copy_stream)
        return staged, event

    batches = layer_batches(stream)
    # A layer split into several runs of the stream cannot be dropped: part of it would already be handed over.
    runs = Counter(batch[0].parent for batch in batches)

    batch_bytes = [sum(item.entry.nbytes for item in batch) for batch in batches]
    largest_batch = max(batch_bytes, default=0)
    # The backlog keeps views of at most two of the largest layers' bytes.
    backlog = _HashBacklog(digests, stats, 2 * largest_batch)

    def hash_batch(batch: list[PlannedTensor], raws: list[torch.Tensor]) -> None:
        """Hash a layer's tensors in full into `digests`."""
        start = time.perf_counter()
        for item, raw in zip(batch, raws):
            digests[item.entry.name] = tensor_digest(item.entry.dtype, item.entry.shape, raw_bytes(raw))
        stats.hash_s += time.perf_counter() - start

    def dropped(batch: list[PlannedTensor]) -> bool:
        """After hashing: True when `skip_layer` drops the layer."""
        parent = batch[0].parent
        if skip_layer(parent, layer_digest({item.entry.name: digests[item.entry.name] for item in batch})):
            skipped.add(parent)
            return True
        return False

    def load_batch(batch: list[PlannedTensor], nbytes: int) -> list[tuple] | None:
        """Read one parent layer (NBYTES: its tensors' bytes); with `check_finite`, refuse it if any holds NaN or Inf.

        None when the layer is hashed and `skip_layer` drops it.
        """
        parent = batch[0].parent
        read = [read_host(item) for item in batch]
        if parent in hash_layers:
            # Hashed in full only when the hash can decide a skip now: the layer is whole in this run and its
            # samples equal its record's. A changed layer (a full change: every one) costs no hash at all.
            if skip_layer is not None and parent is not None and runs[parent] == 1 and (
                    may_skip is None or may_skip(parent, {item.entry.name: samples[item.entry.name]
                                                          for item in batch})):
                hash_batch(batch, [raw for _, raw in read])
                if dropped(batch):
                    return None
            elif readahead:
                backlog.add(batch, [raw for _, raw in read], nbytes)
            else:
                stats.unhashed_layers += 1
        loaded = [(item, *to_device(host)) for item, (host, _) in zip(batch, read)]
        if check_finite:
            start = time.perf_counter()
            tensors = [(item.entry.name, item.entry.shard, tensor) for item, tensor, _ in loaded]
            if cuda:
                # Reduced on the device, after the copies, on their stream: one read-back per layer.
                with torch.cuda.stream(copy_stream):
                    found = first_nonfinite(tensors)
            elif helper is not None and (not stats.read_layers or engine_waiting.is_set()) and (
                    nbytes >= _SHARED_CHECK_BYTES):
                # The engine waits for this layer (the first one always does): its core is idle, so it checks half.
                found = first_nonfinite_shared(tensors, helper.submit)
            else:
                found = first_nonfinite(tensors)
            stats.check_s += time.perf_counter() - start
            if found is not None:
                raise refusal(found, str(folder / found.shard))
        stats.read_layers += 1
        return loaded

    def handover(item: PlannedTensor, tensor, event) -> tuple[PlannedTensor, torch.Tensor]:
        if event is not None:
            torch.cuda.current_stream(device).wait_event(event)
            tensor.record_stream(torch.cuda.current_stream(device))
        return item, tensor

    spare = spare_cpus() if readahead else set()
    # When the reading thread runs beside the engine's cores: one thread on them, which checks half of a layer
    # the engine waits for. Started here, by the engine's thread, so that it runs where the engine does.
    shared_check = bool(spare) and check_finite and not cuda
    helper = ThreadPoolExecutor(1, thread_name_prefix="layerwise-check") if shared_check else None
    if helper is not None:
        helper.submit(lambda: None).result()
    engine_waiting = threading.Event()

    def release() -> None:
        reader.close()
        if pool is not None:
            pool.shutdown(wait=True)
        if helper is not None:
            helper.shutdown(wait=True)

    if not readahead:
        def inline() -> Iterator[tuple[PlannedTensor, torch.Tensor]]:
            try:
                for batch, nbytes in zip(batches, batch_bytes):
                    # The whole layer is read (and checked) before its first tensor is handed over.
                    loaded = load_batch(batch, nbytes)
                    if loaded is None:
                        continue
                    for item, _, _ in loaded:
                        stats.add(item.entry.nbytes)
                    for item, tensor, event in loaded:
                        stats.remove(item.entry.nbytes)
                        yield handover(item, tensor, event)
            finally:
                release()

        return OpenStream(inline(), release, lambda: None)

    ready: queue.Queue = queue.Queue()
    limit = ahead_bytes if ahead_bytes is not None else (0 if cuda else 2 * largest_batch)
    # Bytes of the layers read that the engine has not started; the reader waits on `room` for it to fall.
    waiting = [0]
    room = threading.Condition()
    stop = threading.Event()
    finishing = threading.Event()

    def fits(nbytes: int) -> bool:
        return stop.is_set() or waiting[0] == 0 or waiting[0] + nbytes <= limit

    def other_work() -> bool:
        """One step of the hashing backlog, else of the caller's idle work; False when neither had any."""
        return backlog.step() or (idle is not None and idle())

    # Set by `wake` (new idle work), cleared by the reader when it looks for work.
    woken = [False]

    def wake() -> None:
        with room:
            woken[0] = True
            room.notify_all()

    def wait_for_room(nbytes: int) -> None:
        """Block until a layer of NBYTES may be read, doing other work meanwhile; then count it."""
        while True:
            with room:
                if fits(nbytes):
                    waiting[0] += nbytes
                    return
                woken[0] = False
            if other_work():
                continue
            with room:
                room.wait_for(lambda: fits(nbytes) or woken[0])

    def started(nbytes: int) -> None:
        with room:
            waiting[0] -= nbytes
            room.notify()

    def produce() -> None:
        try:
            stats.reader_cpus = move_to(spare)
            for batch, nbytes in zip(batches, batch_bytes):
                wait_for_room(nbytes)
                if stop.is_set():
                    return
                loaded = load_batch(batch, nbytes)
                if loaded is None:
                    started(nbytes)  # nothing handed over: no room taken
                    continue
                for item, _, _ in loaded:
                    stats.add(item.entry.nbytes)
                ready.put((nbytes, loaded))
            ready.put(_DONE)
            # While vLLM finalizes (`stop` drops the rest): the backlog, and with idle work, whatever the caller
            # adds until it waits for this thread before recording (the last layers finish after the stream; a
            # caller that never waits lets it go after a minute).
            given_up = time.monotonic() + 60
            while not stop.is_set():
                with room:
                    woken[0] = False
                if other_work():
                    continue
                if idle is None or finishing.is_set() or time.monotonic() > given_up:
                    break
                with room:
                    room.wait_for(lambda: woken[0] or finishing.is_set() or stop.is_set(),
                                  timeout=max(0.0, given_up - time.monotonic()))
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer, which raises it
            ready.put(exc)
        finally:
            backlog.abandon()

    thread = threading.Thread(target=produce, name="layerwise-readahead", daemon=True)
    thread.start()
    state = {"complete": False, "closed": False}

    def abort() -> None:
        """Stop the reading thread unless the stream ended (then the caller waits for it: `hashing_done`)."""
        if state["closed"]:
            return
        state["closed"] = True
        if not state["complete"]:
            stop.set()
            with room:
                room.notify_all()
            thread.join(timeout=60)
        release()

    def consume() -> Iterator[tuple[PlannedTensor, torch.Tensor]]:
        try:
            while True:
                engine_waiting.set()
                got = ready.get()
                engine_waiting.clear()
                if got is _DONE:
                    state["complete"] = True
                    break
                if isinstance(got, BaseException):
                    raise got
                nbytes, loaded = got
                started(nbytes)  # the engine starts this layer: the reader may fetch more
                for item, tensor, event in loaded:
                    stats.remove(item.entry.nbytes)
                    yield handover(item, tensor, event)
        finally:
            if state["complete"]:
                # The reader finishes its backlog and idle work while vLLM finalizes; the caller waits for it
                # before recording.
                def hashing_done() -> None:
                    finishing.set()
                    wake()
                    thread.join(timeout=60)

                stats.hashing_done = hashing_done
            abort()

    return OpenStream(consume(), abort, wake)


class _HashBacklog:
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


def raw_bytes(tensor: torch.Tensor):
    """A contiguous host tensor's raw bytes, without a copy (b"" for an empty one)."""
    flat = tensor.reshape(-1)
    return flat.view(torch.uint8).numpy().data if flat.numel() else b""
