"""`write_delta`: a trainer's full step written again as a sparse delta against the step before, atomically."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

from layerwise_cli.checkpoint.delta.encode import VERSION
from layerwise_cli.checkpoint.delta.format import DELTA_FILE, WHOLE_FRACTION
from layerwise_cli.checkpoint.delta.read import delta_file
from layerwise_cli.checkpoint.format.layout import is_weight_file
from layerwise_cli.checkpoint.sources import Checkpoint, open_checkpoint
from layerwise_cli.errors import LayerwiseError
from layerwise_cli.planning.parents import mapping_for_config
from layerwise_cli.reorder.commit import CHECKPOINT_FILE_SUFFIXES, fsync_dir
from layerwise_cli.writer.delta_file import (
    NoDelta,
    checkpoint_tensors,
    delta_summary,
    open_base,
    plan_delta,
    write_delta_file,
)
from layerwise_cli.writer.save import (
    _TMP_MARK,
    SavedCheckpoint,
    _check_destination,
    _check_marker,
    _commit,
    _write_marker,
)
from layerwise_cli.writer.spill import copy_range

_PATCHES = ".layerwise-patches"


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
    tmp: Path | None = None
    try:
        dst.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}{_TMP_MARK}", dir=dst.parent))
        delta, fallback = _delta_or_none(base, checkpoint, tmp, whole_fraction, delta_format)
        _copy_files(checkpoint.local_dir, tmp, weights=delta is None)
        written = _figures(checkpoint)
        fsync_dir(tmp)
        replaced = _commit(tmp, dst, overwrite)
        tmp = None
        marker_path = _write_marker(dst, marker) if marker else None
    except OSError as exc:
        raise LayerwiseError(f"cannot write: {exc.strerror or exc}; nothing was put in place", where=where) from None
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    plan = written.plan
    return SavedCheckpoint(
        directory=dst, shards=(DELTA_FILE,) if delta is not None else tuple(s.name for s in checkpoint.shards),
        tensors=len(checkpoint.tensors), total_bytes=delta.delta_bytes if delta is not None else plan.total_bytes,
        largest_layer_bytes=plan.largest_layer_bytes,
        peak_buffer_bytes=written.file_order_buffering.peak_buffer_bytes, marker=marker_path, replaced=replaced,
        seconds=time.perf_counter() - started, delta=delta, fallback=fallback)


def _figures(checkpoint: Checkpoint):
    """NEW's plan and what vLLM's read order buffers reading it (its layout is NEW's own, whoever wrote it)."""
    from layerwise_cli.planning.inspect import OrderReport
    from layerwise_cli.planning.plan import build_plan

    plan = build_plan(checkpoint, mapping_for_config(checkpoint.config, "auto"))
    return OrderReport(plan, plan.simulate("file"), plan.simulate("layer"))


def _delta_or_none(base, checkpoint: Checkpoint, tmp: Path, whole_fraction: float, version: int):
    """Write tmp/delta.safetensors; (summary, None), or (None, why) when NEW must be copied whole."""
    patches = tmp / _PATCHES
    fd = os.open(patches, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        try:
            plan = plan_delta(open_base(base), checkpoint_tensors(checkpoint), fd, whole_fraction=whole_fraction,
                              version=version)
        except NoDelta as why:
            return None, str(why)
        write_delta_file(tmp, plan, fd)
    finally:
        os.close(fd)
        os.unlink(patches)
    return delta_summary(plan), None


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
