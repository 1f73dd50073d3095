"""`write_delta`: a trainer's full step written again as a sparse delta against the step before, atomically."""

from __future__ import annotations

import os
import time
from pathlib import Path

from layerwise_cli.checkpoint.delta.encode import VERSION
from layerwise_cli.checkpoint.delta.format import WHOLE_FRACTION
from layerwise_cli.checkpoint.delta.read import delta_file
from layerwise_cli.checkpoint.format.layout import is_weight_file
from layerwise_cli.checkpoint.sources import Checkpoint, open_checkpoint
from layerwise_cli.errors import LayerwiseError
from layerwise_cli.planning.inspect import OrderReport
from layerwise_cli.planning.parents import mapping_for_config
from layerwise_cli.planning.plan import build_plan
from layerwise_cli.reorder.commit import CHECKPOINT_FILE_SUFFIXES
from layerwise_cli.staging import put_in_place, staging
from layerwise_cli.writer.delta_file import checkpoint_tensors, write_delta_against
from layerwise_cli.writer.save import (
    FILLED_UP,
    SavedCheckpoint,
    _check_destination,
    _check_marker,
    _saved,
    _write_marker,
)
from layerwise_cli.writer.spill import copy_range


def write_delta(base: str | os.PathLike[str], new: str | os.PathLike[str], directory: str | os.PathLike[str], *,
                marker: str | None = "STABLE", overwrite: bool = False,
                whole_fraction: float = WHOLE_FRACTION, delta_format: int = VERSION) -> SavedCheckpoint:
    """Write NEW (a full checkpoint) into DIRECTORY as a delta against BASE, or as a full copy when it must be.

    The same rule as `save_checkpoint(..., base=BASE)`: a delta when BASE is proved (its header digests match
    its bytes; without digests they are computed from the bytes), holds the same tensors with the same shapes
    and dtypes as NEW, and the delta is smaller than NEW; otherwise NEW's files are copied and `fallback` says
    why. DIRECTORY gets `delta.safetensors` (or NEW's shards and index), NEW's other files (`config.json`,
    tokenizer), then the MARKER, atomically: written beside DIRECTORY, fsync'd, renamed into place, marker last.

    Args:
        base: the previous step's directory (a full checkpoint on this machine).
        new: the new step's directory (a full checkpoint).
        directory: the step directory to create.
        marker: the empty completion file created last (None: none).
        overwrite: replace an existing non-empty DIRECTORY of plain files.
        whole_fraction: a tensor with more than this fraction of its values changed is stored whole.
        delta_format: the delta format's version: 2 (`checkpoint.delta.v2`), or 1 for engines running a layerwise
            that reads only v1.

    Returns:
        What was written (`delta` set for a delta, `fallback` for a full copy).

    Raises:
        LayerwiseError: NEW cannot be read or is a delta itself, DIRECTORY exists without `overwrite`, or a
            write failed; nothing is put in place then.
    """
    started = time.perf_counter()
    dst = Path(directory).absolute()
    where = str(dst)
    if delta_file(new) is not None:
        raise LayerwiseError("is a delta: `layerwise delta` takes a full checkpoint as NEW", where=str(new))
    checkpoint = open_checkpoint(str(new))
    if checkpoint.local_dir is None or checkpoint.kind != "directory":
        raise LayerwiseError("NEW must be a checkpoint directory on this machine", where=str(new))
    _check_marker(marker, where)
    _check_destination(dst, overwrite)
    try:
        with staging(dst) as tmp:
            out = tmp / "out"
            out.mkdir()
            delta, fallback = write_delta_against(base, checkpoint_tensors(checkpoint), out, whole_fraction,
                                                   version=delta_format)
            _copy_files(checkpoint.local_dir, out, weights=delta is None)
            written = _figures(checkpoint)
            replaced = put_in_place(out, dst, tmp, replace=overwrite, refusal=FILLED_UP)
        marker_path = _write_marker(dst, marker) if marker else None
    except OSError as exc:
        raise LayerwiseError(f"cannot write: {exc.strerror or exc}; nothing was put in place", where=where) from None
    return _saved(dst, [s.name for s in checkpoint.shards], len(checkpoint.tensors), written, (delta, fallback),
                  marker_path, replaced, started)


def _figures(checkpoint: Checkpoint):
    """NEW's plan and what vLLM's read order buffers reading it (its layout is NEW's own, whoever wrote it)."""
    plan = build_plan(checkpoint, mapping_for_config(checkpoint.config, "auto"))
    return OrderReport(plan, plan.simulate("file"), plan.simulate("layer"))


def _copy_files(src: Path, out: Path, *, weights: bool) -> None:
    """Copy SRC's plain files into OUT (its weight files and index only when WEIGHTS), each fsync'd."""
    for entry in sorted(src.iterdir()):
        # Only what a checkpoint holds: a completion marker of NEW's (`STABLE`) must not arrive before ours.
        if not entry.is_file() or entry.name.startswith(".") or not entry.name.endswith(CHECKPOINT_FILE_SUFFIXES):
            continue
        if is_weight_file(entry.name) and not weights:
            continue
        with open(entry, "rb") as source:
            fd = os.open(out / entry.name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                copy_range(source.fileno(), fd, 0, 0, os.fstat(source.fileno()).st_size)
                os.fsync(fd)
            finally:
                os.close(fd)
