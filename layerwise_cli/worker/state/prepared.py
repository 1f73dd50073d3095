"""A pinned step a pre-flight opened, kept for the reload that follows it, so that the pause holds only the apply.

A fleet pre-flights every server before it pauses any (`client/servers/fleet.py`), then pauses them and
reloads. For a step by URL or from a Hub run, opening it is network work: each link of a delta's chain named,
checked against the operation's pin and kept in this host's cache, the full step's headers read. Checking a
delta (its positions, its new values for NaN/Inf) decodes every link. Done again by the reload, all of it would
sit inside the pause. The pre-flight keeps what it opened under (source, pin); the reload of the same source at
the same pin takes it, once, with the checks its delta passed (`DeltaChain.passed`).

Only a pinned source is kept: a Hub commit, or a store pin (`etags:<hex>` of every object read), names every
byte, and the objects are kept in this host's cache under their ETags. A local delta step's files name no bytes;
they are pinned by what the kernel keeps about each (`checkpoint/local_pin.py`: inode, size, modification and
change times), taken when none had changed since before the pre-flight began, and the reload takes the step
only while every file still has that pin (a file written or replaced in between: opened and checked again).
What is kept ends by itself: one entry, replaced by the next pre-flight, and not taken after `KEEP_S` seconds.

A delta step the reload would rebuild rather than patch in place (the CPU's packed linear layers) is rebuilt by
the pre-flight into a full step's files (`checkpoint/delta/rebuilt_step.py`), in this process's folder of the
cache (`prepared_folder`: one step at a time, replaced by the next; a dead process's folder is removed by the
next one to write).
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from layerwise_cli.cache_root import cache_root
from layerwise_cli.checkpoint.format.layout import INDEX_NAME
from layerwise_cli.checkpoint.local_pin import files_pin
from layerwise_cli.checkpoint.sources import Checkpoint
from layerwise_cli.worker.state.worker_state import kept_on

_ATTRIBUTE = "_layerwise_prepared"
# A reload follows its pre-flight within a fleet's pause request; later, the step is opened again.
KEEP_S = 300.0


@dataclass(frozen=True)
class _Kept:
    source: str
    revision: str
    checkpoint: Checkpoint
    notes: tuple[str, ...]
    at: float
    files: tuple[Path, ...] = ()  # a local step's files, pinned by `revision` (`files_pin`)


class Prepared:
    """One worker's last pre-flighted pinned step."""

    def __init__(self) -> None:
        self._kept: _Kept | None = None

    def keep(self, source: str, revision: str | None, checkpoint: Checkpoint, notes: tuple[str, ...] = (),
             files: tuple[Path, ...] = ()) -> None:
        """Keep CHECKPOINT, opened from SOURCE at the pin REVISION (nothing is kept without a pin), with the NOTES
        the reload's report is to carry (what the pre-flight found that the prepared step no longer shows). A
        local step's REVISION is its FILES' `files_pin`."""
        self._kept = _Kept(source, revision, checkpoint, tuple(notes), time.monotonic(), tuple(files)) \
            if revision else None

    def take(self, source: str, revision: str | None) -> tuple[Checkpoint, tuple[str, ...]] | None:
        """The step kept for SOURCE at REVISION and its notes, once; None when there is none, another, or it is
        too old."""
        kept, self._kept = self._kept, None
        if kept is None or not revision or (kept.source, kept.revision) != (source, revision):
            return None
        return (kept.checkpoint, kept.notes) if time.monotonic() - kept.at <= KEEP_S else None

    def take_local(self, source: str) -> tuple[Checkpoint, tuple[str, ...]] | None:
        """The local step kept for SOURCE and its notes, once, while each of its files has the pin it had when
        the pre-flight read it; None otherwise. As `take`, it ends what was kept, whatever it returns."""
        files = self._kept.files if self._kept is not None else ()
        return self.take(source, files_pin(files) if files else None)


def step_files(checkpoint: Checkpoint) -> list[Path]:
    """Every local file a delta step is rebuilt from: each link's delta file and the `config.json` beside it, and
    the shards, index and config of the full step at the chain's start. What a local step is pinned by."""
    assert checkpoint.delta is not None and checkpoint.local_dir is not None, checkpoint.source
    files = [checkpoint.shard_path(shard) for shard in checkpoint.shards]
    files += [path for path in (checkpoint.local_dir / INDEX_NAME, checkpoint.local_dir / "config.json")
              if path.is_file()]
    for link in checkpoint.delta.links:
        config = link.path.parent / "config.json"
        files += [link.path, config] if config.is_file() else [link.path]
    return files


def prepared_of(worker) -> Prepared:
    """The worker's kept step, made on first use."""
    return kept_on(worker, _ATTRIBUTE, Prepared)


def prepared_folder() -> Path:
    """Where this process rebuilds a prepared step: `<cache>/prepared/<pid>/step`. Folders of processes that no
    longer run are removed first."""
    root = cache_root() / "prepared"
    if root.is_dir():
        for other in root.iterdir():
            if other.name.isdigit() and int(other.name) != os.getpid() and not _running(int(other.name)):
                shutil.rmtree(other, ignore_errors=True)
    return root / str(os.getpid()) / "step"


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True
