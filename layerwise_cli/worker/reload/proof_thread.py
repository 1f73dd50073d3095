"""A second thread for the proofs of a patch in place, so that proving one layer overlaps writing the next."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

from layerwise_cli.worker.stream.cpu_placement import move_to


class ProofThread:
    """Calls run in order in a second thread bound to SPARE CPUs (those beside the engine's), or unbound where
    ANYWHERE (the calling thread only waits for a device); in the calling thread otherwise.

    On the host, both the write and the proof go through memory: a second thread on the engine's own cores
    only competes with the first (measured: slower), so it runs only where a spare CPU is.

    `results` waits for every call, in order, and returns their keys; the first call that raised raises there.
    On leaving, calls not yet run are cancelled and the one running is waited for: nothing runs after the block.
    """

    def __init__(self, spare: set[int], anywhere: bool = False) -> None:
        self._spare, self._anywhere = spare, anywhere
        self._pool = None
        self._futures: list[tuple[str, object]] = []

    def __enter__(self) -> ProofThread:
        if self._spare or self._anywhere:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="layerwise-patch-proof",
                                            initializer=move_to, initargs=(self._spare,))
        return self

    def submit(self, key: str, call: Callable, *args) -> None:
        if self._pool is None:
            call(*args)
            self._futures.append((key, None))
        else:
            self._futures.append((key, self._pool.submit(call, *args)))

    def results(self) -> list[str]:
        for _, future in self._futures:
            if future is not None:
                future.result()
        return [key for key, _ in self._futures]

    def __exit__(self, *exc: object) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)


def written_mark(device: torch.device):
    """On a CUDA device, an event after the work queued so far on the calling thread's current stream (the
    layer's writes); None on the host, where a write is done when its call returns."""
    if device.type != "cuda":
        return None
    mark = torch.cuda.Event()
    mark.record()
    return mark
