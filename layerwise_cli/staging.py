"""A directory written beside its destination, then renamed into place: the one atomic commit every writer uses.

`save_checkpoint`, `write_delta` and `reorder` each write into `staging(dst)` (a fresh `.<name>.layerwise-tmp-*`
directory in DST's parent, so the final rename never crosses a file system), fsync what they wrote and call
`put_in_place`: a reader sees the old DST or the whole new one, never part of it. The staging directory, and an
old DST moved into it, are removed on the way out, whatever happened.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path

from layerwise_cli.errors import LayerwiseError

TMP_MARK = ".layerwise-tmp-"


@contextmanager
def staging(dst: Path, *, hold: Callable[[], AbstractContextManager] = nullcontext) -> Iterator[Path]:
    """A fresh temporary directory beside DST, removed when the block ends (also after `put_in_place`).

    Args:
        dst: the directory the block will put in place (its parent is made if missing).
        hold: a context the removal runs under (`reorder` holds SIGINT/SIGTERM off while it removes).

    Raises:
        LayerwiseError: the directory cannot be made (one line naming DST).
    """
    try:
        dst.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}{TMP_MARK}", dir=dst.parent))
    except OSError as exc:
        raise LayerwiseError(f"cannot write beside the destination: {exc.strerror or exc}", where=str(dst)) from None
    try:
        yield tmp
    finally:
        with hold():
            shutil.rmtree(tmp, ignore_errors=True)


def put_in_place(out: Path, dst: Path, tmp: Path, *, replace: bool, refusal: str) -> bool:
    """Rename the finished directory OUT (inside the staging directory TMP) to DST, durably.

    OUT is fsync'd first. An existing DST is moved into TMP (removed with it), and put back if the rename fails;
    an empty DST directory is replaced without asking.

    Args:
        replace: whether an existing, non-empty DST may be replaced (checked before the write began: this is
            the check again, for a DST that appeared meanwhile).
        refusal: the error when DST is there and may not be replaced (`--force` or `overwrite=True` to pass).

    Returns:
        Whether a non-empty DST was replaced.
    """
    fsync_dir(out)
    previous = tmp / "previous"
    moved = replaced = False
    if dst.exists() or dst.is_symlink():
        empty = dst.is_dir() and not dst.is_symlink() and not any(dst.iterdir())
        if not (replace or empty):
            raise LayerwiseError(refusal, where=str(dst))
        os.rename(dst, previous)
        moved, replaced = True, not empty
    try:
        os.rename(out, dst)
    except OSError:
        if moved:
            os.rename(previous, dst)
        raise
    fsync_dir(dst.parent)
    return replaced


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (new files, renames) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
