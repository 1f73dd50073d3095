"""A local step's files pinned by what the kernel keeps about them, so that work done on them can be kept.

A local path names no bytes: no commit, no ETag. What survives a rewrite is
the file's identity as the kernel keeps it. Writing to a file moves its
change time (`st_ctime`, set by the kernel; a writer can set the
modification time back, not the change time), and a step replaced by a
rename (as `save_checkpoint` writes one) is a new inode. `files_pin` digests
the device, inode, size and both times of every file: the same pin later
means that no file was written or replaced in between.

The kernel stamps those times from a coarse clock (one tick: 1 to 10 ms), so
a file written twice within one tick can keep its stamps. A file whose last
change is less than `RACY_S` before the work on it began is therefore not
pinned (as git treats a "racily clean" index entry): whatever was read could
have been rewritten within the same tick.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from pathlib import Path

# Files changed less than this before the work on them began are not pinned (ten ticks of the coarsest clock).
RACY_S = 0.1
PIN_PREFIX = "files:"


def files_pin(paths: Iterable[Path | str], *, unchanged_since: float | None = None) -> str | None:
    """A digest of PATHS' identities (`files:<32 hex>`), or None when one is missing, or (with UNCHANGED_SINCE, a
    `time.time()` taken before the files were read) changed after `UNCHANGED_SINCE - RACY_S`."""
    digest = hashlib.sha256()
    for path in sorted({str(p) for p in paths}):
        try:
            stat = os.stat(path)
        except OSError:
            return None
        if unchanged_since is not None and max(stat.st_mtime, stat.st_ctime) > unchanged_since - RACY_S:
            return None
        identity = (path, stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns)
        digest.update("\0".join(map(str, identity)).encode() + b"\n")
    return PIN_PREFIX + digest.hexdigest()[:32]
