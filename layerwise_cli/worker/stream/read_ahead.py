"""Read a checkpoint's tensors in planned order, one layer ahead of the engine."""

from __future__ import annotations

import queue
import threading
import time
from collections import Counter
from collections.abc import Callable, Collection, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from layerwise_cli.checkpoint.digests import layer_digest, tensor_digest
from layerwise_cli.checkpoint.finite import first_nonfinite, first_nonfinite_shared, refusal
from layerwise_cli.checkpoint.samples import buffer_sample
from layerwise_cli.planning.plan import PlannedTensor
from layerwise_cli.worker.stream.cpu_placement import move_to, spare_cpus
from layerwise_cli.worker.stream.hash_backlog import HashBacklog
from layerwise_cli.worker.stream.open_stream import OpenStream
from layerwise_cli.worker.stream.read_into_place import PlaceReader
from layerwise_cli.worker.stream.shard_reader import ShardReader, layer_batches, raw_bytes
from layerwise_cli.worker.stream.staging import copy_in_chunks, handed_over, staging_threads, to_device
from layerwise_cli.worker.stream.stats import ReadAheadStats

# A layer the engine waits for is checked by two threads when it holds at least this many bytes.
_SHARED_CHECK_BYTES = 8 << 20
_DONE = object()


def read_in_order(stream: list[PlannedTensor], folder: Path, **options) -> Iterator[tuple[PlannedTensor, torch.Tensor]]:
    """Yield (planned tensor, tensor) in stream order: `open_stream`, read as a generator (closed with it)."""
    opened = open_stream(stream, folder, **options)
    try:
        yield from opened
    finally:
        opened.close()


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
    into_place: PlaceReader | None = None,
) -> OpenStream:
    """Start reading STREAM; iterating the result yields (planned tensor, tensor) in stream order.

    The reading thread starts at once, so the first layers are read (and
    checked) while the caller prepares the engine (vLLM's reload moves the
    model's layers to the meta device before it asks for the first tensor).

    With `readahead`, a thread reads the next parent layers while the engine
    loads and processes the current one, at most `ahead_bytes` of layers the
    engine has not started (always at least one layer). On CPU the tensors are
    safetensors' views of the file mapping (holding them costs mapped page
    cache, not memory of their own), so the reader may run two of the largest
    layers ahead (a small layer takes the engine no time). On a CUDA device,
    tensors are staged in pinned host memory by a few threads and copied to the
    device asynchronously on a side stream. On the CPU, the reading thread moves
    beside the cores vLLM bound the worker to (`cpu_placement`), and a layer the
    engine waits for (the first one always) is checked by two threads: the
    reader and one on the engine's idle cores.

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
        into_place: reads the tensors it plans straight into the engine's tensors, checked, sampled and
            hashed in one pass, once vLLM's reload began (`read_into_place`; CPU only).

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

    batches = layer_batches(stream)
    # A layer split into several runs of the stream cannot be dropped: part of it would already be handed over.
    runs = Counter(batch[0].parent for batch in batches)

    batch_bytes = [sum(item.entry.nbytes for item in batch) for batch in batches]
    largest_batch = max(batch_bytes, default=0)
    # The backlog keeps views of at most two of the largest layers' bytes.
    backlog = HashBacklog(digests, stats, 2 * largest_batch)

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

    def mapped(item: PlannedTensor) -> torch.Tensor:
        tensor = reader.read(item)  # safetensors' view of the file: handed to vLLM, whose copy from it is skipped
        if last_of_shard.get(item.entry.shard) is item:
            reader.release(item.entry.shard)
        return tensor

    def load_batch(batch: list[PlannedTensor], nbytes: int) -> list[tuple] | None:
        """Read one parent layer (NBYTES: its tensors' bytes); with `check_finite`, refuse it if any holds NaN or Inf.

        None when the layer is hashed and `skip_layer` drops it.
        """
        parent = batch[0].parent
        may_drop = skip_layer is not None and parent is not None and parent in hash_layers and runs[parent] == 1
        placing = into_place.to_place(batch, may_drop, may_skip) if into_place is not None and not cuda else set()
        if placing and not into_place.wait_for_engine(stop):
            return None  # stopped before vLLM began: nothing read, nothing changed
        # The engine waits for this layer (the first always): its idle core checks part of it. A layer read into
        # place is always shared: the copy moved from the engine's thread to the reading side.
        share = helper.submit if helper is not None and (not stats.read_layers or engine_waiting.is_set()) else None
        placed = into_place.read_layer([item for item in batch if item.entry.name in placing], mapped, stats, samples,
                                       digests, check=check_finite, digest=parent in hash_layers,
                                       submit=helper.submit if helper is not None else None) if placing else {}
        read = [(placed[item.entry.name].mapped,) * 2 if item.entry.name in placed else read_host(item)
                for item in batch]
        if parent in hash_layers:
            # Hashed in full only when the hash can decide a skip now: the layer is whole in this run and its
            # samples equal its record's. A changed layer (a full change: every one) costs no hash at all, except
            # the tensors read into place: hashed in that pass, while their bytes are in the cache.
            if not placing and may_drop and (may_skip is None or may_skip(
                    parent, {item.entry.name: samples[item.entry.name] for item in batch})):
                hash_batch(batch, [raw for _, raw in read])
                if dropped(batch):
                    return None
            else:
                rest = [(item, raw) for item, (_, raw) in zip(batch, read) if item.entry.name not in digests]
                if rest and readahead:
                    backlog.add([item for item, _ in rest], [raw for _, raw in rest], nbytes)
                elif rest:
                    stats.unhashed_layers += 1
        loaded = [(item, *to_device(host, device, copy_stream)) for item, (host, _) in zip(batch, read)]
        if check_finite:
            start = time.perf_counter()
            tensors = [(item.entry.name, item.entry.shard, tensor) for item, tensor, _ in loaded
                       if item.entry.name not in placed]
            found = None
            if any(done.nonfinite for done in placed.values()):
                # Found from the bit patterns as each chunk was read: counted exactly, named.
                found = next((hit for hit in (into_place.nonfinite(item) for item in batch
                                              if item.entry.name in placed) if hit is not None), None)
            if found is not None or not tensors:
                pass
            elif cuda:
                # Reduced on the device, after the copies, on their stream: one read-back per layer.
                with torch.cuda.stream(copy_stream):
                    found = first_nonfinite(tensors)
            elif share is not None and nbytes >= _SHARED_CHECK_BYTES:
                found = first_nonfinite_shared(tensors, share)
            else:
                found = first_nonfinite(tensors)
            stats.check_s += time.perf_counter() - start
            if found is not None:
                raise refusal(found, str(folder / found.shard))
        stats.read_layers += 1
        return loaded

    def handover(item: PlannedTensor, tensor, event) -> tuple[PlannedTensor, torch.Tensor]:
        return item, handed_over(tensor, event, device)

    spare = spare_cpus() if readahead else set()
    # When the reading thread runs beside the engine's cores: one thread on them, which checks half of a layer
    # the engine waits for. Started here, by the engine's thread, so that it runs where the engine does.
    shared_check = ((bool(spare) and check_finite) or into_place is not None) and not cuda
    helper = ThreadPoolExecutor(1, thread_name_prefix="layerwise-check") if shared_check else None
    if helper is not None:
        helper.submit(lambda: None).result()
    engine_waiting = threading.Event()
    stop = threading.Event()  # set when the stream is closed before its end

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
