"""A worker extension for the data-parallel tests: one engine reads a poisoned copy of the source.

Where `<source>.engine<N>` exists, the workers of data-parallel engine N
reload from that folder instead of SOURCE: the test arms it with a copy
holding a NaN, so that engine N fails mid-stream (and rolls back) while the
others load SOURCE, as if SOURCE were corrupt for that engine only. Every
other behaviour is layerwise's own extension.
"""

from __future__ import annotations

from pathlib import Path

from layerwise_cli.worker.extension import LayerwiseWorkerExtension
from layerwise_cli.worker.stream.rank_plan import rank_position

FAULTY_EXTENSION_CLS = "tests.support.dp_fault.FaultOnOneEngine"


class FaultOnOneEngine(LayerwiseWorkerExtension):
    """`layerwise_reload` from `<source>.engine<dp_rank>` when that folder exists."""

    def layerwise_reload(self, source: str, *args, **kwargs) -> dict:
        poisoned = Path(f"{source}.engine{rank_position(self).dp_rank}")
        return super().layerwise_reload(str(poisoned) if poisoned.is_dir() else source, *args, **kwargs)
