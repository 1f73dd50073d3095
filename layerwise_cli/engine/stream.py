"""Read a checkpoint's tensors in planned order, one layer ahead of the engine."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from ..plan import PlannedTensor


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
            handle = self._handles[shard] = safe_open(str(self._folder / shard), framework="pt", device="cpu")
        return handle.get_tensor(item.entry.name)

    def close(self) -> None:
        self._handles.clear()


@dataclass
class ReadAheadStats:
    peak_bytes: int = 0
    _held: int = 0

    def add(self, n: int) -> None:
        self._held += n
        self.peak_bytes = max(self.peak_bytes, self._held)

    def remove(self, n: int) -> None:
        self._held -= n


_DONE = object()


def read_in_order(
    stream: list[PlannedTensor],
    folder: Path,
    *,
    device: torch.device | None = None,
    readahead: bool = True,
    stats: ReadAheadStats | None = None,
) -> Iterator[tuple[PlannedTensor, torch.Tensor]]:
    """Yield (planned tensor, tensor) in stream order.

    With `readahead`, a thread reads the next parent layer while the engine
    loads and processes the current one; it never runs more than one layer
    ahead. On a CUDA device, tensors are staged in pinned host memory and
    copied asynchronously on a side stream, so the engine's processing
    (online quantization) runs on the device.

    Args:
        stream: tensors in the order to hand them over.
        folder: directory holding the shard files.
        device: where the engine wants tensors (None or CPU: stay on host).
        readahead: overlap reading with loading.
        stats: receives the peak bytes read but not yet handed over.

    Yields:
        Each planned tensor with its data.
    """
    stats = stats or ReadAheadStats()
    reader = ShardReader(folder)
    cuda = device is not None and device.type == "cuda"
    copy_stream = torch.cuda.Stream(device=device) if cuda else None

    def load(item: PlannedTensor):
        tensor = reader.read(item)
        if not cuda:
            return tensor, None
        with torch.cuda.stream(copy_stream):
            staged = tensor.pin_memory().to(device, non_blocking=True)
            event = torch.cuda.Event()
            event.record(copy_stream)
        return staged, event

    def handover(item: PlannedTensor, tensor, event) -> tuple[PlannedTensor, torch.Tensor]:
        if event is not None:
            torch.cuda.current_stream(device).wait_event(event)
            tensor.record_stream(torch.cuda.current_stream(device))
        return item, tensor

    batches = layer_batches(stream)
    if not readahead:
        try:
            for batch in batches:
                for item in batch:
                    tensor, event = load(item)
                    stats.add(item.entry.nbytes)
                    stats.remove(item.entry.nbytes)
                    yield handover(item, tensor, event)
        finally:
            reader.close()
        return

    ready: queue.Queue = queue.Queue()
    # One slot: the reader may hold at most one layer that the engine has not started.
    slot = threading.Semaphore(1)
    stop = threading.Event()

    def produce() -> None:
        try:
            for batch in batches:
                slot.acquire()
                if stop.is_set():
                    return
                loaded = []
                for item in batch:
                    loaded.append((item, *load(item)))
                    stats.add(item.entry.nbytes)
                ready.put(loaded)
            ready.put(_DONE)
        except BaseException as exc:  # handed to the consumer, which raises it
            ready.put(exc)

    thread = threading.Thread(target=produce, name="layerwise-readahead", daemon=True)
    thread.start()
    try:
        while True:
            loaded = ready.get()
            if loaded is _DONE:
                break
            if isinstance(loaded, BaseException):
                raise loaded
            slot.release()  # the engine starts this layer: the reader may fetch the next
            for item, tensor, event in loaded:
                stats.remove(item.entry.nbytes)
                yield handover(item, tensor, event)
    finally:
        stop.set()
        slot.release()
        thread.join(timeout=60)
        reader.close()
