"""Decode the next layer's v2 delta chunks in a second thread while the engine thread writes the current layer."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import ThreadPoolExecutor

from layerwise_cli.worker.stream.cpu_placement import move_to


class DecodeAhead:
    """`take(key)` returns `call(key)`, computed one key ahead in a thread bound to SPARE CPUs (or unbound where
    ANYWHERE: the engine thread only queues a device's writes); in the calling thread when neither.

    Keys are taken in the order given. Decoding a v2 chunk (decompress, unshuffle, a cumulative sum) costs about
    as much per change as writing it, and needs no engine state: on a spare core it overlaps the writes. An error
    in a call is raised by the `take` of its key. On leaving, a call not yet taken is waited for and dropped.
    """

    def __init__(self, keys: Sequence[Hashable], call: Callable, spare: set[int], anywhere: bool = False) -> None:
        self._keys, self._call = list(keys), call
        self._spare, self._anywhere = spare, anywhere
        self._pool = None
        self._pending: dict = {}
        self._next = 0

    def __enter__(self) -> DecodeAhead:
        if self._spare or self._anywhere:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="layerwise-decode-ahead",
                                            initializer=move_to, initargs=(self._spare,))
            self._submit_next()
        return self

    def _submit_next(self) -> None:
        if self._next < len(self._keys):
            key = self._keys[self._next]
            self._next += 1
            self._pending[key] = self._pool.submit(self._call, key)

    def take(self, key: Hashable):
        """`call(KEY)`'s result (the next key's call is started first)."""
        if self._pool is None:
            return self._call(key)
        future = self._pending.pop(key)
        self._submit_next()
        return future.result()

    def __exit__(self, *exc: object) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
