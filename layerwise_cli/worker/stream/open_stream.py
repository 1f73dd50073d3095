"""A stream of a checkpoint's tensors being read: iterate it once, close it in any case."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from layerwise_cli.planning.plan import PlannedTensor


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
