"""SIGINT/SIGTERM during a rewrite: raise `ReorderInterrupted`, or hold the signal while DST is swapped in."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager


class ReorderInterrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM arrived while writing; temporary files are removed before this propagates."""

    def __init__(self, signum: int, committed: bool = False) -> None:
        self.signum = signum
        self.committed = committed  # True: the signal came during the final rename, DST is complete
        super().__init__(signal.Signals(signum).name)


class SignalGuard:
    """Turn SIGINT/SIGTERM into `ReorderInterrupted`, or hold them while the DST is being swapped in."""

    def __init__(self) -> None:
        self.held = False
        self.pending: int | None = None

    def handler(self, signum: int, frame: object) -> None:
        if self.held:
            self.pending = signum
            return
        raise ReorderInterrupted(signum)

    @contextmanager
    def hold(self) -> Iterator[None]:
        self.held = True
        try:
            yield
        finally:
            self.held = False


@contextmanager
def signals_raise() -> Iterator[SignalGuard]:
    guard = SignalGuard()
    if threading.current_thread() is not threading.main_thread():
        yield guard  # signals reach only the main thread's handlers anyway
        return
    previous = {sig: signal.signal(sig, guard.handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield guard
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
