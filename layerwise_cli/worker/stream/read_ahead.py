"""Read a checkpoint's tensors in planned order, one layer ahead of the engine."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Collection, Iterator
from pathlib import Path

import torch

from layerwise_cli.planning.plan import PlannedTensor
from layerwise_cli.worker.stream.cpu_placement import move_to, spare_cpus
from layerwise_cli.worker.stream.layer_reader import LayerReader
from layerwise_cli.worker.stream.open_stream import OpenStream
from layerwise_cli.worker.stream.remote_stream import RemoteStream
from layerwise_cli.worker.stream.stats import ReadAheadStats

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
    remote: RemoteStream | None = None,
    delta=None,
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
            read-back per layer; see `layerwise_cli.checkpoint.format.finite`).
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
        remote: the source is remote and pinned (a Hub commit, or a store's objects at their ETags), read
            as its bytes arrive (`remote_stream`; FOLDER then only names it).
        delta: a sparse delta FOLDER's base is read through (`Checkpoint.delta`): each tensor is the step's,
            rebuilt and proved by its digests (`ShardReader`). None: the tensors are FOLDER's.

    Returns:
        An `OpenStream` (iterate it once; close it in any case), yielding each planned tensor with its data.

    Raises:
        LayerwiseError: a tensor holds NaN or Inf (naming its shard file), at
            the point in the stream where its layer would be handed over.
    """
    stats = stats or ReadAheadStats()
    layers = LayerReader(stream, folder, device=device, readahead=readahead, stats=stats, check_finite=check_finite,
                         hash_layers=frozenset(hash_layers), digests=digests if digests is not None else {},
                         skip_layer=skip_layer, skipped=skipped if skipped is not None else set(),
                         samples=samples if samples is not None else {}, may_skip=may_skip,
                         copy_threads=copy_threads, remote=remote, delta=delta)
    spare = spare_cpus() if readahead else set()
    # When the reading thread runs beside the engine's cores: one thread on them, which checks half of a layer
    # the engine waits for.
    layers.start_shared_check(bool(spare) and check_finite)
    if not readahead:
        return OpenStream(_inline(layers), layers.release, lambda: None)
    return ReadAhead(layers, spare, ahead_bytes, idle).opened()


def _inline(layers: LayerReader) -> Iterator[tuple[PlannedTensor, torch.Tensor]]:
    """The stream without a reading thread: each layer read (and checked) when the engine asks for it."""
    try:
        for batch, nbytes in layers.batches:
            # The whole layer is read (and checked) before its first tensor is handed over.
            loaded = layers.load(batch, nbytes)
            if loaded is None:
                continue
            for item, _, _ in loaded:
                layers.stats.add(item.entry.nbytes)
            for item, tensor, event in loaded:
                layers.stats.remove(item.entry.nbytes)
                yield layers.handover(item, tensor, event)
    finally:
        layers.release()


class ReadAhead:
    """The reading thread of a stream with read-ahead, and its protocol with the engine's thread.

    The reader reads a layer whenever the bytes of read layers the engine has
    not started (`waiting`) leave room for it under `limit` (always when none
    is held), and puts it on `ready`; the engine takes it from there (`consume`)
    and says so (`_started`), which makes room. While there is no room, the
    reader does other work: the hashing backlog, then the caller's `idle` work;
    when it has none it sleeps on `room` until there is room or `wake` says new
    idle work is there. After the stream it keeps at that work while vLLM
    finalizes, until the caller waits for it (`stats.hashing_done`). Closing the
    stream before its end (`abort`) stops it.
    """

    def __init__(self, layers: LayerReader, spare: set[int], ahead_bytes: int | None,
                 idle: Callable[[], bool] | None) -> None:
        self.layers = layers
        self.spare = spare
        self.idle = idle
        self.ready: queue.Queue = queue.Queue()
        self.limit = ahead_bytes if ahead_bytes is not None else (0 if layers.cuda else 2 * layers.largest_batch)
        # Bytes of the layers read that the engine has not started; the reader waits on `room` for it to fall.
        self.waiting = 0
        self.room = threading.Condition()
        self.finishing = threading.Event()
        # Set by `wake` (new idle work), cleared by the reader when it looks for work.
        self.woken = False
        self.stop = threading.Event()  # set when the stream is closed before its end
        self.complete = False  # the engine took the whole stream
        self.closed = False
        self.thread = threading.Thread(target=self._produce, name="layerwise-readahead", daemon=True)
        self.thread.start()

    def opened(self) -> OpenStream:
        """The stream for the engine's side: `consume`, closed by `abort`, woken by `wake`."""
        return OpenStream(self.consume(), self.abort, self.wake)

    # ----------------------------------------------------------------------------- the reading thread

    def _fits(self, nbytes: int) -> bool:
        return self.stop.is_set() or self.waiting == 0 or self.waiting + nbytes <= self.limit

    def _other_work(self) -> bool:
        """One step of the hashing backlog, else of the caller's idle work; False when neither had any."""
        return self.layers.backlog.step() or (self.idle is not None and self.idle())

    def _wait_for_room(self, nbytes: int) -> None:
        """Block until a layer of NBYTES may be read, doing other work meanwhile; then count it."""
        while True:
            with self.room:
                if self._fits(nbytes):
                    self.waiting += nbytes
                    return
                self.woken = False
            if self._other_work():
                continue
            with self.room:
                self.room.wait_for(lambda: self._fits(nbytes) or self.woken)

    def _started(self, nbytes: int) -> None:
        with self.room:
            self.waiting -= nbytes
            self.room.notify()

    def _produce(self) -> None:
        try:
            self.layers.stats.reader_cpus = move_to(self.spare)
            if self._read_all():
                self.ready.put(_DONE)
                self._work_while_finalizing()
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer, which raises it
            self.ready.put(exc)
        finally:
            self.layers.backlog.abandon()

    def _read_all(self) -> bool:
        """Read every layer onto `ready`, as room allows; False when the stream was stopped first."""
        for batch, nbytes in self.layers.batches:
            self._wait_for_room(nbytes)
            if self.stop.is_set():
                return False
            loaded = self.layers.load(batch, nbytes)
            if loaded is None:
                self._started(nbytes)  # nothing handed over: no room taken
                continue
            for item, _, _ in loaded:
                self.layers.stats.add(item.entry.nbytes)
            self.ready.put((nbytes, loaded))
        return True

    def _work_while_finalizing(self) -> None:
        # While vLLM finalizes (`stop` drops the rest): the backlog, and with idle work, whatever the caller
        # adds until it waits for this thread before recording (the last layers finish after the stream; a
        # caller that never waits lets it go after a minute).
        given_up = time.monotonic() + 60
        while not self.stop.is_set():
            with self.room:
                self.woken = False
            if self._other_work():
                continue
            if self.idle is None or self.finishing.is_set() or time.monotonic() > given_up:
                break
            with self.room:
                self.room.wait_for(lambda: self.woken or self.finishing.is_set() or self.stop.is_set(),
                                   timeout=max(0.0, given_up - time.monotonic()))

    # ----------------------------------------------------------------------------- the engine's side

    def wake(self) -> None:
        """Tell the reading thread that new idle work is there (any thread may call it)."""
        with self.room:
            self.woken = True
            self.room.notify_all()

    def consume(self) -> Iterator[tuple[PlannedTensor, torch.Tensor]]:
        """Yield the layers the reader put on `ready`, in order; raise what it raised."""
        layers = self.layers
        try:
            while True:
                layers.engine_waiting.set()
                got = self.ready.get()
                layers.engine_waiting.clear()
                if got is _DONE:
                    self.complete = True
                    break
                if isinstance(got, BaseException):
                    raise got
                nbytes, loaded = got
                self._started(nbytes)  # the engine starts this layer: the reader may fetch more
                for item, tensor, event in loaded:
                    layers.stats.remove(item.entry.nbytes)
                    yield layers.handover(item, tensor, event)
        finally:
            if self.complete:
                # The reader finishes its backlog and idle work while vLLM finalizes; the caller waits for it
                # before recording.
                layers.stats.hashing_done = self._hashing_done
            self.abort()

    def _hashing_done(self) -> None:
        self.finishing.set()
        self.wake()
        self.thread.join(timeout=60)

    def abort(self) -> None:
        """Stop the reading thread unless the stream ended (then the caller waits for it: `hashing_done`)."""
        if self.closed:
            return
        self.closed = True
        if not self.complete:
            self.stop.set()
            with self.room:
                self.room.notify_all()
            self.thread.join(timeout=60)
        self.layers.release()
