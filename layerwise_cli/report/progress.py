"""Per-layer progress from workers to the command, through a file both can see."""

from __future__ import annotations

import json
import os
import tempfile
import threading
from pathlib import Path


class ProgressWriter:
    """Appends one JSON line per completed or skipped parent layer (rank 0 only).

    Safe to call from the reading thread and the engine's thread at once.
    """

    def __init__(self, path: str | None, total_layers: int, total_bytes: int) -> None:
        self._file = open(path, "a", buffering=1, encoding="utf-8") if path else None  # noqa: SIM115
        self._lock = threading.Lock()
        self.write({"event": "start", "layers": total_layers, "bytes": total_bytes})

    def write(self, event: dict) -> None:
        with self._lock:
            if self._file is not None:
                self._file.write(json.dumps(event) + "\n")

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


def read_events(path: Path, offset: int) -> tuple[list[dict], int]:
    """New events after byte `offset`, and the new offset (only whole lines)."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read()
    except FileNotFoundError:
        return [], offset
    end = data.rfind(b"\n") + 1
    events = [json.loads(line) for line in data[:end].splitlines() if line.strip()]
    return events, offset + end


def new_progress_path() -> str:
    fd, path = tempfile.mkstemp(prefix="layerwise-progress-", suffix=".jsonl")
    os.close(fd)
    return path
