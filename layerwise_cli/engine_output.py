"""While a vLLM engine starts, copy this process's and its children's output through a pipe, to name why it failed.

vLLM's engine core and worker processes report a failed start only in their
own output: `logger.exception("EngineCore failed to start.")` (its log goes
to stdout by default, VLLM_LOGGING_STREAM), `WorkerProc failed to start.`
likewise, and multiprocessing's traceback of the engine process on stderr.
The parent only learns "Engine core initialization failed. See root cause
above. Failed core proc(s): {}" (vllm/v1/engine/utils.py). Those processes
are spawned with this process's file descriptors 1 and 2; a logging handler
installed in them (a worker extension) would come too late for a config that
breaks model init. So `capture_engine_output` points fds 1 and 2 at pipes
before the engine starts; a thread copies every byte on to the original
descriptor (the user sees all of it, as before) and keeps the last lines;
`root_cause` reads the exception those lines end with.

The children keep the pipes for their lifetime; after the start the parent's
own descriptors are restored and the threads go on copying the children's
output until they exit.
"""

from __future__ import annotations

import os
import re
import sys
import threading
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager, suppress

_KEPT_LINES = 2000
# vLLM prefixes its child processes' lines: "(EngineCore_DP0 pid=123) ", "(Worker_TP1 pid=9) ".
_PROCESS_PREFIX = re.compile(r"^\((?:[\w.-]+ )?pid=\d+\) ")
# A log record's header: "ERROR 12-01 13:00:00 [core.py:1510] ".
_LOG_PREFIX = re.compile(r"^(?:DEBUG|INFO|WARNING|ERROR|CRITICAL) \d\d-\d\d \d\d:\d\d:\d\d(?:\.\d+)? \[[^\]]*\] ")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_EXCEPTION_LINE = re.compile(r"^(?P<type>[A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt|Failure|Fault))"
                             r"(?::\s*(?P<text>.*))?$")
# Exceptions that only point at another process's report.
_WRAPPERS = ("See root cause above", "See stack trace for root cause", "initialization failed",
             "Engine core initialization", "WorkerProc initialization failed")


class _Tee:
    """One descriptor copied through a pipe to its original target, keeping the last lines."""

    def __init__(self, fd: int, lines: deque[str]) -> None:
        self.fd = fd
        self._lines = lines
        self._keeping = True
        self._original = os.dup(fd)
        read_end, write_end = os.pipe()
        os.dup2(write_end, fd)
        os.close(write_end)
        self._read_end = read_end
        self._thread = threading.Thread(target=self._pump, name=f"layerwise-engine-output-{fd}", daemon=True)
        self._thread.start()

    def _pump(self) -> None:
        partial = b""
        try:
            while chunk := os.read(self._read_end, 65536):
                _write_all(self._original, chunk)
                if self._keeping:
                    *complete, partial = (partial + chunk).split(b"\n")
                    self._lines.extend(line.decode("utf-8", "replace") for line in complete)
                    partial = partial[-65536:]
        finally:
            os.close(self._read_end)
            os.close(self._original)

    def restore(self) -> None:
        """Point the descriptor back at its original target; the pipe serves the children until they exit."""
        os.dup2(self._original, self.fd)

    def settle(self, timeout: float) -> None:
        """Wait (up to TIMEOUT s) until the children that hold the pipe have exited and their last lines are in."""
        self._thread.join(timeout)

    def stop_keeping(self) -> None:
        self._keeping = False


def _write_all(fd: int, data: bytes) -> None:
    try:
        while data:
            data = data[os.write(fd, data):]
    except OSError:  # the original target is gone (a closed pipe): keep draining
        pass


class EngineOutput:
    """The lines an engine start wrote (this process's and its children's)."""

    def __init__(self) -> None:
        self.lines: deque[str] = deque(maxlen=_KEPT_LINES)
        self._tees: list[_Tee] = []

    def stop_keeping(self) -> None:
        """Keep no more lines (the start succeeded); the output is still copied through."""
        for tee in self._tees:
            tee.stop_keeping()

    def root_cause(self, settle_s: float = 3.0) -> str | None:
        """The exception the start's output ends with; call it after the capture ended.

        Waits up to SETTLE_S s for children that are exiting to write their last lines.
        """
        for tee in self._tees:
            tee.settle(settle_s)
        return root_cause(list(self.lines))


@contextmanager
def capture_engine_output() -> Iterator[EngineOutput]:
    """Copy fds 1 and 2 through pipes while the block runs (an engine start), keeping what is written.

    A no-op capture (nothing kept) when the descriptors cannot be redirected.
    """
    output = EngineOutput()
    tees = output._tees
    try:
        _flush()
        for fd in (1, 2):
            tees.append(_Tee(fd, output.lines))
    except OSError:
        for tee in tees:
            tee.restore()
            tee.stop_keeping()
        tees.clear()
    try:
        yield output
    finally:
        _flush()
        for tee in tees:
            tee.restore()


def _flush() -> None:
    # What Python buffered goes out before the descriptors change under it.
    for stream in (sys.stdout, sys.stderr):
        with suppress(OSError, ValueError, AttributeError):
            stream.flush()


def start_failure(exc: BaseException, cause: str | None) -> str:
    """The one-line reason an engine start failed: vLLM's exception, or the root cause it points at.

    Args:
        exc: what the start raised in this process.
        cause: `root_cause` of the start's output.
    """
    text = " ".join(str(exc).split())[:300] or type(exc).__name__
    if cause and (any(wrapper in text for wrapper in _WRAPPERS) or text in cause):
        return f"the vLLM engine failed to start: {cause[:400]} (raised in vLLM's engine process; its log above " \
               "has the traceback)"
    return f"the vLLM engine failed to start: {text}"


def root_cause(lines: list[str]) -> str | None:
    """The last exception a traceback in LINES ends with, other than one that points elsewhere for its cause.

    Args:
        lines: output lines (vLLM's process and log prefixes and colours are stripped).

    Returns:
        `Type: message` (one line), or None when no traceback names one.
    """
    found = None
    in_traceback = False
    for raw in lines:
        line = _LOG_PREFIX.sub("", _PROCESS_PREFIX.sub("", _ANSI.sub("", raw.rstrip("\r"))))
        if line.startswith("Traceback (most recent call last):"):
            in_traceback = True
            continue
        if not in_traceback or not line.strip():
            continue
        if line[0].isspace() or line.startswith("^"):
            continue  # a frame or its source line
        match = _EXCEPTION_LINE.match(line.strip())
        in_traceback = False
        if match and not any(wrapper in line for wrapper in _WRAPPERS):
            found = " ".join(line.split())
    return found
